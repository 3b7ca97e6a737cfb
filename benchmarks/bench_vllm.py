"""vLLM with `load_format="expertd"` against vLLM's own load of the bf16 folder, in one run.

    python benchmarks/bench_vllm.py [--workdir /tmp/expertd-bench-vllm] [--layers 4] [--experts 32] [--hidden 512]
                                    [--moe-intermediate 512] [--reps 3] [--python VLLM_PYTHON]

V1  `LLM()` start-to-ready (the constructor, in-process engine, `import vllm` done before the clock starts) with
    `load_format="expertd"` from a folder holding config files only, the daemon serving the FP8 (128x128 blocks)
    checkpoint ÷ vLLM's own load of the bf16 folder; vLLM's own load of the FP8 folder is tried too (its CPU FP8
    kernels need AMX: on a CPU without, the error is printed). Page cache warm, runs alternated, each engine in a
    fresh process, medians of --reps.
V2  per engine: the served bytes it maps (parameters bound to shared memory, as served or in the daemon's derived
    expert layout) and the bytes its other parameters hold privately, and the growth of the process's private
    memory (`Anonymous` of /proc/self/smaps_rollup) across `LLM()`, which includes the KV cache
    (VLLM_CPU_KVCACHE_SPACE=1 GiB) for both modes alike.
V3  4 engine processes side by side on one host, measured while all 4 map the experts: the sum of their
    proportional set sizes of the expert bytes (+ expert bytes held privately) ÷ one copy; the same for 4 engines
    of vLLM's own load (each holds its own copy: 4).
V4  `expertd.client.engines.vllm.refresh(llm)` after an update that changes one expert stack (gate_up of layer
    0): in the first engine (the daemon derives the new layout) and in a second one (maps it), ÷ a fresh `LLM()`
    on the new generation.
The checkpoint is a Qwen3-MoE written by `expertd generate`'s writer (default ~200 MB bf16); the engines run in the
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))
from vllm_engines import barrier, expert_memory  # noqa: E402  (the tests' measures, run in the vLLM virtualenv too)


def private_bytes() -> int:
    """This process's anonymous memory: its own copies (smaps' Private_* would also count the pages of shared
    mappings that no other process maps at the moment)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith(("0", "7")))
    return int(fields["Anonymous"].split()[0]) * 1024


def engine(model: str, endpoint: str | None, side_by_side: tuple | None = None, refresh: tuple | None = None) -> dict:
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

    def placement(m) -> tuple[int, int, int]:
        from expertd.client.engines import state_of
        from expertd.client.engines.binding import residency

        state = state_of(m)
        if state is None:  # vLLM's own load: every weight read from the files into the engine
            return 0, sum(p.nbytes for p in m.parameters()), 0
        where = residency(m, state.client.index().shm_dir).values()
        return (sum(size for size, shared in where if shared), sum(size for size, shared in where if not shared),
                state.memory["kernels"])

    shared, copied, kernels = llm.apply_model(placement)[0]
    out = {"seconds": seconds, "private_grown": grown, "shared": shared, "copied": copied, "kernels": kernels}
    if side_by_side:  # V3: measured while every engine of the host maps its experts
        folder, name, count = side_by_side
        peers = [str(k) for k in range(int(count))]
        barrier(folder, name, "loaded", peers)
        out["experts"] = llm.apply_model(expert_memory)[0]
        barrier(folder, name, "measured", peers)
    if refresh:  # V4: a trainer's update, then this engine follows it
        out["refresh"] = follow(llm, endpoint, *refresh)
    return out


def follow(llm, endpoint: str, folder: str, name: str) -> dict:
    """The first engine pushes an update of one expert stack; each engine then refreshes, timed (the second waits
    for the first, so that it maps what the first made the daemon derive)."""
    from expertd.client import ExpertClient
    from expertd.client.engines import vllm as plugin

    barrier(folder, name, "loaded", ["first", "second"])  # both engines on the generation before the update
    if name == "first":
        with ExpertClient(endpoint, heartbeat=False) as client:
            stack = next(n for n in client.served_tensors() if n.endswith("layers.0.mlp.experts.gate_up_proj"))
            client.update({stack: -client.served_tensors()[stack]})
    else:
        barrier(folder, name, "refreshed", ["first"])
    t0 = time.perf_counter()
    done = plugin.refresh(llm)[0]
    seconds = time.perf_counter() - t0
    if name == "first":
        barrier(folder, name, "refreshed", ["first"])
    return {"seconds": seconds, "remapped": len(done["remapped"]), "modules": len(done["modules"])}


