"""Folders and processes of the vLLM tests: weightless model folders, the reference checkpoints, engine runs.

Used by tests/test_vllm.py and tests/test_vllm_serve.py (in this environment, which has no vLLM: the engines run in
the vLLM virtualenv's python, `helpers/vllm_engines.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

ENGINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_engines.py")
PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 200], [300, 5, 9, 11, 12, 13], [42]]
MAX_TOKENS = 8


def model_folder(src: str, dst: str, **changes) -> str:
    """A model folder holding only `src`'s config.json (with `changes`; None removes a key) and
    generation_config.json: no weights."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    config = {key: value for key, value in config.items() if not (key in changes and value is None)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(src, "generation_config.json"), dst)
    return dst


def dequantized_folder(endpoint: str, src: str, dst: str, **changes) -> str:
    """A bf16 checkpoint of what the daemon at `endpoint` serves (the reference vLLM loads by itself)."""
    from safetensors.torch import save_file

    from expertd.client import ExpertClient

    model_folder(src, dst, quantization_config=None, **changes)
    with ExpertClient(endpoint, heartbeat=False) as client:
        save_file({name: t.clone() for name, t in client.tensors().items()}, os.path.join(dst, "model.safetensors"))
    return dst


def run_engines(python: str, folder: str, engines: list[dict], multiprocess: bool = False,
                tag: str = "") -> dict[str, dict]:
    """Run `engines` (helpers/vllm_engines.py) in `python`, from `folder`; name -> what each reported. With
    `multiprocess`, each engine runs as `vllm serve` does: its core and its worker in processes of their own."""
    spec = os.path.join(folder, f"engines{tag}-multiprocess.json" if multiprocess else f"engines{tag}.json")
    with open(spec, "w") as f:
        json.dump({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engines": engines}, f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
               VLLM_CACHE_ROOT=os.path.join(folder, "vllm-cache"), VLLM_CONFIG_ROOT=os.path.join(folder, "vllm-config"),
               VLLM_NO_USAGE_STATS="1", TMPDIR=os.path.join(folder, "tmp"))  # vLLM's sockets and files: in `folder`
    os.makedirs(env["TMPDIR"], exist_ok=True)
    done = subprocess.run([python, ENGINES, spec], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("ENGINE "):
            report = json.loads(line[len("ENGINE "):])
            out[report["name"]] = report
    assert sorted(out) == sorted(e["name"] for e in engines), done.stderr[-6000:]
    return out


def room_for_one_generation(folder: str) -> int:
    """A reader's share of derived bytes that holds one generation's expert layouts in vLLM's CPU layout (w13 and w2
    of every layer, the intermediate size padded to anywhere in [I, 256]) but not one more gate/up stack beside them
    (the refresh's new layout of layer 1 while generation 1 still lives): for I in [200, 256]."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    experts = config.get("num_experts") or config["num_local_experts"]
    assert 200 <= config["moe_intermediate_size"] <= 256, config["moe_intermediate_size"]
    per_layer = 3 * experts * config["hidden_size"] * 256 * 2  # w13 (2 I) and w2 (I), bf16, at the largest pad
    return config["num_hidden_layers"] * per_layer + 8 * 4096  # each tensor placed in whole pages


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
