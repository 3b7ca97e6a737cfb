"""A worker on whatever transformers its python has: the daemon's model vs its own `from_pretrained`.

    python release_worker.py ENDPOINT REFERENCE_BF16_FOLDER INPUT_IDS_JSON
    python release_worker.py --serve     (a job a line on stdin: {"endpoint", "reference", "ids", "use_cache"})

Run by tests/test_transformers_releases.py in other virtualenvs too, so it imports nothing but expertd's
client, torch, transformers and helpers.worker (which imports no more). Prints one JSON line: the logits'
equality with the worker's own `from_pretrained(dtype=bfloat16)` of the bf16 reference, the dtypes of both,
which parameters and loaded buffers lie outside the daemon's read-only shared memory, and how many of the served
segments it maps writable.
With --serve, one process runs job after job (a model of another daemon each time, the one before let go): the
imports are paid once; a job that raises answers {"error": its traceback} and the next one runs.
"""

import gc
import json
import logging
import os
import sys
import traceback

import torch
import transformers
from transformers import AutoModelForCausalLM

from expertd.client import ExpertClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.worker import shm_ranges  # noqa: E402


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def writable_maps(shm_dir: str, namespace: str) -> int:
    """Mappings of the daemon's segments this process may write (0: every one read-only)."""
    return sum("w" in perms for _, _, perms in shm_ranges(namespace, shm_dir))


def report(endpoint: str, reference: str, ids: torch.Tensor, use_cache: bool = False) -> dict:
    """The worker's report on the daemon's model (see above); `use_cache`: both forwards with a cache, the path a
    hybrid model's linear-attention layers need (helpers.forward)."""
    lines = Lines()
    logger = logging.getLogger("expertd.client")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)
        ids = ids % ref.config.get_text_config().vocab_size  # presets with a vocabulary smaller than the ids
        with ExpertClient(endpoint) as client:
            model = client.load_model()
            private = client.private_tensors(model)
            status = client.status()
            index = client.index()
            with torch.no_grad():
                kw = {"use_cache": True} if use_cache else {}
                equal = torch.equal(model(ids, **kw).logits, ref(ids, **kw).logits)
            return {
                "transformers": transformers.__version__,
                "equal": equal,
                "private": private,
                "writable_maps": writable_maps(index.shm_dir, index.namespace),
                "tensors": len(model.state_dict()),
                "dtypes": {n: str(t.dtype) for n, t in model.state_dict().items()},
                "ref_dtypes": {n: str(t.dtype) for n, t in ref.state_dict().items()},
                "log": lines.lines,
                "derived": [v for g in status["generations"] for v in g.get("derived", {}).get("tensors", [])],
            }
    finally:
        logger.removeHandler(lines)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        for line in sys.stdin:
            job = json.loads(line)
            try:
                out = report(job["endpoint"], job["reference"], torch.tensor(job["ids"]), job.get("use_cache", False))
            except Exception:
                out = {"error": traceback.format_exc()}
            gc.collect()  # the job's model and reference go before the next
            print(json.dumps(out), flush=True)
        return
    print(json.dumps(report(sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3])))))


if __name__ == "__main__":
    main()
