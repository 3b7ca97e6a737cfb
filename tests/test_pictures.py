"""What a new user saw in the pictures: exact round trips on log axes, group order, and e5m2 block vs tensor."""

from __future__ import annotations

import numpy as np
import torch

from expertd.kernels import weight_dequant_reference
from expertd.tools import number_formats as F
from expertd.tools.inspect.groups import COMPONENTS, ErrorTable, GroupKey, group_rank
from expertd.tools.plotting import log_lines, pyplot


def test_exact_points_are_drawn_at_the_floor_and_named():
    plt = pyplot()
    fig, ax = plt.subplots()
    log_lines(ax, ["a", "b", "c"], {"bf16": [0.0, 0.0, 0.0], "mxfp4": [0.1, 0.2, 0.15]})
    labels = [line.get_label() for line in ax.get_lines()]
    assert "bf16: exact (0), drawn at the floor" in labels
    marker = next(line for line in ax.get_lines() if line.get_label().startswith("bf16: exact"))
    assert len(marker.get_xdata()) == 3 and min(marker.get_ydata()) > 0 and max(marker.get_ydata()) < 0.1
    assert ax.get_ylim()[0] < min(marker.get_ydata())  # inside the axis, not clipped
    plt.close(fig)


def test_groups_keep_one_order_in_tables_and_pictures():
    table = ErrorTable(["bf16"])
    for group in ["router", "attention", "forward input", "embeddings", "routed experts"]:
        table.add("bf16", [GroupKey("by_group", group), GroupKey("by_component", group)], F.FormatError(1.0, 2.0))
    summary = table.summary()
    want = sorted(["router", "attention", "forward input", "embeddings", "routed experts"], key=group_rank)
    assert list(summary["by_group"]["bf16"]) == want == list(summary["by_component"]["bf16"])
    assert want[:4] == [c for c in COMPONENTS if c in want]  # components first, as the plots draw them


def _e5m2_numpy(v: np.ndarray) -> np.ndarray:
    """e5m2 rounding written out: 2 mantissa bits, emin -14 (subnormals share its step), ties to even, saturating."""
    a = np.minimum(np.abs(v), 57344.0)
    e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -14)
    step = 2.0 ** (e - 2)
    return np.copysign(np.minimum(np.round(a / step) * step, 57344.0), v)


def _block_numpy(x: np.ndarray, b: int = 128) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(0, x.shape[0], b):
        for j in range(0, x.shape[1], b):
            t = x[i:i + b, j:j + b]
            s = np.abs(t).max() / 57344.0
            out[i:i + b, j:j + b] = _e5m2_numpy(t / s) * s
    return out


def test_e5m2_block_error_above_per_tensor_is_the_e4m3_grid_not_a_defect():
    gen = torch.Generator().manual_seed(0)
    # a weight as DeepSeek-V3 stores it: e4m3 values with one scale per 128x128 block (partial edge blocks)
    q = (torch.randn(200, 320, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen) * 1e-3 + 1e-4
    w = weight_dequant_reference(q, scale, 128, out_dtype=torch.float32)
    rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(x))  # noqa: E731
    x = w.double().numpy()
    block, tensor = F.FORMATS["fp8_e5m2_block128"](w).double().numpy(), F.FORMATS["fp8_e5m2_tensor"](w).double().numpy()
    assert abs(rel(x, block) - rel(x, _block_numpy(x))) < 1e-6  # the independent computation agrees: no defect
    assert rel(x, block) > rel(x, tensor)
    # why: a block's e5m2 scale maps it onto 128 x its e4m3 values, keeping 3 mantissa bits, so those with an
    # odd last bit sit exactly halfway between two e5m2 values
    tile = w[:128, :128]
    y = tile / (tile.abs().amax() / 57344.0)
    assert torch.allclose((y / 128).to(torch.float8_e4m3fn).float(), y / 128, rtol=1e-6, atol=0)
    frac = (y.abs() / torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=1e-30))) - 2)).frac()
    assert ((frac - 0.5).abs() < 1e-4).float().mean() > 0.3  # (up to the float32 rounding of the scale)
    g = torch.randn(512, 512, generator=gen)  # no e4m3 grid: block and tensor agree
    gb, gt = F.FORMATS["fp8_e5m2_block128"](g), F.FORMATS["fp8_e5m2_tensor"](g)
    assert abs(F.relative_error(g, gb) / F.relative_error(g, gt) - 1) < 0.02
