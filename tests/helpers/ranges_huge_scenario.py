"""A push of one expert's part on a huge-page tmpfs `shm_dir` with `expert_ranges`, run inside the test's private mount
namespace (the folder exists only there).

Usage: ranges_huge_scenario.py CHECKPOINT WORK NAMESPACE SHM_DIR

CHECKPOINT's experts' parts are whole 2 MiB pages. Prints one JSON line: the stack's ranges after the push, whether
the reader's view of it equals the expected bytes and lies in one shared mapping of SHM_DIR's files (not a private
copy), the huge pages mapped in that view once read (smaps ShmemPmdMapped/FilePmdMapped), and whether the model's
logits equal transformers' own with that expert changed.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.daemon import DaemonProcess  # noqa: E402

from expertd.client import ExpertClient  # noqa: E402
from expertd.client.residency import shared_ranges  # noqa: E402

STACK = "model.layers.1.mlp.experts.gate_up_proj"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def huge_kb(t: torch.Tensor) -> int:
    """kB of `t`'s range mapped by huge pages (smaps of the mappings inside it)."""
    lo, hi, total, inside = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(line.split()[1])
    return total


def main(checkpoint: str, work: str, namespace: str, shm_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    daemon = DaemonProcess.launch(f"{work}/daemon", checkpoint, namespace, shm_dir=shm_dir, expert_ranges=True)
    out = {}
    try:
        daemon.wait_serving()
        with ExpertClient(daemon.endpoint, heartbeat=False) as c:
            part = c.tensors()[EXPERT].clone()
            before = c.served_tensors()[STACK].clone()
            c.update({EXPERT: -part})
            c.refresh()
            (entry,) = [t for t in c.index().tensors if t.name == STACK]
            stack = c.served_tensors()[STACK]
            want = before.clone()
            want[3, want.shape[1] // 2:] = -part
            out["extents"] = [x.to_wire() for x in entry.extents or []]
            out["equal"] = torch.equal(stack, want)
            lo, hi = stack.data_ptr(), stack.data_ptr() + stack.numel() * stack.element_size()
            out["shared"] = any(a <= lo and hi <= b for a, b in shared_ranges(shm_dir))
            out["aligned"] = lo % (2 << 20) == 0
            stack.sum()  # read it all: its pages mapped
            out["huge_kb"], out["size_kb"] = huge_kb(stack), (hi - lo) >> 10
            reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
            ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
            with torch.no_grad():
                dict(reference.named_parameters())[STACK].data.copy_(want)
                out["logits_equal"] = torch.equal(c.load_model()(ids).logits, reference(ids).logits)
            out["verify"] = c.verify()
    finally:
        out["stop"] = daemon.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:5])
