"""Capture what flows through a transformers model: forward inputs/outputs and backward gradients.

    from expertd.tools.capture import capture

    with capture(model, "/tmp/acts", modules=["*.self_attn", "*.o_proj"], steps=[1, 2]):
        loss = model(ids, labels=ids).loss
        loss.backward()

Every `nn.Linear` and every attention module (a class named `*Attention`, or a module named
`self_attn`/`attn`/`attention`) whose qualified name matches one of the globs is hooked. A step is
one forward call of the root model, counted from 1. Each (step, module, direction, tensor) becomes
one safetensors file, e.g. `000001_L03_self_attn_forward_output.safetensors`, holding every tensor of
that kind (`args.0`, keyword names such as `hidden_states`, `output.0`, ...) and self-describing
metadata; `manifest.json` lists them all.

Gradients are caught with tensor hooks rather than `register_full_backward_hook`, which only sees
positional inputs: transformers calls attention modules with keyword arguments. Each input that
requires grad is replaced, for the module only, by an identity view of itself, so the gradient that
reaches the view is exactly the module's grad-input (not the sum over every consumer of the tensor).

With `EXPERTD_CAPTURE_DIR` set, `ExpertClient.load_model()` captures without code changes into
`$EXPERTD_CAPTURE_DIR/pid<PID>[-<n>]` (one folder per worker process); `EXPERTD_CAPTURE_MODULES`
(comma-separated globs), `EXPERTD_CAPTURE_STEPS` (e.g. `1-3,10`), `EXPERTD_CAPTURE_DIRECTIONS`
(`forward`, `backward` or both) and `EXPERTD_CAPTURE_MAX_BYTES` (e.g. `2GB`) narrow it down.
`encoding="hif8"` stores floating tensors as HiFloat8 byte codes (`expertd.tools.hif8`; inspect decodes them).

`attention_probs=True` also saves each attention module's per-head probabilities [batch, heads, query,
key] (`..._forward_attention_probs.safetensors`, tensor `probs`): the model runs eager attention while
the capture is open (SDPA and flash kernels never materialize them). When the model runs under
`expertd.tools.simulate`, the manifest records the simulation and the files of simulated modules
carry its tag (`..._forward_input_sim-w-mxfp4_e2m1.a-hif8.safetensors`).
"""

from __future__ import annotations

import atexit
import fnmatch
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import save_file
from torch import nn

from expertd.index import write_json_atomic
from expertd.units import parse_size, parse_steps

from .hif8 import hif8_encode

from .capture_manifest import FORMAT, MANIFEST, VERSION
from .simulate import simulation_info, simulation_tag

log = logging.getLogger("expertd.capture")

