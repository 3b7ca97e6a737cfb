"""vLLM with `load_format="expertd"` (engines that map instead of load) against vLLM's own load of the bf16 folder.

    python benchmarks/bench_vllm.py [--workdir /tmp/expertd-bench-vllm] [--layers 4] [--experts 32] [--hidden 512]
                                    [--moe-intermediate 512] [--reps 3] [--measures load,fp8,side,refresh,serve]
                                    [--python VLLM_PYTHON]

Three modes, each engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `import vllm` done before the clock starts)
in a fresh process, runs alternated (vLLM's own, first, second) after one uncounted warm-up run of vLLM's own (page
cache and vLLM's caches warm), medians of --reps:
vLLM's own load of the bf16 folder; a first engine (`load_format="expertd"` from a folder holding config files only,
the FP8 checkpoint's without its `quantization_config`, on a daemon started for this rep that has derived nothing yet:
the engine waits for the daemon's derived expert layout); a second engine (the same daemon, after the first: it maps
what exists). The daemon serves the FP8 (128x128 blocks) checkpoint of the same model, dequantized.
V1  model loading: vLLM's `get_model` as the CPU model runner calls it, timed around it in the engine (build,
    weights, post-load step: the same span for every mode), beside what vLLM logs ("Loading weights took": weights
    only) and what expertd's loader logs ("weights mapped in"); `LLM()` start-to-ready; both as ratios to vLLM's own.
    vLLM's own load of the FP8 folder is tried once (`fp8`; its CPU FP8 kernels need AMX: the error is printed).
V2  per mode: the served bytes the engine maps (as served or in the daemon's derived layout), the bytes its other
    parameters hold privately, what kernels packed into copies of their own (oneDNN's dense layers), and the growth
    of the process's anonymous memory (/proc/self/smaps_rollup) across `LLM()`: for the second engine, set beside the
    KV cache (VLLM_CPU_KVCACHE_SPACE=1 GiB) plus the kernels' packed copies; that growth split into vLLM's engine set-up
    before the model load, the model load (`get_model`) and what follows it (the KV cache, ...).
V3  (`side`) 4 engine processes side by side on one host, measured while all 4 map the experts: the sum of their
    proportional set sizes of the expert bytes (+ expert bytes held privately) / one copy; the same for 4 engines of
    vLLM's own load (each holds its own copy: 4).
V4  (`refresh`) `expertd.client.engines.vllm.refresh(llm)` after an update that changes one expert stack (gate_up of
    layer 0): in the first engine (the daemon derives the new layout) and in a second one (maps it), / a fresh
    `LLM()` on the new generation; on a daemon of default limits (`max_derived_bytes`: the live generations' served
    bytes, so the new generation's gather is made while the engines still map the previous generation's layouts).
V5  (`serve`) 4 `vllm serve` replicas (the CLI, multi-process) started one after another on a fresh daemon (the
    first replica is a first engine): each one's start until /health answers 200, and with all 4 up the sum of the
    Pss of all their processes (the daemon's and its segments' apart); the same for vLLM's own load of the bf16
    folder (benchmarks/vllm_replicas.py).
The checkpoint is a Qwen3-MoE written by `expertd generate`'s writer (default ~200 MB bf16); the engines run in the
vLLM virtualenv the tests use (tests/helpers/vllm_venv.py, built when missing), with this tree's wheel installed
(--python: a virtualenv's python to use as it is).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))
from vllm_engines import barrier, expert_memory  # noqa: E402  (the tests' measures, run in the vLLM virtualenv too)

LOGGED = {"built_logged": r"Initializing model took ([0-9.]+) seconds",  # vLLM's loaders
          "weights_logged": r"Loading weights took ([0-9.]+) seconds",  # vLLM's default loader: weights only
          "attach_logged": r"expertd: attached and checked ([0-9.]+) s",  # expertd's loader
          "expertd_built_logged": r"expertd: attached and checked .*, model built ([0-9.]+) s",
          "expertd_logged": r"expertd: attached and checked .* weights (?:mapped|loaded) in ([0-9.]+) s",
          "layers_mapped": r"expertd: (\d+) of \d+ layer\(s\) mapped"}


def private_bytes() -> int:
    """This process's anonymous memory: its own copies (smaps' Private_* would also count the pages of shared
    mappings that no other process maps at the moment)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith(("0", "7")))
    return int(fields["Anonymous"].split()[0]) * 1024


def timed_model_load(clock: dict) -> None:
    """Time vLLM's whole model load (build, weights, post-load step) where the CPU model runner calls `get_model`
    (the in-process engine's worker runs in this process)."""
    from vllm.v1.worker import cpu_model_runner

    load = cpu_model_runner.get_model

    def get_model(*args, **kwargs):
        t0, before = time.perf_counter(), private_bytes()
        clock["before_load"] = before
        try:
            return load(*args, **kwargs)
        finally:
            clock["model_load"] = time.perf_counter() - t0
            clock["load_grown"] = private_bytes() - before

    cpu_model_runner.get_model = get_model


