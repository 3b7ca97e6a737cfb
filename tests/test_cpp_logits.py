"""A libtorch model on the C++ client's views computes transformers' own logits (issue 39: in every client), through a
push that makes an expert stack of ranges: `expertd-cpp-logits` (client/cpp/tools/logits.cpp) loads a traced
transformers model, binds every parameter to the C++ client's read-only view of the served tensor (no copy: the
data pointers are the views'), runs it, refreshes onto the pushed generation and runs again, then runs once more on
the views it took before the refresh. Real daemon, the built tool, transformers' from_pretrained as the reference."""

from __future__ import annotations

import subprocess

import pytest
import torch

from expertd.client import ExpertClient
from helpers.checkpoints import edit_checkpoint
from test_cpp_client import cpp_build  # noqa: F401  (the session's build of client/cpp)
from test_cpp_extents import EXPERT, STACK, paged  # noqa: F401  (a bf16 Qwen3-MoE with 64 KiB expert parts)

IDS = [1, 5, 9, 22, 7, 3, 11, 2, 40, 41, 42, 43]


def from_pretrained(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


class Logits(torch.nn.Module):
    """input ids -> logits, the form a trace keeps (its parameters named `m.` + the model's own names)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False, return_dict=False)[0]


def reference(folder: str) -> torch.Tensor:
    with torch.no_grad():
        return Logits(from_pretrained(folder))(torch.tensor([IDS]))


def read_logits(path: str, like: torch.Tensor) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=like.dtype).reshape(like.shape)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_a_libtorch_model_on_the_cpp_clients_views_computes_transformers_logits(cpp_build, start_daemon,  # noqa: F811
                                                                                 paged, tmp_path):  # noqa: F811
    module = str(tmp_path / "model.pt")
    with torch.no_grad():  # traced on the checkpoint's own weights; it runs on whatever it is bound to
        torch.jit.save(torch.jit.trace(Logits(from_pretrained(paged)), (torch.tensor([IDS]),), check_trace=False),
                       module)
    d = start_daemon(paged)
    out = str(tmp_path / "logits")
    tool = subprocess.Popen([str(cpp_build / "expertd-cpp-logits"), d.endpoint, module, ",".join(map(str, IDS)), out,
                             "--refresh-on-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = tool.stdout.readline().split()
        assert first[:2] == ["generation", "1"] and first[3] == first[5], first  # every parameter bound
        assert tool.stdout.readline().startswith(out + ".0 torch.bfloat16")
        with ExpertClient(d.endpoint, heartbeat=False) as client:
            part = client.tensors()[EXPERT].clone()
            client.update({EXPERT: -part})
            client.refresh()
            (entry,) = [t for t in client.index().tensors if t.name == STACK]
            assert entry.extents and len(entry.extents) == 3  # the stack now lies in two segments' ranges
        said, err = tool.communicate("pushed\n", timeout=300)
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.communicate()
    assert tool.returncode == 0, err
    assert said.splitlines()[0].split()[:4] == ["generation", "2", "changed", "1"], said
    old = reference(paged)
    changed = edit_checkpoint(paged, str(tmp_path / "changed"), replace={EXPERT: -part})
    new = reference(changed)
    assert not torch.equal(old, new)  # the pushed expert shows in the logits
    assert torch.equal(read_logits(out + ".0", old), old)
    assert torch.equal(read_logits(out + ".1", new), new)  # the stack of ranges, bound as one view
    assert torch.equal(read_logits(out + ".2", old), old)  # the views taken before the refresh: the old bytes
