"""A daemon on tcp:// with CURVE for attack tests: `curve_daemon` starts one (any client key with its public one
connects unless the config lists `curve_client_keys`) and waits until it serves."""

from __future__ import annotations

import socket

from expertd.connection import Connection
from expertd.security import Credentials, create_keys
from helpers.polling import wait_until


def curve_daemon(start_daemon, checkpoint: str, folder, probe_key: str | None = None, **extra):
    """A daemon on tcp:// with CURVE (without curve_client_keys in `extra`, any key with its public one connects),
    serving, as a client of `probe_key` (a NAME.key_secret; else a throwaway key) sees; and its public key."""
    public, secret = create_keys(str(folder / "keys"), "daemon")
    daemon = start_daemon(checkpoint, wait=False, endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key=secret,
                          **extra)
    conn = Connection(daemon.endpoint, timeout=2, credentials=Credentials.resolve(server_key=public,
                                                                                  client_key=probe_key))
    try:
        wait_until(lambda: daemon.proc.poll() is None and _state(conn) == "serving", "the CURVE daemon serves", 120)
    finally:
        conn.close()
    return daemon, public


def _state(conn) -> str | None:
    try:
        return conn.request("status")["state"]
    except Exception:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
