"""HiFloat8 (Huawei Ascend, arXiv 2409.16626): byte codes, decoding, encoding and the round trip.

A code is a sign bit, then a prefix-coded "dot" field that says how the remaining bits split between
a sign-magnitude exponent E (its leading magnitude bit implicit) and the mantissa M:

    dot   |E|          exponent bits  mantissa bits
    11    8..15        4              1
    10    4..7         3              2
    01    2..3         2              3
    001   1            1 (sign)       3
    0001  0            0              3
    0000  denormal 2^(M-23), M = 1..7 (M = 0: zero, or NaN with the sign bit set)

Largest finite 32768 (0x6E), smallest normal 2^-15 (0x7E), smallest denormal 2^-22 (0x01); one zero
(0x00), NaN 0x80, +-Inf 0x6F/0xEF. Rounding is half away from zero (the paper's TA mode): the
representable magnitudes are tabulated and a value goes to the nearer neighbour, a tie to the larger.
"""

from __future__ import annotations

import torch

HIF8_MAX = 32768.0
NAN_CODE, POS_INF_CODE, NEG_INF_CODE, MAX_CODE = 0x80, 0x6F, 0xEF, 0x6E

# dot prefix (as bits), its length, exponent bits (incl. sign), mantissa bits, |E| of the tier's implicit bit
_TIERS = (("11", 4, 1, 8), ("10", 3, 2, 4), ("01", 2, 3, 2), ("001", 1, 3, 1), ("0001", 0, 3, 0))


def _decode_code(code: int) -> float:
    """The value of one byte code (the spec, written out for one code at a time)."""
    sign = -1.0 if code & 0x80 else 1.0
    bits = format(code & 0x7F, "07b")
    if bits.startswith("0000"):
        m = int(bits[4:], 2)
        if m == 0:
            return float("nan") if code & 0x80 else 0.0
        return sign * 2.0 ** (m - 23)
    for dot, ebits, mbits, implicit in _TIERS:
        if bits.startswith(dot):
            rest = bits[len(dot):]
            e_field, m_field = rest[:ebits], rest[ebits:]
            magnitude = implicit + (int(e_field[1:], 2) if len(e_field) > 1 else 0)
            exponent = -magnitude if e_field[:1] == "1" else magnitude
            mantissa = 1.0 + int(m_field, 2) / 2 ** mbits
            if exponent == 15 and mantissa == 1.5:  # 0x6F / 0xEF
                return sign * float("inf")
            return sign * mantissa * 2.0 ** exponent
    raise AssertionError("unreachable: every 7-bit pattern has a dot prefix")


DECODE_TABLE = torch.tensor([_decode_code(c) for c in range(256)], dtype=torch.float32)
_POSITIVE = sorted((float(v), c) for c, v in enumerate(DECODE_TABLE.tolist()) if v >= 0 and v != float("inf"))
MAGNITUDES = torch.tensor([v for v, _ in _POSITIVE], dtype=torch.float32)  # 0, 2^-22, ..., 32768 ascending
_MAGNITUDE_CODES = torch.tensor([c for _, c in _POSITIVE], dtype=torch.uint8)
# the midpoint between neighbours i-1 and i (exact in float32: neighbours have at most 4 significant bits)
_MIDPOINTS = (MAGNITUDES[:-1] + MAGNITUDES[1:]) / 2


def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 HiF8 codes."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"hif8_decode takes uint8 codes, got {codes.dtype}")
    return DECODE_TABLE.to(codes.device)[codes.long()]


def hif8_encode(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """uint8 HiF8 codes of `x`, rounded half away from zero.

    Finite magnitudes that round past 32768 saturate to +-32768 (`saturate=False`: become +-Inf, as a
    hardware cast without saturation does); +-Inf stay +-Inf, NaN is 0x80, below 2^-23 flushes to 0.
    """
    x = x.detach().float()
    a = x.abs()
    table = MAGNITUDES.to(x.device)
    # index of the first magnitude >= |x| ... then step down when |x| is below the midpoint
    upper = torch.searchsorted(table, a.contiguous(), right=False).clamp(max=len(table) - 1)
    lower = (upper - 1).clamp(min=0)
    below_mid = a < _MIDPOINTS.to(x.device)[lower.clamp(max=len(_MIDPOINTS) - 1)]
    idx = torch.where((upper > 0) & below_mid, lower, upper)
    codes = _MAGNITUDE_CODES.to(x.device)[idx]
    if not saturate:  # rounds past 32768 once |x| reaches the midpoint to the next tier value (1.5 * 2^15)
        codes = torch.where(a >= 1.25 * HIF8_MAX, torch.full_like(codes, POS_INF_CODE), codes)
    codes = torch.where(torch.isinf(a), torch.full_like(codes, POS_INF_CODE), codes)
    codes = torch.where((x < 0) & (codes != 0), codes | 0x80, codes)  # one zero: -0 and tiny negatives are 0x00
    return torch.where(torch.isnan(x), torch.full_like(codes, NAN_CODE), codes)


def hif8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as float32 after a direct (unscaled) cast to HiF8 and back; saturating at +-32768 like the other formats."""
    x = x.detach().float().clamp(-HIF8_MAX, HIF8_MAX)
    return hif8_decode(hif8_encode(x))
