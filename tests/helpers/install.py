"""Installing expertd as a user would: a wheel built from a copy of the tracked files, fresh virtualenvs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH = f"torch=={torch.__version__.split('+')[0]}"  # the one the README's set-up installed here
PIP = ("-m", "pip", "--disable-pip-version-check", "-q")


def run(cmd: list[str], cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run outside this environment: no PYTHONPATH, no user site, not from the repo's folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


CACHE = os.path.join(os.path.expanduser("~"), ".cache", "expertd")


@contextlib.contextmanager
def locked(name: str):
    """Hold ~/.cache/expertd/NAME.lock: one test process (of parallel ones, or of sessions side by side) at a time
    makes or changes what the name stands for."""
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_venv(name: str, *steps: list[str]) -> str:
    """The python of the virtualenv ~/.cache/expertd/NAME, made once: each step is pip's arguments, run in it in
    order (`install ...`, `uninstall -y ...`); one whose steps did not all finish is made again."""
    venv = os.path.join(CACHE, name)
    python = os.path.join(venv, "bin", "python")
    ready = os.path.join(venv, ".expertd-ready")
    with locked(name):
        if not os.path.exists(ready):
            run([sys.executable, "-m", "venv", "--clear", venv], cwd="/")
            for step in steps:
                run([python, *PIP, *step], cwd=venv, timeout=1800)
            open(ready, "w").close()
    return python


def wheel_digest(wheel: str) -> str:
    """What a wheel holds (each file's name and bytes), whatever its zip's timestamps."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
    return h.hexdigest()


def copy_tracked_files(dst) -> None:
    """Copy the files git tracks (as they are in the working tree) to `dst`."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):  # deleted but not yet committed: skip
            os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))


def build_wheel(tmp) -> str:
    """expertd built as a wheel under `tmp` from a copy of the tracked files (nothing lands in the tree)."""
    src, out = os.path.join(str(tmp), "src"), os.path.join(str(tmp), "wheels")
    copy_tracked_files(src)
    run([sys.executable, *PIP, "wheel", "--no-deps", "-w", out, src], cwd=tmp)
    (built,) = [os.path.join(out, f) for f in os.listdir(out) if f.startswith("expertd-") and f.endswith(".whl")]
    return built


def has_git_checkout() -> bool:
    return shutil.which("git") is not None and os.path.exists(os.path.join(ROOT, ".git"))
