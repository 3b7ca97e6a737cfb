"""The experts in vLLM's own layout, once per host: found with vLLM's own ops, made by the daemon, mapped by all.

vLLM's CPU MoE kernel keeps its experts (`w13_weight`, `w2_weight`) padded and packed for the CPU's ISA, a layout
that does not depend on the values. So the layout is found by running the layer's own post-load step on probes,
one expert whose elements carry their own position in base-255 digits (exact in bf16), and reading where each
element went: a gather index (`expertd.derived`). The daemon gathers its served expert stack by that index into a
segment of the generation, once per host; every engine checks that the daemon's bytes equal its own post-load
result, then maps them instead. A layer whose layout is not such a gather (or whose probe fails) keeps vLLM's
private copy, said in one log line.
"""

from __future__ import annotations

import copy
import logging
import math
import re

import torch
from torch import nn

from expertd import derived

log = logging.getLogger("vllm.expertd")
BASE = 255  # digit d of a position is stored as d + 1 in 1..255 (0 marks padding); exact in bf16
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
REQUEST_BYTES = 768 << 10  # a variant request's items, under the daemon's message cap


def _layer(name: str) -> str | None:
    found = LAYER.search(name)
    return found.group(1) if found else None


def expert_sources(model: nn.Module, served: dict[str, torch.Tensor], feeds: dict[str, set[str]] | None = None
                   ) -> dict[str, tuple[str, torch.Tensor | None]]:
    """Before vLLM's post-load step: parameter name -> (served name, load index) for each stacked parameter (3 or
    more dimensions: experts) that is a served tensor of its layer as loaded (index None), or that the model's
    `load_weights` made from one served tensor (`feeds`) by a value-independent rearrangement within each expert
    (gpt-oss's transposed, interleaved gate/up): its gather index, found by loading probes (`load_layout`)."""
    by_layer: dict[tuple, list[str]] = {}
    for name, t in served.items():
        if t.dim() >= 3:
            by_layer.setdefault((_layer(name), tuple(t.shape), t.dtype), []).append(name)
    out = {}
    for name, param in model.named_parameters():
        if param.dim() < 3 or param.device.type != "cpu":
            continue
        for candidate in by_layer.get((_layer(name), tuple(param.shape), param.dtype), []):
            if torch.equal(param.data, served[candidate]):
                out[name] = (candidate, None)
                break
        else:
            fed = (feeds or {}).get(name) or set()
            feed = next(iter(fed)) if len(fed) == 1 else None
            source = served.get(feed) if feed is not None else None
            if source is not None and source.dtype == param.dtype and source.shape[0] == param.shape[0] \
                    and source.numel() == param.numel():
                index = load_layout(model, param, feed, source)
                if index is not None:
                    out[name] = (feed, index)
    return out


def load_layout(model: nn.Module, param: nn.Parameter, feed: str, source: torch.Tensor) -> torch.Tensor | None:
    """Where the model's `load_weights` puts each element of one expert of `source` in `param`'s expert (a gather
    index), found by loading probes under the served name `feed`; the loaded bytes are put back. None where the
    result is not such a rearrangement (checked again on the real bytes: `share_experts` compares)."""
    saved = param.data.clone()
    n = source[0].numel()
    found = Positions(padding=False)  # a load fills every element of the parameter
    try:
        for digit in range(digit_count(n)):
            probe_values = digits(torch.arange(n), digit, source.dtype).reshape(source[:1].shape)
            model.load_weights(iter([(feed, probe_values.expand(source.shape).contiguous())]))
            if found.add(param.data[0], digit) is not None:
                return None
    except (KeyError, AssertionError, RuntimeError, ValueError):
        return None
    finally:
        param.data.copy_(saved)
    index = found.result()
    return index if bool((index < n).all()) else None


def digit_count(n: int) -> int:
    """How many base-255 digits the positions 0 .. n-1 take (at least one)."""
    count = 1
    while BASE ** count < n:
        count += 1
    return count


