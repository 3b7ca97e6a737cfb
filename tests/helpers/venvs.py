"""Virtualenvs with another transformers release, made once and cached in ~/.cache/expertd.

The worker matrix runs the client (and, for neighbouring releases, the daemon too) under transformers
releases other than the one this environment resolved: 4.57 (the last 4.x, per-expert modules) and the
release before the newest (5.23: the last one whose DeepSeek-V3 kept its router in the load dtype). Each
venv gets this tree's wheel installed afresh per test session (`install_wheel`).
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers.install import PIP, TORCH, cached_venv, locked, run, wheel_digest

TF4 = "transformers==4.57.6"  # the last 4.x, still pinned by many inference stacks
TF_PREVIOUS = "transformers==5.23.0"  # the release before 5.24, which moved DeepSeek-V3's routers to fp32

CLIENT_NEEDS = ["accelerate>=1.0", "safetensors>=0.4", "pyzmq>=25", "msgpack>=1.0", "xxhash>=3"]
# the daemon's extra without triton (CPU only here: the dequant path never imports it)
SERVER_NEEDS = ["pyyaml>=6", "tqdm>=4.60", "numpy>=1.24", "prometheus-client>=0.17"]


def transformers_venv(spec: str, server: bool = False) -> str:
    """The python of a virtualenv with torch (the one installed here), transformers `spec` and what the client
    needs (with `server`: what the daemon needs too), made once."""
    name = f"venv-{spec.replace('==', '-')}" + ("-server" if server else "")
    # torch first, the one installed here, so that the second step finds it met (no CUDA wheels)
    return cached_venv(name, ["install", TORCH],
                       ["install", TORCH, spec, *CLIENT_NEEDS, *(SERVER_NEEDS if server else [])])


def install_wheel(python: str, wheel: str) -> str:
    """This tree's wheel into a cached venv, replacing what an earlier session put there; where the venv holds the
    same files already (a test process beside this one installed them), it is left as it is: a reinstall would
    pull them from under that process's engines."""
    venv = os.path.dirname(os.path.dirname(python))
    marker, digest = os.path.join(venv, ".expertd-wheel"), wheel_digest(wheel)
    with locked(os.path.basename(venv)):
        if not os.path.exists(marker) or Path(marker).read_text() != digest:
            run([python, *PIP, "install", "--no-deps", "--force-reinstall", wheel], cwd=os.path.dirname(wheel))
            Path(marker).write_text(digest)
    return python


if __name__ == "__main__":  # make the venvs ahead of a test run: PYTHONPATH=tests python -m helpers.venvs
    print(transformers_venv(TF4))
    print(transformers_venv(TF_PREVIOUS, server=True))
