"""`expertd stop` and `expertd restart`: end a daemon, or hand its generations over to a successor, and wait until
it has exited."""

from __future__ import annotations

import os

from expertd import messages, replies
from expertd.errors import DaemonError, DaemonNotRunning, ExpertdError


def cmd_stop(args) -> int:
    """Ask the daemon to stop (with --keep: hand its generations over), wait until it has exited, say what stopped."""
    import time

    from expertd.protocol import ipc_path

    from ..daemon.config import connection_of as _connection

    conn = _connection(args)
    try:
        # read typed: whatever answers without a daemon's status fields (one that holds the port, say) is a
        # ProtocolError, one line, and is sent nothing more
        status = conn.send(messages.Status(), replies.StatusReply)
        conn.send(messages.Stop(keep=bool(getattr(args, "keep", False))))
    finally:
        conn.close()
    path = ipc_path(status.endpoint)

    def running() -> bool:  # an ipc socket file, the process (on this host), or a tcp endpoint that still answers
        if path is not None and os.path.exists(path) or _running(status.pid):
            return True
        return path is None and _answers(args)

    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and running():
        time.sleep(0.05)  # the daemon unlinks its segments, index, manifest and socket on the way out, then exits
    gone = not running()
    kept = " (generations left for a successor)" if getattr(args, "keep", False) else ""
    namespace = f"namespace {status.namespace}, " if status.namespace else ""
    print(f"stopped expertd pid {status.pid} ({namespace}endpoint {status.endpoint}, generation {status.generation})"
          f"{kept}"
          + ("" if gone else f"; it is still cleaning up after {args.timeout:.0f}s"))
    return 0 if gone else 1


def _running(pid: int) -> bool:
    """Whether the daemon's process still runs, when it is on this host (a tcp:// daemon elsewhere: unknown, False).
    A process that is exiting has an empty command line before it becomes a zombie, and its first thread is a zombie
    while the others still exit: it still runs until then."""
    from expertd.procfs import command_line, process_state

    state = process_state(pid)
    if state is None or state == "X" or (state == "Z" and _threads(pid) <= 1):
        return False
    line = command_line(pid)
    return line is not None and (b"expertd" in line or not line)


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _answers(args) -> bool:
    """Whether a daemon still answers on the endpoint `args` names (a tcp:// daemon on another host)."""
    from ..daemon.config import connection_of

    conn = connection_of(args, timeout=0.5)
    try:
        conn.request("status")
        return True
    except ExpertdError:
        return False
    finally:
        conn.close()


def cmd_restart(args) -> int:
    """Hand the running daemon's generations over (`stop --keep`) and start a successor that adopts them."""
    from ..daemon.config import load_config
    from .starting import cmd_start

    cfg = load_config(args.config)
    args.endpoint, args.token, args.server_key, args.keep = None, None, None, True
    try:
        if cmd_stop(args) != 0:
            raise DaemonError(f"the daemon of {args.config} did not exit within {args.timeout:.0f}s; not starting "
                              "another")
    except DaemonNotRunning:
        print(f"no daemon answered on {cfg.endpoint}: starting one")
    return cmd_start(args)