DIRECTIONS = ("forward", "backward")
ATTENTION_NAMES = ("self_attn", "attn", "attention", "cross_attn", "encoder_attn")
_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def is_attention(name: str, module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") or name.rsplit(".", 1)[-1] in ATTENTION_NAMES


def split_layer(name: str) -> tuple[int | None, str]:
    """('model.layers.3.self_attn') -> (3, 'self_attn'); names outside a layer stack keep their full name."""
    match = _LAYER_RE.search(name)
    if match is None:
        return None, name
    return int(match.group(1)), name[match.end():]


@dataclass
class CaptureFile:
    """One file of a capture, as listed in the manifest."""

    file: str
    step: int
    layer: int | None
    module: str
    module_type: str
    kind: str  # "linear" | "attention"
    direction: str  # "forward" | "backward"
    tensor: str  # "input" | "output" | "grad_input" | "grad_output" | "attention_probs"
    call: int
    nbytes: int
    tensors: dict[str, dict] = field(default_factory=dict)  # key -> {"dtype", "shape"}
    simulated: str | None = None  # the simulation's tag when the module ran simulated formats
    encoding: str | None = None  # "hif8": floating tensors stored as uint8 HiFloat8 codes (expertd.tools.hif8)


@dataclass
class _Call:
    """One call of a hooked module; its gradients are gathered here until all have arrived."""

    name: str
    module: nn.Module
    kind: str
    step: int
    call: int
    expected: dict[str, int] = field(default_factory=dict)  # "grad_input"/"grad_output" -> how many
    grads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(len(self.grads.get(k, ())) == n for k, n in self.expected.items())


def _flatten(obj, prefix: str):
    """(key, tensor) for every tensor in nested tuples, lists and dicts (ModelOutputs are dicts)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _flatten(item, f"{prefix}.{i}")
    elif isinstance(obj, dict):
        for k, item in obj.items():
            yield from _flatten(item, f"{prefix}.{k}")


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and t.is_floating_point() and torch.is_grad_enabled()


class Capture:
    """Hooks on a model's linear and attention modules; `close()` (or leaving `with`) removes them."""

    def __init__(self, model: nn.Module, out_dir: str, modules=None, steps=None, directions=None,
                 max_bytes: int | None = None, attention_probs: bool = False, encoding: str | None = None):
        self.model = model
        self.out_dir = os.path.abspath(out_dir)
        self.patterns = [modules] if isinstance(modules, str) else list(modules or ["*"])
        self.steps = set(parse_steps(steps)) if isinstance(steps, str) else (None if steps is None else set(steps))
        directions = [directions] if isinstance(directions, str) else list(directions or DIRECTIONS)
        unknown = sorted(set(directions) - set(DIRECTIONS))
        if unknown:
            raise ValueError(f"unknown capture direction(s) {unknown}; expected some of {list(DIRECTIONS)}")
        self.directions = tuple(directions)
        self.max_bytes = max_bytes
        if encoding not in (None, "hif8"):
            raise ValueError(f"unknown capture encoding {encoding!r}; expected None or 'hif8'")
        self.encoding = encoding
        self.attention_probs = attention_probs
        self._attn_impl = None
        if attention_probs:  # eager attention for the pass: the only one that computes the probabilities
            self._attn_impl = getattr(model.config, "_attn_implementation", None)
            _set_attn_implementation(model, "eager")
        self.step = 0
        self.files: list[CaptureFile] = []
        self.nbytes = 0
        self.skipped = 0
        self._calls: dict[tuple[int, str], int] = {}
        self._open: dict[str, list[_Call]] = {}
        self._pending: list[_Call] = []
        self._lock = threading.RLock()
        self._handles = []
        self._closed = False
        os.makedirs(self.out_dir, exist_ok=True)
        self.hooked = self._install()
        if not self.hooked:
            log.warning("capture: no linear or attention module matches %s", self.patterns)

    # --- hooks ------------------------------------------------------------------------------

    def _install(self) -> list[str]:
        self._handles.append(self.model.register_forward_pre_hook(self._on_step))
        hooked = []
        for name, module in self.model.named_modules():
            kind = "linear" if isinstance(module, nn.Linear) else "attention" if is_attention(name, module) else None
            if kind is None or not name or not any(fnmatch.fnmatchcase(name, p) for p in self.patterns):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name, kind), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name, kind), with_kwargs=True))
            hooked.append(name)
        return hooked

    def _on_step(self, module, args) -> None:
        with self._lock:
            if self.step:
                self.write_manifest()
            self.step += 1

    def _active(self) -> bool:
        return self.step > 0 and (self.steps is None or self.step in self.steps)

    def _pre_hook(self, name: str, kind: str):
        def hook(module, args, kwargs):
            if not self._active():
                return None
            with self._lock:
                call = self._calls.get((self.step, name), 0)
                self._calls[(self.step, name)] = call + 1
                record = _Call(name, module, kind, self.step, call)
                self._open.setdefault(name, []).append(record)
                if "forward" in self.directions:
                    inputs = list(_flatten(args, "args")) + list(_flatten(kwargs, ""))
                    self._save(record, "forward", "input", {k.lstrip("."): t for k, t in inputs})
            if "backward" not in self.directions:
                return None
            tapped = 0

            def tap(key: str, t: torch.Tensor) -> torch.Tensor:
                nonlocal tapped
                if not _needs_grad(t):
                    return t
                tapped += 1
                view = t.view_as(t)
                view.register_hook(self._grad_hook(record, "grad_input", key))
                return view

            args = tuple(tap(f"args.{i}", a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
            kwargs = {k: tap(k, v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            record.expected["grad_input"] = tapped
            return args, kwargs

        return hook

    def _post_hook(self, name: str, kind: str):
        def hook(module, args, kwargs, output):
            stack = self._open.get(name)
            if not stack or not self._active():
                return None
            record = stack.pop()
            with self._lock:
                if "forward" in self.directions:
                    self._save(record, "forward", "output", dict(_flatten(output, "output")))
                probs = output[1] if kind == "attention" and isinstance(output, tuple) and len(output) > 1 else None
                if self.attention_probs and isinstance(probs, torch.Tensor) and probs.dim() == 4:
                    self._save(record, "forward", "attention_probs", {"probs": probs})
            if "backward" in self.directions:
                outs = [(k, t) for k, t in _flatten(output, "output") if _needs_grad(t)]
                record.expected["grad_output"] = len(outs)
                for key, t in outs:
                    t.register_hook(self._grad_hook(record, "grad_output", key))
                if not record.complete:
                    with self._lock:
                        self._pending.append(record)
            return None

        return hook

    def _grad_hook(self, record: _Call, tensor: str, key: str):
        def hook(grad: torch.Tensor):
            with self._lock:
                got = record.grads.setdefault(tensor, {})
                got[key] = grad
                if len(got) == record.expected.get(tensor):
                    self._save(record, "backward", tensor, got)
                    record.grads[tensor] = dict.fromkeys(got)  # saved: keep the count, drop the tensors
                if record.complete and record in self._pending:
                    self._pending.remove(record)
            return None

        return hook

    # --- files ------------------------------------------------------------------------------

    def _save(self, record: _Call, direction: str, tensor: str, tensors: dict[str, torch.Tensor | None]) -> None:
        present = {k: t for k, t in tensors.items() if t is not None}
        if not present:
            return
        packed = lambda t: self.encoding is not None and t.is_floating_point()  # noqa: E731
        nbytes = sum(t.numel() * (1 if packed(t) else t.element_size()) for t in present.values())
        if self.max_bytes is not None and self.nbytes + nbytes > self.max_bytes:  # checked before any copy
            if not self.skipped:
                log.warning("capture: byte budget of %d reached; further tensors are not saved", self.max_bytes)
            self.skipped += 1
            return
        # one copy each: to the CPU for device tensors, a private clone for CPU ones (they may be views
        # into buffers the model reuses)
        data = {k: hif8_encode(t.detach()).cpu() if packed(t) else t.detach().to("cpu", copy=True).contiguous()
                for k, t in present.items()}
        layer, short = split_layer(record.name)
        sim = simulation_tag(self.model, record.name)
        stem = f"{record.step:06d}_" + (f"L{layer:02d}_" if layer is not None else "") + f"{short}_{direction}_{tensor}"
        file = stem + (f"_call{record.call}" if record.call else "") + (f"_sim-{sim}" if sim else "") + ".safetensors"
        shapes = {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for k, t in data.items()}
        entry = CaptureFile(file, record.step, layer, record.name, type(record.module).__name__, record.kind,
                            direction, tensor, record.call, nbytes, shapes, sim, self.encoding)
        metadata = {"format": FORMAT, **{k: json.dumps(v) for k, v in asdict(entry).items() if k != "tensors"}}
        save_file(data, os.path.join(self.out_dir, file), metadata=metadata)
        self.files.append(entry)
        self.nbytes += nbytes

    def write_manifest(self) -> None:
        """Write manifest.json (temp file + rename): every file so far and the options."""
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "model": type(self.model).__name__,
            "options": {"modules": self.patterns, "steps": None if self.steps is None else sorted(self.steps),
                        "directions": list(self.directions), "max_bytes": self.max_bytes,
                        "attention_probs": self.attention_probs, "encoding": self.encoding},
            "simulation": simulation_info(self.model),
            "steps": self.step,
            "nbytes": self.nbytes,
            "skipped": self.skipped,
            "files": [asdict(f) for f in self.files],
        }
        write_json_atomic(os.path.join(self.out_dir, MANIFEST), manifest)

    def close(self) -> None:
        """Remove the hooks, save gradients still incomplete (some inputs got none), write the manifest."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for record in self._pending:  # some inputs or outputs got no gradient: save the ones that did
                for tensor, grads in record.grads.items():
                    if len(grads) != record.expected.get(tensor):
                        self._save(record, "backward", tensor, grads)
            self._pending.clear()
            if self.attention_probs:
                _set_attn_implementation(self.model, self._attn_impl)
            self.write_manifest()

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _set_attn_implementation(model: nn.Module, impl: str | None) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # older transformers: the config is read at each forward
        model.config._attn_implementation = impl


def capture(model: nn.Module, out_dir: str, *, modules=None, steps=None, directions=None,
            max_bytes: int | str | None = None, attention_probs: bool = False, encoding: str | None = None) -> Capture:
    """Start capturing `model`'s linear and attention modules into `out_dir`; use as a context manager.

    `modules`: globs on qualified module names (default all); `steps`: forward calls of the root model
    to capture (ints, or a string like "1-3,10"; default all); `directions`: "forward" and/or
    "backward"; `max_bytes`: stop saving once this many bytes are written (an int or "2GB");
    `attention_probs`: also save attention modules' per-head probabilities (eager attention meanwhile);
    `encoding="hif8"`: store floating tensors as HiFloat8 byte codes (a quarter of fp32;
    `expertd.tools.hif8.hif8_decode`).
    """
    if isinstance(max_bytes, str):
        max_bytes = parse_size(max_bytes)
    return Capture(model, out_dir, modules=modules, steps=steps, directions=directions, max_bytes=max_bytes,
                   attention_probs=attention_probs, encoding=encoding)


_ENV_CAPTURES: list[Capture] = []


def capture_from_env(model: nn.Module) -> Capture | None:
    """Start a capture when EXPERTD_CAPTURE_DIR is set (used by `ExpertClient.load_model`); closed at exit."""
    root = os.environ.get("EXPERTD_CAPTURE_DIR")
    if not root:
        return None
    env = os.environ.get
    folder = os.path.join(root, f"pid{os.getpid()}")
    n = 1
    while os.path.exists(folder + (f"-{n}" if n > 1 else "")):  # a second model in this process, or a reused pid
        n += 1
    cap = capture(
        model,
        folder + (f"-{n}" if n > 1 else ""),
        modules=[p.strip() for p in env("EXPERTD_CAPTURE_MODULES", "*").split(",") if p.strip()],
        steps=env("EXPERTD_CAPTURE_STEPS") or None,
        directions=[d.strip() for d in env("EXPERTD_CAPTURE_DIRECTIONS", ",".join(DIRECTIONS)).split(",") if d.strip()],
        max_bytes=env("EXPERTD_CAPTURE_MAX_BYTES") or None,
    )
    if not _ENV_CAPTURES:
        atexit.unregister(close_env_captures)
        atexit.register(close_env_captures)
    _ENV_CAPTURES.append(cap)
    log.info("capturing activations of %d modules into %s", len(cap.hooked), cap.out_dir)
    return cap


def close_env_captures() -> None:
    """Close every capture EXPERTD_CAPTURE_DIR started (also run at exit): manifests written, hooks gone."""
    while _ENV_CAPTURES:
        _ENV_CAPTURES.pop().close()
