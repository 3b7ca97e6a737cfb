"""The Triton dequant kernel itself; imported only by triton_dequant on first use, so importing
expertd.kernels never imports triton (and TRITON_INTERPRET is read when this module loads).

The fp8 bytes are decoded with integer ops rather than a float8 cast so the kernel also runs on GPUs
without native fp8 conversion (A100), and bf16 is rounded by hand because the interpreter's
fp32 -> bf16 store truncates; done this way one kernel is bit-exact on GPU and in the interpreter.
"""

import triton
import triton.language as tl

# OUT_KIND values
OUT_BF16, OUT_FP16, OUT_FP32 = 0, 1, 2


@triton.jit
def _decode_e4m3(b):
    """uint8 bytes (as int32) -> float32 values; NaN bytes 0x7f/0xff -> +-NaN with mantissa 0x700000."""
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23) | (m << 20)  # 2**(e-7) * (1 + m/8): rebias 7 -> 127
    # subnormal m * 2**-9: normalise on the leading bit p of m (0, 1 or 2)
    p = (m >= 2).to(tl.int32) + (m >= 4).to(tl.int32)
    sub = ((118 + p) << 23) | ((m << (23 - p)) & 0x7FFFFF)
    sub = tl.where(m == 0, 0, sub)
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, 0x7FF00000, mag)
    return (sign | mag).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_kernel(
    x_ptr,  # uint8 [M, N]
    s_ptr,  # float32 [ceil(M/BLOCK_M), ceil(N/BLOCK_N)]
    y_ptr,  # int16 view of bf16/fp16 output, or float32 [M, N]
    M,
    N,
    s_stride,
    nan_bf16,  # bits the bf16 path writes for NaN (what torch's CPU cast writes)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SCALAR_SCALE: tl.constexpr,  # tile lies inside one scale block
    OUT_KIND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * TILE_M + tl.arange(0, TILE_M)
    rn = pid_n * TILE_N + tl.arange(0, TILE_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    b = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)
    x = _decode_e4m3(b)
    if SCALAR_SCALE:
        s = tl.load(s_ptr + (pid_m * TILE_M // BLOCK_M) * s_stride + (pid_n * TILE_N // BLOCK_N))
    else:
        s = tl.load(s_ptr + (rm // BLOCK_M)[:, None] * s_stride + (rn // BLOCK_N)[None, :], mask=mask, other=1.0)
    y = x * s
    if OUT_KIND == 0:
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        r = tl.where(y != y, nan_bf16, r.to(tl.int32))
        tl.store(y_ptr + offs, r.to(tl.int16), mask=mask)
    elif OUT_KIND == 1:
        tl.store(y_ptr + offs, y.to(tl.float16), mask=mask)
    else:
        tl.store(y_ptr + offs, y, mask=mask)
