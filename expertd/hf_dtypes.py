"""Which dtype `from_pretrained(dtype=...)` gives each tensor of a model, by the rules of the installed transformers.

The daemon serves every tensor in the dtype its transformers loads it as; a worker on another release
compares its own answer with what is served and asks the daemon for the difference (a dtype cast) rather
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
        keep = {p: keep.get(p, "_get_dtype_plan")
                for p, d in model._get_dtype_plan(dtype).items() if d == torch.float32}
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


def loaded_tensors(model) -> dict[str, torch.Tensor]:
    """What `from_pretrained` loads into a model: its parameters (a tied one once) and its persistent buffers, by
    name. Non-persistent buffers (rotary `inv_freq`) are computed at init and never loaded or served."""
    out = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def loaded_dtypes(model, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype `from_pretrained(dtype=dtype)` gives each floating tensor it loads into `model` (built with `dtype`):
    float32 where a keep-in-fp32 pattern matches its name, else the dtype the model created it with (both 4.57 and
    5.x cast a loaded tensor to its empty parameter's dtype, so a module that makes its weight float32 itself
    keeps it)."""
    pattern = _matcher(keep_in_fp32(model, dtype))
    return {name: torch.float32 if pattern is not None and pattern.search(name) else tensor.dtype
            for name, tensor in loaded_tensors(model).items() if tensor.is_floating_point()}


def dtype_reason(model, dtype: torch.dtype, name: str, want: torch.dtype) -> str:
    """Why `from_pretrained(dtype=dtype)` gives `name` the dtype `want` (what `loaded_dtypes` says), in words."""
    import transformers

    for pattern, attribute in keep_in_fp32(model, dtype).items():
        if _matcher([pattern]).search(name):
            return f"transformers {transformers.__version__} {type(model).__name__}.{attribute} has {pattern!r}"
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
