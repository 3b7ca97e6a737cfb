"""Each format's dequant entry points, by its codec's `kind`: one part written whole, one part streamed chunk by
chunk, and the pure-torch reference the offline tools use.

The codec (`expertd.quantization`) says what a stored tensor is and checks it; this is how its bytes become the
served ones, over the format's kernel in `expertd.kernels` — which only the daemon and its tools import, never
the client, so it lives here and not on the codec. `plain` is stored bytes served as they are.
"""

from __future__ import annotations

import math

import torch
import xxhash

from expertd.index import tensor_bytes

from .checkpoint import Checkpoint
from .layout import Source
from .parts import BATCH_BYTES, CHUNK_BYTES, Output, Part, buffer, memory_at


class Plain:
    """Stored bytes, copied as they are."""

    kind = "plain"
    batched = False  # small parts of this kind are not filled together (small_parts)

    def write(self, out: torch.Tensor, data: torch.Tensor, scale, *, name: str, block, device: torch.device,
              threads: int | None = None) -> None:
        out.copy_(data.view(out.shape))

    def stream(self, part: Part, output: Output, ckpt: Checkpoint, src: Source, scale, device: torch.device):
        """Read straight into place; source and result are the same bytes."""
        info, src_hash = src.info, xxhash.xxh3_64()
        for b0 in range(0, info.nbytes, CHUNK_BYTES):
            nbytes = min(CHUNK_BYTES, info.nbytes - b0)
            into = memory_at(output.at(part, b0, nbytes), nbytes)
            ckpt.read_into(info, b0, into)
            src_hash.update(into)
        digest = "xxh3_64:" + src_hash.hexdigest()
        return digest, digest


