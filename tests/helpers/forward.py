"""The one forward both sides of the model matrix run: the reference in the test process and the served model
in a worker process (which must not import server code: this imports torch only)."""

from __future__ import annotations

import torch


def forward_logits(model, input_ids) -> torch.Tensor:
    """The logits of one no-grad forward of `input_ids` (a list of rows), with a cache.

    `use_cache=True` lets the model build the cache its config calls for (transformers' DynamicCache holds
    a linear-attention layer for each of a hybrid's linear layers): every model then runs its cached path,
    which a hybrid needs, and the others run exactly as they do by default (their configs' use_cache is True).
    """
    with torch.no_grad():
        return model(torch.tensor(input_ids), use_cache=True).logits
