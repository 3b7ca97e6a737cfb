"""Dequantization kernels: FP8 e4m3 with block scales (DeepSeek-V3's `scale_inv`, compressed-tensors' channel,
tensor and block scales: one rule, see `reference`) and MXFP4 (gpt-oss, see `mxfp4`) -> bf16.

`weight_dequant` picks the path: the Triton kernel on a CUDA device, else the CPU path (a table lookup
compiled with the system C compiler on first use, or vectorized torch ops where that cannot be built).
For bf16 output, the served dtype, every path is bit-identical to `weight_dequant_reference`, NaN
patterns included; fp16/fp32 outputs match too except for NaN payloads on the GPU. Importing this
package never imports triton.
"""

from __future__ import annotations

import torch

from .cpu import _dequant_cpu, weight_dequant_cpu
from .mxfp4 import (
    dequant_mxfp4,
    dequant_mxfp4_groups,
    dequant_mxfp4_reference,
    dequant_mxfp4_triton,
    mxfp4_table,
    quantize_mxfp4,
)
from .quant import quantize_fp8_blockwise
from .reference import (
    DEFAULT_BLOCK_SIZE,
    ceil_div,
    check_dequant_args,
    check_dequant_call,
    scale_shape,
    weight_dequant_reference,
)
from .triton_dequant import _dequant_triton, weight_dequant_batched_triton, weight_dequant_triton

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ceil_div",
    "check_dequant_args",
    "check_dequant_call",
    "dequant_mxfp4",
    "dequant_mxfp4_groups",
    "dequant_mxfp4_reference",
    "dequant_mxfp4_triton",
    "mxfp4_table",
    "quantize_mxfp4",
    "quantize_fp8_blockwise",
    "scale_shape",
    "weight_dequant",
    "weight_dequant_batched_triton",
    "weight_dequant_cpu",
    "weight_dequant_reference",
    "weight_dequant_triton",
]


def weight_dequant(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    device: torch.device | str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Dequantize on `device` (default: CUDA if available, else CPU) into `out` if given; return the result.

    `block_size` is B for square B x B blocks (DeepSeek) or a (rows, columns) pair: (1, N) is one scale per
    output channel and (M, N) one per tensor (compressed-tensors' strategies).

    On CUDA the inputs are moved to the GPU; a CPU `out` receives a copy of the GPU result. `threads`
    caps the CPU threads one call uses (default: torch's thread count); a loader that runs one call
    per thread passes 1.
    """
    m, n = check_dequant_call(weight, scale_inv, block_size, out, out_dtype, name)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        if device.type != "cpu":
            raise ValueError(f"weight_dequant runs on cpu or cuda, not {device}")
        return _dequant_cpu(weight, scale_inv, block_size, out, out_dtype, m, n, threads)

    w = weight.to(device, non_blocking=True)
    s = scale_inv.to(device, non_blocking=True)
    if out is not None and out.device == w.device:
        return _dequant_triton(w, s, block_size, out, out_dtype, m, n)
    y = _dequant_triton(w, s, block_size, None, out_dtype, m, n)
    if out is None:
        return y
    out.copy_(y)
    return out