class ScaledFp8:
    """FP8 e4m3 with a scale over blocks of it: y = bf16(float32(x) * float32(s)); bf16 / fp16 scales (Qwen's and
    llmcompressor's FP8) widen to float32 exactly."""

    kind = "fp8"
    batched = True  # DeepSeek-V3's tens of thousands of small experts cost Python per part: small_parts fills them

    def write(self, out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, *, name: str, block: tuple[int, int],
              device: torch.device, threads: int | None = None) -> None:
        from expertd import kernels

        m, n = data.shape
        grid = scale.float().reshape(-(-m // block[0]), -(-n // block[1]))  # a per-tensor scale may be stored as [1]
        kernels.weight_dequant(data, grid, block, out=out, out_dtype=out.dtype, name=name, device=device,
                               threads=threads)

    def stream(self, part: Part, output: Output, ckpt: Checkpoint, src: Source, scale: torch.Tensor,
               device: torch.device) -> tuple[str, str]:
        """A piece of rows at a time (`row_pieces`), each read, dequantized and hashed while it is in cache."""
        info = src.info
        src_hash, out_hash = xxhash.xxh3_64(), xxhash.xxh3_64()
        m, n = info.shape  # FP8 [M, N], as the plan checked
        item = part.out.element_size()
        rows_per_scale, cols_per_scale = src.block
        grid = scale.float().reshape(-(-m // rows_per_scale), -(-n // cols_per_scale))
        for r0, r1, rows in row_pieces(m, n * item, rows_per_scale, device.type == "cuda"):
            piece = buffer((r1 - r0) * n) if device.type != "cuda" else torch.empty((r1 - r0) * n, dtype=torch.uint8)
            ckpt.read_into(info, r0 * n, tensor_bytes(piece))
            src_hash.update(tensor_bytes(piece))
            dst = output.tensor(part, r0 * n * item, (r1 - r0) * n * item, part.out.dtype, (r1 - r0, n))
            self.write(dst, piece.view(info.dtype).view(r1 - r0, n),
                       grid[r0 // rows_per_scale: -(-r1 // rows_per_scale)], name=info.name,
                       block=(rows, cols_per_scale), device=device, threads=1)
            out_hash.update(tensor_bytes(dst))
        return "xxh3_64:" + src_hash.hexdigest(), "xxh3_64:" + out_hash.hexdigest()

    def reference(self, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
        from expertd.kernels import scale_shape, weight_dequant_reference

        return weight_dequant_reference(data, scale.float().reshape(scale_shape(*data.shape, block)), block,
                                        out_dtype=dtype)


def row_pieces(m: int, row_bytes: int, block_rows: int, cuda: bool):
    """(r0, r1, rows one scale covers) row ranges of an [m, ...] FP8 weight dequantized a piece at a time:
    whole block rows about CHUNK_BYTES of results each (one block row when that is up to BATCH_BYTES), else
    slices of one block row (a per-tensor scale over a large tensor). On CUDA: the whole tensor."""
    if cuda or m == 0:
        yield 0, m, block_rows
        return
    target = max(1, CHUNK_BYTES // max(1, row_bytes))
    if block_rows <= target or block_rows * row_bytes <= BATCH_BYTES:
        step = max(1, target // block_rows) * block_rows
        for r0 in range(0, m, step):
            yield r0, min(m, r0 + step), block_rows
        return
    for b0 in range(0, m, block_rows):
        b1 = min(m, b0 + block_rows)
        for r0 in range(b0, b1, target):
            yield r0, min(b1, r0 + target), min(b1, r0 + target) - r0


class Mxfp4:
    """MXFP4 blocks [..., R, G, 16] with e8m0 scales [..., R, G], decoded to bf16 [..., G*32, R]."""

    kind = "mxfp4"
    batched = False

    def write(self, out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, *, name: str, block,
              device: torch.device, threads: int | None = None) -> None:
        from expertd import kernels

        kernels.dequant_mxfp4(data, scale, out=out, name=name, device=device, threads=threads)

    def stream(self, part: Part, output: Output, ckpt: Checkpoint, src: Source, scales: torch.Tensor,
               device: torch.device) -> tuple[str, str]:
        """Decoded a matrix at a time (an expert: its blocks read whole, a quarter of its result's bytes), its
        [G*32, R] result written about CHUNK_BYTES of rows (whole groups) at a time."""
        from expertd.kernels import dequant_mxfp4, dequant_mxfp4_groups

        info = src.info
        *lead, rows, groups, width = info.shape
        matrices = math.prod(lead)
        per_matrix = rows * groups * width
        scales = scales.reshape(matrices, rows, groups)
        out_rows = groups * 32
        step = max(1, CHUNK_BYTES // max(1, 32 * rows * 2)) if device.type != "cuda" else groups
        src_hash, out_hash = xxhash.xxh3_64(), xxhash.xxh3_64()
        for e in range(matrices):
            blocks = buffer(per_matrix) if device.type != "cuda" else torch.empty(per_matrix, dtype=torch.uint8)
            ckpt.read_into(info, e * per_matrix, tensor_bytes(blocks))
            src_hash.update(tensor_bytes(blocks))
            blocks = blocks.view(rows, groups, width)
            for g0 in range(0, groups, step):
                g1 = min(groups, g0 + step)
                offset = (e * out_rows + g0 * 32) * rows * 2
                dst = output.tensor(part, offset, (g1 - g0) * 32 * rows * 2, torch.bfloat16, ((g1 - g0) * 32, rows))
                if device.type == "cuda":
                    dst.copy_(dequant_mxfp4(blocks, scales[e], device=device)[g0 * 32: g1 * 32])
                else:
                    dequant_mxfp4_groups(blocks, scales[e], g0, g1, dst, threads=1)
                out_hash.update(tensor_bytes(dst))
        return "xxh3_64:" + src_hash.hexdigest(), "xxh3_64:" + out_hash.hexdigest()

    def reference(self, data: torch.Tensor, scales: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
        from expertd.kernels import dequant_mxfp4_reference

        return dequant_mxfp4_reference(data, scales).to(dtype)


DEQUANT = {f.kind: f for f in (Plain(), ScaledFp8(), Mxfp4())}  # by the codec's `kind`


def write_part(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, *, name: str,
               block: tuple[int, int] | None, device: torch.device, threads: int | None = None,
               kind: str | None = None) -> None:
    """One source part into its place: dequantized by its format (`kind`: "fp8" when a scale is given and no
    kind), bit-exact to the format's definition; plain bytes copied."""
    kind = kind or ("fp8" if scale is not None else "plain")
    DEQUANT[kind].write(out, data, scale, name=name, block=block, device=device, threads=threads)


def stream_part(part: Part, output: Output, ckpt: Checkpoint, src: Source, scale: torch.Tensor | None, *,
                device: torch.device) -> tuple[str, str]:
    """Write one part chunk by chunk: read (`preadv`), hash the source chunk, dequantize or copy it,
    hash the result while it is in cache: (checksum of the source bytes, checksum of the written bytes)."""
    return DEQUANT[src.kind].stream(part, output, ckpt, src, scale, device)
