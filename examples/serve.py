"""A worker that stays up: attach to expertd, then answer generation requests over HTTP until stopped,
moving to each new generation the daemon publishes (between requests, in the same model object).

    python examples/serve.py --port 8080 [--endpoint ipc:///run/expertd/expertd.sock] [--wait 1800]

    GET  /healthz   200 with {"generation": N} once the model is bound (a readiness probe)
    POST /generate  {"input_ids": [[...]], "max_new_tokens": 8}  ->  {"generation": N, "output_ids": [[...]]}

What the Kubernetes worker Deployment runs (docker/kubernetes/worker-deployment.yaml); SIGTERM ends it
and releases the lease.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from expertd.protocol import default_endpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker import attach  # noqa: E402


class Model:
    """The served model and the lock that keeps a refresh and a forward pass apart."""

    def __init__(self, client):
        self.client, self.lock = client, threading.Lock()
        self.model = client.load_model()
        self.stale = threading.Event()
        client.on_update = lambda generation: self.stale.set()

    def generate(self, input_ids: list, max_new_tokens: int) -> dict:
        with self.lock:
            if self.stale.is_set():
                self.stale.clear()
                self.client.refresh(self.model)
            with torch.no_grad():
                out = self.model.generate(torch.tensor(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
            return {"generation": self.client.generation, "output_ids": out.tolist()}


def handler(served: Model):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/healthz":
                return self._reply(404, {"error": "GET /healthz or POST /generate"})
            self._reply(200, {"generation": served.client.generation})

        def do_POST(self):
            if self.path != "/generate":
                return self._reply(404, {"error": "GET /healthz or POST /generate"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids, new = request["input_ids"], int(request.get("max_new_tokens", 8))
                well_formed = isinstance(ids, list) and ids and all(isinstance(r, list) and r for r in ids)
                if not well_formed or not 0 < new <= 512:
                    raise ValueError("input_ids must be a non-empty list of token id lists, max_new_tokens 1-512")
            except (ValueError, KeyError, TypeError) as exc:
                return self._reply(400, {"error": str(exc)})
            self._reply(200, served.generate(ids, new))

        def log_message(self, *args) -> None:  # no line per request on stderr
            pass

    return Handler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default=os.environ.get("EXPERTD_ENDPOINT") or default_endpoint())
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for a daemon that is not running yet")
    args = ap.parse_args()
    with attach(args.endpoint, args.wait) as client:
        served = Model(client)
        server = ThreadingHTTPServer((args.host, args.port), handler(served))
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
        print(f"serving generation {client.generation} on http://{args.host}:{server.server_port}", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
