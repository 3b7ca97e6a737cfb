"""Each format's dequant entry points agree bit for bit: a part whole (`dequant`), a piece at a time (`stream`, over
plain in-memory pieces at chunk sizes that split scale blocks), many small parts at once (`batch`) and the format's
`reference`, on shapes that are not multiples of a block; and the loader's small FP8 parts go through `batch`."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import xxhash

from expertd.formats.mxfp4 import Mxfp4
from expertd.formats.scaled_fp8 import ScaledFp8
from expertd.index import checksum_parts, tensor_checksum
from expertd.kernels import native
from expertd.server.load.loader import build, prepare
from expertd.shm import map_segments, view

CPU = torch.device("cpu")
FP8 = ScaledFp8("fp8")
CHUNKS = [(1 << 20, 8 << 20), (4096, 4096), (640, 640)]  # (chunk, most): whole, block rows, slices of one block row


class MemoryPieces:
    """`Pieces` over bytes in memory: what the loader does with a checkpoint and a segment, without either."""

    def __init__(self, source: torch.Tensor, nbytes: int, chunk: int, most: int):
        self.source, self.out = source.reshape(-1).view(torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        self.chunk, self.most = chunk, most
        self.read_at = 0  # pieces are read in order, each once

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        assert offset == self.read_at
        self.read_at += nbytes
        return self.source[offset: offset + nbytes].clone()

    @contextmanager
    def place(self, offset: int, nbytes: int, dtype: torch.dtype, shape):
        dst = torch.empty(shape, dtype=dtype)
        yield dst
        self.out[offset: offset + nbytes] = dst.reshape(-1).view(torch.uint8)


def fp8_case(m: int, n: int, block: tuple[int, int], scale_dtype: torch.dtype, seed: int):
    """Every fp8 byte (NaNs too) at random, with positive scales of `scale_dtype` over `block`s."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    grid = (-(-m // block[0]), -(-n // block[1]))
    s = (torch.rand(grid, generator=g) * 4 + 2 ** -10).to(scale_dtype)
    return x, s


@pytest.mark.parametrize("chunk,most", CHUNKS)
@pytest.mark.parametrize("m,n,block", [(200, 320, (128, 128)), (7, 300, (1, 300)), (130, 17, (130, 17)),
                                       (129, 260, (64, 32))], ids=["blocks", "channel", "tensor", "small-blocks"])
def test_fp8_streamed_whole_and_reference_agree(m, n, block, chunk, most):
    for scale_dtype in (torch.float32, torch.bfloat16):
        x, s = fp8_case(m, n, block, scale_dtype, seed=m + n)
        whole = torch.empty(m, n, dtype=torch.bfloat16)
        FP8.dequant(whole, x, s, name="w", block=block, device=CPU)
        pieces = MemoryPieces(x, m * n * 2, chunk, most)
        FP8.stream(pieces, s, name="w", shape=(m, n), block=block, dtype=torch.bfloat16, device=CPU)
        assert pieces.read_at == m * n
        reference = FP8.reference(x, s, block, torch.bfloat16)
        assert torch.equal(pieces.out, whole.view(-1).view(torch.uint8))
        assert torch.equal(whole.view(torch.int16), reference.view(torch.int16))


@pytest.mark.skipif(not native.available(), reason="the compiled CPU dequant could not be built")
def test_fp8_batch_gives_each_weight_its_whole_dequant():
    """Weights of several shapes from one table: whole (with both hashes) and row by row."""
    blocks = {(200, 320): (128, 128), (7, 300): (1, 300), (130, 17): (130, 17)}
    cases = [fp8_case(m, n, block, torch.float32, seed=k) for k, ((m, n), block) in enumerate(blocks.items())]
    table = FP8.batch(torch.cat([s.reshape(-1) for _, s in cases]), torch.bfloat16)
    wants, outs, rows, first = [], [], [], 0
    for (x, s), block in zip(cases, blocks.values()):
        want = torch.empty(x.shape, dtype=torch.bfloat16)
        FP8.dequant(want, x, s, name="w", block=block, device=CPU)
        out = torch.empty_like(want)
        rows.append([x.data_ptr(), out.data_ptr(), *x.shape, first, *block])
        wants.append(want)
        outs.append(out)
        first += s.numel()
    hashes = torch.empty(len(cases), 2, dtype=torch.int64)
    assert table.parts(torch.tensor(rows, dtype=torch.int64), hashes)
    for (x, _), want, out, (h_in, h_out) in zip(cases, wants, outs, hashes.view(torch.uint64).tolist()):
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        assert (h_in, h_out) == (xxhash.xxh3_64_intdigest(x.view(torch.uint8).numpy().tobytes()),
                                 xxhash.xxh3_64_intdigest(out.view(torch.uint8).numpy().tobytes()))
    for (x, _), want, row in zip(cases, wants, rows):
        m, n = x.shape
        out = torch.zeros_like(want)
        for r0 in range(0, m, 3):
            table.rows(x.data_ptr(), out.data_ptr(), n, tuple(row[5:]), row[4], r0, min(m, r0 + 3))
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("chunk", [1 << 20, 320])  # every group at once; one group (32 rows of 5) a piece
def test_mxfp4_streamed_whole_and_reference_agree(chunk):
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (2, 5, 3), dtype=torch.uint8, generator=g)
    codec = Mxfp4()
    whole = torch.empty(2, 96, 5, dtype=torch.bfloat16)
    codec.dequant(whole, blocks, scales, name="x_blocks", block=None, device=CPU)
    pieces = MemoryPieces(blocks, whole.numel() * 2, chunk, chunk)
    codec.stream(pieces, scales, name="x_blocks", shape=tuple(blocks.shape), block=None, dtype=torch.bfloat16,
                 device=CPU)
    assert pieces.read_at == blocks.numel()
    assert torch.equal(pieces.out, whole.view(-1).view(torch.uint8))
    assert torch.equal(whole.view(torch.int16), codec.reference(blocks, scales, None, torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(not native.available(), reason="the compiled CPU dequant could not be built")
def test_the_loaders_small_fp8_parts_go_through_the_formats_batch(tiny_checkpoint, namespace, monkeypatch):
    calls = []
    batch = ScaledFp8.batch

    def counted(self, scales, dtype):
        calls.append(scales.numel())
        return batch(self, scales, dtype)

    monkeypatch.setattr(ScaledFp8, "batch", counted)
    built = build(*prepare(tiny_checkpoint), namespace=namespace, generation=1, threads=1, device="cpu")
    try:
        assert calls  # the small parts' tables were made by the format
        maps = map_segments(built.index.segments, shm_dir=built.index.shm_dir)
        for t in built.index.tensors:
            assert tensor_checksum(view(maps, t), checksum_parts(t.checksum)) == t.checksum, t.name
        del maps
    finally:
        built.close()
