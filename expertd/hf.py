"""Everything that depends on the installed transformers version, in one place.

Server, tools and client build models, read expert fusions and ask for dtypes only through
here, so supporting another transformers version touches this module alone. transformers is
imported lazily so that importing expertd stays cheap.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .fusion import Fusion
from .hf_dtypes import SERVED_DTYPE, loaded_dtypes

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


def _decode_floats(value):
    """transformers writes non-finite floats into config.json as {"__float__": "Infinity"}; its own loading decodes
    them."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def tied_aliases(model) -> dict[str, str]:
    """Parameters that are another parameter under a second name when the config ties them (tied
    embeddings): alias -> the name transformers loads. 5.x declares them as a dict, 4.x as a list of
    aliases of the input embeddings."""
    config = getattr(model, "config", None)  # a plain module (no transformers config) ties nothing
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    keys = getattr(model, "_tied_weights_keys", None)
    if not keys or not getattr(config, "tie_word_embeddings", False):
        return {}
    if isinstance(keys, dict):
        return dict(keys)
    embeddings = model.get_input_embeddings()
    target = next(n for n, m in model.named_modules() if m is embeddings) + ".weight"
    return {k: target for k in keys if k != target}


def model_config(config: dict):
    """A transformers config object for a checkpoint's config.json, minus quantization (served weights are bf16)."""
    from transformers import AutoConfig

    values = {k: _decode_floats(v) for k, v in config.items() if k != "quantization_config"}
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


@dataclass
class Assembly:
    """How one model parameter is built from checkpoint tensors, as transformers' own loading builds it.

    `sources` are checkpoint names in storage order; `patterns` (expert stacks only) the converter's
    source patterns, so part k is expert k // len(patterns), pattern k % len(patterns). A `converter`
    with any other op (transpose, chunk, interleave, ...) makes the parameter computed: `groups` holds
    its source names per source pattern in the order transformers collects them, and `layer` the name
    transformers converts under (its first target); the result is no view of the sources.
    """

    param: str
    sources: list[str]
    patterns: tuple[str, ...] = ()
    converter: object | None = None  # a transformers WeightConverter, for computed parameters only
    groups: dict[str, list[str]] | None = None
    layer: str | None = None

    @property
    def computed(self) -> bool:
        return self.converter is not None


class UnsupportedConversion(CheckpointError):
    """transformers' conversion for a tensor cannot be followed (e.g. expert indices not readable from the names)."""


def _expert_position(keys: list[str]) -> int | None:
    """Which dot-separated component of these checkpoint names is the expert index: the one numeric
    component they differ in (transformers' patterns are regexes, so the names decide, not the pattern)."""
    parts = [k.split(".") for k in keys]
    if len({len(p) for p in parts}) != 1:
        return None
    differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    if len(differ) == 1 and all(p[differ[0]].isdigit() for p in parts):
        return differ[0]
    numeric = [i for i, c in enumerate(parts[0]) if c.isdigit()]
    return numeric[-1] if len(parts) == 1 and numeric else None


def natural_key(part_key):
    """transformers' `dot_natural_key` (the order it collects checkpoint names in) taken one dot-separated
    part at a time, each part's key remembered: a checkpoint repeats a few dozen parts tens of thousands of
    times. The same keys, since `dot_natural_key` keys each part on its own."""
    known: dict[str, object] = {}

    def key(name: str) -> list:
        out = []
        for part in name.split("."):
            k = known.get(part)
            if k is None:
                k = known[part] = part_key(part)[0]
            out.append(k)
        return out

    return key