def placement(model) -> tuple[int, int, int]:
    """(bytes mapping shared memory, bytes held privately, bytes kernels packed into copies of their own)."""
    from expertd.client.engines import state_of
    from expertd.client.engines.binding import residency

    state = state_of(model)
    if state is None:  # vLLM's own load: every weight read from the files into the engine
        return 0, sum(p.nbytes for p in model.parameters()), 0
    where = residency(model, state.client.index().shm_dir).values()
    return (sum(size for size, shared in where if shared), sum(size for size, shared in where if not shared),
            state.memory["kernels"])


def engine(model: str, endpoint: str | None, side_by_side: tuple | None = None, refresh: tuple | None = None) -> dict:
    """Run in the vLLM virtualenv: one engine, timed and measured."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    timed_model_load(clock := {})
    kwargs = {"load_format": "expertd", "model_loader_extra_config": {"endpoint": endpoint}} if endpoint else {}
    before = private_bytes()
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, **kwargs)
    seconds = time.perf_counter() - t0
    grown = private_bytes() - before
    shared, copied, kernels = llm.apply_model(placement)[0]
    out = {"seconds": seconds, "model_load": clock.get("model_load", float("nan")), "private_grown": grown,
           "init_grown": clock.get("before_load", before) - before, "load_grown": clock.get("load_grown", 0),
           "shared": shared, "copied": copied, "kernels": kernels}
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


def logged(text: str) -> dict:
    """What vLLM and expertd's loader logged about the load (`LOGGED`)."""
    out = {}
    for key, pattern in LOGGED.items():
        found = re.search(pattern, text)
        out[key] = float(found.group(1)) if found else float("nan")
    return out


