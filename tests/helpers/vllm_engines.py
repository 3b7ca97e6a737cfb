"""Run vLLM engines one after another in this process and print what each generated, as JSON lines.

Run by tests/test_vllm.py in the vLLM virtualenv (`helpers.vllm_venv`): `python vllm_engines.py SPEC`, SPEC a JSON
file {"prompts": [[token ids]], "max_tokens": N, "engines": [{"name", "model", "load_format", "extra"}]}. One
process for all engines: `import vllm` is the slow part (14-21 s), each `LLM()` 2-4 s. Per engine it prints
{"name", "tokens": [[ids] per prompt], "residency": {parameter: [bytes, shared]}, "leases": [the daemon's leases
while the engine runs, after it is deleted] (with "residency")} or {"name", "error": {"types": the error's classes,
"message"}}. Imports nothing of the tests' helpers.
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process (apply_model sees the model) unless set
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def residency(model) -> dict:
    """Where each parameter of the engine's model lies, when it was loaded from expertd."""
    from expertd.client.engines import state_of
    from expertd.client.engines.binding import residency as where

    state = state_of(model)
    if state is None:
        return {}
    return {name: list(v) for name, v in where(model, state.client.index().shm_dir).items()}


def is_expert(name: str) -> bool:
    return name.endswith(("experts.w13_weight", "experts.w2_weight"))


def expert_memory(model) -> dict:
    """The experts' bytes in this process: "pss" of the shared mappings holding them (each mapping counted once,
    its pages shared by every process mapping them), "private" those not in a shared mapping, "total"."""
    experts = [p for n, p in model.named_parameters() if is_expert(n)]
    maps, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = [lo, hi, head[1][3] == "s", 0]
                maps.append(current)
            elif head[0] == "Pss:" and current is not None:
                current[3] = int(head[1]) * 1024
    held, private = {}, 0
    for p in experts:
        lo = p.data_ptr()
        found = next((m for m in maps if m[0] <= lo < m[1] and m[2]), None)
        if found is None:
            private += p.nbytes
        else:
            held[found[0]] = found[3]
    return {"pss": sum(held.values()), "private": private, "total": sum(p.nbytes for p in experts)}


def barrier(folder: str, name: str, step: str, peers: list) -> None:
    """Wait until every engine of `peers` reached `step` (files in `folder`)."""
    import time

    open(os.path.join(folder, f"{name}.{step}"), "w").close()
    deadline = time.monotonic() + 600
    while not all(os.path.exists(os.path.join(folder, f"{peer}.{step}")) for peer in peers):
        assert time.monotonic() < deadline, f"peers {peers} did not reach {step}"
        time.sleep(0.1)


def latest_generation(model) -> int:
    from expertd.client.engines import state_of

    return state_of(model).client.latest_generation


def live(endpoint: str) -> list:
    """The generations the daemon at `endpoint` keeps."""
    from expertd.connection import Connection

    conn = Connection(endpoint, timeout=10)
    try:
        return sorted(g["generation"] for g in conn.request("status")["generations"])
    finally:
        conn.close()


def leases(endpoint: str) -> int:
    """How many leases the daemon at `endpoint` holds."""
    from expertd.connection import Connection

    conn = Connection(endpoint, timeout=10)
    try:
        return len(conn.request("status")["leases"])
    finally:
        conn.close()


def engine_for(engine: dict):
    from vllm import LLM

    return LLM(model=engine["model"], load_format=engine.get("load_format", "auto"), dtype="bfloat16",
               enforce_eager=True, skip_tokenizer_init=True, seed=0,
               model_loader_extra_config=engine.get("extra") or {})


def generate(llm, prompts: list, max_tokens: int) -> list:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results]


def push(endpoint: str, names: list, seed: int, shuffle: bool = False) -> int:
    """Publish a generation in which the tensors `names` (served or checkpoint names) are replaced by others of
    their kind (scaled by random factors in [1, 2); with `shuffle`, their elements in a random order first: a
    change of a few experts that no host's rounding hides from greedy tokens): a trainer's update."""
    import torch

    from expertd.client import ExpertClient

    with ExpertClient(endpoint, heartbeat=False) as client:
        served = {**client.tensors(), **client.served_tensors()}
        gen = torch.Generator().manual_seed(seed)
        new = {}
        for name in names:
            old = served[name].float()
            if shuffle:
                old = old.flatten()[torch.randperm(old.numel(), generator=gen)].view(old.shape)
            new[name] = (old * (1 + torch.rand(old.shape, generator=gen))).to(served[name].dtype)
        return client.update(new)


