"""What an engine asks of a daemon, checked before the engine builds anything: the loader's options and the model.

Plain Python (no vLLM, no torch), so that the checks are tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertd.errors import ConfigError, ModelMismatch

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


@dataclass(frozen=True)
class LoaderOptions:
    """`model_loader_extra_config` of `load_format="expertd"`; what is left out comes from the environment as in
    `ExpertClient` ($EXPERTD_ENDPOINT, $EXPERTD_TOKEN, $EXPERTD_SERVER_KEY, $EXPERTD_CLIENT_KEY)."""

    endpoint: str | None = None
    token: str | None = None
    server_key: str | None = None
    client_key: str | None = None
    timeout: float = 30.0
    zero_copy: bool = True  # bind the parameters vLLM uses as they are served to the shared views
    follow: bool = False  # refresh on its own before the first forward pass after the daemon publishes a generation

    @classmethod
    def parse(cls, extra: dict | None) -> "LoaderOptions":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"model_loader_extra_config of load_format 'expertd' has unknown keys {unknown}; "
                              f"known: {sorted(cls.__dataclass_fields__)}")
        where = "model_loader_extra_config"
        for key in ("endpoint", "token", "server_key", "client_key"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ConfigError(f"{where}[{key!r}] must be a string, not {type(extra[key]).__name__}")
        if not isinstance(extra.get("timeout", 30.0), (int, float)) or isinstance(extra.get("timeout"), bool):
            raise ConfigError(f"{where}['timeout'] must be a number of seconds, not {extra['timeout']!r}")
        for key in ("zero_copy", "follow"):
            if not isinstance(extra.get(key, False), bool):
                raise ConfigError(f"{where}[{key!r}] must be true or false, not {extra[key]!r}")
        if extra.get("follow") and extra.get("zero_copy") is False:
            raise ConfigError(f"{where}: 'follow' needs 'zero_copy' (the engine follows the daemon by remapping)")
        return cls(**extra)


def _value(config: dict, names: tuple[str, ...]):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def check_config(served: dict, wanted: dict, endpoint: str, model: str) -> None:
    """The daemon at `endpoint` serves a model of the same tensor names and shapes as `wanted` (the engine's config,
    read from `model`), by the config values that decide them."""
    for names in SHAPE_KEYS:
        mine, theirs = _value(wanted, names), _value(served, names)
        if mine is not None and theirs is not None and mine != theirs:
            raise ModelMismatch(f"the daemon at {endpoint} serves another model than {model}: its config has "
                                f"{names[0]}={theirs!r}, the engine's {names[0]}={mine!r}")


def check_loaded(expected: set[str], loaded: set[str] | None, endpoint: str, model: str) -> None:
    """Every parameter of the engine's model got a served tensor (`loaded`: what the model's load_weights
    returned; None where the model does not track it)."""
    if loaded is None:
        return
    missing = sorted(expected - loaded)
    if missing:
        raise ModelMismatch(f"the daemon at {endpoint} serves no tensor for {len(missing)} parameter(s) of {model}'s "
                            f"model, e.g. {missing[:3]}")
