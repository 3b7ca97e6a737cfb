"""The Triton MXFP4 dequant kernel; imported only by mxfp4.py on first use, so importing expertd.kernels
never imports triton (and TRITON_INTERPRET is read when this module loads).

Every result is exact: value(code) * 2**(s - 127) has two significant bits, so it is a bf16 unless it
overflows (to inf, as in transformers' decode, whose table mxfp4.py holds). The code's 3 magnitude bits
placed at bits 22..24 read as a float32 of value * 2**-126 (normal and subnormal codes alike), and
2**(s - 128) is a float32 for every scale byte s (subnormal for s < 2), so (raw * 2**127) * 2**(s - 128)
is the result, exact or inf, and its top 16 bits are the bf16: no rounding anywhere, so the GPU and the
interpreter write the table's bits (the tests check every (scale, code) pair).

One program covers GROUPS consecutive groups (GROUPS * 16 contiguous bytes of each row) by TILE_R rows of
one expert, i.e. GROUPS * 32 result rows by TILE_R columns; the grid is flat over (expert, row tile, group
tile), so one launch covers a whole stack.
"""

import triton
import triton.language as tl

TWO_POW_127 = tl.constexpr(2.0**127)


@triton.jit
def _e2m1_times_two(c):
    """e2m1 codes (int32, 0..15) -> float32 2 * value(code), exactly."""
    raw = ((c & 8) << 28) | ((c & 7) << 22)
    return raw.to(tl.float32, bitcast=True) * TWO_POW_127


@triton.jit
def _bf16_bits(y):
    """The bf16 bits of float32 values that are bf16 already (low 16 bits zero)."""
    return (y.to(tl.uint32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def _mxfp4_kernel(
    x_ptr,  # uint8 [E, R, G, 16]
    s_ptr,  # uint8 [E, R, G]
    y_ptr,  # int16 view of bf16 [E, G*32, R]
    R,
    G,
    tiles_g,
    tiles_r,
    GROUPS: tl.constexpr,
    TILE_R: tl.constexpr,
    MASKED: tl.constexpr,  # False when the tiles divide G and R
):
    pid = tl.program_id(0)
    tg = pid % tiles_g
    t = pid // tiles_g
    tr = t % tiles_r
    e = (t // tiles_r).to(tl.int64)
    g0 = tg * GROUPS
    r0 = tr * TILE_R
    gi = tl.arange(0, GROUPS)[:, None, None]
    k = tl.arange(0, 16)[None, :, None]  # byte within the group: result rows 2k (low nibble) and 2k + 1
    ri = tl.arange(0, TILE_R)[None, None, :]
    first = (e * R + r0) * G + g0  # this program's first (expert, row, group)
    at = ri * G + gi  # [GROUPS, 1, TILE_R]: each (row, group) relative to it
    out = (e * G + g0) * 32 * R + r0
    rows = (gi * 32 + 2 * k) * R + ri  # [GROUPS, 16, TILE_R]: low nibble's result rows
    if MASKED:
        mask = (gi < G - g0) & (ri < R - r0)
        s = tl.load(s_ptr + first + at, mask=mask, other=0).to(tl.int32)
        b = tl.load(x_ptr + first * 16 + at * 16 + k, mask=mask, other=0).to(tl.int32)
    else:
        s = tl.load(s_ptr + first + at).to(tl.int32)
        b = tl.load(x_ptr + first * 16 + at * 16 + k).to(tl.int32)
    # 2**(s - 128): exponent field s - 1 from s = 2 on, the subnormals 2**-128 and 2**-127 below
    scale = tl.where(s >= 2, (s - 1) << 23, 0x200000 << (s & 1)).to(tl.float32, bitcast=True)
    lo = _bf16_bits(_e2m1_times_two(b & 0xF) * scale)
    hi = _bf16_bits(_e2m1_times_two(b >> 4) * scale)
    if MASKED:
        tl.store(y_ptr + out + rows, lo, mask=mask)
        tl.store(y_ptr + out + rows + R, hi, mask=mask)
    else:
        tl.store(y_ptr + out + rows, lo)
        tl.store(y_ptr + out + rows + R, hi)
