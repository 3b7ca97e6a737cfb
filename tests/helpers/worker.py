"""A real worker process, driven over stdin/stdout: one command a line in, one JSON line out.

Usage: worker.py ENDPOINT [--timeout S] [--cow] [--namespace NS] [--model] [--save DIR]

Once attached it prints a hello: {"lease", "digest"} (a hash of every checkpoint tensor it holds), and
with --model the report of a model loaded through the client, after touching every weight (where the
parameters live, their dtypes, the server or kernel modules it imported). --save DIR writes the model's
logits and the served tensors there. Commands: digest, call (ask the daemon for status), reconnect,
write (write into a served view), lease, measure (size and Pss of its mappings of NS), pages (its mappings
of NS: files, permissions and huge-page use from /proc/self/smaps), exit; with
--model also: logits (a digest of the model's logits), refresh (move to the latest generation, rebinding
in place), loop SECONDS (forwards back to back, refreshing whenever a newer generation appears).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch

from expertd.client import ExpertClient
from expertd.errors import ExpertdError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.forward import forward_logits  # noqa: E402
from helpers.inputs import INPUT_IDS  # noqa: E402


def digest(views: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(views):
        h.update(name.encode())
        h.update(views[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def segment_prefix(namespace: str, shm_dir: str = "/dev/shm") -> str:
    """How the files of a namespace's segments start in /proc/self/maps (the index names their folder)."""
    return os.path.join(shm_dir, f"{namespace}.")


def shm_ranges(namespace: str, shm_dir: str = "/dev/shm") -> list[tuple[int, int, str]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith(segment_prefix(namespace, shm_dir)):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi, parts[1]))
    return ranges


def shm_pss(namespace: str, shm_dir: str = "/dev/shm") -> dict:
    sizes, pss, name = {}, {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                name = parts[5] if len(parts) >= 6 and parts[5].startswith(segment_prefix(namespace, shm_dir)) else None
            elif name and parts[0] == "Size:":
                sizes[name] = sizes.get(name, 0) + int(parts[1]) * 1024
            elif name and parts[0] == "Pss:":
                pss[name] = pss.get(name, 0) + int(parts[1]) * 1024
    return {"size": sum(sizes.values()), "pss": sum(pss.values())}


HUGE_FIELDS = ("ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")


def shm_pages(namespace: str, shm_dir: str) -> dict:
    """This process's mappings of the namespace's segments: the files, their permissions and modes,
    and how many kB of them the kernel maps with huge pages (PMD-mapped tmpfs or hugetlbfs)."""
    files, perms, huge, size, current = set(), set(), dict.fromkeys(HUGE_FIELDS, 0), 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                ours = len(parts) >= 6 and parts[5].startswith(segment_prefix(namespace, shm_dir))
                current = parts[5] if ours else None
                if current:
                    files.add(current)
                    perms.add(parts[1])
            elif current and parts[0] == "Size:":
                size += int(parts[1])
            elif current and parts[0].rstrip(":") in huge:
                huge[parts[0].rstrip(":")] += int(parts[1])
    modes = {oct(os.stat(p).st_mode & 0o777) for p in files if os.path.exists(p)}
    return {"files": sorted(files), "perms": sorted(perms), "modes": sorted(modes), "size_kb": size, "huge_kb": huge}


def logits_digest(model) -> str:
    logits = forward_logits(model, INPUT_IDS)
    return hashlib.sha256(logits.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def forward_loop(client: ExpertClient, model, seconds: float) -> dict:
    """Forwards back to back for `seconds`; whenever the daemon serves a newer generation, refresh first."""
    seen, generations, refreshed, n = [], [], [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.latest_generation > (client.generation or 0):
            refreshed.append(client.refresh(model))
        d = logits_digest(model)
        n += 1
        if not seen or seen[-1] != d:
            seen.append(d)
            generations.append(client.generation)
    return {"forwards": n, "digests": seen, "generations": generations, "refreshes": len(refreshed)}


def model_report(client: ExpertClient, namespace: str, save_dir: str | None) -> tuple[dict, object]:
    """Load the model through the client, touch every weight, and say where and what its parameters are."""
    model = client.load_model()
    ranges = shm_ranges(namespace, client.index().shm_dir)
    outside, writable = [], [r for r in ranges if "w" in r[2]]
    state = dict(model.named_parameters())
    state.update((k, v) for k, v in model.named_buffers() if k in model.state_dict())
    for name, t in state.items():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if not any(a <= lo and hi <= b for a, b, _ in ranges):
            outside.append(name)
    if save_dir is not None:
        from safetensors.torch import save_file

        logits = forward_logits(model, INPUT_IDS)
        save_file({k: v.contiguous() for k, v in client.tensors().items()},
                  os.path.join(save_dir, "tensors.safetensors"))
        torch.save(logits, os.path.join(save_dir, "logits.pt"))
    touched = sum(float(v.float().abs().sum()) for v in client.served_tensors().values())
    return {
        "generation": client.generation,
        "shm_dir": client.index().shm_dir,
        "outside": outside,
        "writable_maps": len(writable),
        "dtypes": {k: str(v.dtype) for k, v in state.items()},
        "training": model.training,
        "touched": touched,
        "nparams": len(state),
        # (triton itself may be imported by torch._dynamo when installed; client code never imports it)
        "forbidden_imports": sorted(m for m in sys.modules if m.startswith(("expertd.server", "expertd.kernels"))),
    }, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--cow", action="store_true", help="attach copy-on-write")
    ap.add_argument("--namespace")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--save", metavar="DIR")
    args = ap.parse_args()
    client = ExpertClient(args.endpoint, timeout=args.timeout, copy_on_write=args.cow)
    views = client.tensors()
    hello = {"ready": True, "lease": client.lease, "digest": digest(views), "pid": os.getpid()}
    model = None
    if args.model:
        report, model = model_report(client, args.namespace, args.save)
        hello.update(report)
    print(json.dumps(hello), flush=True)
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
            elif cmd == "measure":
                reply = shm_pss(args.namespace, client.index().shm_dir)
            elif cmd == "pages":
                reply = shm_pages(args.namespace, client.index().shm_dir)
            elif cmd == "logits":
                reply = {"logits": logits_digest(model), "generation": client.generation}
            elif cmd == "refresh":
                names = client.refresh(model)
                views = client.tensors()
                reply = {"names": names, "generation": client.generation}
            elif cmd.startswith("loop "):
                reply = forward_loop(client, model, float(cmd.split()[1]))
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
