"""The client is what workers import: its code must never import server code, kernels, Triton or the offline tools.
What it shares with the daemon (expertd/) imports them nowhere either, but for the kernels inside the formats' dequant
entry points (`expertd/formats`), which only the daemon and its tools call."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("triton", "expertd.server", "expertd.kernels", "expertd.tools")


# folder -> the package its files are installed as (pyproject's package-dir), for relative imports
PACKAGES = {"client": "expertd.client", "client/engines": "expertd.client.engines",
            "client/engines/vllm": "expertd.client.engines.vllm", "expertd/formats": "expertd.formats"}
ENGINES = os.path.join(ROOT, "client", "engines")


def imported_modules(path: str, top_level: bool = False) -> set[str]:
    """The modules `path` imports, anywhere in it (or only at module level)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package the file is installed as
                pkg = PACKAGES.get(os.path.relpath(os.path.dirname(path), ROOT), "expertd")
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                found.add(f"{base}.{node.module}" if node.module else base)
            else:
                found.add(node.module)
    return found


def test_client_and_shared_code_import_nothing_forbidden():
    files = [os.path.join(ROOT, d, f) for d in ("client", *PACKAGES, "expertd")  # engines: vLLM's plugin and more
             for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")]
    assert len(files) >= 8
    for path in files:
        bad = {m for m in imported_modules(path) if m.startswith(FORBIDDEN)}
        if os.path.relpath(path, ROOT).startswith("expertd/formats/"):  # the kernels inside dequant entry points only
            bad -= {m for m in bad - imported_modules(path, top_level=True) if m.startswith("expertd.kernels")}
        assert not bad, f"{path} imports {bad}"


def test_the_client_and_the_formats_load_no_kernels():
    """A worker imports the client and splits a push by the format's names (`push_all`): no kernel, server code or
    Triton is loaded."""
    code = ("import sys, expertd.client, expertd.client.push\n"
            "from expertd.quantization import quantization_format\n"
            "for config in ({}, {'quantization_config': {'quant_method': 'mxfp4'}}):\n"
            "    quantization_format(config).logical({'w': 0, 'w_scale_inv': 0, 'x_blocks': 0, 'x_scales': 0})\n"
            "print(sorted(m for m in sys.modules if m.startswith(('triton', 'expertd.server', 'expertd.kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_the_core_package_imports_no_client_and_the_engines_machinery_no_engine():
    """expertd/ (shared by server, tools and client) imports no client module; client/engines/ (probes, derived
    layouts, binding, following) imports no engine: only its adapters (client/engines/vllm/) know vLLM."""
    core = [os.path.join(ROOT, "expertd", f) for f in os.listdir(os.path.join(ROOT, "expertd")) if f.endswith(".py")]
    for path in core:
        bad = {m for m in imported_modules(path) if m.startswith("expertd.client")}
        assert not bad, f"{path} imports {bad}"
    assert not os.path.exists(os.path.join(ROOT, "expertd", "vllm")), "the vLLM plugin moved to client/engines/vllm"
    neutral = [os.path.join(ENGINES, f) for f in os.listdir(ENGINES) if f.endswith(".py")]
    assert len(neutral) >= 7
    for path in neutral:
        bad = {m for m in imported_modules(path) if m.split(".")[0] in ("vllm", "sglang")
               or m.startswith("expertd.client.engines.vllm")}
        assert not bad, f"{path} imports {bad}"


def test_importing_the_engines_machinery_imports_no_vllm():
    code = ("import sys, expertd.client.engines, expertd.client.engines.following, expertd.client.engines.checks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.endswith('engines.vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_core_imports_tools_only_lazily():
    """The pipeline never imports the tools (expertd.tools); the server's CLI only inside its functions."""
    for d in ("kernels", "server"):
        for f in os.listdir(os.path.join(ROOT, d)):
            if not f.endswith(".py"):
                continue
            path = os.path.join(ROOT, d, f)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
            names += [("." * n.level) + (n.module or "") for n in top if isinstance(n, ast.ImportFrom)]
            tools = [m for m in names if m.startswith(("expertd.tools", ".tools", "..tools"))]
            assert not tools, f"{path} imports the tools at module level: {tools}"
            if d == "kernels":  # not even inside functions
                assert not {m for m in imported_modules(path) if m.startswith("expertd.tools")}, path


def test_client_and_its_model_hooks_leave_the_tools_unimported(monkeypatch):
    """`import expertd.client` and load_model's hooks import expertd.tools only when EXPERTD_CAPTURE_DIR or
    EXPERTD_SIMULATE_* ask for it."""
    for var in ("EXPERTD_CAPTURE_DIR", "EXPERTD_SIMULATE_WEIGHTS", "EXPERTD_SIMULATE_ACTIVATIONS",
                "EXPERTD_MODEL_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    code = ("import sys, expertd.client\n"
            "from expertd.client.hooks import run_model_hooks\n"
            "run_model_hooks(object())\n"
            "print(sorted(m for m in sys.modules if m.startswith('expertd.tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
