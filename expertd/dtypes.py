"""dtypes, named once: as the index writes them, as safetensors tags them, and which ones are FP8."""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"  # DeepSeek's block scale of an FP8 weight `NAME` is stored as `NAME_scale_inv`

# safetensors' dtype tags; the index writes the same dtypes as `str(torch.dtype)`
SAFETENSORS: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_TAGS = {dtype: tag for tag, dtype in SAFETENSORS.items()}
BY_NAME: dict[str, torch.dtype] = {str(dtype): dtype for dtype in SAFETENSORS.values()}

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # FP8 as checkpoints store it
DEQUANTIZED = torch.float8_e4m3fn  # what DeepSeek-V3 block scales (and the kernels) are for
E4M3_MAX = 448.0  # largest finite float8_e4m3fn

