"""Which dtype `from_pretrained(dtype=...)` gives each tensor of a model, by the rules of the installed transformers.

The daemon serves every tensor in the dtype its transformers loads it as; a worker on another release
compares its own answer with what is served and asks the daemon for the difference (a dtype variant) rather
than copying. Both ask here. transformers is imported lazily.
"""

from __future__ import annotations

import re

import torch


SERVED_DTYPE = torch.bfloat16  # the dtype the daemon plans for: what `load_model()` asks `from_pretrained` for


def keep_in_fp32(model, dtype: torch.dtype) -> dict[str, str]:
    """Module-name patterns that `from_pretrained(dtype=dtype)` keeps in float32, each with the class attribute that
    asks for it (transformers 5.x `_get_dtype_plan`; 4.x applies the same two attributes itself)."""
    keep = {}
    if getattr(model, "_keep_in_fp32_modules", None) and dtype == torch.float16:
        keep.update(dict.fromkeys(model._keep_in_fp32_modules, "_keep_in_fp32_modules"))
    if getattr(model, "_keep_in_fp32_modules_strict", None) and dtype in (torch.float16, torch.bfloat16):
        keep.update(dict.fromkeys(model._keep_in_fp32_modules_strict, "_keep_in_fp32_modules_strict"))
    if hasattr(model, "_get_dtype_plan"):  # 5.x: its own plan decides which patterns apply
        keep = {p: keep.get(p, "_get_dtype_plan") for p, d in model._get_dtype_plan(dtype).items() if d == torch.float32}
    return keep


def _matcher(patterns):
    """What `from_pretrained` matches keep-in-fp32 patterns with: 5.x a glob alternation (`*` any run, searched),
    4.x each module name between dots or the name's ends (4.57's `keep_in_fp32_regex`), searched."""
    if not patterns:
        return None
    try:
        from transformers.core_model_loading import build_glob_alternation
    except ImportError:
        return re.compile("|".join(rf"((^|\.){p}($|\.))" for p in patterns))
    return build_glob_alternation(list(patterns))[0]


def loaded_dtypes(model, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype `from_pretrained(dtype=dtype)` gives each floating parameter and buffer of `model` (built with
    `dtype`): float32 where a keep-in-fp32 pattern matches its name, else the dtype the model created it with
    (both 4.57 and 5.x cast a loaded tensor to its empty parameter's dtype, so a module that makes its weight
    float32 itself keeps it)."""
    pattern = _matcher(keep_in_fp32(model, dtype))
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point():
            out[name] = torch.float32 if pattern is not None and pattern.search(name) else tensor.dtype
    return out


def dtype_reason(model, dtype: torch.dtype, name: str) -> str:
    """Why `from_pretrained(dtype=dtype)` gives `name` the dtype `loaded_dtypes` says, in words (for one log line)."""
    import transformers

    for pattern, attribute in keep_in_fp32(model, dtype).items():
        matcher = _matcher([pattern])
        if matcher.search(name):
            return f"transformers {transformers.__version__} {type(model).__name__}.{attribute} has {pattern!r}"
    want = loaded_dtypes(model, dtype).get(name, dtype)
    return (f"transformers {transformers.__version__} {type(model).__name__} loads it as {want} (no keep-in-fp32 "
            f"pattern matches it)")


def expected_dtypes(model, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """`loaded_dtypes` judged on a fresh skeleton of the model's class and config (on the meta device): what
    `from_pretrained(dtype=dtype)` would give, even for a model cast since it was built (`model.float()`)."""
    try:
        with torch.device("meta"):
            fresh = type(model)._from_config(model.config, dtype=dtype)
    except Exception:  # not a transformers model built from a config: judge the model itself
        return loaded_dtypes(model, dtype)
    return loaded_dtypes(fresh, dtype)
