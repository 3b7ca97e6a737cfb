"""Expert parallelism: which experts of each MoE layer a daemon serves, stored once and read everywhere.

With `expert_parallel: {size: N, ranks: [...]}` a daemon serves every dense tensor and, of each fused
expert parameter `[E, ...]`, only the experts of its EP ranks: rank r owns experts [r·E/N, (r+1)·E/N)
("linear" placement, as transformers' `Shard(0)` on the expert dimension). Its ranks' blocks are laid
back to back in one served tensor, in rank order, so each rank's `[E/N, ...]` block is a contiguous
view. The served entry carries an `ExpertBlock` (total experts and the served rows): planner, loader,
index, updates and the worker's binder read the geometry from it and never recompute it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ExpertdError, ProtocolError


class PartitionError(ExpertdError, ValueError):
    """An expert-parallel setting does not fit the model, the daemon or the worker (names both sides)."""


@dataclass(frozen=True)
class ExpertParallel:
    """The EP world size the workers use and the EP ranks whose workers attach to this daemon."""

    size: int
    ranks: tuple[int, ...]

    @classmethod
    def from_config(cls, value, where: str = "expert_parallel") -> "ExpertParallel":
        """Read the config's `expert_parallel: {size, ranks}` (ranks default to all of them)."""
        if not isinstance(value, dict) or set(value) - {"size", "ranks"} or "size" not in value:
            raise PartitionError(f"{where} must be a mapping with `size` (the EP world size) and optional `ranks`, "
                                 f"got {value!r}")
        size = value["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise PartitionError(f"{where}.size must be an integer >= 1, got {size!r}")
        ranks = value.get("ranks", list(range(size)))
        if (not isinstance(ranks, list) or not ranks
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
            raise PartitionError(f"{where}.ranks must be a non-empty list of EP ranks, got {ranks!r}")
        bad = [r for r in ranks if not 0 <= r < size]
        if bad:
            raise PartitionError(f"{where}.ranks {bad} out of range: ranks are 0 to {size - 1} for size {size}")
        if len(set(ranks)) != len(ranks):
            raise PartitionError(f"{where}.ranks {ranks} names a rank twice")
        return cls(size, tuple(sorted(ranks)))

    @property
    def whole(self) -> bool:
        """Every rank on this daemon: it serves every expert."""
        return len(self.ranks) == self.size

    def check_experts(self, experts: int, param: str) -> None:
        if experts % self.size:
            valid = [n for n in range(1, experts + 1) if experts % n == 0]
            raise PartitionError(f"expert_parallel.size {self.size} does not divide the {experts} experts of {param}; "
                                 f"valid sizes for this model: {', '.join(map(str, valid))}")

    def rows(self, experts: int) -> list[tuple[int, int]]:
        """(first expert, count) of each served rank's block, in rank order."""
        per = experts // self.size
        return [(r * per, per) for r in self.ranks]

    def block(self, experts: int, param: str) -> "ExpertBlock":
        """The experts of a stack of `experts` (parameter `param`) this partition serves; PartitionError when its
        size does not divide them."""
        self.check_experts(experts, param)
        return ExpertBlock(experts, tuple(self.rows(experts)))

    def serves(self, expert: int, experts: int) -> bool:
        return expert // (experts // self.size) in self.ranks

    def to_dict(self) -> dict:
        return {"size": self.size, "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, data) -> "ExpertParallel | None":
        if data is None:
            return None
        try:
            return cls.from_config(dict(data), "index expert_parallel")
        except (PartitionError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed expert_parallel in the tensor index: {exc}") from exc


def parse_ranks(text: str) -> list[int]:
    """EP ranks written as `0,1`, `0-3` (inclusive) or `0.1` (dots: what a Kubernetes label value may hold)."""
    text = text.strip()
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            ranks = list(range(lo, hi + 1))
        else:
            ranks = [int(x) for x in text.replace(".", ",").split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks:
        raise PartitionError(f"EP ranks {text!r}: write them as 0,1 or 0-3 (a range) or 0.1 (a label value)")
    return ranks


@dataclass(frozen=True)
class ExpertBlock:
    """The experts a served fused tensor holds: `total` in the model's parameter, and the served
    `rows` (first, count), laid back to back in this order along dim 0."""

    total: int
    rows: tuple[tuple[int, int], ...]  # on the wire and in status: `ranges`

    @property
    def count(self) -> int:
        return sum(count for _, count in self.rows)

    def experts(self) -> list[int]:
        """The global expert index of each row block along the served tensor's dim 0."""
        return [first + k for first, count in self.rows for k in range(count)]

    def rows_of(self, first: int, count: int) -> int | None:
        """Where experts [first, first + count) start along dim 0 of the served tensor; None unless all of them
        are served, back to back in that order."""
        held = self.experts()
        if first not in held:
            return None
        at = held.index(first)
        return at if held[at: at + count] == list(range(first, first + count)) else None

    def stack_rows(self, shape) -> tuple[tuple[int, int], ...] | None:
        """The rows of a stored expert stack that this block serves, as (first, count) runs in served order: a
        pre-fused weight [E, ...] or its aux (experts outermost, all `total` of them) is cut along dim 0 to the
        served rows. None for any other shape (no stack, or one already cut to a share): it cannot be cut by
        expert. The planner reads a stack's rows and a pushing client cuts a state dict by this one rule."""
        return self.rows if len(shape) and shape[0] == self.total else None

    def to_dict(self) -> dict:
        return {"total": self.total, "ranges": [list(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data) -> "ExpertBlock | None":
        if data is None:
            return None
        try:
            total, ranges = data["total"], tuple((int(a), int(b)) for a, b in data["ranges"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed expert block {data!r}: {exc}") from exc
        if not isinstance(total, int) or any(a < 0 or b < 1 or a + b > total for a, b in ranges):
            raise ProtocolError(f"malformed expert block {data!r}: ranges must lie within {total} experts")
        return cls(total, ranges)


def expert_sharded(config: dict):
    """Whether a parameter name is an expert stack that transformers' expert parallelism splits by expert: the
    model's `base_model_ep_plan` entries of style `grouped_gemm` (gpt-oss: `gate_up_proj`, its bias, ...)."""
    from expertd.hf import model_config

    plan = getattr(model_config(config), "base_model_ep_plan", None) or {}
    patterns = [re.compile(r"(?:^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$")
                for key, style in plan.items() if style == "grouped_gemm"]
    return lambda name: any(p.search(name) for p in patterns)


def fused_experts(name: str, shape) -> int:
    """How many experts a tensor stores fused along its outermost dimension ([E, R, C] under `.experts.`, as gpt-oss
    stores them), or 0: the planner reads such a stack expert by expert, and `expert_ranges` writes it so."""
    return shape[0] if len(shape) == 3 and ".experts." in name and shape[0] > 1 else 0