def follow(llm, engine: dict, prompts: list, max_tokens: int, out: dict) -> None:
    """An update pushed, `expertd.client.engines.vllm.refresh`, the tokens after it and a fresh engine's on the new
    generation."""
    from expertd.client.engines import vllm as plugin

    held = None
    if engine["refresh"].get("hold"):  # another reader still on the old generation: it stays live through the refresh
        from expertd.client import ExpertClient

        held = ExpertClient(engine["extra"]["endpoint"], heartbeat=False)
    shuffle = engine["refresh"].get("shuffle", False)
    out["generation"] = push(engine["extra"]["endpoint"], engine["refresh"]["tensors"], engine["refresh"]["seed"],
                             shuffle)
    if engine["extra"].get("follow"):  # the engine refreshes on its own once its client heard of the generation
        import time

        deadline = time.monotonic() + 120
        while llm.apply_model(latest_generation)[0] < out["generation"]:
            assert time.monotonic() < deadline, "the engine's client never heard of the new generation"
            time.sleep(0.2)
    else:
        out["refreshed"] = plugin.refresh(llm)[0]
    out["tokens_after"] = generate(llm, prompts, max_tokens)
    out["live_after"] = live(engine["extra"]["endpoint"])
    if held is not None:
        held.close()
    out["residency_after"] = llm.apply_model(residency)[0]
    second = engine_for({**engine, "extra": {**engine["extra"], **engine["refresh"].get("fresh", {})}})
    out["fresh_tokens"] = generate(second, prompts, max_tokens)
    out["fresh_residency"] = second.apply_model(residency)[0]
    if engine["refresh"].get("again"):  # a second update and refresh of the same engine, and a fresh engine's tokens
        # (before any engine goes: an in-process engine that does takes vLLM's process groups with it, and `llm`
        # could not run)
        names, seed = engine["refresh"]["again"]
        push(engine["extra"]["endpoint"], names, seed, shuffle)
        plugin.refresh(llm)
        out["tokens_again"] = generate(llm, prompts, max_tokens)
        third = engine_for({**engine, "extra": {**engine["extra"], **engine["refresh"].get("fresh", {})}})
        out["fresh_tokens_again"] = generate(third, prompts, max_tokens)
        del third
    del second
    gc.collect()


class Lines:
    """The expertd loader's log lines (logger `vllm.expertd`) while an engine is built."""

    def __init__(self):
        import logging

        self.lines, self.handler = [], logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger = logging.getLogger("vllm.expertd")

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def altered(enabled: bool):
    """With `enabled`, vLLM's CPU MoE packing made value-dependent: the probes' integers stay where it puts them,
    every other value is scaled (a post-load step that is not a pure rearrangement). Undone afterwards."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    original = cpu_moe.cpu_prepack_moe_weight

    def prepack(weight, isa):
        out = original(weight, isa)
        return out.where(out == out.round(), out * 1.5)

    @contextlib.contextmanager
    def patched():
        cpu_moe.cpu_prepack_moe_weight = prepack
        try:
            yield
        finally:
            cpu_moe.cpu_prepack_moe_weight = original

    return patched()


def run(engine: dict, prompts: list, max_tokens: int) -> dict:
    out = {"name": engine["name"]}
    try:
        with Lines() as out["log"], altered(engine.get("alter", False)):
            llm = engine_for(engine)
            out["tokens"] = generate(llm, prompts, max_tokens)
    except Exception as exc:  # the error the loader raised, maybe wrapped by the engine
        while exc.__cause__ is not None and not type(exc).__module__.startswith("expertd"):
            exc = exc.__cause__
        out["error"] = {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
        out.pop("tokens", None)
        return out
    if engine.get("peers"):  # engines of one host side by side: measured while all of them map the experts
        barrier(engine["barrier"], engine["name"], "loaded", engine["peers"])
        out["experts"] = llm.apply_model(expert_memory)[0]
        barrier(engine["barrier"], engine["name"], "measured", engine["peers"])
    if engine.get("refresh"):
        with Lines() as out["refresh_log"]:
            follow(llm, engine, prompts, max_tokens, out)
    out["residency"] = llm.apply_model(residency)[0] if engine.get("residency") else {}
    if engine.get("residency"):
        out["leases"] = [leases(engine["extra"]["endpoint"])]
    del llm
    gc.collect()
    if engine.get("residency"):
        out["leases"].append(leases(engine["extra"]["endpoint"]))
    return out


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    for engine in spec["engines"]:
        print("ENGINE " + json.dumps(run(engine, spec["prompts"], spec["max_tokens"])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