def checkpoint(folder: str, args, fp8: bool = False) -> str:
    from expertd.tools.generate import generate_model_type

    if not os.path.exists(os.path.join(folder, "config.json")):
        generate_model_type(folder, "qwen3_moe", fp8=fp8, max_shard_size="2GB", num_hidden_layers=args.layers,
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
    parser.add_argument("--side", nargs=3, metavar=("FOLDER", "NAME", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--refresh", nargs=2, metavar=("FOLDER", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # the child, in the vLLM virtualenv
        model, endpoint = args.engine
        print("RESULT " + json.dumps(engine(model, endpoint or None, args.side, args.refresh)), flush=True)
        return

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from helpers.daemon import DaemonProcess
    from helpers.install import build_wheel
    from helpers.venvs import install_wheel
    from helpers.vllm_venv import VLLM, vllm_venv
    from run_all import machine

    os.makedirs(args.workdir, exist_ok=True)
    python = args.python or install_wheel(vllm_venv(), build_wheel(tempfile.mkdtemp(dir=args.workdir)))
    name = f"qwen3moe-{args.layers}x{args.experts}-{args.hidden}"
    ckpt = checkpoint(os.path.join(args.workdir, name), args)
    fp8 = checkpoint(os.path.join(args.workdir, name + "-fp8"), args, fp8=True)
    weightless = os.path.join(args.workdir, "config-only")
    os.makedirs(weightless, exist_ok=True)
    for file in ("config.json", "generation_config.json"):
        with open(os.path.join(fp8, file)) as src, open(os.path.join(weightless, file), "w") as dst:
            dst.write(src.read())
    daemon = DaemonProcess.launch(os.path.join(args.workdir, "daemon"), fp8, f"edtbench{uuid.uuid4().hex[:8]}",
                                  stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_CACHE_ROOT=os.path.join(args.workdir, "vllm-cache"), VLLM_NO_USAGE_STATS="1")

    def start(model: str, endpoint: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([python, os.path.abspath(__file__), "--engine", model, endpoint, *extra],
                                cwd=args.workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(proc: subprocess.Popen, what: str, fail: bool = True) -> dict | str:
        out, err = proc.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            if not fail:
                return next((line for line in reversed(err.splitlines()) if "Error" in line), err[-300:])
            raise SystemExit(f"{what} engine failed ({proc.returncode}):\n{err[-4000:]}")
        return json.loads(lines[-1][len("RESULT "):])

    def side_by_side(count: int, model: str, endpoint: str, tag: str, refresh: bool = False) -> list[dict]:
        folder = tempfile.mkdtemp(dir=args.workdir, prefix=tag)
        names = ["first", "second"] if refresh else [str(k) for k in range(count)]
        procs = [start(model, endpoint, *(["--refresh", folder, n] if refresh else ["--side", folder, n, str(count)]))
                 for n in names]
        return [result(proc, tag) for proc in procs]

    runs: dict[str, list[dict]] = {"vllm": [], "expertd": []}
    try:
        daemon.wait_serving(timeout=900)
        for _ in range(args.reps):
            for mode, model, endpoint in (("vllm", ckpt, ""), ("expertd", weightless, daemon.endpoint)):
                runs[mode].append(result(start(model, endpoint), mode))
        fp8_own = result(start(fp8, ""), "vllm-fp8", fail=False)
        four = {"expertd": side_by_side(4, weightless, daemon.endpoint, "v3-expertd"),
                "vllm": side_by_side(4, ckpt, "", "v3-vllm")}
        refreshed = side_by_side(2, weightless, daemon.endpoint, "v4", refresh=True)
        fresh = result(start(weightless, daemon.endpoint), "fresh")
    finally:
        daemon.stop()
    weights = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    isa = ", ".join(flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in flags)
    print(f"# {machine()}; {VLLM}; CPU flags: {isa}")
    print(f"# Qwen3-MoE {args.layers} layers x {args.experts} experts, hidden {args.hidden}, moe_intermediate "
          f"{args.moe_intermediate}: {mib(weights)} bf16; the daemon serves its FP8-blocks checkpoint; medians of "
          f"{args.reps}")
    print(f"V1  LLM() start-to-ready: vLLM's own load of the bf16 folder {med['vllm']['seconds']:.2f} s, "
          f"load_format=expertd {med['expertd']['seconds']:.2f} s, ratio "
          f"{med['expertd']['seconds'] / med['vllm']['seconds']:.2f}")
    if isinstance(fp8_own, dict):
        print(f"V1  vLLM's own load of the FP8 folder {fp8_own['seconds']:.2f} s (one run), expertd ÷ it "
              f"{med['expertd']['seconds'] / fp8_own['seconds']:.2f}")
    else:
        print(f"V1  vLLM's own load of the FP8 folder: fails on this CPU: {fp8_own.strip()[:300]}")
    for mode in runs:
        m = med[mode]
        kernels = f", packed by kernels from emptied parameters {mib(m['kernels'])}" if mode == "expertd" else ""
        print(f"V2  {mode:8s} weights mapped from shared memory {mib(m['shared'])}, parameters held privately "
              f"{mib(m['copied'])}{kernels}; private memory grown across LLM() {mib(m['private_grown'])}")
    for mode, rows in four.items():
        one = rows[0]["experts"]["total"]
        total = sum(r["experts"]["pss"] + r["experts"]["private"] for r in rows)
        print(f"V3  4 engines ({mode:8s}): sum of expert Pss + private expert bytes {mib(total)} = "
              f"{total / one:.2f} x one copy ({mib(one)})")
    first, second = (r["refresh"]["seconds"] for r in refreshed)
    print(f"V4  refresh after an update of one expert stack: first engine {first:.3f} s (the daemon derives), second "
          f"{second:.3f} s (maps); a fresh LLM() on the new generation {fresh['seconds']:.2f} s; ratios "
          f"{first / fresh['seconds']:.3f}, {second / fresh['seconds']:.3f}")


if __name__ == "__main__":
    main()
