"""The figures of bench_vllm.py, printed: V1 and V2 as a table with the issue's goals, V3 to V5 as lines."""

from __future__ import annotations

import json
import os
import statistics

MODES = ("vllm", "first", "second")


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report_loads(runs: dict[str, list[dict]], started: list[float]) -> None:
    """V1 and V2 as a table (medians; ratios to vLLM's own load), then the goals."""
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if not isinstance(rs[0][k], dict)}
           for mode, rs in runs.items()}
    own = med["vllm"]

    def row(title: str, key: str | tuple[str, str], fmt, ratio: bool = False) -> None:
        """One figure per mode (`key`: vLLM's own key, the engines' key), with its ratio to vLLM's own."""
        own_key, ours = (key, key) if isinstance(key, str) else key
        cells = [fmt(own[own_key])] + [fmt(med[mode][ours]) + (f" ({med[mode][ours] / own[own_key]:.2f})"
                                                               if ratio else "") for mode in MODES[1:]]
        print(f"| {title} | " + " | ".join(cells) + " |")

    seconds = "{:.2f} s".format
    print("| | vLLM's own load of the bf16 folder | first engine (fresh daemon) | second engine |")
    print("| --- | --- | --- | --- |")
    row("V1 model loading (`get_model`: build, weights, post-load step)", "model_load", seconds, ratio=True)
    row("V1 of which logged: model built", ("built_logged", "expertd_built_logged"), seconds)
    row("V1 of which logged: vLLM's \"Loading weights took\" / expertd's \"weights mapped in\" (incl. post-load)",
        ("weights_logged", "expertd_logged"), seconds)
    row("V1 `LLM()` start-to-ready", "seconds", seconds, ratio=True)
    row("V2 parameters mapping shared memory", "shared", mib)
    row("V2 parameters held privately", "copied", mib)
    row("V2 kernels' own packed copies (oneDNN's dense layers)", "kernels", mib)
    row("V2 anonymous memory grown across `LLM()` (incl. KV cache)", "private_grown", mib)
    for key, what in (("model_load", "model loading"), ("seconds", "LLM()")):
        fastest = {mode: min(r[key] for r in rs) for mode, rs in runs.items()}
        print(f"# fastest run of each mode (the least disturbed by the machine's other load), {what}: "
              + ", ".join(f"{mode} {v:.2f} s ({v / fastest['vllm']:.2f})" for mode, v in fastest.items()))
    print(f"# expertd's attach and checks (logged, median): first {med['first']['attach_logged']:.2f} s, second "
          f"{med['second']['attach_logged']:.2f} s")
    print(f"# layers mapped (median): first {med['first']['layers_mapped']:.0f}, second "
          f"{med['second']['layers_mapped']:.0f}; daemon start-to-serving per rep: "
          + ", ".join(f"{s:.2f} s" for s in started))
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30
    second, first = med["second"], med["first"]
    goals = [("second engine's model loading <= 0.2x vLLM's own", second["model_load"] / own["model_load"], 0.2),
             ("second engine's LLM() <= 0.6x vLLM's own", second["seconds"] / own["seconds"], 0.6),
             ("first engine's model loading <= 1.0x vLLM's own", first["model_load"] / own["model_load"], 1.0),
             ("first engine's LLM() <= 1.0x vLLM's own", first["seconds"] / own["seconds"], 1.0)]
    for text, value, goal in goals:
        print(f"GOAL {text}: {value:.2f} {'met' if value <= goal else 'MISSED'}")
    bound = kv + second["kernels"]
    print(f"GOAL second engine's anonymous growth {mib(second['private_grown'])} <= KV cache {mib(kv)} + kernels' "
          f"packed copies {mib(second['kernels'])} = {mib(bound)}: difference {mib(second['private_grown'] - bound)} "
          f"{'met' if second['private_grown'] <= bound else 'MISSED'}")
    print("# of the anonymous growth across LLM(), medians: vLLM's set-up before the model load / the model load "
          "beyond the parameters held privately and the kernels' packed copies / after it beyond the KV cache: "
          + ", ".join(f"{mode} {mib(med[mode]['init_grown'])} / "
                      f"{mib(med[mode]['load_grown'] - med[mode]['copied'] - second['kernels'])} / "
                      f"{mib(med[mode]['private_grown'] - med[mode]['init_grown'] - med[mode]['load_grown'] - kv)}"
                      for mode in MODES))
    rest = {mode: med[mode]["private_grown"] - kv - med[mode]["copied"] - second["kernels"] for mode in MODES}
    print("# anonymous growth beyond the KV cache, the parameters held privately and the kernels' packed copies (the "
          "second engine's figure for every mode: the same layers): "
          + ", ".join(f"{mode} {mib(value)}" for mode, value in rest.items()))
    figures = lambda r: {k: round(v, 3) for k, v in r.items() if isinstance(v, (int, float))}  # noqa: E731
    print("RUNS " + json.dumps({mode: [figures(r) for r in rs] for mode, rs in runs.items()}))


def report_extras(out: dict) -> None:
    fp8 = out.get("fp8")
    if isinstance(fp8, dict):
        print(f"V1  vLLM's own load of the FP8 folder: model loading {fp8['model_load']:.2f} s, LLM() "
              f"{fp8['seconds']:.2f} s (one run)")
    elif fp8 is not None:
        print(f"V1  vLLM's own load of the FP8 folder: fails on this CPU: {fp8.strip()[:300]}")
    for mode, rows in out.get("four", {}).items():
        one = rows[0]["experts"]["total"]
        total = sum(r["experts"]["pss"] + r["experts"]["private"] for r in rows)
        print(f"V3  4 engines ({mode:8s}): sum of expert Pss + private expert bytes {mib(total)} = "
              f"{total / one:.2f} x one copy ({mib(one)})")
    if "refreshed" in out:
        (first, second), fresh = (r["refresh"]["seconds"] for r in out["refreshed"]), out["fresh"]["seconds"]
        print(f"V4  refresh after an update of one expert stack: first engine {first:.3f} s (the daemon derives), "
              f"second {second:.3f} s (maps); a fresh LLM() on the new generation {fresh:.2f} s; ratios "
              f"{first / fresh:.3f}, {second / fresh:.3f}")
    for mode, v5 in out.get("serve", {}).items():
        o, m, starts = v5["others"], v5["memory"], ", ".join(f"{s:.1f} s" for s in v5["starts"])
        host = m["Pss"] - m["Pss_Shmem"] + o["Pss"] - o["Pss_Shmem"] + v5["segments"]
        daemon = (f"; the daemon's own Pss {mib(o['Pss'])} (anonymous {mib(o['Pss_Anon'])}, shared memory "
                  f"{mib(o['Pss_Shmem'])}), its segments in /dev/shm {mib(v5['segments'])}") if o["Pss"] else ""
        print(f"V5  4 `vllm serve` ({mode:8s}) one after another: starts {starts}; all up: {m['processes']} "
              f"processes, sum of Pss {mib(m['Pss'])} (anonymous {mib(m['Pss_Anon'])}, shared memory "
              f"{mib(m['Pss_Shmem'])}, files {mib(m['Pss_File'])}){daemon}; host total {mib(host)}")
