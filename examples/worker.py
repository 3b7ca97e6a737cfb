"""An inference worker: attach to expertd, get the shared model, generate a few tokens.

    python examples/worker.py --endpoint ipc:///tmp/expertd/expertd.sock
    python examples/worker.py --with-daemon configs/tiny.yaml   # starts and stops the daemon itself
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from expertd.client import ExpertClient


def run_worker(endpoint: str, new_tokens: int) -> None:
    started = time.perf_counter()
    with ExpertClient(endpoint) as client:
        model = client.load_model()
        attached = time.perf_counter() - started
        prompt = torch.tensor([[0, 5, 17, 42]])
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        shared = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"attached in {attached * 1000:.1f} ms; {shared / 2**20:.1f} MiB of weights in shared memory")
        print(f"dtypes: {sorted({str(p.dtype) for p in model.parameters()})}")
        print(f"generated: {out[0].tolist()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("EXPERTD_ENDPOINT", "ipc:///tmp/expertd/expertd.sock"))
    parser.add_argument("--with-daemon", metavar="CONFIG", help="start `expertd start --config CONFIG` first, stop it after")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    if not args.with_daemon:
        run_worker(args.endpoint, args.new_tokens)
        return 0
    from expertd.server.config import load_config

    endpoint = load_config(args.with_daemon).endpoint
    daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", args.with_daemon])
    try:
        run_worker(endpoint, args.new_tokens)
    finally:
        daemon.terminate()
        code = daemon.wait(60)
    return code


if __name__ == "__main__":
    sys.exit(main())
