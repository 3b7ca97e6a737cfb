"""Dequant throughput next to a plain copy, on the CPU and (where CUDA is present) on the GPU.

CPU (GB/s of output written), per checkpoint format: DeepSeek FP8 128x128 blocks (float32 scales),
compressed-tensors FP8 per channel, per tensor and per 128x128 block (bf16 scales, as llmcompressor writes
them) and MXFP4 (gpt-oss) vs `dst.copy_(src)` of a bf16 tensor of the output's size (torch's copy, using the
same intra-op threads) and vs one-threaded libc memmove, measured side by side, best of N.
GPU (GB/s of bytes read + written, median of CUDA-event times, L2 flushed before each call; see
bench_dequant_gpu.py): the Triton kernels, native fp8 conversion and integer decode, vs a device-to-device
copy of as many bytes and vs a DeepSeek-V3-style kernel, each result checked bit for bit.

    python benchmarks/bench_dequant.py [--reps 10] [--shapes 7168x2048,2048x7168] [--formats fp8-block,...]
    python benchmarks/bench_dequant.py --gpu-only [--no-sweep] [--experts 256]   # the GPU part alone
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_dequant_gpu beside it, also under -P
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


# format -> the (rows, columns) one scale covers in an [m, n] weight, and the scale's stored dtype
FORMATS = {
    "fp8-block": (lambda m, n: BLOCK, torch.float32),
    "ct-channel": (lambda m, n: (1, n), torch.bfloat16),
    "ct-tensor": (lambda m, n: (m, n), torch.bfloat16),
    "ct-block": (lambda m, n: BLOCK, torch.bfloat16),
    "mxfp4": (None, None),
}


def format_case(fmt: str, m: int, n: int):
    """(dequant into `out` callable, reference result) of an [m, n] bf16 output in checkpoint format `fmt`."""
    w = torch.randn(m, n) * 0.02
    if fmt == "mxfp4":
        from expertd.kernels import dequant_mxfp4, dequant_mxfp4_reference, quantize_mxfp4

        blocks, scales = quantize_mxfp4(w)  # [n, m/32, 16]: decodes to [m, n]
        return (lambda out: dequant_mxfp4(blocks, scales, out=out)), dequant_mxfp4_reference(blocks, scales)
    block_of, scale_dtype = FORMATS[fmt]
    block = block_of(m, n)
    x, s = quantize_fp8_blockwise(w, block)
    s = s.to(scale_dtype).float()  # stored in the format's dtype, widened exactly as the loader does
    return (lambda out: weight_dequant_cpu(x, s, block, out=out)), weight_dequant_reference(x, s, block)


def measure_formats(m: int, n: int, formats, reps: int) -> dict[str, float]:
    """Best seconds of each format's dequant of an [m, n] bf16 output (each checked against its reference first)
    and of a torch copy and a one-threaded memmove of the same bytes, interleaved."""
    out = torch.empty(m, n, dtype=torch.bfloat16)
    src = torch.randn(m, n).to(torch.bfloat16)
    dst = torch.empty_like(src)
    cases = {}
    for fmt in formats:
        run, reference = format_case(fmt, m, n)
        run(out)
        if not torch.equal(out.view(torch.int16), reference.view(torch.int16)):
            raise SystemExit(f"CPU dequant of {fmt} does not match its reference")
        cases[fmt] = lambda run=run: run(out)
    return best_of({**cases, "copy": lambda: dst.copy_(src),
                    "memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), m * n * 2)}, reps)


def bench_cpu(m: int, n: int, reps: int, formats: list[str]) -> None:
    nbytes = m * n * 2
    t = measure_formats(m, n, formats, reps)
    cp, mm = (nbytes / t[k] / 1e9 for k in ("copy", "memmove"))
    print(f"cpu  {m}x{n}: torch copy_ {cp:6.2f} GB/s | memmove 1 thread {mm:6.2f} GB/s")
    for fmt in formats:
        deq = nbytes / t[fmt] / 1e9
        print(f"cpu  {m}x{n} {fmt:10s}: dequant {deq:6.2f} GB/s (ratio to copy_ {deq / cp:.2f}, "
              f"to memmove {deq / mm:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default="7168x2048,2048x7168", help="CPU shapes")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU part (under 90 s on an H100)")
    ap.add_argument("--gpu-reps", type=int, default=25, help="CUDA-event samples per GPU measurement (median)")
    ap.add_argument("--experts", type=int, default=256, help="experts in the GPU layer case")
    ap.add_argument("--no-sweep", action="store_true", help="skip the GPU tile sweep")
    args = ap.parse_args()
    if not args.gpu_only:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, best of {args.reps}")
        for m, n in shapes:
            bench_cpu(m, n, args.reps, args.formats.split(","))
    if not torch.cuda.is_available():
        print("gpu: skipped, no CUDA GPU present (torch.cuda.is_available() is False)")
        return
    from bench_dequant_gpu import bench_gpu

    bench_gpu(args.gpu_reps, args.experts, sweep=not args.no_sweep)


if __name__ == "__main__":
    main()