def checkpoint_assembly(config: dict, names) -> tuple[dict[str, Assembly], list[str], dict]:
    """Map checkpoint names onto the parameters of the model a config describes, the way transformers'
    own loading does (renames, prefix changes, expert stacks); returns ({param: Assembly}, unused names,
    {param or persistent buffer: (shape, the dtype `from_pretrained(dtype=SERVED_DTYPE)` gives it)}).

    transformers 5.x: its complete conversion mapping for the model (`get_model_conversion_mapping`).
    4.x has none: checkpoint names are parameter names there.
    """
    model = empty_model(config, SERVED_DTYPE, meta=True)
    meta = model.state_dict()
    tied = tied_aliases(model)  # served once, under the name transformers loads, unless the checkpoint has both
    present = set(names)
    loaded = loaded_dtypes(model, SERVED_DTYPE)
    state = {k: (tuple(v.shape), loaded.get(k, v.dtype)) for k, v in meta.items() if k not in tied or k in present}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate, MergeModulelist, WeightConverter, WeightRenaming, dot_natural_key, rename_source_key,
        )
    except ImportError:
        plan = {n: Assembly(n, [n]) for n in names if n in state}
        return plan, [n for n in names if n not in meta], state
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    plan: dict[str, Assembly] = {}
    stacks: dict[str, dict[str, list[str]]] = {}
    computed: dict[str, tuple] = {}  # layer name -> (converter, {pattern: keys})
    unused = []
    rename = _RenameCache(lambda key: rename_source_key(key, renamings, converters, model.base_model_prefix, meta),
                          meta)
    for key in sorted(names, key=natural_key(dot_natural_key)):
        renamed, pattern = rename(key)
        if renamed not in meta and key in meta:
            renamed, pattern = key, None
        if renamed not in meta:
            unused.append(key)
            continue
        if pattern is None:
            if renamed in plan:
                raise CheckpointError(f"both {plan[renamed].sources[0]!r} and {key!r} load into parameter {renamed!r}",
                                      tensor=key)
            plan[renamed] = Assembly(renamed, [key])
            continue
        conv = by_pattern[pattern]
        ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
        stack = [(MergeModulelist, 0)] + ([(Concatenate, 1)] if len(conv.source_patterns) > 1 else [])
        if ops != stack or len(conv.target_patterns) != 1:
            groups = computed.setdefault(renamed, (conv, {p: [] for p in conv.source_patterns}))[1]
            groups[pattern].append(key)  # names come in dot_natural_key order, as transformers collects them
            continue
        stacks.setdefault(renamed, {p: [] for p in conv.source_patterns})[pattern].append(key)
        plan[renamed] = Assembly(renamed, [], tuple(conv.source_patterns))
    for param, lists in stacks.items():
        plan[param].sources = _interleave(param, lists)
    for layer, (conv, groups) in computed.items():
        sources = [k for keys in groups.values() for k in keys]
        for param in _targets(layer, conv.target_patterns):
            if param in plan:
                raise CheckpointError(f"{param!r} is both loaded from {plan[param].sources} and converted from "
                                      f"{sources}", tensor=sources[0])
            plan[param] = Assembly(param, sources, tuple(conv.source_patterns), conv, groups, layer)
    return plan, unused, state


_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a name component that is a number: a layer or expert index


class _RenameCache:
    """transformers' `rename_source_key`, called once or twice per name shape instead of once per name.

    DeepSeek-V3 has ~46k checkpoint weights but a few dozen shapes of name ("model.layers.#.mlp.experts.#.
    gate_proj.weight", # a whole-component index); renaming each costs ~20-70 us. For a shape, a name with
    distinct indices tells where each index of the result comes from; a second name's real rename must
    agree with that prediction, on a name whose every index differs, before any prediction is used (else
    the shape is always renamed for real),
    and a predicted name that is not a parameter is renamed for real (an index past the model's layers,
    where transformers may decide differently).
    """

    def __init__(self, rename, meta):
        self.rename = rename
        self.meta = meta
        self.shapes: dict[str, tuple | bool | None] = {}  # shape -> (result template, index sources, pattern) or False
        self.checked: set[str] = set()

    def __call__(self, key: str):
        numbers = _INDEX.findall(key)
        shape = _INDEX.sub("#", key)
        rule = self.shapes.get(shape)
        if rule is None:  # not learned yet (or the names so far had equal indices)
            result = self.rename(key)
            if shape not in self.shapes or self.shapes[shape] is None:
                self.shapes[shape] = self._rule(numbers, *result)
            return result
        if rule is False:
            return self.rename(key)
        template, where, pattern, learned = rule
        predicted = template.format(*(numbers[i] for i in where))
        if predicted not in self.meta:
            return self.rename(key)
        if shape not in self.checked:
            result = self.rename(key)
            if result != (predicted, pattern):
                self.shapes[shape] = False  # this shape renames by its indices: no shortcut
            elif all(a != b for a, b in zip(numbers, learned)):
                self.checked.add(shape)  # confirmed on a name whose every index differs from the one it was learned on
            return result
        return predicted, pattern

    @staticmethod
    def _rule(numbers: list[str], renamed: str, pattern):
        if len(set(numbers)) != len(numbers) or "{" in renamed or "}" in renamed:
            return None  # ambiguous: learn from a later name
        where = []
        for n in _INDEX.findall(renamed):
            if n not in numbers:
                return False  # an index the name lacks: always rename for real
            where.append(numbers.index(n))
        return _INDEX.sub("{}", renamed), where, pattern, numbers


