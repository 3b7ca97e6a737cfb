"""What an engine asks of a daemon, checked before the engine builds anything: the same model, every parameter fed.

Plain Python (no engine, no torch), so that the checks are tested without an engine.
"""

from __future__ import annotations

from expertd.errors import ModelMismatch
from expertd.partition import PartitionError

MISMATCH_FIX = ("point the engine at the daemon that serves this checkpoint (its endpoint option, or "
                "$EXPERTD_ENDPOINT), or start one on it with `expertd start`")

# Config values that decide the model's tensor names and shapes; each tuple is one value under its several names
# (transformers releases and families spell the expert count differently). Values absent on either side are not
# compared: a config may leave out what its class derives (head_dim).
SHAPE_KEYS = (
    ("model_type",), ("vocab_size",), ("hidden_size",), ("intermediate_size",), ("moe_intermediate_size",),
    ("num_hidden_layers",), ("num_attention_heads",), ("num_key_value_heads",), ("head_dim",),
    ("num_experts", "num_local_experts", "n_routed_experts"), ("n_shared_experts",),
    ("shared_expert_intermediate_size",), ("first_k_dense_replace",), ("decoder_sparse_step",), ("mlp_only_layers",),
    ("q_lora_rank",), ("kv_lora_rank",), ("qk_nope_head_dim",), ("qk_rope_head_dim",), ("v_head_dim",),
    ("tie_word_embeddings",),
)


def _value(config: dict, names: tuple[str, ...]):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def check_daemon(index, config: dict, endpoint: str, model: str) -> None:
    """The daemon (`index`: its TensorIndex) serves every expert of the model `config` (the engine's HF config,
    read from `model`) describes; raised before the engine allocates."""
    ep = index.expert_parallel
    if ep is not None and not ep.whole:
        raise PartitionError(f"the daemon at {endpoint} serves EP ranks {list(ep.ranks)} of EP size {ep.size} only, "
                             f"and load_format 'expertd' does not map an engine (expert-parallel or not) onto a "
                             f"partitioned daemon yet: attach it to a daemon without `expert_parallel`")
    check_config(index.config, config, endpoint, model)


def check_config(served: dict, wanted: dict, endpoint: str, model: str) -> None:
    """The daemon at `endpoint` serves a model of the same tensor names and shapes as `wanted` (the engine's config,
    read from `model`), by the config values that decide them."""
    for names in SHAPE_KEYS:
        mine, theirs = _value(wanted, names), _value(served, names)
        if mine is not None and theirs is not None and mine != theirs:
            raise ModelMismatch(f"the daemon at {endpoint} serves another model than {model}: its config has "
                                f"{names[0]}={theirs!r}, the engine's {names[0]}={mine!r}; {MISMATCH_FIX}")


def check_loaded(expected: set[str], loaded: set[str] | None, endpoint: str, model: str) -> None:
    """Every parameter of the engine's model got a served tensor (`loaded`: what the model's load_weights
    returned; None where the model does not track it)."""
    if loaded is None:
        return
    missing = sorted(expected - loaded)
    if missing:
        raise ModelMismatch(f"the daemon at {endpoint} serves no tensor for {len(missing)} parameter(s) of {model}'s "
                            f"model, e.g. {missing[:3]}; {MISMATCH_FIX}")
