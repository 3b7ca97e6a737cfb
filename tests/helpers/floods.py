"""A process of many CURVE keys flooding the derivation queue, for attack tests and benchmarks.

`FLOODER` runs as `python -c FLOODER ENDPOINT SERVER_KEY KEYS...`: KEYS is either a count of throwaway keys or
NAME.key_secret files (keys the daemon lists). Each key keeps 4 large gathers asked (1.5 M index entries, refused only
once the whole index is inflated), again and again; it prints "flooding" once its leases are taken, and when its stdin
closes, how many distinct refusals it was told.
"""

FLOODER = """
import os, sys, threading, torch
from expertd import derived
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION
from expertd.security import Credentials
endpoint, server_key, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
keys = [None] * int(keys[0]) if len(keys) == 1 and keys[0].isdigit() else keys
conns = [Connection(endpoint, timeout=60, credentials=Credentials.resolve(server_key=server_key, client_key=k))
         for k in keys]
leases = [c.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"] for c in conns]
requests = []
for k in range(4):
    index = torch.arange(1_500_000) % 1_024_000
    index[-1] = 10_000_000 + k  # out of range: refused once the whole index is inflated
    requests.append([derived.request("model.layers.1.mlp.experts.gate_up_proj", derived.encode(index),
                                     index.numel(), (index.numel(),), whole=True).wire()])
done, refusals = threading.Event(), set()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("flooding", flush=True)
while not done.is_set():
    for conn, lease in zip(conns, leases):
        for request in requests:
            try:
                conn.request("gather", client=lease, tensors=request)
            except DaemonError as exc:
                refusals.add(str(exc).split(":")[0][:60])
print(len(refusals), flush=True)
"""
