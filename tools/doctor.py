"""`expertd doctor`: the dtype of every tensor at every stage, and every silent cast between stages.

A tensor passes through up to five dtypes: as stored in the checkpoint, as expertd serves it (FP8
with a scale becomes bf16, everything else keeps its stored dtype), as the daemon's index records
it, as the view over shared memory reads it, and as the restored model holds it. The model's dtype
is checked against what `from_pretrained(dtype=...)` would give (transformers keeps some modules,
such as DeepSeek-V3's `e_score_correction_bias`, in fp32). A disagreement is a finding:

- error: the stages are inconsistent (the index disagrees with the checkpoint or with shared memory,
  the model holds another dtype than from_pretrained would give, FP8 bytes served unscaled, a
  parameter still on the meta device). `expertd doctor` exits 1.
  A model tensor that is not in the daemon's read-only shared memory (a private copy) is an error too:
  `expertd doctor --load-model` exits 1 naming each one and why.
- warning: a cast that works but costs something (a stored fp32 tensor rounded to bf16 once at build, as
  from_pretrained rounds it; served in another dtype than the model needs, so workers map the daemon's
  dtype cast, cast once per host). Exit 1 with --strict.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import torch

from expertd.errors import CheckpointError, ShmError
from expertd.quantization import ScaledFp8, quantization_format

from expertd.server.load.layout import plan_checkpoint
from expertd.server.load.checkpoint import Checkpoint

log = logging.getLogger("expertd.doctor")

STAGES = ("checkpoint", "served", "index", "shm", "model")


def _itemsize(name: str) -> int:
    return getattr(torch, name).itemsize


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """'bfloat16' for torch.bfloat16 or 'torch.bfloat16'."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass
class Row:
    """One served tensor (a model parameter name, or a checkpoint name the model does not use)."""

    name: str
    checkpoint: str | None = None  # stored dtype(s), "+scale" for scaled FP8
    served: str | None = None  # what expertd serves from that checkpoint
    index: str | None = None
    shm: str | None = None
    model: str | None = None
    expected: str | None = None  # what from_pretrained(dtype=...) gives this parameter
    shared: bool | None = None  # the model's tensor lies in the daemon's shared memory


@dataclass
class Finding:
    severity: str  # "error" | "warning"
    kind: str
    name: str
    message: str


