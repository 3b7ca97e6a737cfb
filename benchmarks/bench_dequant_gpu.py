"""The GPU part of bench_dequant.py: the Triton kernels vs a device-to-device copy and a DeepSeek-V3-style kernel.

Every figure is GB/s of bytes read + written (weights + scales + output for a dequant), from the median of
CUDA-event times, with the L2 cache flushed (a 256 MiB write) before each call and the cases interleaved.
"copy" is torch's `copy_` of a uint8 buffer half as large as the dequant's traffic (the same bytes read +
written). "deepseek" is DeepSeek-V3's `weight_dequant` formulation, written here: one 128x128 block per
program, native fp8 load and `x.to(float32) * s` stored as bf16, 4 warps. "native" is ours with the GPU's
fp8 -> float32 conversion (sm_89+), "integer" ours with the integer decode (EXPERTD_TRITON_NATIVE=0; what
A100s and the interpreter run). Each of our results is compared bit for bit with the CPU reference on a
sample (the first 256 rows; whole tensors for the every-byte and partial-block checks): PASS / FAIL.
"""

from __future__ import annotations

import statistics
import time

import torch

from expertd.kernels import (
    dequant_mxfp4_reference,
    weight_dequant_batched_triton,
    weight_dequant_reference,
    weight_dequant_triton,
)
from expertd.kernels.mxfp4 import Mxfp4Tiling, launch_mxfp4, mxfp4_tiling
from expertd.kernels.triton_dequant import Tiling, conversions, launch_dequant, tiling

FP8 = torch.float8_e4m3fn
BLOCK = 128
GOAL_COPY_BIG, GOAL_DEEPSEEK, GOAL_LAYER = 0.85, 1.0, 0.6
SAMPLE_ROWS = 256
DEVICE = "cuda"  # "cpu" with TRITON_INTERPRET=1 for a dry run of the code (timings meaningless)
FP8_SWEEP = [Tiling(32, 128, 4), Tiling(64, 128, 4), Tiling(64, 128, 8), Tiling(128, 128, 4), Tiling(128, 128, 8),
             Tiling(32, 256, 4), Tiling(64, 256, 8)]
MXFP4_SWEEP = [Mxfp4Tiling(2, 64, 4), Mxfp4Tiling(4, 32, 4), Mxfp4Tiling(4, 128, 8), Mxfp4Tiling(8, 64, 8)]


def _deepseek_kernel():
    """The baseline, DeepSeek-V3's weight_dequant formulation: one BLOCK x BLOCK scale block per program."""
    import triton
    import triton.language as tl

    @triton.jit
    def block_dequant(x_ptr, s_ptr, y_ptr, M, N, BLOCK_SIZE: tl.constexpr):
        bm, bn = tl.program_id(0), tl.program_id(1)
        rows = bm * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        cols = bn * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        at = rows[:, None] * N + cols[None, :]
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + at, mask=inside).to(tl.float32)
        scale = tl.load(s_ptr + bm * tl.cdiv(N, BLOCK_SIZE) + bn)
        tl.store(y_ptr + at, x * scale, mask=inside)

    def run(x, s, y):
        m, n = x.shape
        block_dequant[(triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))](x, s, y, m, n, BLOCK_SIZE=BLOCK, num_warps=4)

    return run


