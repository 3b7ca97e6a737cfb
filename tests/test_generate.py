"""The generator is deterministic: it reproduces the bundled tiny checkpoint byte for byte."""

import filecmp
import os

from expertd.server.tools.generate import generate
from expertd.server.layout import plan_checkpoint
from expertd.server.reader import Checkpoint

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny")


def test_generator_reproduces_the_bundled_checkpoint(tmp_path):
    out = str(tmp_path / "tiny")
    generate(out, preset="tiny")
    files = sorted(os.listdir(BUNDLED))
    assert files == sorted(os.listdir(out))
    match, mismatch, errors = filecmp.cmpfiles(BUNDLED, out, files, shallow=False)
    assert mismatch == [] and errors == []


def test_bundled_checkpoint_has_partial_blocks_and_foreign_scales():
    plan = plan_checkpoint(Checkpoint.open(BUNDLED))
    fp8 = [s for t in plan.tensors for s in t.sources if s.scale is not None]
    assert any(s.info.shape[0] % 128 or s.info.shape[1] % 128 for s in fp8)
    assert any(s.info.file != s.scale.file for s in fp8)
