"""Low-precision number formats as plain-torch quantize-dequantize round trips, and their error metrics.

Each format maps a float tensor to the float32 values it would hold after quantization and
dequantization, so formats can be compared on real weights and activations:

- `fp16`, `bf16`: a plain cast (round to nearest even; fp16 overflows to inf past 65504).
- `fp8_e4m3` / `fp8_e5m2` with one float32 scale per tensor or per 128x128 block (DeepSeek-V3's
  recipe): s = amax / max_finite, q = fp8(clamp(x / s)), x' = q * s.
- `mxfp8` / `mxfp4` (OCP Microscaling Formats v1.0): 32 consecutive elements of the last dim share
  an E8M0 power-of-two scale X = 2^(floor(log2(amax)) - emax_elem), clamped to [2^-127, 2^127]; each
  element is V / X rounded to nearest even in E4M3 (emax_elem 8) or E2M1 (emax_elem 2, values
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}), magnitudes past the largest normal clamped to it.
- `hif8`: HiFloat8 (tools/hif8.py), a direct cast with no scale: tapered precision over 2^-22..2^15,
  rounded half away from zero, magnitudes past 32768 saturated to it.

Tensors of any rank are compared on a 2-D view [-1, last dim] (1-D tensors as one row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from expertd.dtypes import E4M3_MAX

from .hif8 import hif8_round_trip

BLOCK = 128  # DeepSeek-V3's block scales
MX_BLOCK = 32  # OCP MX: elements sharing one E8M0 scale
E8M0_MIN, E8M0_MAX = -127, 127  # exponent range of the E8M0 scale (0xFF is NaN)


@dataclass(frozen=True)
class Minifloat:
    """An element format: exponent and mantissa bits, largest finite magnitude, OCP MX emax_elem."""

    name: str
    exp_bits: int
    man_bits: int
    max_value: float
    emax: int
    torch_dtype: torch.dtype | None = None

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (bias 2^(e-1) - 1)."""
        return 2 - 2 ** (self.exp_bits - 1)


E4M3 = Minifloat("e4m3", 4, 3, E4M3_MAX, 8, torch.float8_e4m3fn)
E5M2 = Minifloat("e5m2", 5, 2, 57344.0, 15, torch.float8_e5m2)
E2M1 = Minifloat("e2m1", 2, 1, 6.0, 2, None)


def round_minifloat(x: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Round float32 `x` to the nearest value of `fmt` (ties to even), magnitudes past max clamped to max.

    The spacing of representable values around |x| is 2^(e - man_bits) with e = max(floor(log2|x|), emin)
    (subnormals share the spacing of the smallest normals); torch.round rounds half to even, and the even
    multiple of the spacing is the value with an even mantissa.
    """
    a = x.abs().clamp(max=fmt.max_value)
    e = floor_log2(a).clamp(min=fmt.emin)
    step = torch.exp2(e - fmt.man_bits)
    q = (torch.round(a / step) * step).clamp(max=fmt.max_value)
    return torch.copysign(q, x)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) exactly, as float32 (a float32 log2 rounds 16 - 1e-6 up to 4); -1 for a == 0."""
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1)
    return (exponent - 1).float()