@dataclass
class DoctorReport:
    sources: dict[str, str]
    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def exit_code(self, strict: bool = False) -> int:
        return 1 if self.errors or (strict and self.warnings) else 0

    @property
    def shared_memory(self) -> dict[str, int] | None:
        """How many of the model's tensors lie in the daemon's shared memory ("shared") and how many do not
        ("private"); None without both a model and a daemon."""
        found = [r.shared for r in self.rows if r.shared is not None]
        return {"shared": sum(found), "private": len(found) - sum(found)} if found else None

    def to_dict(self) -> dict:
        return {"sources": self.sources, "ok": not self.errors, "shared_memory": self.shared_memory,
                "rows": [asdict(r) for r in self.rows], "findings": [asdict(f) for f in self.findings]}

    def text(self, per_kind: int = 10) -> str:
        """Dtype paths with their tensor counts, then the findings grouped by kind."""
        lines = [f"expertd doctor: {', '.join(f'{k} {v}' for k, v in self.sources.items())}"]
        stages = [s for s in STAGES if any(getattr(r, s) is not None for r in self.rows)]
        paths = Counter(tuple(getattr(r, s) or "-" for s in stages) + (r.expected or "-",) for r in self.rows)
        table = [(" -> ".join(stages) + " (from_pretrained gives)", "tensors")]
        table += [(f"{' -> '.join(p[:-1])} ({p[-1]})", str(n)) for p, n in sorted(paths.items(), key=lambda kv: -kv[1])]
        width = max(len(a) for a, _ in table)
        lines.append("")
        lines.extend(f"  {a:<{width}}  {b:>7}" for a, b in table)
        if self.shared_memory is not None:
            shared, private = self.shared_memory["shared"], self.shared_memory["private"]
            lines.append(f"\nmodel tensors in the daemon's shared memory: {shared} of {shared + private}"
                         f" ({private} not)")
        by_kind: dict[tuple[str, str], list[Finding]] = defaultdict(list)
        for f in self.findings:
            by_kind[(f.severity, f.kind)].append(f)
        for (severity, kind), found in sorted(by_kind.items()):
            lines.append(f"\n{severity.upper()} {kind}: {len(found)} tensor(s)")
            lines.extend(f"  {f.name}: {f.message}" for f in found[:per_kind])
            if len(found) > per_kind:
                lines.append(f"  ... and {len(found) - per_kind} more")
        lines.append(f"\n{len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join(lines)


class Doctor:
    """Collects rows by name from each stage, then compares them."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.rows: dict[str, Row] = {}
        self.findings: list[Finding] = []
        self.sources: dict[str, str] = {}
        self.shm_dir: str | None = None  # the daemon's segments' folder, once attached

    def row(self, name: str) -> Row:
        if name not in self.rows:
            self.rows[name] = Row(name)
        return self.rows[name]

    def find(self, severity: str, kind: str, name: str, message: str) -> None:
        self.findings.append(Finding(severity, kind, name, message))

    # --- stages ----------------------------------------------------------------------------

    def add_checkpoint(self, folder: str) -> dict:
        """Stored and served dtypes per served tensor; a checkpoint the daemon would refuse is an error."""
        ckpt = Checkpoint.open(folder)
        self.sources["checkpoint"] = ckpt.folder
        try:
            plan = plan_checkpoint(ckpt)
        except CheckpointError as exc:
            self.find("error", "checkpoint-invalid", exc.tensor or ckpt.folder,
                      f"{type(exc).__name__}: {exc} (the daemon would refuse this checkpoint)")
            plan = None
        finally:
            ckpt.close()
        if plan is None:  # stored dtypes only, by checkpoint name (in the checkpoint's format where it is served)
            try:
                codec = quantization_format(ckpt.config)
            except CheckpointError:
                codec = ScaledFp8(None)
            for name, (stored, aux) in codec.logical(ckpt.tensors).items():
                info = ckpt.tensors[stored]
                scaled = aux is not None and codec.quantized(name, info)
                self.row(name).checkpoint = dtype_name(info.dtype) + ("+scale" if scaled else "")
            return ckpt.config
        for t in plan.tensors:
            stored = sorted({dtype_name(s.info.dtype) + ("+scale" if s.scale is not None else "") for s in t.sources})
            row = self.row(t.name)
            row.checkpoint = "|".join(stored)
            row.served = dtype_name(t.dtype)
        return ckpt.config

    def add_daemon(self, client) -> dict:
        """The daemon's index dtype and the dtype of the view over shared memory, per served tensor."""
        index = client.index()
        self.sources["daemon"] = f"{client.endpoint} (generation {index.generation})"
        try:
            views = client.served_tensors()
        except ShmError as exc:
            self.find("error", "shm-unreadable", client.endpoint, str(exc))
            views = {}
        self.shm_dir = index.shm_dir
        for entry in index.tensors:
            row = self.row(entry.name)
            row.index = dtype_name(entry.dtype)
            view = views.get(entry.name)
            row.shm = dtype_name(view.dtype) if view is not None else None
        return index.config

    def add_model(self, model) -> None:
        """The dtype each parameter and buffer of `model` holds, and what from_pretrained would give it."""
        from expertd.hf_dtypes import expected_dtypes, loaded_tensors

        self.sources["model"] = (f"{type(model).__name__} (expected dtypes of "
                                 f"from_pretrained(dtype={dtype_name(self.dtype)}))")
        want = expected_dtypes(model, self.dtype)
        private = None
        if self.shm_dir is not None:  # with a daemon: what lies in its read-only shared memory (derived too)
            from expertd.client.residency import private_tensors

            private = set(private_tensors(model, self.shm_dir))
        for name, tensor in loaded_tensors(model).items():
            if not tensor.is_floating_point():
                continue
            row = self.row(name)
            row.model = dtype_name(tensor.dtype)
            row.expected = dtype_name(want.get(name))
            if tensor.device.type == "meta":
                self.find("error", "model-meta", name, "still on the meta device: no weights were bound to it")
            if private is not None and tensor.device.type == "cpu":
                row.shared = name not in private

    def add_expected(self, config: dict) -> None:
        """Without a model: what from_pretrained(dtype=...) would give each parameter of the config's model."""
        from expertd.hf import empty_model
        from expertd.hf_dtypes import loaded_dtypes

        model = empty_model(config, self.dtype)
        for name, dtype in loaded_dtypes(model, self.dtype).items():
            self.row(name).expected = dtype_name(dtype)

    # --- comparison ------------------------------------------------------------------------

    def compare(self) -> DoctorReport:
        for row in self.rows.values():
            self._compare(row)
        rows = sorted(self.rows.values(), key=lambda r: r.name)
        return DoctorReport(self.sources, rows, self.findings)

    def _compare(self, r: Row) -> None:
        if r.checkpoint and r.checkpoint.startswith("float8") and "+scale" not in r.checkpoint:
            self.find("error", "fp8-unscaled", r.name, f"stored as {r.checkpoint} without its scale")
        # (a model's tensor: its release's dtype)
        if r.served and r.index and r.served != r.index and r.expected is None:
            self.find("error", "index-vs-checkpoint", r.name,
                      f"the daemon's index says {r.index}, the checkpoint ({r.checkpoint}) is served as {r.served}: "
                      "the daemon serves another checkpoint or casts silently")
        if r.index and r.shm and r.index != r.shm:
            self.find("error", "shm-vs-index", r.name,
                      f"the view over shared memory reads {r.shm}, the index says {r.index}")
        if r.index and r.index.startswith("float8") and r.expected and not r.expected.startswith("float8"):
            self.find("error", "fp8-unscaled", r.name,
                      f"the daemon serves {r.index} bytes, the model needs {r.expected}")
        upstream = r.shm or r.index or r.served
        target = r.model or r.expected
        if r.model is not None and r.expected is not None and r.model != r.expected:
            self.find("error", "model-vs-expected", r.name,
                      f"the model holds {r.model}, from_pretrained(dtype={dtype_name(self.dtype)}) gives {r.expected}"
                      + (f"; served as {upstream}" if upstream else ""))
        elif r.shared is False and r.index:
            why = (f"served as {upstream}, the model holds {r.model}: no dtype cast was mapped (a daemon that makes "
                   "none?)" if upstream != r.model else f"the model's {r.model} tensor is a copy of the shared view")
            self.find("error", "private-copy", r.name, f"a private copy, not the daemon's shared memory ({why})")
        elif r.model is None and upstream and target and upstream != target and not upstream.startswith("float8"):
            self.find("warning", "cast-needed", r.name, f"served as {upstream}, from_pretrained(dtype="
                      f"{dtype_name(self.dtype)}) gives {target}: workers map the daemon's dtype cast (cast once "
                      "per host)")
        if r.checkpoint and r.served and "+scale" not in r.checkpoint and "|" not in r.checkpoint and \
                _itemsize(r.checkpoint) > _itemsize(r.served):
            self.find("warning", "cast-at-build", r.name, f"stored as {r.checkpoint}, served as {r.served} (what "
                      f"from_pretrained(dtype={dtype_name(self.dtype)}) gives it): rounded once at build")
        if r.index is None and r.served is None and r.model is not None and "daemon" in self.sources:
            self.find("error", "missing-in-index", r.name,
                      "the model has this tensor, the daemon serves nothing for it")


def diagnose(checkpoint: str | None = None, client=None, model=None,
             dtype: torch.dtype = torch.bfloat16) -> DoctorReport:
    """Compare dtypes across a checkpoint folder, a daemon (an `ExpertClient`) and/or a model."""
    if checkpoint is None and client is None and model is None:
        raise ValueError("diagnose needs a checkpoint, a daemon client or a model")
    doctor = Doctor(dtype)
    config = None
    if checkpoint is not None:
        config = doctor.add_checkpoint(checkpoint)
    if client is not None:
        config = doctor.add_daemon(client)
    if model is not None:
        doctor.add_model(model)
    elif config is not None:
        doctor.add_expected(config)
    return doctor.compare()
