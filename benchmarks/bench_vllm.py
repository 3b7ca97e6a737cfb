"""vLLM with `load_format="expertd"` against vLLM's own load of the bf16 folder, in one run.

    python benchmarks/bench_vllm.py [--workdir /tmp/expertd-bench-vllm] [--layers 4] [--experts 32] [--hidden 512]
                                    [--moe-intermediate 512] [--reps 3] [--python VLLM_PYTHON]

V1  `LLM()` start-to-ready (the constructor, in-process engine, `import vllm` done before the clock starts) with
    `load_format="expertd"` from a folder holding config files only ÷ vLLM's own load of the bf16 checkpoint
    folder (page cache warm, runs alternated, each engine in a fresh process, medians of --reps).
V2  per engine: the served bytes it maps (parameters bound to the daemon's shared views) and those it copied into
    private memory (fused, repacked or packed by a kernel), and the growth of the process's private memory
    (`Anonymous` of /proc/self/smaps_rollup) across `LLM()`, which includes the KV cache
    (VLLM_CPU_KVCACHE_SPACE=1 GiB) for both modes alike.
The checkpoint is a bf16 Qwen3-MoE written by `expertd generate`'s writer (default ~200 MB); the engines run in the
vLLM virtualenv the tests use (tests/helpers/vllm_venv.py, built when missing), with this tree's wheel installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def private_bytes() -> int:
    """This process's anonymous memory: its own copies (smaps' Private_* would also count the pages of shared
    mappings that no other process maps at the moment)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith(("0", "7")))
    return int(fields["Anonymous"].split()[0]) * 1024


def engine(model: str, endpoint: str | None) -> dict:
    """Run in the vLLM virtualenv: one engine, timed and measured."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kwargs = {"load_format": "expertd", "model_loader_extra_config": {"endpoint": endpoint}} if endpoint else {}
    before = private_bytes()
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, **kwargs)
    seconds = time.perf_counter() - t0
    grown = private_bytes() - before

    def placement(m) -> tuple[int, int]:
        client = getattr(m, "_expertd_client", None)
        if client is None:
            return 0, None  # vLLM's own load: every weight read from the files into the engine
        from expertd.vllm.binding import residency

        shared = sum(size for size, is_shared in residency(m, client.index().shm_dir).values() if is_shared)
        return shared, sum(t.nbytes for t in client.tensors().values()) - shared

    shared, copied = llm.apply_model(placement)[0]
    return {"seconds": seconds, "private_grown": grown, "shared": shared, "copied": copied}


def checkpoint(folder: str, args) -> str:
    from expertd.server.tools.generate import generate_model_type

    if not os.path.exists(os.path.join(folder, "config.json")):
        generate_model_type(folder, "qwen3_moe", fp8=False, max_shard_size="2GB", num_hidden_layers=args.layers,
                            num_local_experts=args.experts, hidden_size=args.hidden,
                            moe_intermediate_size=args.moe_intermediate)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "expertd-bench-vllm"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--python", help="the vLLM virtualenv's python (default: the tests' cached one)")
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "ENDPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # the child, in the vLLM virtualenv
        model, endpoint = args.engine
        print("RESULT " + json.dumps(engine(model, endpoint or None)), flush=True)
        return

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from helpers.daemon import DaemonProcess
    from helpers.install import build_wheel
    from helpers.venvs import install_wheel
    from helpers.vllm_venv import VLLM, vllm_venv
    from run_all import machine

    os.makedirs(args.workdir, exist_ok=True)
    python = args.python or install_wheel(vllm_venv(), build_wheel(tempfile.mkdtemp(dir=args.workdir)))
    ckpt = checkpoint(os.path.join(args.workdir, f"qwen3moe-{args.layers}x{args.experts}-{args.hidden}"), args)
    weightless = os.path.join(args.workdir, "config-only")
    os.makedirs(weightless, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(ckpt, name)) as src, open(os.path.join(weightless, name), "w") as dst:
            dst.write(src.read())
    daemon = DaemonProcess.launch(os.path.join(args.workdir, "daemon"), ckpt, f"edtbench{uuid.uuid4().hex[:8]}",
                                  stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_CACHE_ROOT=os.path.join(args.workdir, "vllm-cache"), VLLM_NO_USAGE_STATS="1")
    runs: dict[str, list[dict]] = {"vllm": [], "expertd": []}
    try:
        daemon.wait_serving(timeout=900)
        for _ in range(args.reps):
            for mode, model, endpoint in (("vllm", ckpt, ""), ("expertd", weightless, daemon.endpoint)):
                done = subprocess.run([python, os.path.abspath(__file__), "--engine", model, endpoint],
                                      cwd=args.workdir, env=env, capture_output=True, text=True, timeout=900)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    raise SystemExit(f"{mode} engine failed ({done.returncode}):\n{done.stderr[-4000:]}")
                runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        daemon.stop()
    weights = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    for r in runs["vllm"]:
        r["copied"] = weights
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    with open("/proc/cpuinfo") as f:
        isa = "avx512_bf16" if "avx512_bf16" in f.read() else "no avx512_bf16"
    print(f"# {machine()}; {VLLM}; CPU: {isa}")
    print(f"# Qwen3-MoE {args.layers} layers x {args.experts} experts, hidden {args.hidden}, moe_intermediate "
          f"{args.moe_intermediate}: {mib(weights)} bf16; medians of {args.reps}")
    print(f"V1  LLM() start-to-ready: vLLM's own load {med['vllm']['seconds']:.2f} s, load_format=expertd "
          f"{med['expertd']['seconds']:.2f} s, ratio {med['expertd']['seconds'] / med['vllm']['seconds']:.2f}")
    for mode in runs:
        m = med[mode]
        print(f"V2  {mode:8s} weights mapped from shared memory {mib(m['shared'])}, copied into the engine "
              f"{mib(m['copied'])}; private memory grown across LLM() {mib(m['private_grown'])}")


if __name__ == "__main__":
    main()
