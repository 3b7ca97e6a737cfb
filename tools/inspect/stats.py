"""Per-tensor statistics, memory footprints and format errors, as JSON-ready numbers."""

from __future__ import annotations

import math

import torch

from .. import number_formats as fmts

FOOTPRINT_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def json_number(x: float) -> float | str:
    """Strict JSON has no inf or nan: those are written as strings."""
    return x if math.isfinite(x) else str(x)


def error_dict(e: fmts.FormatError) -> dict:
    return {"rel_error": json_number(e.rel_error), "snr_db": json_number(e.snr_db)}


def tensor_stats(x: torch.Tensor) -> dict:
    """min/max/mean/std/rms over the finite values, their sum of squares; fractions of zeros and non-finite values."""
    n = x.numel()
    if n == 0:
        return {"numel": 0, "zeros": 0.0, "nonfinite": 0.0}
    v = x.detach().reshape(-1)
    v = v.double() if not v.is_floating_point() or v.dtype == torch.float64 else v.float()
    zeros = n - int(torch.count_nonzero(v))
    bad = 0
    if not math.isfinite(float(v.abs().amax())):  # the slow mask only when there is something to drop
        finite = torch.isfinite(v)
        bad = n - int(finite.sum())
        v = v[finite]
    out = {"numel": n, "zeros": zeros / n, "nonfinite": bad / n}
    if v.numel():
        lo, hi = torch.aminmax(v)
        mean = float(v.sum(dtype=torch.float64)) / v.numel()
        sq = fmts.sum_squares(v)
        var = max(sq / v.numel() - mean * mean, 0.0)
        out.update(min=float(lo), max=float(hi), mean=json_number(mean), std=json_number(math.sqrt(var)),
                   absmax=max(-float(lo), float(hi)), rms=json_number(math.sqrt(sq / v.numel())), sumsq=json_number(sq))
    return out


def footprint(shape: tuple[int, ...], fp8_eligible: bool) -> dict[str, int]:
    """Bytes the tensor takes in each dtype; fp8 means e4m3 + float32 128x128 block scales where eligible."""
    n = math.prod(shape)
    out = {k: n * size for k, size in FOOTPRINT_DTYPES.items()}
    if fp8_eligible and shape:
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        blocks = -(-rows // fmts.BLOCK) * -(-shape[-1] // fmts.BLOCK)
        out["fp8"] = n + 4 * blocks
    else:
        out["fp8"] = 2 * n
    return out

