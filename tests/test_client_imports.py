"""The client is what workers import: its code must never import server code, kernels or Triton."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("triton", "expertd.server", "expertd.kernels")


def imported_modules(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package the file is installed as
                folder = os.path.basename(os.path.dirname(path))
                pkg = {"client": "expertd.client", "vllm": "expertd.vllm"}.get(folder, "expertd")
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                found.add(f"{base}.{node.module}" if node.module else base)
            else:
                found.add(node.module)
    return found


def test_client_and_shared_code_import_nothing_forbidden():
    files = [os.path.join(ROOT, d, f) for d in ("client", "expertd", "expertd/vllm")  # vllm: the engines' plugin
             for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")]
    assert len(files) >= 8
    for path in files:
        bad = {m for m in imported_modules(path) if m.startswith(FORBIDDEN)}
        assert not bad, f"{path} imports {bad}"
