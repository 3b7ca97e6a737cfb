"""Everything that depends on the installed transformers version, in one place.

Server, tools and client build models, read expert fusions and ask for dtypes only through
here, so supporting another transformers version touches this module alone. transformers is
imported lazily so that importing expertd stays cheap.
"""

from __future__ import annotations

import contextlib
import re

import torch

from .errors import CheckpointError
from .fusion import Fusion

# Used only where transformers' conversion mapping cannot be read. A fusion applies only to
# parameters the built model has, so it is harmless for 4.x models with per-expert modules.
FALLBACK_FUSIONS = {
    "deepseek_v3": (
        Fusion("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")),
        Fusion("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",)),
    ),
}

# config.json names the weights' dtype `torch_dtype` (transformers 4.x) or `dtype` (5.x).
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")


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


def _no_init_weights():
    """transformers' switch that skips random init of weights about to be replaced (a no-op if absent)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def empty_model(config: dict, dtype: torch.dtype | None = None, *, meta: bool = False):
    """The causal-LM model a config.json describes, with no weight memory and no random init.

    `meta=True` puts everything (buffers too) on the meta device: enough to learn names and
    shapes. Otherwise the model is built under accelerate's `init_empty_weights` (parameters on
    meta, buffers real), ready to have shared views bound into it.
    """
    from transformers import AutoModelForCausalLM

    cfg = model_config(config)
    kwargs = {} if dtype is None else {"dtype": dtype}
    if meta:
        context = torch.device("meta")
    else:
        from accelerate import init_empty_weights

        context = init_empty_weights()
    try:
        with context, _no_init_weights():
            return AutoModelForCausalLM.from_config(cfg, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"config.json does not describe a model transformers can build: {exc}") from exc


def model_state(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter and persistent buffer of the model a config describes: name -> (shape, dtype)."""
    model = empty_model(config, meta=True)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _keep_in_fp32(model, dtype: torch.dtype) -> list[str]:
    """Module-name patterns that `from_pretrained(dtype=dtype)` keeps in float32."""
    if hasattr(model, "_get_dtype_plan"):  # transformers 5.x
        return list(model._get_dtype_plan(dtype))
    # transformers 4.x applies the same two class attributes itself
    keep = []
    if getattr(model, "_keep_in_fp32_modules", None) and dtype == torch.float16:
        keep += list(model._keep_in_fp32_modules)
    if getattr(model, "_keep_in_fp32_modules_strict", None) and dtype in (torch.float16, torch.bfloat16):
        keep += list(model._keep_in_fp32_modules_strict)
    return keep


def loaded_dtypes(model, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype `from_pretrained(dtype=dtype)` gives each floating parameter and buffer of `model`."""
    keep = _keep_in_fp32(model, dtype)
    pattern = re.compile("|".join(re.escape(p) for p in keep)) if keep else None
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point():
            out[name] = torch.float32 if pattern is not None and pattern.search(name) else dtype
    return out


def set_config_dtype(config: dict, dtype: str) -> dict:
    """`config` with its weights' dtype set under every key a transformers version reads."""
    return {**config, **dict.fromkeys(CONFIG_DTYPE_KEYS, dtype)}