def _targets(layer: str, targets) -> list[str]:
    """Every parameter a converter fills: transformers renames to the first target pattern and puts each
    result under that name with the target swapped (the prefix and suffix around it kept)."""
    prefix, found, suffix = layer.partition(targets[0])
    if not found:
        return [layer]
    return [prefix + t + suffix for t in targets]


class _ParameterDtypes:
    """What a conversion op may ask of the model (5.24's Inkling2UnpadVocab: the parameter's dtype), no model built."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def get_parameter(self, name: str):
        return self


def convert(assembly: Assembly, collected: dict[str, list[torch.Tensor]], config,
            dtype: torch.dtype = SERVED_DTYPE) -> torch.Tensor:
    """A computed parameter from its source tensors ({source pattern: tensors in order}), by applying the
    converter's operations in order exactly as transformers' `WeightConverter.convert` does (an op that asks for
    the parameter's dtype is told `dtype`)."""
    conv = assembly.converter
    for op in conv.operations:
        collected = op.convert(collected, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                               full_layer_name=assembly.layer, model=_ParameterDtypes(dtype), config=config,
                               missing_keys=None)
    prefix, _, suffix = next((assembly.layer.partition(k) for k in collected if k in assembly.layer), ("", "", ""))
    results = {prefix + k + suffix: v for k, v in collected.items()}
    result = results.get(assembly.param)
    if isinstance(result, list) and len(result) == 1:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise CheckpointError(f"transformers' conversion {[type(op).__name__ for op in conv.operations]} gives no "
                              f"single tensor for {assembly.param!r} (it gives {sorted(results)})",
                              tensor=assembly.sources[0])
    return result


def expert_name(keys: list[str], e: int) -> str:
    """The checkpoint name expert `e` would have, from its siblings' names."""
    pos = _expert_position(keys)
    if pos is None:
        return f"expert {e} like {keys[0]!r}"
    parts = keys[0].split(".")
    parts[pos] = str(e)
    return ".".join(parts)


def _interleave(param: str, lists: dict[str, list[str]]) -> list[str]:
    """Expert e's parts in pattern order, e = 0, 1, ...: the storage order of MergeModulelist + Concatenate(1)."""
    from .errors import MissingTensorError

    by_index = {}
    for pattern, keys in lists.items():
        pos = _expert_position(keys)
        if pos is None:
            raise UnsupportedConversion(f"cannot tell the expert index in the names of {param!r}'s parts",
                                        tensor=keys[0])
        by_index[pattern] = {int(k.split(".")[pos]): k for k in keys}
    count = max(max(d) + 1 for d in by_index.values())
    out = []
    for e in range(count):
        for pattern, found in by_index.items():
            if e not in found:
                raise MissingTensorError(f"checkpoint lacks a tensor the model needs (expert {e} of parameter "
                                         f"{param!r})", tensor=expert_name(lists[pattern], e))
            out.append(found[e])
    return out
