"""The Triton MXFP4 dequant kernel; imported only by mxfp4.py on first use, so importing expertd.kernels
never imports triton (and TRITON_INTERPRET is read when this module loads).

Each result is a load from the [256, 16] table of bf16 bits (transformers' decode of every scale byte and
code, see mxfp4.py): no float arithmetic, so no rounding to get right, and the GPU and the interpreter
write the CPU paths' bits.
"""

import triton
import triton.language as tl


@triton.jit
def _mxfp4_kernel(
    x_ptr,  # uint8 [E, R, G, 16]
    s_ptr,  # uint8 [E, R, G]
    t_ptr,  # int16 [256, 16]: bf16 bits of code c under scale byte s at s * 16 + c
    y_ptr,  # int16 view of bf16 [E, G*32, R]
    R,
    G,
    TILE_R: tl.constexpr,
):
    pid_eg = tl.program_id(0).to(tl.int64)  # expert * G + group: one group's 32 result rows
    pid_r = tl.program_id(1)
    e = pid_eg // G
    g = pid_eg % G
    r = pid_r * TILE_R + tl.arange(0, TILE_R)
    j = tl.arange(0, 32)  # result row within the group: byte j // 2, low nibble first
    rmask = r < R
    at = (e * R + r.to(tl.int64)) * G + g  # [TILE_R]: the (expert, row, group) of each column
    s = tl.load(s_ptr + at, mask=rmask, other=0).to(tl.int32)
    mask = (j[:, None] < 32) & rmask[None, :]
    b = tl.load(x_ptr + at[None, :] * 16 + (j // 2)[:, None], mask=mask, other=0).to(tl.int32)
    code = (b >> ((j % 2) * 4)[:, None]) & 0xF
    v = tl.load(t_ptr + s[None, :] * 16 + code, mask=mask, other=0)
    tl.store(y_ptr + (pid_eg * 32 + j[:, None]) * R + r[None, :], v, mask=mask)
