"""What an engine fuses from several served tensors (vLLM: q/k/v into `qkv_proj`, a dense MLP's gate/up, their
biases) or pads (the vocabulary), once per host, where the engine uses the result as a parameter.

Found like the experts' layout (`experts`): the model's own `load_weights` is run on probes of the feeding tensors,
each element carrying its position in their concatenation in base-255 digits, and where each landed in the
parameter (zero where none did: padding) is a gather index over the concatenated sources. The daemon makes the
bytes from its served ones (`derived tensor` with `gather` and `also`); the engine maps them after checking they equal
its own. Parameters a kernel repacked into a handle (oneDNN's linear layers on AVX-512: the parameter is emptied) have
nothing left to bind and keep that private copy.
"""

from __future__ import annotations

import torch
from torch import nn

from expertd import derived
from expertd.shm import same_bytes

from .experts import fetch_refusable
from .probes import Positions, digit_count, digits
from .state import EngineState


def candidates(model: nn.Module, served: dict[str, torch.Tensor], feeds: dict[str, set[str]], loaded: dict,
               done: set[str]) -> dict[str, list[str]]:
    """Parameter name -> the served tensors (in order) it is fused or padded from, for parameters the engine still
    uses as loaded: not stacked experts, not emptied or replaced by the post-load step, not bound already."""
    out = {}
    for name, param in model.named_parameters():
        fed = sorted(feeds.get(name) or ())
        if (name in done or param.dim() > 2 or param.numel() == 0 or param.device.type != "cpu" or not fed
                or name not in loaded or loaded[name][1:] != (tuple(param.shape), param.dtype)):
            continue
        if any(f not in served or served[f].dtype != param.dtype for f in fed):
            continue
        if len(fed) == 1 and served[fed[0]].numel() == param.numel():
            continue  # one tensor of the same size: bound as served, or not a rearrangement
        out[name] = fed
    return out


def layout(model: nn.Module, name: str, order: list[str], served: dict[str, torch.Tensor], feeds: dict) -> \
        torch.Tensor | None:
    """Where the model's `load_weights` puts each element of `order`'s concatenation in parameter `name` (-1: none),
    found with probes; every parameter those tensors feed gets its bytes back. None if not such a gather."""
    params = dict(model.named_parameters())
    touched = [n for n, fed in feeds.items() if n in params and fed & set(order)]
    if any(params[n].numel() == 0 for n in touched):
        return None  # a parameter a kernel emptied would take the probes: leave it alone
    saved = {n: params[n].data.clone() for n in touched}
    sizes = [served[f].numel() for f in order]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    total = sum(sizes)
    param, found = params[name], Positions()
    try:
        for digit in range(digit_count(total)):
            param.data.zero_()  # what no probe element reaches reads 0: padding
            probes = [(f, digits(torch.arange(n) + off, digit, param.dtype).reshape(served[f].shape))
                      for f, n, off in zip(order, sizes, offsets)]
            model.load_weights(iter(probes))
            if found.add(param.data, digit) is not None:
                return None
    except (KeyError, AssertionError, RuntimeError, ValueError, TypeError):
        return None
    finally:
        for n, data in saved.items():
            params[n].data.copy_(data)
    index = found.result()
    return index if bool((index < total).all()) else None


def share_fused(model: nn.Module, state: EngineState, only: set[str] | None = None) -> list[str]:
    """Map each fused or padded parameter the engine uses as loaded (of `only`, if given) onto the daemon's derived
    tensor of it (checked equal first); returns the names bound, `state.derived` gets the request of each (a
    refresh asks again)."""
    feeds, remember = state.feeds, state.derived
    served = state.served()
    params = dict(model.named_parameters())
    wanted = []
    for name, order in candidates(model, served, feeds, state.params, set(remember)).items():
        if only is not None and name not in only:
            continue
        index = layout(model, name, order, served, feeds)
        if index is None:
            state.log.info("expertd: %s keeps the engine's private copy (its layout is not a gather of %s)", name,
                           order)
            continue
        wanted.append((name, derived.request(order[0], derived.encode(index), index.numel(),
                                             tuple(params[name].shape), also=order[1:], whole=True)))
    bound = []
    for (name, item), view in zip(wanted, fetch_refusable(state, [item for _, item in wanted], "fused or padded")):
        param = params[name]
        if same_bytes(param.data, view):
            param.data = view
            bound.append(name)
            remember[name] = item
        else:
            state.log.warning("expertd: the daemon's fused %s differs from the engine's: kept private", name)
            state.refused.append(name)
    return bound
