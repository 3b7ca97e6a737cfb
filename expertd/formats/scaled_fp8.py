"""FP8 e4m3 weights with one scale tensor each: y = bf16(float32(w) * float32(s)), s broadcast over a block of w.

DeepSeek's `quant_method: fp8` stores `NAME_scale_inv` per `weight_block_size` block; compressed-tensors
(`format: float-quantized`, what llmcompressor writes) stores `NAME_scale` per output channel ([out, 1]), per
tensor ([1]) or per `block_structure` block. Every layout is one kernel rule, a scale over a (rows, columns) block:
`kernels.weight_dequant` for a part, its batched forms for many (`dequant_stack`, `batch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dtypes import DEQUANTIZED, FP8, SCALE_SUFFIX
from ..errors import ScaleError, ShapeError, UnsupportedDtypeError, UpdateRejected
from .codec import Codec, Decoding, Pieces, UnsupportedQuantization

DEFAULT_BLOCK = (128, 128)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # DeepSeek stores float32, Qwen and llmcompressor bf16
# compressed-tensors' other per-module tensors: static activation scales, zero points, group indices
FOREIGN_AUX = ("input_scale", "output_scale", "weight_zero_point", "input_zero_point", "weight_g_idx", "k_scale",
               "v_scale")


@dataclass(frozen=True)
class ScaledFp8(Codec):
    """FP8 e4m3 weights, each with a `NAME + suffix` scale over blocks of it (see the module docstring); bf16 / fp16
    scales widen to float32 exactly."""

    method: str | None  # "fp8", "compressed-tensors"; None: no quantization_config
    suffix: str = SCALE_SUFFIX
    strategies: tuple[str, ...] = ("block",)  # of "block", "channel", "tensor": what the config declares
    block_size: tuple[int, int] = DEFAULT_BLOCK  # the "block" strategy's (rows, columns)
    ignore: tuple[str, ...] = ()  # modules the config leaves unquantized (informational: their weights are bf16)

    batched = True  # DeepSeek-V3's tens of thousands of small experts cost Python per part: `batch` makes them

    @property
    def aux_suffix(self) -> str:
        return self.suffix

    def expected_scale(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(strategy, scale shape) each declared strategy expects for a weight of `shape`."""
        m, n = shape
        out = []
        for strategy in self.strategies:
            if strategy == "channel":
                out.append((strategy, (m, 1)))
            elif strategy == "tensor":
                out.extend((strategy, s) for s in ((1,), (1, 1), ()))
            else:
                out.append((strategy, (math.ceil(m / self.block_size[0]), math.ceil(n / self.block_size[1]))))
        return out

    def block_for(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, columns) one scale covers in a weight of `shape` whose scale has `scale_shape` (checked)."""
        m, n = shape
        strategy = self.strategy_of(shape, scale_shape)
        return {"channel": (1, max(n, 1)), "tensor": (max(m, 1), max(n, 1))}.get(strategy, self.block_size)

    def strategy_of(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        """The declared strategy a scale of `scale_shape` follows for a weight of `shape`; ValueError for none."""
        for strategy, want in self.expected_scale(shape):
            if tuple(scale_shape) == want:
                return strategy
        raise ValueError(f"scale shape {list(scale_shape)} fits no declared strategy")

    def scheme(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        """How one weight is quantized, in words ("fp8 e4m3, per-channel bf16 scale")."""
        strategy = self.strategy_of(shape, scale_shape)
        how = f"{self.block_size[0]}x{self.block_size[1]} block" if strategy == "block" else f"per-{strategy}"
        return f"fp8 e4m3, {how} scale"

    def describe(self) -> str:
        parts = [f"{s} {self.block_size[0]}x{self.block_size[1]}" if s == "block" else f"per-{s}"
                 for s in self.strategies]
        return f"FP8 e4m3 ({self.method or 'fp8'}: {', '.join(parts)}; *{self.suffix})"

    def quantized(self, name: str, info) -> bool:
        return info.dtype == DEQUANTIZED

    def decoding(self, name: str, info, aux) -> Decoding | None:
        if info.dtype not in FP8:
            return None
        if info.dtype != DEQUANTIZED:
            raise UnsupportedDtypeError(f"{info.dtype} weights cannot be dequantized (FP8 scales are for "
                                        f"float8_e4m3fn)", file=info.file, tensor=info.name)
        if aux is None:
            raise ScaleError(f"FP8 weight has no {self.aux_name(name)!r}; refusing to serve FP8 bytes as if they "
                             f"were bf16", file=info.file, tensor=info.name)
        if len(info.shape) != 2:
            raise ShapeError(f"FP8 weight must be 2-D for block dequant, has shape {list(info.shape)}",
                             file=info.file, tensor=info.name)
        try:
            block = self.block_for(info.shape, aux.shape)
        except ValueError:
            want = " or ".join(f"{list(s)} ({strategy})" for strategy, s in self.expected_scale(info.shape))
            raise ScaleError(f"scale shape {list(aux.shape)} does not fit weight {list(info.shape)}; expected {want}",
                             file=aux.file, tensor=aux.name) from None
        if aux.dtype not in SCALE_DTYPES:
            raise ScaleError(f"scale dtype {aux.dtype} is not one of {', '.join(map(str, SCALE_DTYPES))}",
                             file=aux.file, tensor=aux.name)
        return Decoding(self, info.shape, block, self.scheme(info.shape, aux.shape))

    def check_aux(self, tensors: dict) -> None:
        """A scale beside a bf16 weight (or none), a compressed-tensors activation scale or zero point mean the
        checkpoint is not what its config claims: dropping or serving them would be silently wrong."""
        for name, info in tensors.items():
            if self.is_aux(name, tensors):
                weight = tensors[name[: -len(self.suffix)]]
                if weight.dtype not in FP8:
                    raise ScaleError(f"scale belongs to a {weight.dtype} weight, not an FP8 one", file=info.file,
                                     tensor=name)
            elif self.method == "compressed-tensors" and name.rsplit(".", 1)[-1] in FOREIGN_AUX:
                raise UnsupportedQuantization(
                    f"{name.rsplit('.', 1)[-1]} tensors are not served (quantization_config declares FP8 weights "
                    f"with dynamic activations; a static scale or zero point would change the numerics)",
                    file=info.file, tensor=name)

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        shape, dtype = spec
        if dtype != str(DEQUANTIZED) or want.dtype != str(torch.bfloat16) or shape != want.shape:
            return None
        if aux is None:
            raise UpdateRejected(f"FP8 tensor {stored!r} needs its {self.aux_name(stored)!r} pushed with it")
        s_shape, s_dtype = aux_spec
        if len(shape) != 2 or s_dtype not in tuple(map(str, SCALE_DTYPES)):
            raise UpdateRejected(f"FP8 tensor {stored!r} must be 2-D with a float32 (or bf16/fp16) scale, got "
                                 f"{shape} with {s_dtype} {aux!r}")
        try:
            block = self.block_for(tuple(shape), tuple(s_shape))
        except ValueError:
            want_scale = " or ".join(f"{list(w)} ({how})" for how, w in self.expected_scale(tuple(shape)))
            raise UpdateRejected(f"scale {aux!r} must have shape {want_scale} for {stored!r} {shape}, "
                                 f"got {s_shape}") from None
        return Decoding(self, tuple(shape), block)

    # dequant entry points

    def dequant(self, out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, *, name: str,
                block: tuple[int, int], device: torch.device, threads: int | None = None) -> None:
        from expertd.kernels import weight_dequant

        m, n = data.shape
        grid = scale.float().reshape(-(-m // block[0]), -(-n // block[1]))  # a per-tensor scale may be stored as [1]
        weight_dequant(data, grid, block, out=out, out_dtype=out.dtype, name=name, device=device, threads=threads)

    def dequant_stack(self, out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, name: str,
                      block: tuple[int, int]) -> None:
        """Same-shaped weights [parts, M, N] with their float32 scale grids [parts, ...] into `out`, all on one GPU:
        one launch (the loader's GPU path, a run of one layer's experts)."""
        from expertd.kernels import weight_dequant_batched_triton

        weight_dequant_batched_triton(data, scales, block, out=out, name=name)

    def batch(self, scales: torch.Tensor, dtype: torch.dtype):
        """Many small weights at once on the CPU: their scales (back to back, float32) made one table of block
        results (`kernels.native.BlockTable`), each weight then dequantized from its first row by address."""
        from expertd.kernels.native import BlockTable

        return BlockTable(scales.float(), dtype)

    def stream(self, pieces: Pieces, scale: torch.Tensor, *, name: str, shape: tuple[int, ...],
               block: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        """A piece of rows at a time (`row_pieces`), each read, dequantized and hashed while it is in cache."""
        m, n = shape  # FP8 [M, N], as `decoding` checked
        item = dtype.itemsize
        rows_per_scale, cols_per_scale = block
        grid = scale.float().reshape(-(-m // rows_per_scale), -(-n // cols_per_scale))
        for r0, r1, rows in row_pieces(m, n * item, rows_per_scale, device.type == "cuda", pieces.chunk, pieces.most):
            piece = pieces.read(r0 * n, (r1 - r0) * n)
            with pieces.place(r0 * n * item, (r1 - r0) * n * item, dtype, (r1 - r0, n)) as dst:
                self.dequant(dst, piece.view(DEQUANTIZED).view(r1 - r0, n),
                             grid[r0 // rows_per_scale: -(-r1 // rows_per_scale)], name=name,
                             block=(rows, cols_per_scale), device=device, threads=1)

    def reference(self, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
        from expertd.kernels import scale_shape, weight_dequant_reference

        return weight_dequant_reference(data, scale.float().reshape(scale_shape(*data.shape, block)), block,
                                        out_dtype=dtype)


def row_pieces(m: int, row_bytes: int, block_rows: int, cuda: bool, chunk: int, most: int):
    """(r0, r1, rows one scale covers) row ranges of an [m, ...] FP8 weight dequantized a piece at a time:
    whole block rows about `chunk` bytes of results each (one block row when that is up to `most`), else
    slices of one block row (a per-tensor scale over a large tensor). On CUDA: the whole tensor."""
    if cuda or m == 0:
        yield 0, m, block_rows
        return
    target = max(1, chunk // max(1, row_bytes))
    if block_rows <= target or block_rows * row_bytes <= most:
        step = max(1, target // block_rows) * block_rows
        for r0 in range(0, m, step):
            yield r0, min(m, r0 + step), block_rows
        return
    for b0 in range(0, m, block_rows):
        b1 = min(m, b0 + block_rows)
        for r0 in range(b0, b1, target):
            yield r0, min(b1, r0 + target), min(b1, r0 + target) - r0
