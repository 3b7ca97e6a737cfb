"""A real worker process for the end-to-end tests: attach, run the model, report what it sees.

Usage: worker_probe.py ENDPOINT NAMESPACE OUT_DIR. Prints READY once it has touched every weight,
waits for a line on stdin, then prints one JSON line with the Pss of its shared mappings, and
exits after one more line (so that every worker measures while all are attached).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from expertd.client import ExpertClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inputs import INPUT_IDS  # noqa: E402


def shm_ranges(namespace: str) -> list[tuple[int, int, str]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith(f"/dev/shm/{namespace}."):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi, parts[1]))
    return ranges


def shm_pss(namespace: str) -> dict:
    sizes, pss, name = {}, {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                name = parts[5] if len(parts) >= 6 and parts[5].startswith(f"/dev/shm/{namespace}.") else None
            elif name and parts[0] == "Size:":
                sizes[name] = sizes.get(name, 0) + int(parts[1]) * 1024
            elif name and parts[0] == "Pss:":
                pss[name] = pss.get(name, 0) + int(parts[1]) * 1024
    return {"size": sum(sizes.values()), "pss": sum(pss.values())}


def main() -> None:
    endpoint, namespace, out_dir = sys.argv[1:4]
    with ExpertClient(endpoint, timeout=60) as client:
        model = client.load_model()
        with torch.no_grad():
            logits = model(torch.tensor(INPUT_IDS)).logits
        ranges = shm_ranges(namespace)
        outside, writable = [], [r for r in ranges if "w" in r[2]]
        state = dict(model.named_parameters())
        state.update((k, v) for k, v in model.named_buffers() if k in model.state_dict())
        for name, t in state.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            if not any(a <= lo and hi <= b for a, b, _ in ranges):
                outside.append(name)
        views = client.tensors()
        save_file({k: v.contiguous() for k, v in views.items()}, os.path.join(out_dir, "tensors.safetensors"))
        torch.save(logits, os.path.join(out_dir, "logits.pt"))
        touched = sum(float(v.float().abs().sum()) for v in client.served_tensors().values())
        report = {
            "outside": outside,
            "writable_maps": len(writable),
            "dtypes": {k: str(v.dtype) for k, v in state.items()},
            "training": model.training,
            "touched": touched,
            "nparams": len(state),
            # (triton itself may be imported by torch._dynamo when installed; client code never imports it)
            "forbidden_imports": sorted(m for m in sys.modules if m.startswith(("expertd.server", "expertd.kernels"))),
        }
        print("READY", flush=True)
        sys.stdin.readline()
        report.update(shm_pss(namespace))
        print(json.dumps(report), flush=True)
        sys.stdin.readline()  # stay attached until every worker has measured


if __name__ == "__main__":
    main()
