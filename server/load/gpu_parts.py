"""A task's parts dequantized on the GPU: the sources read into pinned memory and hashed, their scales read, hashed,
checked and widened to float32, by one compiled call,
copied up at once, dequantized by one launch per run of same-shaped experts, copied back into pinned memory, then
hashed and written into their segments by a second compiled call (`kernels/fill_batch.c`).

Each loader thread has its own pinned buffers and CUDA stream, so while one thread's parts are on the GPU
another's are being read and a third's written: the pipeline is the threads. Nothing on the way holds the GIL
but the planning of a task. Stored (plain) parts never go to the GPU: read, hashed and written in one call.
"""

from __future__ import annotations

import threading
from array import array
from itertools import accumulate, chain

import torch
from expertd.kernels import native

from expertd.formats.scaled_fp8 import ScaledFp8
from expertd.index import checksum_text

from ..shm.arena import Arena
from .checkpoint import Checkpoint
from .native_parts import check, copy_row, destination, results, scale_count
from .parts import CHUNK_BYTES, Output, Part, buffer_at

_local = threading.local()


def usable(device: torch.device) -> bool:
    """Whether parts go this way: a CUDA device, and the compiled library with XXH3's streaming functions."""
    return device.type == "cuda" and native.can_fill_batch()


def takes(part: Part) -> bool:
    """Stored bytes, or FP8 made bf16 (the Triton kernel's bit-exact output)."""
    codec = part.src.codec
    if codec is None:
        return True
    return isinstance(codec, ScaledFp8) and part.block.dtype == torch.bfloat16 and scale_count(part.src) is not None


def _pinned(which: str, nbytes: int) -> torch.Tensor:
    """This thread's pinned host buffer `which`, at least `nbytes` long (grown by doubling, kept for the build)."""
    buf = getattr(_local, which, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 2 * (0 if buf is None else buf.numel()), CHUNK_BYTES), dtype=torch.uint8,
                          pin_memory=True)
        setattr(_local, which, buf)
    return buf[:nbytes]


def _stream(device: torch.device) -> torch.cuda.Stream:
    stream = getattr(_local, "stream", None)
    if stream is None or stream.device != device:
        stream = _local.stream = torch.cuda.Stream(device)
    return stream


def _runs(parts: list[Part]) -> list[list[int]]:
    """Consecutive scaled parts of one shape and block: each run is one kernel launch."""
    runs: list[list[int]] = []
    for i, part in enumerate(parts):
        src = part.src
        if src.scale is None:
            continue
        key = (src.info.shape, src.block)  # hence one scale count (`takes` checked each scale tensor holds it)
        if runs and runs[-1][0] == key and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([key, i])
    return [run[1:] for run in runs]


def _launch(run: list[Part], x: torch.Tensor, scales_at: torch.Tensor, y: torch.Tensor) -> None:
    """Dequantize a run of same-shaped parts lying one after another from the start of `x` (fp8 bytes), their
    float32 scales from the start of `scales_at`, into `y` (bf16 bytes): one launch on the current stream (the
    format's batched entry point, `ScaledFp8.dequant_stack`)."""
    src = run[0].src
    m, n = src.info.shape
    grid = (-(-m // src.block[0]), -(-n // src.block[1]))
    count, per = len(run), grid[0] * grid[1]
    xs = x[: count * m * n].view(count, m, n)
    ss = scales_at[: count * per].view(count, *grid)
    ys = y[: count * m * n * 2].view(torch.bfloat16).view(count, m, n)
    src.codec.dequant_stack(ys, xs.view(torch.float8_e4m3fn), ss, name=src.info.name, block=src.block)


def fill_gpu(parts: list[Part], output: Output, ckpt: Checkpoint, arena: Arena,
             device: torch.device) -> list[tuple[str, dict, str]]:
    """Fill `parts` (each `takes`) through the GPU; per part what `filling.fill` gives."""
    output.flush()
    counts = [scale_count(p.src) if p.src.scale is not None else 0 for p in parts]
    first_at = [0, *accumulate(counts)][:-1]
    floats = torch.empty(max(1, sum(counts)), dtype=torch.float32)
    sizes = [p.src.info.nbytes for p in parts]
    starts, total = [0, *accumulate(sizes)][:-1], sum(sizes)
    outs = [2 * s if p.src.scale is not None else 0 for p, s in zip(parts, sizes)]
    out_starts = [0, *accumulate(outs)][:-1]
    host_in, host_out = _pinned("in", total), _pinned("out", sum(outs))
    # 1. every source read into pinned memory and hashed; every scale read, hashed, checked, widened: no GIL
    rows = [copy_row(ckpt.fd(p.src.info), p.src.info.offset, n, -1, host_in.data_ptr() + at)
            for p, n, at in zip(parts, sizes, starts)]
    scaled = [i for i, p in enumerate(parts) if p.src.scale is not None]
    for i in scaled:
        src = parts[i].src
        rows.append((native.FILL_SCALES, -1, 0, *src.info.shape, -1, floats.data_ptr() + 4 * first_at[i],
                     ckpt.fd(src.scale), src.scale.offset, *src.block, native.FILL_SCALE_DTYPES[src.scale.dtype], 0, 0))
    table, read = array("q", chain.from_iterable(rows)), array("Q", bytes(24 * len(rows)))
    raw = buffer_at(8 * max(counts, default=1) + 8, "scales")
    done = native.fill_batch(table, host_in.data_ptr(), host_in.data_ptr(), raw, raw, CHUNK_BYTES, read)
    check(done, parts + [parts[i] for i in scaled], table, arena, ckpt)
    ckpt.counted(total + sum(parts[i].src.scale.nbytes for i in scaled))
    scale_digests: list = [None] * len(parts)
    for j, i in enumerate(scaled, len(parts)):
        scale_digests[i] = checksum_text(read[3 * j + 2])
    runs = _runs(parts)
    if runs:
        stream = _stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # 2. up at once, dequantized run by run, back into pinned memory at once
            dev_in = host_in.to(device, non_blocking=True)
            dev_scales = floats.to(device, non_blocking=True)
            dev_out = torch.empty(sum(outs), dtype=torch.uint8, device=device)
            for run in runs:
                _launch([parts[i] for i in run], dev_in[starts[run[0]]:], dev_scales[first_at[run[0]]:],
                        dev_out[out_starts[run[0]]:])
            host_out.copy_(dev_out, non_blocking=True)
        stream.synchronize()
    # 3. results hashed and written into their segments (stored parts straight from what was read)
    desc, made, stored = [], host_out.data_ptr(), host_in.data_ptr()
    for p, n, at, out_at, size in zip(parts, sizes, starts, out_starts, outs):
        dst_fd, dst_at = destination(p, output, arena)
        src_at, nbytes = (made + out_at, size) if p.src.scale is not None else (stored + at, n)
        desc.append(copy_row(-1, src_at, nbytes, dst_fd, dst_at))
    table, written = array("q", chain.from_iterable(desc)), array("Q", bytes(24 * len(parts)))
    check(native.fill_batch(table, made, made, made, made, CHUNK_BYTES, written), parts, table, arena, ckpt)
    for k in range(len(parts)):  # the source's hash from the reading, the result's from the writing
        written[3 * k] = read[3 * k]
    return results(parts, ckpt, written, scale_digests)
