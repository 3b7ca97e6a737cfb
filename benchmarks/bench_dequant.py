"""Dequant throughput (GB/s of output written) next to a plain copy of the same output bytes.

CPU: weight_dequant_cpu vs `dst.copy_(src)` of a bf16 tensor of the output's size (torch's copy, using
the same intra-op threads) and vs one-threaded libc memmove, measured side by side, best of N.
GPU (skipped without CUDA): the Triton kernel vs DeepSeek-V3's own `x.float() * s` kernel (needs
native fp8 loads) and vs a device-to-device copy.

    python benchmarks/bench_dequant.py [--reps 10] [--shapes 7168x2048,2048x7168]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from expertd.kernels import quantize_fp8_blockwise, weight_dequant_cpu, weight_dequant_reference

BLOCK = 128


def best_of(fns: dict, reps: int, sync=lambda: None) -> dict:
    """Fastest wall time of each callable over `reps` rounds; rounds interleave the callables so a
    neighbour's load hits all of them alike. One warm-up call each first."""
    for fn in fns.values():
        fn()
    sync()
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def make_weight(m: int, n: int, device: str = "cpu"):
    w = torch.randn(m, n, device=device) * 0.02
    return quantize_fp8_blockwise(w, BLOCK)


def bench_cpu(m: int, n: int, reps: int) -> None:
    x, s = make_weight(m, n)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    src = torch.randn(m, n).to(torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = out.numel() * out.element_size()
    weight_dequant_cpu(x, s, BLOCK, out=out)
    if not torch.equal(out.view(torch.int16), weight_dequant_reference(x, s, BLOCK).view(torch.int16)):
        raise SystemExit("CPU dequant does not match the reference")
    t = best_of(
        {
            "dequant": lambda: weight_dequant_cpu(x, s, BLOCK, out=out),
            "copy": lambda: dst.copy_(src),
            "memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        },
        reps,
    )
    deq, cp, mm = (nbytes / t[k] / 1e9 for k in ("dequant", "copy", "memmove"))
    print(
        f"cpu  {m}x{n}: dequant {deq:6.2f} GB/s | torch copy_ {cp:6.2f} GB/s (ratio {deq / cp:.2f}) "
        f"| memmove 1 thread {mm:6.2f} GB/s (ratio {deq / mm:.2f})"
    )


def _deepseek_kernel():
    """The baseline: DeepSeek-V3's weight_dequant formulation (native fp8 load, x.float() * s per tile)."""
    import triton
    import triton.language as tl

    @triton.jit
    def weight_dequant_kernel(x_ptr, s_ptr, y_ptr, M, N, BLOCK_SIZE: tl.constexpr):
        pid_m = tl.program_id(axis=0)
        pid_n = tl.program_id(axis=1)
        n = tl.cdiv(N, BLOCK_SIZE)
        offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        offs_n = pid_n * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        offs = offs_m[:, None] * N + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        s = tl.load(s_ptr + pid_m * n + pid_n)
        tl.store(y_ptr + offs, x * s, mask=mask)

    def run(x, s, y):
        m, n = x.shape
        grid = (triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))
        weight_dequant_kernel[grid](x, s, y, m, n, BLOCK_SIZE=BLOCK)

    return run


def bench_gpu(m: int, n: int, reps: int) -> None:
    from expertd.kernels import weight_dequant_triton

    x, s = make_weight(m, n, "cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(out)
    nbytes = out.numel() * out.element_size()
    ref = weight_dequant_reference(x.cpu(), s.cpu(), BLOCK)
    weight_dequant_triton(x, s, BLOCK, out=out)
    if not torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16)):
        raise SystemExit("Triton dequant does not match the reference")
    fns = {"triton": lambda: weight_dequant_triton(x, s, BLOCK, out=out), "copy": lambda: dst.copy_(out)}
    try:
        ds = _deepseek_kernel()
        ds(x, s, dst)
        fns["deepseek"] = lambda: ds(x, s, dst)
    except Exception as e:  # e.g. no native fp8 conversion on this GPU
        print(f"gpu: DeepSeek-V3 kernel unavailable here ({type(e).__name__}: {e})")
    t = best_of(fns, reps, torch.cuda.synchronize)
    line = f"gpu  {m}x{n}: triton {nbytes / t['triton'] / 1e9:7.1f} GB/s | d2d copy {nbytes / t['copy'] / 1e9:7.1f} GB/s"
    if "deepseek" in t:
        line += f" | deepseek x.float()*s {nbytes / t['deepseek'] / 1e9:7.1f} GB/s"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default="7168x2048,2048x7168")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, best of {args.reps}")
    for m, n in shapes:
        bench_cpu(m, n, args.reps)
    if not torch.cuda.is_available():
        print("gpu: skipped (torch.cuda.is_available() is False)")
        return
    for m, n in shapes:
        bench_gpu(m, n, args.reps)


if __name__ == "__main__":
    main()
