"""The package's shape, checked mechanically: modules a newcomer can name (each opens with a one-sentence docstring,
about 400 lines at most, a class as long as its idea within that, no function body over about 40), imports that go
one way (the transfer layer knows no feature but the copy stream it builds, no runtime, policy or observer; observers
and the runtime never import each other: the ledger and the marks sit between them), with no circle; a list of pure
modules (plain Python: no torch, diffusers or accelerate, and only pure modules imported), which the planner and the
test kit use besides the public API; and a session whose fields only `runtime/session.py` writes."""

import ast
import pathlib
import re

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the package's own structure")

pytestmark = pytest.mark.plugin_only

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext"
#: About 400 lines a module, a class as long as its idea (within its module), about 40 lines a function body.
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 420, 420, 45
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


#: Every feature folder and the runtime's wiring: what the transfer layer and the observers must not import.
FEATURES = {"residency", "blocks", "pinning", "recovery"}
RULES = {
    # layer: what it must not import
    "policies": {"torch", "runtime", "transfer", "observe", "cli", "models", "testing"},
    "residency": {"observe", "cli", "models", "testing"},
    "blocks": {"observe", "cli", "models", "testing"},
    "pinning": {"observe", "cli", "models", "testing"},
    "recovery": {"observe", "cli", "models", "testing"},
    # the transfer builds the copy stream's transfer for `make_transfer` (`pinning/copy_stream.py`), and no other
    "transfer": {"runtime", "policies", "residency", "blocks", "recovery", "observe", "cli", "models", "testing"},
    "runtime": {"cli", "models", "testing", "observe"},
    "observe": {"runtime", "residency", "blocks", "pinning", "recovery", "cli", "models", "testing"},
    "models": {"runtime", "transfer", "pinning", "recovery", "observe", "testing"},
    "host": {"runtime", "policies", "transfer", "observe", "cli", "models", "testing"},
    "marks.py": {"runtime", "policies", "transfer", "observe", "cli", "models", "testing"} | FEATURES,
    "storages.py": {"runtime", "policies", "transfer", "observe", "cli", "models", "testing"} | FEATURES,
}


def test_imports_go_one_way():
    wrong = []
    for path in modules():
        name = relative(path)
        layer = name.split("/")[0]
        forbidden = RULES.get(layer, set())
        for module in sorted(imports(path) & forbidden):
            wrong.append(f"{name} imports {module}")
    assert wrong == []


#: The pure modules: decisions and data in plain Python. Each imports no torch, diffusers, accelerate or transformers
#: (not even inside a function) and no package module that is not in this list. Each feature keeps its pure decision
#: modules beside its mechanism; the planner and the replay run on them alone.
PURE = {
    "__init__.py",
    "calls.py",
    "constants.py",
    "layout.py",
    "ledger.py",
    "units.py",
    "policies/__init__.py",
    "policies/base.py",
    "policies/chain.py",
    "policies/replay.py",
    "policies/replay_book.py",
    "residency/__init__.py",
    "residency/belady.py",
    "residency/block_sets.py",
    "residency/block_tables.py",
    "residency/blockwise.py",
    "residency/choice.py",
    "residency/forecast.py",
    "residency/limits.py",
    "residency/masks.py",
    "residency/optimum.py",
    "residency/policy.py",
    "residency/prediction.py",
    "residency/reserve.py",
    "residency/shadow.py",
    "blocks/__init__.py",
    "blocks/choice.py",
    "blocks/kept_streams.py",
    "blocks/prefetch.py",
    "pinning/__init__.py",
    "pinning/prefetch.py",
    "recovery/__init__.py",
    "recovery/rungs.py",
    "host/__init__.py",
    "host/memory.py",
    "observe/report/__init__.py",
    "observe/report/panel.py",
    "observe/report/slots.py",
    "observe/report/summary.py",
    "observe/report/table.py",
    "observe/report/timeline.py",
    "observe/trace/records.py",
}
HEAVY = {"torch", "diffusers", "accelerate", "transformers"}


