"""What server and client both need from transformers: the config object and the expert fusions.

transformers is imported lazily so that importing expertd stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError


@dataclass(frozen=True)
class Fusion:
    """A fused model parameter built from per-expert checkpoint tensors.

    `target` is the parameter-name suffix (e.g. "mlp.experts.gate_up_proj"); `sources` are
    checkpoint-name suffixes with `*` for the expert index, concatenated per expert in order.
    """

    target: str
    sources: tuple[str, ...]

    def source_names(self, param: str, num_experts: int) -> list[str] | None:
        """Checkpoint names of `param`'s parts in storage order, or None if `param` is not this fusion's."""
        if not param.endswith(self.target):
            return None
        prefix = param[: len(param) - len(self.target)]
        if prefix and not (prefix.endswith(".") or self.target.startswith(".")):
            return None
        return [prefix + src.replace("*", str(e)) for e in range(num_experts) for src in self.sources]


# Used only where transformers' conversion mapping cannot be read. A fusion applies only to
# parameters the built model has, so it is harmless for 4.x models with per-expert modules.
FALLBACK_FUSIONS = {
    "deepseek_v3": (
        Fusion("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")),
        Fusion("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",)),
    ),
}


def fusions_for(model_type: str | None) -> tuple[Fusion, ...]:
    """Expert fusions read from transformers' conversion mapping (MergeModulelist(0) [+ Concatenate(1)])."""
    if not model_type:
        return ()
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:  # transformers 4.x: no mapping to read; its models keep per-expert modules
        return FALLBACK_FUSIONS.get(model_type, ())
    fusions = []
    for conv in get_checkpoint_conversion_mapping(model_type) or ():
        if not isinstance(conv, WeightConverter) or len(conv.target_patterns) != 1:
            continue
        ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
        expected = [(MergeModulelist, 0)] + ([(Concatenate, 1)] if len(conv.source_patterns) > 1 else [])
        if ops != expected or not all(p.count("*") == 1 for p in conv.source_patterns):
            continue  # another transform: not a plain expert stack that can be served as views
        fusions.append(Fusion(conv.target_patterns[0], tuple(conv.source_patterns)))
    return tuple(fusions) or FALLBACK_FUSIONS.get(model_type, ())


def model_config(config: dict):
    """A transformers config object for a checkpoint's config.json, minus quantization (served weights are bf16)."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = values.pop("model_type", None)
    if not model_type:
        raise CheckpointError("config.json has no 'model_type'")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as exc:
        raise CheckpointError(f"config.json does not describe a model transformers can build: {exc}") from exc
