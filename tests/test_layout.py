"""The tree as a newcomer reads it: README's layout names every module, no module over 400 lines, no product function
over 80, and no import circle between modules (an import inside a function counts: it hides a circle, it does not
remove one)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package its modules are installed as (pyproject's package-dir)
PACKAGES = {"expertd": "expertd", "server": "expertd.server", "client": "expertd.client", "kernels": "expertd.kernels",
            "tools": "expertd.tools"}


def product_modules() -> dict[str, Path]:
    """Every product module by its installed name (packages' __init__ as the package itself)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not (path.parent / "__init__.py").exists():
                continue  # not installed (client/cpp's scripts)
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules `name` imports, anywhere in its file (`from X import y` counts as X.y when that is a
    module, else as X)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if m in known and m != name}


def test_readme_layout_names_every_module():
    layout = (ROOT / "README.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Za-z_][\w./]*)`", layout))
    missing = []
    for name, path in product_modules().items():
        if path.name == "__init__.py":
            continue
        stem = path.stem
        folder = path.parent.relative_to(ROOT).as_posix()
        if stem not in named and f"{folder}/{stem}.py" not in named and name not in named:
            missing.append(f"{folder}/{stem}.py")
    assert not missing, f"README's Layout section does not name: {', '.join(missing)}"


def test_no_module_over_400_lines_and_no_product_function_over_80():
    long_modules, long_functions = [], []
    for path in product_modules().values():
        text = path.read_text()
        if text.count("\n") > 400:
            long_modules.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_no_import_circle():
    modules = product_modules()
    graph = {name: imports_of(name, path, set(modules)) for name, path in modules.items()}
    for name in graph:  # a package's __init__ is imported with each of its modules: not an edge back
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "\n".join(circles)


SERVER_STAGES = ("shm", "load", "serving", "derived", "restart", "push", "daemon", "cli")  # README's Layout order


def test_server_stages_import_only_the_stages_below_them():
    """Each of server/'s subpackages imports only those before it in SERVER_STAGES (and the shared `expertd`), so
    the daemon reads as a few stages, each testable alone; every module of server/ lies in one of them."""
    modules = product_modules()
    server = {name: path for name, path in modules.items() if name.startswith("expertd.server.")}
    loose = [name for name in server if name.split(".")[2] not in SERVER_STAGES]
    assert not loose, f"server modules in no stage: {loose}"
    upward = []
    for name, path in server.items():
        mine = SERVER_STAGES.index(name.split(".")[2])
        for other in imports_of(name, path, set(modules)):
            if other.startswith("expertd.server.") and SERVER_STAGES.index(other.split(".")[2]) > mine:
                upward.append(f"{name} imports {other}")
    assert not upward, "\n".join(upward)
    assert {p.name for p in (ROOT / "server").iterdir() if p.suffix == ".py"} == {"__init__.py"}
