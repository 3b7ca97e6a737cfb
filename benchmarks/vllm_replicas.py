"""V5 of bench_vllm.py: `vllm serve` replicas started one after another on one host, then measured side by side.

Each replica is the real CLI (`vllm serve`, multi-process: API server, engine core, its worker) in a session of its
own; its start is the time from the command to /health answering 200, the next one starts once it does. With all
of them up: the sum of the proportional set sizes (`Pss` of /proc/PID/smaps_rollup) of every process of every
replica (pages shared between processes counted once in all, whatever the number of processes mapping them), and
the bytes of the daemon's segments in /dev/shm, mapped or not (a host's total: Σ Pss less shared memory, plus those).
Then
each is stopped as Ctrl-C stops it (SIGINT; SIGKILL to its session after 60 s); the `psm_*` segments its processes
mapped (vLLM's message queues, which a stopped server leaves behind) are removed, and no one else's.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from test_vllm_serve import serve_env, vllm_cli  # the tests' `vllm serve` command line and environment


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a replica and everything it started)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
            out.append(int(stat.split("/")[2]))
    return out


def smaps_rollup(pid: int) -> dict[str, int]:
    """`Pss`, `Pss_Anon`, `Pss_Shmem`, ... of one process, in bytes (0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if line[0].isupper())}
    except (FileNotFoundError, ProcessLookupError):
        return {}


def mapped_psm(pids: list[int]) -> set[str]:
    """The /dev/shm/psm_* segments the processes `pids` map (vLLM's shared-memory message queues)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                out.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/psm_" in line)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return {path.removesuffix(" (deleted)") for path in out}


class Replica:
    """One `vllm serve MODEL` (`extra`: model_loader_extra_config for `--load-format expertd`, None: vLLM's own
    load of the folder)."""

    def __init__(self, python: str, folder: str, model: str, extra: dict | None, name: str):
        self.port = free_port()
        self.log = os.path.join(folder, f"{name}.log")
        load = ["--load-format", "expertd", "--model-loader-extra-config", json.dumps(extra)] if extra else []
        cmd = [*vllm_cli(python, folder), "serve", model, *load, "--dtype", "bfloat16", "--enforce-eager",
               "--skip-tokenizer-init", "--port", str(self.port), "--host", "127.0.0.1"]
        self.t0 = time.perf_counter()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=folder, env=serve_env(folder), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.psm: set[str] = set()

    def wait_healthy(self, timeout: float = 900.0) -> float:
        """Seconds from the command to /health answering 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log, errors="replace") as f:
                    raise SystemExit(f"vllm serve exited {self.proc.returncode}:\n{f.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - self.t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise SystemExit(f"vllm serve not healthy after {timeout} s (log: {self.log})")

    def memory(self) -> dict[str, int]:
        pids = session_pids(self.proc.pid)
        self.psm |= mapped_psm(pids)
        rollups = [smaps_rollup(pid) for pid in pids]
        return {"processes": len(pids), **{k: sum(r.get(k, 0) for r in rollups) for k in ("Pss", "Pss_Anon",
                                                                                         "Pss_Shmem", "Pss_File")}}

    def stop(self, timeout: float = 60.0) -> None:
        self.psm |= mapped_psm(session_pids(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its session
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 30
        while session_pids(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for path in self.psm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def replicas(python: str, folder: str, model: str, extra: dict | None, count: int, tag: str,
             others: tuple[int, ...] = (), segments: str = "") -> dict:
    """Start `count` replicas one after another; each one's start; with all up, Σ of their processes' smaps_rollup
    (and of `others`, e.g. the daemon, apart) and the bytes the files matching `segments` take in /dev/shm (the
    daemon's: pages no process maps are in nobody's Pss); then stop them all."""
    os.makedirs(folder, exist_ok=True)
    started, starts = [], []
    try:
        for k in range(count):
            started.append(Replica(python, folder, model, extra, f"{tag}-{k}"))
            starts.append(started[-1].wait_healthy())
        each = [r.memory() for r in started]
        total = {k: sum(m[k] for m in each) for k in each[0]}
        apart = [smaps_rollup(pid) for pid in others]
        held = sum(os.stat(path).st_blocks * 512 for path in glob.glob(segments)) if segments else 0
        return {"starts": starts, "memory": total, "segments": held,
                "others": {k: sum(r.get(k, 0) for r in apart) for k in ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File")}}
    finally:
        for replica in started:
            replica.stop()