def digits(positions: torch.Tensor, digit: int, dtype: torch.dtype) -> torch.Tensor:
    """Digit `digit` of each position, + 1: 1..255, exact in bf16 (0 is left for padding)."""
    return ((positions // BASE ** digit) % BASE + 1).to(dtype)


class Positions:
    """A gather index read back from probes, one digit at a time: each element of a probe's result holds the digit
    of the source position it came from, + 1, or 0 where none came (padding: -1 in the index)."""

    def __init__(self, padding: bool = True):
        self.padding = padding
        self.index: torch.Tensor | None = None
        self.pad: torch.Tensor | None = None

    def add(self, out: torch.Tensor, digit: int) -> str | None:
        """Take the result of the probe of `digit`; why it is not a rearrangement of the probe, or None."""
        out = out.detach().float().flatten()
        lowest = 0 if self.padding else 1
        if out.numel() == 0 or not torch.equal(out, out.round()) or float(out.min()) < lowest or float(out.max()) > BASE:
            return "changed the probe's values, not only their places"
        pad = out == 0
        if self.pad is not None and not torch.equal(self.pad, pad):
            return "padded differently from one probe to the next"
        self.pad = pad
        part = (out.to(torch.int64) - 1).clamp(min=0) * BASE ** digit
        self.index = part if self.index is None else self.index + part
        return None

    def result(self) -> torch.Tensor:
        """The index: source positions, -1 for padding."""
        self.index[self.pad] = -1
        return self.index


def probe(module: nn.Module, shapes: dict[str, tuple[int, ...]], loaded: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Gather indices (leaf name -> index into one expert) of the layout the post-load step of `module` gives the
    parameters `shapes` names; `loaded`: every parameter of the module as loaded (shape, dtype). Raises ValueError
    where the layout is not a gather."""
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if experts is None or not hasattr(experts, "process_weights_after_loading"):
        raise ValueError(f"{type(module).__name__} has no fused experts kernel with a post-load step")
    blocks = next(iter(shapes.values()))[0]
    found = {leaf: Positions() for leaf in shapes}
    for digit in range(digit_count(max(math.prod(s[1:]) for s in shapes.values()))):
        standin = nn.Module()
        for leaf, (shape, dtype) in loaded.items():
            one = (1, *shape[1:]) if shape and shape[0] == blocks else shape
            value = digits(torch.arange(math.prod(one)), digit, dtype).reshape(one) if leaf in shapes else \
                torch.zeros(one, dtype=dtype)
            standin.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        copy.copy(experts).process_weights_after_loading(standin)  # a copy: nothing of the real kernel changes
        for leaf in shapes:
            why = found[leaf].add(getattr(standin, leaf), digit)
            if why is not None:
                raise ValueError(f"{leaf}: the post-load step {why}")
    return {leaf: positions.result() for leaf, positions in found.items()}


def share_experts(model: nn.Module, client, sources: dict, loaded: dict[str, dict],
                  remember: dict | None = None) -> list[str]:
    """After vLLM's post-load step: map each expert parameter vLLM repacked onto the daemon's derived tensor of it
    (`sources`: `expert_sources`' result; `loaded`: module name -> its parameters as loaded (shape, dtype)).
    Returns the parameter names bound; `remember` gets, for each, the request that makes it (a refresh asks again
    on the new generation)."""
    modules = dict(model.named_modules())
    names = {id(m): name for name, m in modules.items()}
    by_module: dict[str, dict[str, tuple]] = {}
    for name, source in sources.items():
        owner, _, leaf = name.rpartition(".")
        by_module.setdefault(owner, {})[leaf] = source
    probed: dict[tuple, dict | None] = {}
    encoded: dict[bytes, tuple[bytes, int]] = {}
    wanted = []  # (module, leaf, item)
    for owner, leaves in by_module.items():
        module = modules[owner]
        shapes = {leaf: loaded[owner][leaf][0] for leaf in leaves}
        key = tuple(sorted((leaf, shape, loaded[owner][leaf][1]) for leaf, shape in shapes.items()))
        if key not in probed:
            try:
                probed[key] = probe(module, shapes, loaded[owner])
            except (ValueError, RuntimeError, TypeError, AttributeError) as exc:
                log.info("expertd: %s keeps vLLM's private layout of its experts (%s)", owner, exc)
                probed[key] = None
        if probed[key] is None:
            continue
        for leaf, (served_name, at_load) in leaves.items():
            index = probed[key][leaf]
            if at_load is not None:  # the load's own rearrangement first, then the post-load step's
                index = torch.where(index >= 0, at_load[index.clamp(min=0)], index)
            raw = index.to(torch.int32).numpy().tobytes()
            if raw not in encoded:
                encoded[raw] = (derived.encode(index), index.numel())
            deflated, length = encoded[raw]
            current = getattr(module, leaf)
            wanted.append((module, leaf, derived.request(served_name, deflated, length, tuple(current.shape))))
    bound = []
    for (module, leaf, item), view in zip(wanted, fetch(client, [item for _, _, item in wanted])):
        param = getattr(module, leaf)
        if param.shape == view.shape and param.dtype == view.dtype and torch.equal(param.data, view):
            param.data = view
            bound.append(f"{names[id(module)]}.{leaf}")
            if remember is not None:
                remember[bound[-1]] = item
        else:
            log.warning("expertd: the daemon's layout of %s differs from vLLM's: kept private", item["name"])
    return bound


def fetch(client, items: list[dict]) -> list[torch.Tensor]:
    """The daemon's derived tensors `items` asks for, in requests under the message cap."""
    views = []
    for batch in _batches(items):
        views.extend(client.derived(batch))
    return views


def _batches(items: list[dict]) -> list[list]:
    out, size = [[]], 0
    for entry in items:
        nbytes = len(entry[derived.GATHER]["index"]) + 512
        if out[-1] and size + nbytes > REQUEST_BYTES:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return [batch for batch in out if batch]
