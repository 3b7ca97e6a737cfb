"""A worker process the fault tests drive over stdin, one command per line, one JSON reply per line.

Commands: digest (hash of every checkpoint tensor it holds), call (ask the daemon for status),
reconnect, write (write into a served view), lease, exit.
"""

import hashlib
import json
import sys

import torch

from expertd.client import ExpertClient
from expertd.errors import ExpertdError


def digest(views: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(views):
        h.update(name.encode())
        h.update(views[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    endpoint = sys.argv[1]
    copy_on_write = "--cow" in sys.argv
    client = ExpertClient(endpoint, timeout=float(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2][0].isdigit() else 30,
                          copy_on_write=copy_on_write)
    views = client.tensors()
    print(json.dumps({"ready": True, "lease": client.lease, "digest": digest(views)}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "digest":
                reply = {"digest": digest(views)}
            elif cmd == "call":
                reply = {"status": client.status()["state"]}
            elif cmd == "reconnect":
                client.reconnect()
                views = client.tensors()
                reply = {"generation": client.index().generation, "digest": digest(views)}
            elif cmd == "write":
                name = sorted(views)[0]
                views[name].view(torch.uint8)[0] ^= 0xFF
                reply = {"wrote": name, "digest": digest(views)}
            elif cmd == "lease":
                reply = {"lease": client.lease}
            elif cmd == "exit":
                client.close()
                print(json.dumps({"bye": True}), flush=True)
                return
            else:
                reply = {"unknown": cmd}
        except ExpertdError as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
