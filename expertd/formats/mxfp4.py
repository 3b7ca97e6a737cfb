"""gpt-oss's MXFP4 experts: `NAME_blocks` (uint8 [..., R, G, 16]: two e2m1 codes a byte, 32 values a group) with
`NAME_scales` (uint8 e8m0 [..., R, G], bias 127), served as the bf16 `NAME` [..., G*32, R] that transformers' own
decoder makes (`integrations/mxfp4.py`), over `kernels.dequant_mxfp4`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ScaleError, ShapeError, UpdateRejected
from .codec import Codec, Decoding, Pieces


@dataclass(frozen=True)
class Mxfp4(Codec):
    """gpt-oss MXFP4 experts: `NAME_blocks` + `NAME_scales` served as bf16 `NAME` (see the module docstring)."""

    ignore: tuple[str, ...] = ()  # modules_to_not_convert

    method = "mxfp4"
    stored_suffix = "_blocks"  # the served `NAME` is decoded from `NAME_blocks` and `NAME_scales` and transposed:
    aux_suffix = "_scales"  # no part of it is stored as is
    GROUP = 32  # values per e8m0 scale
    BYTES = 16  # bytes per group (two e2m1 codes each)

    def scheme(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        return "mxfp4 e2m1, e8m0 scale per 32"

    def served_shape(self, blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, rows, groups, _ = blocks_shape
        return (*lead, groups * self.GROUP, rows)

    def describe(self) -> str:
        return "MXFP4 (gpt-oss: *_blocks e2m1 + *_scales e8m0, 32 per group)"

    def shape_of(self, name: str, info) -> tuple[int, ...]:
        return self.served_shape(info.shape) if self.quantized(name, info) else info.shape

    def quantized(self, name: str, info) -> bool:
        return info.name != name

    def decoding(self, name: str, info, aux) -> Decoding | None:
        if not self.quantized(name, info):
            return None
        if aux is None:
            raise ScaleError(f"MXFP4 blocks have no {self.aux_name(name)!r}; refusing to serve packed e2m1 codes",
                             file=info.file, tensor=info.name)
        if info.dtype != torch.uint8 or len(info.shape) < 3 or info.shape[-1] != self.BYTES:
            raise ShapeError(f"MXFP4 blocks must be uint8 [..., rows, groups, {self.BYTES}] ({self.GROUP} e2m1 "
                             f"values a group, two a byte); found {info.dtype} {list(info.shape)}",
                             file=info.file, tensor=info.name)
        if aux.dtype != torch.uint8 or aux.shape != info.shape[:-1]:
            raise ScaleError(f"MXFP4 scales must be uint8 {list(info.shape[:-1])} (one e8m0 a group of "
                             f"{info.name}); found {aux.dtype} {list(aux.shape)}", file=aux.file, tensor=aux.name)
        return Decoding(self, self.served_shape(info.shape), scheme=self.scheme(info.shape, aux.shape))

    def check_aux(self, tensors: dict) -> None:
        """Scales without their blocks: said so, not that the decoded tensor is missing."""
        for name, info in tensors.items():
            if name.endswith(self.aux_suffix) and not self.is_aux(name, tensors):
                blocks = name[: -len(self.aux_suffix)] + self.stored_suffix
                raise ScaleError(f"MXFP4 scales have no {blocks!r}", file=info.file, tensor=name)

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        if not stored.endswith(self.stored_suffix):
            return None
        shape, dtype = spec
        if aux is None:
            scales = stored[: -len(self.stored_suffix)] + self.aux_suffix
            raise UpdateRejected(f"MXFP4 blocks {stored!r} need their {scales!r} pushed with them")
        s_shape, s_dtype = aux_spec
        if (dtype != "torch.uint8" or len(shape) < 3 or shape[-1] != self.BYTES or s_dtype != "torch.uint8"
                or s_shape != shape[:-1] or list(self.served_shape(tuple(shape))) != want.shape
                or want.dtype != "torch.bfloat16"):
            raise UpdateRejected(
                f"MXFP4 {stored!r} {dtype} {shape} with {aux!r} {s_dtype} {s_shape} cannot make the served "
                f"{want.dtype} {want.shape}: blocks must be uint8 [..., rows, groups, {self.BYTES}] decoding to "
                f"[..., groups*32, rows], scales uint8 [..., rows, groups]")
        return Decoding(self, tuple(want.shape))

    # dequant entry points

    def dequant(self, out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, name: str, block,
                device: torch.device, threads: int | None = None) -> None:
        from expertd.kernels import dequant_mxfp4

        dequant_mxfp4(data, scales, out=out, name=name, device=device, threads=threads)

    def stream(self, pieces: Pieces, scales: torch.Tensor, *, name: str, shape: tuple[int, ...], block,
               dtype: torch.dtype, device: torch.device) -> None:
        """Decoded a matrix at a time (an expert: its blocks read whole, a quarter of its result's bytes), its
        [G*32, R] bf16 result placed about `pieces.chunk` bytes of rows (whole groups) at a time."""
        from expertd.kernels import dequant_mxfp4, dequant_mxfp4_groups

        *lead, rows, groups, width = shape
        matrices = math.prod(lead)
        per_matrix = rows * groups * width
        scales = scales.reshape(matrices, rows, groups)
        out_rows = groups * self.GROUP
        cuda = device.type == "cuda"
        step = groups if cuda else max(1, pieces.chunk // max(1, self.GROUP * rows * 2))
        for e in range(matrices):
            blocks = pieces.read(e * per_matrix, per_matrix).view(rows, groups, width)
            for g0 in range(0, groups, step):
                g1 = min(groups, g0 + step)
                offset, count = (e * out_rows + g0 * self.GROUP) * rows * 2, (g1 - g0) * self.GROUP
                with pieces.place(offset, count * rows * 2, torch.bfloat16, (count, rows)) as dst:
                    if cuda:
                        dst.copy_(dequant_mxfp4(blocks, scales[e], device=device)[g0 * self.GROUP: g1 * self.GROUP])
                    else:
                        dequant_mxfp4_groups(blocks, scales[e], g0, g1, dst, threads=1)

    def reference(self, data: torch.Tensor, scales: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
        from expertd.kernels import dequant_mxfp4_reference

        return dequant_mxfp4_reference(data, scales).to(dtype)