class Timer:
    """Median seconds of interleaved callables, CUDA events around each call, L2 flushed before each."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fns: dict) -> dict[str, float]:
        for fn in fns.values():  # warm-up: compiles
            fn()
        torch.cuda.synchronize()
        events = {k: [] for k in fns}
        for _ in range(self.reps):
            for k, fn in fns.items():
                self.flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                events[k].append((a, b))
        torch.cuda.synchronize()
        return {k: statistics.median(a.elapsed_time(b) for a, b in v) / 1e3 for k, v in events.items()}


class DryTimer(Timer):
    """Wall time, for a dry run on the CPU under TRITON_INTERPRET=1."""

    def __init__(self, reps: int = 1):
        self.reps = reps

    def __call__(self, fns: dict) -> dict[str, float]:
        out = {}
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k] = time.perf_counter() - t0
        return out


def copy_of(nbytes: int):
    """A copy whose bytes read + written are `nbytes`."""
    src = torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    view = torch.int32 if got.element_size() == 4 else torch.int16
    return got.shape == want.shape and torch.equal(got.cpu().view(view), want.view(view))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def ratio(value: float, goal: float | None) -> str:
    return f"{value:5.2f}x" + ("" if goal is None else f" (goal >= {goal}: {'met' if value >= goal else 'MISSED'})")


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fp8_case(e: int, m: int, n: int, block=BLOCK):
    """Random fp8 bytes (every value, NaN included) [e, m, n] and float32 scales, on the GPU."""
    x = torch.randint(0, 256, (e, m, n), dtype=torch.uint8, device=DEVICE).view(FP8)
    rows, cols = (block, block) if isinstance(block, int) else block
    s = torch.rand(e, -(-m // rows), -(-n // cols), device=DEVICE) * 1e-2 + 1e-6
    return x, s


def fp8_sample_ok(x: torch.Tensor, s: torch.Tensor, y: torch.Tensor, block) -> bool:
    """y's first SAMPLE_ROWS rows against the CPU reference (x, s, y: one expert, 2-D)."""
    rows = block if isinstance(block, int) else block[0]
    k = min(SAMPLE_ROWS, x.shape[0])
    want = weight_dequant_reference(x[:k].cpu(), s[: -(-k // rows)].cpu(), block)
    return bits_equal(y[:k], want)


def ours(x, s, y, block, native: bool, tile: Tiling | None = None):
    e, m, n = x.shape
    return lambda: launch_dequant(x, s, y, e, m, n, block, native=native, tile=tile)


def paths() -> list[tuple[str, bool]]:
    fp8_cvt, _ = conversions(torch.device(DEVICE))
    return ([("native", True)] if fp8_cvt else []) + [("integer", False)]


def checks() -> None:
    """Whole tensors against the CPU references: every fp8 byte under scales from 2**-130 to 2**126 (subnormal,
    overflowing and NaN results), partial blocks, and every MXFP4 (scale, code) pair."""
    row = torch.arange(256, dtype=torch.uint8)
    x = torch.stack([row.roll(i) for i in range(2048)]).repeat(1, 28).view(FP8)  # 2048 x 7168
    s = (torch.exp2(torch.linspace(-130, 126, 16 * 56).round().view(16, 56)) * 1.3).float()
    xp, sp = fp8_case(1, 7000, 2000)
    want_every, want_partial = weight_dequant_reference(x, s), weight_dequant_reference(xp[0].cpu(), sp[0].cpu())
    line = []
    for label, native in paths():
        y = torch.empty(1, *x.shape, dtype=torch.bfloat16, device=DEVICE)
        ours(x.to(DEVICE)[None], s.to(DEVICE)[None], y, BLOCK, native)()
        yp = torch.empty(1, 7000, 2000, dtype=torch.bfloat16, device=DEVICE)
        ours(xp, sp, yp, BLOCK, native)()
        line.append(f"{label}: every byte {verdict(bits_equal(y[0], want_every))}, "
                    f"7000x2000 {verdict(bits_equal(yp[0], want_partial))}")
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    y = torch.empty(1, 16 * 32, 256, dtype=torch.bfloat16, device=DEVICE)
    launch_mxfp4(blocks.to(DEVICE), scales.to(DEVICE), y)
    line.append(f"mxfp4: every pair {verdict(bits_equal(y, dequant_mxfp4_reference(blocks, scales)))}")
    print("gpu  bits vs CPU reference, bf16 | " + " | ".join(line))


def bench_fp8(m: int, n: int, timer: Timer, goal_copy: float | None, sweep: bool) -> None:
    x, s = fp8_case(1, m, n)
    y = torch.empty(1, m, n, dtype=torch.bfloat16, device=DEVICE)
    traffic = x.numel() + s.numel() * 4 + y.numel() * 2
    ds = _deepseek_kernel()
    fns = {"copy": copy_of(traffic), "deepseek": lambda: ds(x[0], s[0], y[0])}
    fns.update({label: ours(x, s, y, BLOCK, native) for label, native in paths()})
    t = timer(fns)
    head = f"gpu  fp8-block {m}x{n}"
    print(f"{head}: d2d copy {gbs(traffic, t['copy']):7.1f} GB/s | deepseek {gbs(traffic, t['deepseek']):7.1f} GB/s")
    for label, native in paths():
        fns[label]()
        ok = fp8_sample_ok(x[0], s[0], y[0], BLOCK)
        print(f"{head}: ours {label:7s} {gbs(traffic, t[label]):7.1f} GB/s | /copy "
              f"{ratio(t['copy'] / t[label], goal_copy)} | /deepseek {ratio(t['deepseek'] / t[label], GOAL_DEEPSEEK)}"
              f" | bits {verdict(ok)}")
    if sweep:
        ts = timer({"copy": fns["copy"], **{tile: ours(x, s, y, BLOCK, True, tile) for tile in FP8_SWEEP}})
        d = tiling(m, n, 1)
        print(f"{head}: sweep {paths()[0][0]}, GB/s by tile (default {d.tile_m}x{d.tile_n} w{d.num_warps}): "
              + ", ".join(f"{k.tile_m}x{k.tile_n} w{k.num_warps} {gbs(traffic, v):.0f} ({ts['copy'] / v:.2f}x copy)"
                          for k, v in ts.items() if k != "copy"))


def bench_layer(experts: int, m: int, n: int, timer: Timer) -> None:
    x, s = fp8_case(experts, m, n)
    y = torch.empty(experts, m, n, dtype=torch.bfloat16, device=DEVICE)
    traffic = x.numel() + s.numel() * 4 + y.numel() * 2

    def loop():
        for i in range(experts):
            weight_dequant_triton(x[i], s[i], BLOCK, out=y[i])

    t = timer({"copy": copy_of(traffic), "batched": lambda: weight_dequant_batched_triton(x, s, BLOCK, out=y),
               "loop": loop})
    weight_dequant_batched_triton(x, s, BLOCK, out=y)
    ok = all(fp8_sample_ok(x[i], s[i], y[i], BLOCK) for i in (0, experts - 1))
    head = f"gpu  fp8-block layer {experts}x{m}x{n}"
    print(f"{head}: d2d copy {gbs(traffic, t['copy']):7.1f} GB/s | per-expert launches "
          f"{gbs(traffic, t['loop']):7.1f} GB/s")
    print(f"{head}: ours batched {gbs(traffic, t['batched']):7.1f} GB/s | /copy "
          f"{ratio(t['copy'] / t['batched'], GOAL_LAYER)} | /per-expert loop {ratio(t['loop'] / t['batched'], None)}"
          f" | bits {verdict(ok)}")


def bench_ct(m: int, n: int, timer: Timer) -> None:
    """compressed-tensors' per-channel (1, N) and per-tensor (M, N) scales."""
    for label, block in (("ct-channel", (1, n)), ("ct-tensor", (m, n))):
        x, s = fp8_case(1, m, n, block)
        y = torch.empty(1, m, n, dtype=torch.bfloat16, device=DEVICE)
        traffic = x.numel() + s.numel() * 4 + y.numel() * 2
        fns = {"copy": copy_of(traffic), **{p: ours(x, s, y, block, native) for p, native in paths()}}
        t = timer(fns)
        for p, _ in paths():
            fns[p]()
            print(f"gpu  {label} {m}x{n}: ours {p:7s} {gbs(traffic, t[p]):7.1f} GB/s | d2d copy "
                  f"{gbs(traffic, t['copy']):7.1f} GB/s | /copy {ratio(t['copy'] / t[p], None)} | "
                  f"bits {verdict(fp8_sample_ok(x[0], s[0], y[0], block))}")
        del x, s, y, fns


def bench_mxfp4(e: int, r: int, g: int, timer: Timer, sweep: bool) -> None:
    blocks = torch.randint(0, 256, (e, r, g, 16), dtype=torch.uint8, device=DEVICE)
    scales = torch.randint(100, 140, (e, r, g), dtype=torch.uint8, device=DEVICE)  # gpt-oss' range
    y = torch.empty(e, g * 32, r, dtype=torch.bfloat16, device=DEVICE)
    traffic = blocks.numel() + scales.numel() + y.numel() * 2
    fns = {"copy": copy_of(traffic), "ours": lambda: launch_mxfp4(blocks, scales, y)}
    t = timer(fns)
    fns["ours"]()
    k = SAMPLE_ROWS
    ok = all(bits_equal(y[i, :, :k], dequant_mxfp4_reference(blocks[i, :k].cpu(), scales[i, :k].cpu()))
             for i in (0, e - 1))
    head = f"gpu  mxfp4 {e}x{r}x{g}x16 -> {e}x{g * 32}x{r}"
    print(f"{head}: ours {gbs(traffic, t['ours']):7.1f} GB/s | d2d copy {gbs(traffic, t['copy']):7.1f} GB/s | "
          f"/copy {ratio(t['copy'] / t['ours'], None)} | bits {verdict(ok)}")
    if sweep:
        ts = timer({tile: (lambda tile=tile: launch_mxfp4(blocks, scales, y, tile)) for tile in MXFP4_SWEEP})
        d = mxfp4_tiling(r, g)
        print(f"{head}: sweep, GB/s by tile (default {d.groups}g x {d.tile_r}r w{d.num_warps}): "
              + ", ".join(f"{k.groups}g x {k.tile_r}r w{k.num_warps} {gbs(traffic, v):.0f} "
                          f"({t['copy'] / v:.2f}x copy)" for k, v in ts.items()))


def bench_gpu(reps: int, experts: int, sweep: bool = True) -> None:
    import triton

    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    fp8_cvt, _ = conversions(torch.device(DEVICE))
    print(f"gpu  {props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, triton {triton.__version__}, "
          f"fp8 conversion {'yes' if fp8_cvt else 'no'}; GB/s = bytes read + written per second, median of {reps}, "
          "L2 flushed before each call")
    timer = Timer(reps)
    checks()
    bench_fp8(7168, 2048, timer, None, sweep)
    bench_fp8(16384, 16384, timer, GOAL_COPY_BIG, sweep)
    torch.cuda.empty_cache()
    bench_layer(experts, 7168, 2048, timer)
    torch.cuda.empty_cache()
    bench_ct(16384, 16384, timer)
    torch.cuda.empty_cache()
    bench_mxfp4(32, 2880, 90, timer, sweep)
    print(f"gpu  done in {time.perf_counter() - t0:.1f} s")
