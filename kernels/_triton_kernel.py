"""The Triton FP8 dequant kernel; imported only by triton_dequant on first use, so importing expertd.kernels
never imports triton (and TRITON_INTERPRET is read when this module loads).

Two ways to the same bits, picked by constexprs (triton_dequant.conversions):
- FP8_CVT (GPUs with fp8 conversion, sm_89+): the byte bitcast to float8e4nv and converted to float32;
  else an exact decode with integer ops and one multiply (A100, TRITON_INTERPRET=1).
- BF16_CVT (any CUDA GPU): the hardware's round-to-nearest-even float32 -> bf16 conversion; else rounded
  by hand, as the interpreter's own cast truncates.
Either way y = float32(x) * s is one float32 multiply (no flush to zero: subnormal products are kept) and
its bf16 rounding is torch's; NaN results get NAN_BF16, the bits torch's CPU cast writes.

One program dequantizes one TILE_M x TILE_N tile of one expert; the grid is flat over (expert, tile row,
tile column), so one launch covers a whole stack [E, M, N]. Offsets within a tile are int32, each
program's base int64.
"""

import triton
import triton.language as tl

# OUT_KIND values
OUT_BF16, OUT_FP16, OUT_FP32 = 0, 1, 2

TWO_POW_120 = tl.constexpr(2.0**120)


@triton.jit
def _decode_e4m3(b):
    """e4m3fn bytes (as int32) -> float32 with no fp8 instruction. The 7 exponent+mantissa bits placed at
    bits 20..26 read as a float32 of exactly x * 2**-120, normal and subnormal bytes alike (float32's bias
    is 120 larger and its subnormals start at the same bit), so one exact multiply restores x.
    NaN bytes 0x7f/0xff -> NaN."""
    raw = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    x = raw.to(tl.float32, bitcast=True) * TWO_POW_120
    return tl.where((b & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def _tile_scales(sp, r0, c0, ri, ci, mask_m, mask_n, mask, s_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SCALE: tl.constexpr, MASKED: tl.constexpr):
    """The scales one tile meets, shaped to broadcast over it: one, one per row, one per column, one per element
    (SCALE 0..3); masked lanes read 1.0."""
    if SCALE == 0:
        s = tl.load(sp + (r0 // BLOCK_M) * s_cols + c0 // BLOCK_N)
    elif SCALE == 1:
        at = ((r0 + ri) // BLOCK_M) * s_cols + c0 // BLOCK_N
        if MASKED:
            s = tl.load(sp + at, mask=mask_m, other=1.0)[:, None]
        else:
            s = tl.load(sp + at)[:, None]
    elif SCALE == 2:
        at = (r0 // BLOCK_M) * s_cols + (c0 + ci) // BLOCK_N
        if MASKED:
            s = tl.load(sp + at, mask=mask_n, other=1.0)[None, :]
        else:
            s = tl.load(sp + at)[None, :]
    else:
        at = ((r0 + ri) // BLOCK_M)[:, None] * s_cols + ((c0 + ci) // BLOCK_N)[None, :]
        if MASKED:
            s = tl.load(sp + at, mask=mask, other=1.0)
        else:
            s = tl.load(sp + at)
    return s


@triton.jit
def _to_out(y, OUT_KIND: tl.constexpr, NAN_BF16: tl.constexpr, BF16_CVT: tl.constexpr):
    """float32 results in the output's dtype: bf16 as int16 bits (round to nearest even, NaN as NAN_BF16),
    fp16, or float32 as is."""
    if OUT_KIND == 0:
        if BF16_CVT:
            r = y.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        else:
            u = y.to(tl.uint32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)  # round to nearest even
        v = tl.where(y != y, NAN_BF16, r).to(tl.int16)
    elif OUT_KIND == 1:
        v = y.to(tl.float16)
    else:
        v = y
    return v


@triton.jit
def _dequant_kernel(
    x_ptr,  # uint8 [E, M, N]
    s_ptr,  # float32 [E, s_rows, s_cols]
    y_ptr,  # int16 view of bf16 output, or fp16 / float32 [E, M, N]
    M,
    N,
    tiles_m,  # tiles per expert: tiles_m x tiles_n
    tiles_n,
    s_rows,
    s_cols,
    BLOCK_M: tl.constexpr,  # scale block; 2**30 where one block covers the whole dimension
    BLOCK_N: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SCALE: tl.constexpr,  # the scales a tile meets: 0 one, 1 one per row, 2 one per column, 3 one per element
    MASKED: tl.constexpr,  # False when the tiles divide M and N
    OUT_KIND: tl.constexpr,
    NAN_BF16: tl.constexpr,
    FP8_CVT: tl.constexpr,
    BF16_CVT: tl.constexpr,
):
    pid = tl.program_id(0)
    tn = pid % tiles_n
    t = pid // tiles_n
    tm = t % tiles_m
    e = (t // tiles_m).to(tl.int64)
    r0 = tm * TILE_M  # int32: M < 2**31
    c0 = tn * TILE_N
    base = (e * M + r0) * N + c0
    ri = tl.arange(0, TILE_M)
    ci = tl.arange(0, TILE_N)
    offs = ri[:, None] * N + ci[None, :]
    # 8 contiguous bytes per thread at most, so the load gets the store's layout (8 results = 16 bytes per
    # thread); with 16-byte loads the compiler would stage every tile through shared memory between them
    xoffs = tl.max_contiguous(offs, [1, 8])
    mask_m = ri < M - r0
    mask_n = ci < N - c0
    mask = mask_m[:, None] & mask_n[None, :]
    if MASKED:
        b = tl.load(x_ptr + base + xoffs, mask=mask, other=0)
    else:
        b = tl.load(x_ptr + base + xoffs)
    if FP8_CVT:
        x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = _decode_e4m3(b.to(tl.int32))

    s = _tile_scales(s_ptr + e * s_rows * s_cols, r0, c0, ri, ci, mask_m, mask_n, mask, s_cols, BLOCK_M, BLOCK_N,
                     SCALE, MASKED)
    y = x * s

    yp = y_ptr + base + offs
    v = _to_out(y, OUT_KIND, NAN_BF16, BF16_CVT)
    if MASKED:
        tl.store(yp, v, mask=mask)
    else:
        tl.store(yp, v)
