"""The package's shape, checked mechanically: modules a newcomer can name (each opens with a one-sentence docstring,
about 300 lines at most, no class over about 200 lines, no function body over about 40), and imports that go one way
(policies never import torch or the runtime; the transfer layer knows no policy, runtime or observer; observers are
imported by the runtime only for the ledger)."""

import ast
import pathlib

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the package's own structure")

pytestmark = pytest.mark.plugin_only

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 320, 210, 45
#: Printing code of the CLI and the report builds tables and figures line by line; the tiny test pipelines and the
#: simulated accelerator are test helpers, not the package's logic.
EXEMPT = ("cli/", "observe/report", "testing/")


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def relative(path):
    return path.relative_to(PACKAGE).as_posix()


def test_every_module_opens_with_what_it_owns():
    missing = [relative(p) for p in modules() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_sizes():
    too_big = []
    for path in modules():
        name = relative(path)
        if name.startswith(EXEMPT):
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS:
                too_big.append(f"{name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                if body:
                    lines = body[-1].end_lineno - body[0].lineno + 1
                    if lines > MAX_FUNCTION:
                        too_big.append(f"{name}: {node.name}() body {lines} lines")
    assert too_big == []


def imports(path):
    """The package-internal top-level package names a module imports (`policies`, `runtime`, ...) and whether it
    imports torch, resolved from relative imports."""
    tree = ast.parse(path.read_text())
    package_parts = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names if alias.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] == "torch":
                    found.add("torch")
                if (node.module or "").startswith("diffusers_offload_ext."):
                    found.add(node.module.split(".")[1])
                continue
            base = list(package_parts[: len(package_parts) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            if target:
                found.add(target[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


RULES = {
    # layer: what it must not import
    "policies": {"torch", "runtime", "transfer", "observe", "cli", "models", "testing"},
    "transfer": {"runtime", "policies", "observe", "cli", "models", "testing"},
    "runtime": {"cli", "models", "testing"},
    "observe": {"cli", "models", "testing"},
    "models": {"runtime", "transfer", "observe", "testing"},
    "calls.py": {"torch", "runtime", "policies", "transfer", "observe"},
    "constants.py": {"torch", "runtime", "policies", "transfer", "observe"},
    "units.py": {"torch", "runtime", "policies", "transfer", "observe"},
    "blocks.py": {"runtime", "policies", "transfer", "observe", "cli", "models", "testing"},
    "storages.py": {"runtime", "policies", "transfer", "observe", "cli", "models", "testing"},
}


def test_imports_go_one_way():
    wrong = []
    for path in modules():
        name = relative(path)
        layer = name.split("/")[0]
        forbidden = RULES.get(layer, set())
        for module in sorted(imports(path) & forbidden):
            wrong.append(f"{name} imports {module}")
        if layer == "runtime":
            # The runtime writes the ledger; no other observer.
            observed = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
            for node in observed:
                if node.level and (node.module or "").startswith("observe") and node.module != "observe.ledger":
                    wrong.append(f"{name} imports {node.module}")
    assert wrong == []


def test_the_runtime_never_imports_the_test_pipelines():
    offenders = [
        relative(p) for p in modules() if not relative(p).startswith(("testing/", "cli/")) and "tiny" in imports(p)
    ]
    assert offenders == []