def dotted(relative_path: str) -> str:
    """`"residency.policy"` for `"residency/policy.py"`, `"residency"` for its `__init__.py`, `""` for the package's."""
    parts = relative_path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path) -> list:
    """`(module, name)` for every package module a module imports (imports inside functions included): `name` is the
    name imported from it (`None` for a module imported whole), and a submodule imported by name is its own module."""
    known = {dotted(relative(p)) for p in modules()}
    own = dotted(relative(path))
    package = own.split(".") if path.name == "__init__.py" else own.split(".")[:-1]
    package = [part for part in package if part]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [
                (a.name.split(".", 1)[1], None) for a in node.names if a.name.startswith("diffusers_offload_ext.")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("diffusers_offload_ext"):
                continue
            base = node.module.split(".")[1:] if node.level == 0 else package[: len(package) - node.level + 1]
            base = base + (node.module.split(".") if node.level and node.module else [])
            for alias in node.names:
                target = ".".join(base + [alias.name])
                found.append((target, None) if target in known else (".".join(base), alias.name))
    return found


def heavy_imports(path) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add((node.module or "").split(".")[0])
    return found & HEAVY


def test_the_pure_modules_are_pure():
    names = {relative(p) for p in modules()}
    assert PURE <= names, sorted(PURE - names)
    pure = {dotted(name) for name in PURE}
    wrong = []
    for path in modules():
        if relative(path) in PURE:
            wrong += [f"{relative(path)} imports {module}" for module in sorted(heavy_imports(path))]
            impure = {module for module, _ in internal_imports(path) if module not in pure}
            wrong += [f"{relative(path)} imports {module or 'the package'}, not pure" for module in sorted(impure)]
    assert wrong == []


def test_the_purity_finder_finds_heavy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n\ndef f():\n    import torch.nn\n    from diffusers import DiffusionPipeline\n")
    assert heavy_imports(probe) == {"torch", "diffusers"}


#: What the planner and the test kit reach besides pure modules, the public API and their own folder, and why: the
#: test kit's fakes stand in for the device boundary (CUDA streams, page-locking, device memory, the fused fingerprint
#: kernel) and its recorder wraps every transfer made; the recorders of the planner's shipped data (sizes, activations)
#: read the planner; the doctor reports the install (stock's methods, which pipelines the options reach), the bus's
#: measured bandwidth and the fast paths each device gets.
SEAMS = {
    "testing/copy_stream.py": {"transfer", "transfer.synchronous", "pinning.copy_stream"},
    "testing/device_memory.py": {"transfer.memory"},
    "testing/page_locking.py": {"pinning.locking", "pinning.store"},
    "testing/recording.py": {"transfer"},
    "testing/record_model_data.py": {"models"},
    "testing/record_activations.py": {"models"},
    "testing/fused.py": {"transfer"},
    "cli/doctor.py": {"marks", "runtime.overrides", "pinning.bandwidth", "runtime.fast_paths"},
}
#: What the planner (`models/`, `cli/`) and the test kit (`testing/`) may import of their own.
OWN = {"models": ("models",), "cli": ("cli", "models", "testing"), "testing": ("testing",)}


def _allowed(module: str, name, area: str, seams: set) -> bool:
    from diffusers_offload_ext import _EXPORTS

    if module in {dotted(p) for p in PURE} or module.startswith(OWN[area]):
        return True
    if name is not None and (module == "" and name in _EXPORTS or _EXPORTS.get(name) == module):
        return True  # a public name, from the package or from the module that defines it
    return any(module == seam or module.startswith(seam + ".") for seam in seams)


def test_the_planner_and_the_test_kit_import_only_pure_modules_and_the_public_api():
    wrong = []
    for path in modules():
        name = relative(path)
        area = name.split("/")[0]
        if area not in OWN:
            continue
        for module, imported in internal_imports(path):
            if not _allowed(module, imported, area, SEAMS.get(name, set())):
                wrong.append(f"{name} imports {module}{'.' + imported if imported else ''}")
    assert wrong == []


def test_the_runtime_never_imports_the_test_pipelines():
    offenders = [
        relative(p) for p in modules() if not relative(p).startswith(("testing/", "cli/")) and "tiny" in imports(p)
    ]
    assert offenders == []


def module_graph():
    """`{module: modules it imports}` over the package, imports inside functions included (`a.b` for `a/b.py`, `a`
    for `a/__init__.py`)."""
    graph = {}
    for path in modules():
        name = dotted(relative(path))
        graph[name] = {module for module, _ in internal_imports(path) if module != name}
    known = set(graph)
    return {name: targets & known for name, targets in graph.items()}


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while node not in component:
                        component.add(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circle():
    graph = module_graph()
    assert graph["runtime.methods"] >= {"runtime.arming"}  # the reading sees imports (inside functions too)
    assert circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


#: Calls that change a list, set or dict in place.
MUTATORS = {
    "add",
    "discard",
    "append",
    "remove",
    "clear",
    "update",
    "pop",
    "popitem",
    "insert",
    "extend",
    "setdefault",
}
#: What code outside `runtime/session.py` may still change through a session: the trace subscribes to its moves.
SUBSCRIPTION = {("observers", "append"), ("observers", "remove")}


def _is_session(node, tainted) -> bool:
    """Whether `node` is a session: a name bound to one, `<x>.session`, or `get_session(...)`/`session_of(...)`."""
    if isinstance(node, ast.Name):
        return node.id in tainted
    if isinstance(node, ast.Attribute):
        return node.attr == "session"
    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
        return getattr(node.func, "id", getattr(node.func, "attr", None)) in ("get_session", "session_of")
    return False


def _session_names(tree) -> set:
    tainted = {"session", "holder", "other"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_session(node.value, tainted):
            tainted.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return tainted


def session_writes(source: str, label: str) -> list:
    """Where `source` (the module `label`) assigns a field of a session, or changes one in place, in line order."""
    tree = ast.parse(source)
    tainted = _session_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Attribute) and _is_session(part.value, tainted):
                    found.append((node.lineno, f"assigns `{part.attr}`"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _is_session(node.args[0], tainted):
                found.append((node.lineno, node.func.id))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and _is_session(owner.value, tainted):
                if (owner.attr, node.func.attr) not in SUBSCRIPTION:
                    found.append((node.lineno, f"changes `{owner.attr}`"))
    return [f"{label}:{line} {what}" for line, what in sorted(found)]


def test_only_the_session_module_writes_a_session():
    writes = []
    for path in modules():
        if relative(path) != "runtime/session.py":
            writes += session_writes(path.read_text(), relative(path))
    assert writes == []


def test_the_session_write_finder_finds_writes():
    source = (
        "session = get_session(pipe)\n"
        "session.active = False\n"
        "self.session.policy, x = None, 1\n"
        "state = session_of(pipe)\n"
        "state.resident.add('vae')\n"
        "setattr(session, 'device', None)\n"
        "session.observers.append(tracer)\n"
        "session.transfer.flush()\n"
        "session.entries['vae'].dirty = True\n"
    )
    assert session_writes(source, "probe") == [
        "probe:2 assigns `active`",
        "probe:3 assigns `policy`",
        "probe:5 changes `resident`",
        "probe:6 setattr",
    ]


README = PACKAGE.parent / "README.md"


def test_the_readme_says_the_import_rules():
    text = README.read_text()
    table = text.split("<!-- import rules:", 1)[1].split("\n\n", 1)[0]
    said = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            layers, forbidden = line.strip("| ").split(" | ")
            for layer in layers.split(", "):
                said[layer.strip("`")] = set(forbidden.split(", "))
    assert said == RULES
    listed = text.split("<!-- pure modules:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`([\w/]+\.py)`", listed)) == PURE


def test_the_signature_the_adapter_the_docstring_and_the_readme_are_the_options_table():
    import inspect

    from diffusers_offload_ext.runtime import methods, options, overrides

    def own(self, gpu_id=None, device=None):
        """A class's own method."""

    for method in (methods.enable_model_cpu_offload, overrides.adapt(own)):
        parameters = inspect.signature(method).parameters.values()
        keyword = [(p.name, p.default) for p in parameters if p.kind is p.KEYWORD_ONLY]
        assert keyword == [(name, None) for name in options.NEW_OPTIONS]
    doc = methods.enable_model_cpu_offload.__doc__
    assert "{options}" not in doc
    for option in options.OPTIONS:
        assert f"{option.name} ({option.types}, *optional*, defaults to {option.default}):" in doc
    begin = "<!-- options table: made from diffusers_offload_ext/runtime/options.py by tools/options_table.py -->"
    assert f"{begin}\n{options.markdown_table()}\n<!-- end of the options table -->" in README.read_text()


def test_the_layout_in_contributing_has_one_line_per_module_of_each_folder_it_draws():
    # CONTRIBUTING.md draws the package one line per file for the wiring and the features (observe/, models/, cli/
    # and testing/ are drawn one line each); a module added without its line, or a line left for one gone, fails.
    text = (PACKAGE.parent / "CONTRIBUTING.md").read_text()
    tree = text.split("## Layout", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    drawn, folder = {}, ""
    for line in tree.splitlines()[1:]:
        match = re.match(r"( *)(\S+)\s*(.*)", line)
        if match is None:
            continue
        indent, name, idea = len(match.group(1)), match.group(2), match.group(3)
        if name.endswith("/"):
            folder = name if indent == 2 else folder
            continue
        drawn[(folder if indent == 4 else "") + name] = idea
    whole = ("observe/", "models/", "cli/", "testing/")
    files = {relative(p) for p in modules() if not relative(p).startswith(whole)}
    assert set(drawn) == files, (sorted(files - set(drawn)), sorted(set(drawn) - files))
    pure = {name for name, idea in drawn.items() if idea.endswith("(pure)")}
    assert pure == {name for name in PURE if not name.startswith(whole)}, sorted(pure ^ PURE)
