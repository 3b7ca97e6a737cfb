"""The README's vLLM path as a newcomer runs it, in the vLLM virtualenv (`vllm_python`): `examples/vllm_engine.py`
(tiny Qwen3-MoE made, daemon started and stopped, tokens generated), and the multi-process engine with no daemon,
whose `LLM()` must end with expertd's one-line cause in vLLM's option words (client/engines/vllm/errors.py), not
with "Engine core initialization failed". Each runs from the test's folder, vLLM's cache and files in it too.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import uuid

import pytest

from helpers.vllm_venv import psm_segments, vllm_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "vllm_engine.py")
pytestmark = pytest.mark.timeout(2400)  # the first session on a machine builds the vLLM virtualenv (minutes)
# an engine as the README's snippet makes it, the multi-process engine (vLLM's default) left as it is
NO_DAEMON = """
import os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM
if __name__ == "__main__":
    LLM(model=sys.argv[1], load_format="expertd", model_loader_extra_config={"endpoint": sys.argv[2]},
        skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
"""


def vllm_env(folder) -> dict:
    """The vLLM virtualenv's own packages only; vLLM's cache, config and temporary files in `folder`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_ENABLE_V1_MULTIPROCESSING",
                        "VLLM_CPU_KVCACHE_SPACE", "EXPERTD_ENDPOINT")}
    env.update(PYTHONNOUSERSITE="1", VLLM_NO_USAGE_STATS="1", VLLM_CACHE_ROOT=os.path.join(folder, "vllm-cache"),
               VLLM_CONFIG_ROOT=os.path.join(folder, "vllm-config"), TMPDIR=os.path.join(folder, "tmp"))
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


@pytest.fixture
def psm():
    before = psm_segments()
    yield
    vllm_leftovers(before)


def test_the_vllm_example_makes_a_model_starts_a_daemon_generates_and_leaves_nothing(vllm_python, tmp_path, psm):
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    endpoint = f"ipc://{tmp_path}/run/expertd.sock"
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([vllm_python, EXAMPLE, "--endpoint", endpoint, "--namespace", namespace], cwd=work,
                          env=vllm_env(str(tmp_path)), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    generated = [json.loads(m) for m in re.findall(r"^prompt \[[\d, ]+\] -> generated (\[[\d, ]+\])$", done.stdout,
                                                   re.MULTILINE)]
    assert len(generated) == 2 and all(len(tokens) == 8 for tokens in generated), done.stdout[-4000:]
    assert sorted(os.listdir(work / "vllm-example")) == ["expertd.yaml", "qwen3-moe", "qwen3-moe-config"]
    assert sorted(os.listdir(work / "vllm-example" / "qwen3-moe-config")) == ["config.json",
                                                                              "generation_config.json"]
    assert not glob.glob(f"/dev/shm/{namespace}*"), "the example's daemon left segments"
    assert not os.path.exists(os.path.join(ROOT, "vllm-example"))
    assert not glob.glob(f"{tmp_path}/tmp/expertd-vllm-*"), "the frontend's private folder is left"


def test_a_multiprocess_engine_without_daemon_ends_with_expertds_cause(vllm_python, tmp_path, psm):
    from expertd.tools.generate import generate_model_type

    checkpoint, model = tmp_path / "qwen3-moe", tmp_path / "model"
    generate_model_type(str(checkpoint), "qwen3_moe", fp8=False)
    model.mkdir()
    for name in ("config.json", "generation_config.json"):
        (model / name).write_bytes((checkpoint / name).read_bytes())
    endpoint = f"ipc://{tmp_path}/nothing/expertd.sock"
    done = subprocess.run([vllm_python, "-c", NO_DAEMON, str(model), endpoint], cwd=tmp_path,
                          env=vllm_env(str(tmp_path)), capture_output=True, text=True, timeout=900)
    assert done.returncode != 0
    assert "Engine core initialization failed" in done.stderr, done.stderr[-4000:]  # vLLM's, chained before ours
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"expertd.errors.DaemonNotRunning: no expertd daemon is running at {endpoint}"), last
    assert 'model_loader_extra_config={"endpoint": ...}' in last and "--endpoint" not in last, last
    assert not glob.glob(f"{tmp_path}/tmp/expertd-vllm-*"), "the frontend's private folder is left"
