"""An inference worker: attach to expertd, get the shared model, generate a few tokens.

    python examples/worker.py --endpoint ipc:///run/expertd/expertd.sock
    python examples/worker.py --with-daemon configs/tiny.yaml   # starts and stops the daemon itself
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from expertd.client import DaemonNotRunning, ExpertClient
from expertd.errors import DaemonTimeout, ExpertdError
from expertd.protocol import default_endpoint


def attach(endpoint: str, wait: float, daemon: subprocess.Popen | None = None) -> ExpertClient:
    """Attach, waiting up to `wait` seconds for a daemon that is still starting (its socket not there yet)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return ExpertClient(endpoint)
        except DaemonNotRunning:
            if time.monotonic() > deadline or (daemon is not None and daemon.poll() is not None):
                raise
            time.sleep(0.1)


def wait_serving(endpoint: str, wait: float, daemon: subprocess.Popen | None = None) -> None:
    """Wait until a daemon answers on `endpoint` and serves (what `expertd status --wait` does), so that the
    attach measured after it is the attach alone."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with ExpertClient(endpoint, heartbeat=False) as probe:
                if probe.status()["state"] == "serving":
                    return
        except DaemonNotRunning:
            pass
        if time.monotonic() > deadline or (daemon is not None and daemon.poll() is not None):
            raise DaemonNotRunning(f"no daemon served at {endpoint} within {wait:.0f}s")
        time.sleep(0.1)


def run_worker(endpoint: str, new_tokens: int, wait: float = 0.0, daemon: subprocess.Popen | None = None) -> None:
    if wait:
        wait_serving(endpoint, wait, daemon)  # the daemon's start-up and load are not the attach
    started = time.perf_counter()
    with attach(endpoint, wait, daemon) as client:
        model = client.load_model()
        attached = time.perf_counter() - started
        prompt = torch.tensor([[0, 5, 17, 42]])
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        from expertd.client.residency import shared_bytes

        shared = shared_bytes(model, client.index().shm_dir)  # only what really lies in the daemon's segments
        private = client.private_tensors(model)
        print(f"attached in {attached * 1000:.1f} ms (a first attach in this process: imports and the model's "
              f"construction included); {shared / 2**20:.1f} MiB of weights in shared memory, "
              f"{len(private)} tensor(s) private{': ' + ', '.join(private[:4]) if private else ''}")
        print(f"dtypes: {sorted({str(p.dtype) for p in model.parameters()})}")
        print(f"generated: {out[0].tolist()}")


def refuse_a_running_daemon(endpoint: str) -> None:
    """--with-daemon starts a daemon on the config's endpoint: say at once if one already answers there."""
    try:
        with ExpertClient(endpoint, heartbeat=False, timeout=2.0) as probe:
            pid = f" (pid {probe.status()['pid']})"
    except (DaemonNotRunning, DaemonTimeout):  # no socket file, or (tcp://) no answer: the endpoint is free
        return
    except ExpertdError:  # it answers, if only to refuse this probe (a wrong token)
        pid = ""
    from expertd.server.restart.runstate import EndpointBusy

    raise EndpointBusy(f"a daemon already answers at {endpoint}{pid}: drop --with-daemon to use it, or stop it first "
                       f"(expertd stop --endpoint {endpoint})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("EXPERTD_ENDPOINT") or default_endpoint())
    parser.add_argument("--with-daemon", metavar="CONFIG",
                        help="start `expertd start --config CONFIG` first, stop it after")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for a daemon that is not running yet (--with-daemon: 600)")
    args = parser.parse_args()
    try:
        return run(args)
    except ExpertdError as exc:  # no daemon, a timeout, a refusal: one line, not a traceback
        print(f"worker: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    if not args.with_daemon:
        run_worker(args.endpoint, args.new_tokens, args.wait)
        return 0
    from expertd.server.daemon.config import load_config

    endpoint = load_config(args.with_daemon).endpoint
    refuse_a_running_daemon(endpoint)  # before any work: this run would use it and then fail to start its own
    daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", args.with_daemon])
    try:
        run_worker(endpoint, args.new_tokens, args.wait or 600.0, daemon)
    finally:
        daemon.terminate()
        code = daemon.wait(60)
    return code


if __name__ == "__main__":
    sys.exit(main())
