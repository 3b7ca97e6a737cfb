"""Processes that take leases for attack tests, as the daemon's own uid or as another one (`MEMBER`, via setpriv).

`spawn(TAKER, endpoint)` starts one; `ask(proc, n)` has it try `n` leases and says how many it got, why it stopped
and their ids; `finish` closes their stdin and waits. A taker's leases are watched: they end with its process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

NOBODY = 65534
# another uid in the daemon's group (root's, for the socket), able to read root's venv
MEMBER = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--groups", "0", "--inh-caps", "+dac_read_search",
          "--ambient-caps", "+dac_read_search"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as another uid")

# a process that takes leases on every line it reads ("N": N attempts), answers how many it got, exits on EOF
TAKER = """
import os, sys
from expertd import procfs
from expertd.connection import Connection
from expertd.errors import LeaseLimit
from expertd.protocol import PROTOCOL_VERSION
conn = Connection(sys.argv[1], timeout=30)
me = {"pid": os.getpid(), "protocol": PROTOCOL_VERSION, "pid_ns": procfs.pid_namespace(),
      "start_time": procfs.process_start_time(os.getpid())}  # watched: its leases end with it
for line in sys.stdin:
    got, why = [], ""
    for _ in range(int(line)):
        try:
            got.append(conn.request("lease", **me)["client"])
        except LeaseLimit as exc:
            why = type(exc).__name__
    print(len(got), why, *got, flush=True)
"""

def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def spawn(script: str, *args: str, prefix=()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())


def ask(proc: subprocess.Popen, attempts: int) -> tuple[int, str, list[str]]:
    proc.stdin.write(f"{attempts}\n")
    proc.stdin.flush()
    line = proc.stdout.readline().split()
    assert line, proc.stderr.read()
    count, rest = int(line[0]), line[1:]
    why = rest.pop(0) if rest and not all(c in "0123456789abcdef" for c in rest[0]) else ""
    return count, why, rest


def finish(procs) -> None:
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