class Bench:
    """The parent: checkpoints, daemons and engine processes (each engine a fresh process in the vLLM virtualenv)."""

    def __init__(self, args, python: str):
        self.args, self.python = args, python
        name = f"qwen3moe-{args.layers}x{args.experts}-{args.hidden}-{args.moe_intermediate}"
        self.ckpt = checkpoint(os.path.join(args.workdir, name), args)
        self.fp8 = checkpoint(os.path.join(args.workdir, name + "-fp8"), args, fp8=True)
        self.weightless = os.path.join(args.workdir, name + "-config-only")
        os.makedirs(self.weightless, exist_ok=True)
        for file in ("config.json", "generation_config.json"):  # the served config, minus its quantization_config
            with open(os.path.join(self.fp8, file)) as src, open(os.path.join(self.weightless, file), "w") as dst:
                config = json.load(src)
                config.pop("quantization_config", None)  # else vLLM imports its FP8 modules to check it (README)
                json.dump(config, dst, indent=2)
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(VLLM_CACHE_ROOT=os.path.join(args.workdir, "vllm-cache"), VLLM_NO_USAGE_STATS="1")
        self.weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(self.ckpt, "*.safetensors")))

    def daemon(self, **settings):
        """A fresh daemon (a namespace of its own: nothing derived, nothing to adopt) serving the FP8 checkpoint,
        config `settings` beside the tests'; its start-to-serving in `.started`."""
        from helpers.daemon import DaemonProcess

        folder = os.path.join(self.args.workdir, "daemon")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "daemon.log"), "a") as log:
            t0 = time.perf_counter()
            daemon = DaemonProcess.launch(folder, self.fp8, f"edtbench{uuid.uuid4().hex[:8]}", stdout=log, stderr=log,
                                          **settings)
        try:
            daemon.wait_serving(timeout=900)
        except BaseException:
            self.stop(daemon)
            raise
        daemon.started = time.perf_counter() - t0
        return daemon

    @staticmethod
    def stop(daemon) -> None:
        code = daemon.stop()
        left = glob.glob(f"/dev/shm/{daemon.namespace}*")
        for path in left:
            os.unlink(path)
        if code or left:
            print(f"# the daemon exited {code} and left {len(left)} segment(s) (removed)", file=sys.stderr)

    def start(self, model: str, endpoint: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([self.python, os.path.abspath(__file__), "--engine", model, endpoint, *extra],
                                cwd=self.args.workdir, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    @staticmethod
    def result(proc: subprocess.Popen, what: str, fail: bool = True) -> dict | str:
        out, err = proc.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            if not fail:
                return next((line for line in reversed(err.splitlines()) if "Error" in line), err[-300:])
            raise SystemExit(f"{what} engine failed ({proc.returncode}):\n{err[-4000:]}")
        return {**json.loads(lines[-1][len("RESULT "):]), **logged(out + err)}

    def run(self, mode: str, endpoint: str = "") -> dict:
        return self.result(self.start(self.ckpt if mode == "vllm" else self.weightless, endpoint), mode)

    def side_by_side(self, count: int, model: str, endpoint: str, tag: str, refresh: bool = False) -> list[dict]:
        folder = tempfile.mkdtemp(dir=self.args.workdir, prefix=tag)
        names = ["first", "second"] if refresh else [str(k) for k in range(count)]
        procs = [self.start(model, endpoint, *(["--refresh", folder, n] if refresh else
                                               ["--side", folder, n, str(count)])) for n in names]
        try:
            return [self.result(proc, tag) for proc in procs]
        finally:  # one failed: its peers would wait for it at a barrier
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()


def loads(bench: Bench) -> tuple[dict[str, list[dict]], list[float]]:
    """V1, V2: after a warm-up, per rep vLLM's own load, then a fresh daemon, its first engine and its second; the
    daemons' starts."""
    runs: dict[str, list[dict]] = {"vllm": [], "first": [], "second": []}
    started = []
    bench.run("vllm")  # a first engine on the host pays for cold caches (vLLM's, the page cache): not counted
    for _ in range(bench.args.reps):
        runs["vllm"].append(bench.run("vllm"))
        daemon = bench.daemon()
        started.append(daemon.started)
        try:
            runs["first"].append(bench.run("first", daemon.endpoint))
            runs["second"].append(bench.run("second", daemon.endpoint))
        finally:
            bench.stop(daemon)
    return runs, started


def extras(bench: Bench, measures: set[str]) -> dict:
    """fp8, V3, V4 on one daemon; V5 on a fresh one of its own (its first replica is a first engine)."""
    from helpers.vllm_venv import psm_segments
    from vllm_replicas import replicas

    out: dict = {}
    if "fp8" in measures:
        out["fp8"] = bench.result(bench.start(bench.fp8, ""), "vllm-fp8", fail=False)
    if measures & {"side", "refresh"}:  # default limits: V4's new gather fits while the engines map the old layouts
        daemon = bench.daemon()
        try:
            if "side" in measures:
                out["four"] = {"expertd": bench.side_by_side(4, bench.weightless, daemon.endpoint, "v3-expertd"),
                               "vllm": bench.side_by_side(4, bench.ckpt, "", "v3-vllm")}
            if "refresh" in measures:
                out["refreshed"] = bench.side_by_side(2, bench.weightless, daemon.endpoint, "v4", refresh=True)
                out["fresh"] = bench.run("second", daemon.endpoint)
        finally:
            bench.stop(daemon)
    if "serve" in measures:
        psm = psm_segments()
        folder = tempfile.mkdtemp(dir=bench.args.workdir, prefix="v5-")
        daemon = bench.daemon()
        try:
            out["serve"] = {"expertd": replicas(bench.python, folder, bench.weightless, {"endpoint": daemon.endpoint},
                                                4, "expertd", others=(daemon.proc.pid,),
                                                segments=f"/dev/shm/{daemon.namespace}*")}
        finally:
            bench.stop(daemon)
        out["serve"]["vllm"] = replicas(bench.python, folder, bench.ckpt, None, 4, "vllm")
        left = psm_segments() - psm
        if left:
            print(f"# /dev/shm/psm_* segments appeared during V5 that no replica mapped (not removed: perhaps "
                  f"another user's): {len(left)}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "expertd-bench-vllm"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--measures", default="load,fp8,side,refresh,serve", help="which of them to run")
    parser.add_argument("--python", help="the vLLM virtualenv's python, used as it is (default: the tests' cached "
                                         "one, with this tree's wheel installed)")
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "ENDPOINT"), help=argparse.SUPPRESS)
    parser.add_argument("--side", nargs=3, metavar=("FOLDER", "NAME", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--refresh", nargs=2, metavar=("FOLDER", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # the child, in the vLLM virtualenv
        model, endpoint = args.engine
        print("RESULT " + json.dumps(engine(model, endpoint or None, args.side, args.refresh)), flush=True)
        return

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from helpers.install import build_wheel
    from helpers.venvs import install_wheel
    from helpers.vllm_venv import VLLM, vllm_venv
    from run_all import machine
    from vllm_report import mib, report_extras, report_loads

    measures = set(args.measures.split(","))
    os.makedirs(args.workdir, exist_ok=True)
    python = args.python or install_wheel(vllm_venv(), build_wheel(tempfile.mkdtemp(dir=args.workdir)))
    bench = Bench(args, python)
    runs, started = loads(bench) if "load" in measures else ({}, [])
    out = extras(bench, measures)
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    isa = ", ".join(flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in flags)
    print(f"# {machine()}; {VLLM}; CPU flags: {isa}")
    print(f"# Qwen3-MoE {args.layers} layers x {args.experts} experts, hidden {args.hidden}, moe_intermediate "
          f"{args.moe_intermediate}: {mib(bench.weights)} bf16; the daemon serves its FP8-blocks checkpoint; medians "
          f"of {args.reps}")
    if runs:
        report_loads(runs, started)
    report_extras(out)


if __name__ == "__main__":
    main()
