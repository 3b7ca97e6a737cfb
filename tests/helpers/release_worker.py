"""A worker on whatever transformers its python has: the daemon's model vs its own `from_pretrained`.

    python release_worker.py ENDPOINT REFERENCE_BF16_FOLDER INPUT_IDS_JSON

Run by tests/test_transformers_releases.py in other virtualenvs too, so it imports nothing but expertd's
client, torch and transformers. Prints one JSON line: the logits' equality with the worker's own
`from_pretrained(dtype=bfloat16)` of the bf16 reference, the dtypes of both, and which parameters and loaded
buffers lie outside the daemon's read-only shared memory.
"""

import json
import logging
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

from expertd.client import ExpertClient


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    endpoint, reference, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
    lines = Lines()
    logging.getLogger("expertd.client").addHandler(lines)
    logging.getLogger("expertd.client").setLevel(logging.INFO)
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)
    ids = ids % ref.config.get_text_config().vocab_size  # presets with a vocabulary smaller than the ids
    with ExpertClient(endpoint) as client:
        model = client.load_model()
        private = client.private_tensors(model)
        status = client.status()
        with torch.no_grad():
            equal = torch.equal(model(ids).logits, ref(ids).logits)
        print(json.dumps({
            "transformers": transformers.__version__,
            "equal": equal,
            "private": private,
            "tensors": len(model.state_dict()),
            "dtypes": {n: str(t.dtype) for n, t in model.state_dict().items()},
            "ref_dtypes": {n: str(t.dtype) for n, t in ref.state_dict().items()},
            "log": lines.lines,
            "derived": [v for g in status["generations"] for v in g.get("derived", {}).get("tensors", [])],
        }))


if __name__ == "__main__":
    main()