def _cast(x: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """x (already scaled into range) rounded to `fmt` as float32, saturating instead of overflowing."""
    x = x.clamp(-fmt.max_value, fmt.max_value)
    if fmt.torch_dtype is not None:
        return x.to(fmt.torch_dtype).float()  # torch's fp8 casts round to nearest even
    return round_minifloat(x, fmt)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The float32 2-D view formats work on: [-1, last dim]; a scalar or 1-D tensor is one row."""
    x = x.detach().float()
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def fp8_per_tensor(x: torch.Tensor, fmt: Minifloat = E4M3) -> torch.Tensor:
    """One float32 scale for the whole tensor: amax maps to the format's largest finite value."""
    x = as_2d(x)
    amax = x.abs().amax() if x.numel() else torch.tensor(0.0)
    scale = amax / fmt.max_value if amax > 0 else torch.tensor(1.0)
    return _cast(x / scale, fmt) * scale


def fp8_block(x: torch.Tensor, fmt: Minifloat = E4M3, block: int = BLOCK) -> torch.Tensor:
    """One float32 scale per block x block tile (edge tiles partial), as DeepSeek-V3 stores its weights."""
    x = as_2d(x)
    m, n = x.shape
    if x.numel() == 0:
        return x.clone()
    mb, nb = -(-m // block), -(-n // block)
    padded = F.pad(x, (0, nb * block - n, 0, mb * block - m))
    tiles = padded.view(mb, block, nb, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
    q = _cast(tiles / scale, fmt) * scale
    return q.view(mb * block, nb * block)[:m, :n]


def mx_scale_exponent(amax: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """The E8M0 shared exponent of each block: floor(log2(amax)) - emax_elem, within [-127, 127]."""
    e = floor_log2(amax) - fmt.emax
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN))  # an all-zero block: any scale works
    return e.clamp(E8M0_MIN, E8M0_MAX)


def mx_quantize(x: torch.Tensor, fmt: Minifloat, block: int = MX_BLOCK) -> torch.Tensor:
    """OCP MX: `block` consecutive elements of each row share a power-of-two scale; elements in `fmt`."""
    x = as_2d(x)
    m, n = x.shape
    if x.numel() == 0:
        return x.clone()
    nb = -(-n // block)
    groups = F.pad(x, (0, nb * block - n)).view(m, nb, block)
    exponent = mx_scale_exponent(groups.abs().amax(dim=-1, keepdim=True), fmt)
    # Powers of two (2^-127 is a float32 subnormal, still exact): V / X is exact unless it underflows
    # below float32's normals, far under the smallest element value, where it rounds to 0 anyway.
    q = _cast(groups * torch.exp2(-exponent), fmt) * torch.exp2(exponent)
    return q.view(m, nb * block)[:, :n]


def mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 with E4M3 elements."""
    return mx_quantize(x, E4M3)


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    """MXFP4: E2M1 elements {0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    return mx_quantize(x, E2M1)


def cast_round_trip(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return as_2d(x).to(dtype).float()

    fn.__name__ = f"cast_{dtype}"
    return fn


# name -> quantize-dequantize round trip; names are what `inspect --formats` accepts.
FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bf16": cast_round_trip(torch.bfloat16),
    "fp16": cast_round_trip(torch.float16),
    "fp8_e4m3_tensor": lambda x: fp8_per_tensor(x, E4M3),
    "fp8_e4m3_block128": lambda x: fp8_block(x, E4M3),
    "fp8_e5m2_tensor": lambda x: fp8_per_tensor(x, E5M2),
    "fp8_e5m2_block128": lambda x: fp8_block(x, E5M2),
    "mxfp8_e4m3": mxfp8,
    "mxfp4_e2m1": mxfp4,
    "hif8": lambda x: hif8_round_trip(as_2d(x)),
}
# other spellings accepted wherever a format is named (`simulate`, `evaluate --formats`)
ALIASES = {"mxfp4": "mxfp4_e2m1", "mxfp8": "mxfp8_e4m3", "hifloat8": "hif8"}


def resolve_format(name: str) -> str:
    """The FORMATS key for `name` or one of its aliases; a ValueError naming the known formats otherwise."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMATS)} (aliases {', '.join(ALIASES)})")
    return key


def round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x` after the round trip through format `name`, in x's shape and dtype."""
    return FORMATS[resolve_format(name)](x).reshape(x.shape).to(x.dtype)


@dataclass
class FormatError:
    """||x - q(x)||^2 and ||x||^2, summed in float64: additive over tensors, layers and experts."""

    err_sq: float = 0.0
    ref_sq: float = 0.0

    def add(self, other: "FormatError") -> None:
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq

    @property
    def rel_error(self) -> float:
        """||x - q(x)|| / ||x||; 0 for an exact round trip, inf for an error on an all-zero x."""
        if self.err_sq == 0:
            return 0.0
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else math.inf

    @property
    def snr_db(self) -> float:
        """10 log10(||x||^2 / ||x - q(x)||^2); inf for an exact round trip."""
        if self.err_sq == 0:
            return math.inf
        if self.ref_sq == 0 or math.isinf(self.err_sq):
            return -math.inf
        return 10.0 * math.log10(self.ref_sq / self.err_sq)


def finite_2d(x: torch.Tensor) -> torch.Tensor:
    """`as_2d(x)` with non-finite values replaced by 0 (formats are compared on the finite values)."""
    ref = as_2d(x)
    if ref.numel() and not math.isfinite(float(ref.abs().amax())):
        ref = torch.nan_to_num(ref, nan=0.0, posinf=0.0, neginf=0.0)
    return ref


def sum_squares(x: torch.Tensor) -> float:
    """sum(x^2) accumulated in float64, scaled so that no float32 square overflows or underflows."""
    if x.numel() == 0:
        return 0.0
    amax = float(x.abs().amax())
    if amax == 0 or not math.isfinite(amax):
        return amax
    if 1e-15 < amax < 1e15:
        return float(x.square().sum(dtype=torch.float64))
    return float((x / amax).square().sum(dtype=torch.float64)) * amax * amax


def measure(x: torch.Tensor, names=None) -> dict[str, FormatError]:
    """The error of each format in `names` (None: all; an empty list: none) on the finite values of `x`."""
    names = FORMATS if names is None else names
    if not names:
        return {}
    ref = finite_2d(x)
    ref_sq = sum_squares(ref)
    return {name: FormatError(sum_squares(ref - FORMATS[name](ref)), ref_sq) for name in names}


def relative_error(x: torch.Tensor, q: torch.Tensor) -> float:
    """||x - q|| / ||x||."""
    return FormatError(sum_squares(x.float() - q.float()), sum_squares(x.float())).rel_error


def snr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    return FormatError(sum_squares(x.float() - q.float()), sum_squares(x.float())).snr_db
