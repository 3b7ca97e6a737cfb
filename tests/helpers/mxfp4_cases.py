"""What the MXFP4 tests share: random and every-pair cases, transformers' own decode, bit-for-bit comparison."""

from __future__ import annotations

import torch

CASES = [((4,), 70, 5), ((3,), 33, 2), ((2,), 1, 1), ((5,), 200, 3), ((1,), 129, 4), ((2,), 15, 7)]


def transformers_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16, f"{got.dtype} vs {want.dtype}"
    assert got.shape == want.shape, f"{list(got.shape)} vs {list(want.shape)}"
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), f"{int(diff.sum())} results differ, first at {diff.nonzero()[0].tolist()}"


def every_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [1, 256, 16, 16] and scales [1, 256, 16]: row s holds every byte 0..255 (its 16 groups) under
    scale byte s, so the result covers every (scale, low code) and (scale, high code) pair, each byte too."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    return blocks, scales


def random_case(*lead: int, rows: int, groups: int, seed: int = 0, lo: int = 0, hi: int = 256):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi, (*lead, rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales
