"""`observe/`: tracing reads the runtime and never writes it, and the package is made of small modules that each say
what they own."""

import ast
import io
import pathlib
import sys

import pytest
import torch

doe = pytest.importorskip("diffusers_offload_ext")

import toy  # noqa: E402

import diffusers_offload_ext.observe  # noqa: E402
from diffusers_offload_ext.calls import CallTracker  # noqa: E402
from diffusers_offload_ext.policies import ChainPolicy  # noqa: E402
from diffusers_offload_ext.residency.policy import ResidencyPolicy  # noqa: E402
from diffusers_offload_ext.marks import get_session  # noqa: E402
from diffusers_offload_ext.runtime.session import Session  # noqa: E402
from diffusers_offload_ext.transfer import Entry  # noqa: E402
from diffusers_offload_ext.units import format_size  # noqa: E402

pytestmark = pytest.mark.plugin_only

OBSERVE = pathlib.Path(diffusers_offload_ext.observe.__file__).parent
MODULES = sorted(OBSERVE.rglob("*.py"))
RUNTIME_CLASSES = (Session, CallTracker, Entry, ChainPolicy, ResidencyPolicy)
OPTIONS = [
    {},
    {"keep_on_device_during_generation": True},
    {"exclude_from_offload": ["transformer"]},
    {"keep_on_device_between_generations": True},
    {"memory_budget": "400B"},
]
EVENTS = (
    ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae"],
    ["text_encoder", "transformer", "controlnet", "transformer", "vae"],
)


class MixedToy(doe.OffloadMixin, toy.TracePipeline):
    pass


def _spy_writes(monkeypatch):
    """Every attribute write on a runtime object made by code in `observe/` itself."""
    writes = []

    def spy(cls):
        original = cls.__setattr__

        def __setattr__(self, name, value):
            caller = sys._getframe(1).f_code.co_filename
            if pathlib.Path(caller).is_relative_to(OBSERVE):
                writes.append((cls.__name__, name, caller))
            original(self, name, value)

        monkeypatch.setattr(cls, "__setattr__", __setattr__)

    for cls in RUNTIME_CLASSES:
        spy(cls)
    return writes


def _state(pipe) -> dict:
    """What the runtime holds for `pipe`, as far as it can be compared between two pipelines."""
    session = get_session(pipe)
    ledger = [(r.component, r.direction, r.nbytes, r.call_index, r.kind, r.step) for r in doe.transfer_ledger(pipe)]
    status = doe.offload_status(pipe)
    return {
        "ledger": ledger,
        "status": status._replace(components=dict(status.components)),
        "calls": dict(vars(session.calls)),
        "resident": set(session.resident),
        "observers": list(session.observers),
        "active": session.active,
        "budget": session.budget,
    }


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "keep", "exclude", "between", "budget"])
def test_tracing_writes_no_runtime_state(monkeypatch, options):
    writes = _spy_writes(monkeypatch)
    traced, plain = toy.build(MixedToy), toy.build(MixedToy)
    for pipe in (traced, plain):
        pipe.enable_model_cpu_offload(device="cpu", **options)
    before = _state(traced)
    with doe.trace(traced):
        assert len(get_session(traced).observers) == 1  # the one subscription a trace makes
    assert _state(traced) == before
    with doe.trace(traced) as recorded:
        for events in EVENTS:
            traced(events)
    for events in EVENTS:
        plain(events)
    assert recorded.records and writes == []
    assert _state(traced) == _state(plain)


def test_tracing_a_denoising_loop_writes_no_runtime_state(monkeypatch):
    """The session's call tracker counts the steps; the trace reads them and keeps no second count."""
    tiny = pytest.importorskip("diffusers_offload_ext.tiny")
    if not tiny.available("flux")[0]:
        pytest.skip(tiny.available("flux")[1])

    class MixedFlux(doe.OffloadMixin, type(tiny.build("flux"))):
        pass

    pipes = []
    for _ in range(2):
        pipe = MixedFlux(**tiny.build("flux").components)
        pipe.set_progress_bar_config(disable=True)
        pipe.enable_model_cpu_offload(device="cpu")
        pipes.append(pipe)
    writes = _spy_writes(monkeypatch)
    with torch.no_grad():
        with doe.trace(pipes[0]) as recorded:
            tiny.run(pipes[0], "flux", preview=True)
        tiny.run(pipes[1], "flux", preview=True)
    assert recorded.calls[0].steps == tiny.STEPS_RUN["flux"] and writes == []
    assert _state(pipes[0]) == _state(pipes[1])


def _chain(node) -> list:
    """`a.b.c` -> `["a", "b", "c"]` (calls and subscripts in the chain keep their callee's names)."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def _session_names(tree) -> set:
    """Names bound to something reached through a session (`session = self.session()`, `state = get_session(pipe)`)."""
    names = {"session"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts))
                for name, value in pairs:
                    if isinstance(name, ast.Name) and any("session" in n for n in _chain(value)):
                        names.add(name.id)
    return names


def test_observe_writes_nothing_through_a_session():
    """Statically: no assignment to, and no method call on, anything reached through a session, except subscribing
    to its observers."""
    allowed = {("observers", "append"), ("observers", "remove")}
    offenders = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        tainted = _session_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                targets = []
            for target in targets:
                if isinstance(target, (ast.Attribute, ast.Subscript)) and tainted & set(_chain(target.value)):
                    offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = _chain(node.func.value)
                if tainted & set(owner) and (owner[-1], node.func.attr) not in allowed:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(OBSERVE)) for p in MODULES])
def test_each_module_is_small_and_says_what_it_owns(path):
    text = path.read_text()
    tree = ast.parse(text)
    docstring = ast.get_docstring(tree)
    assert docstring and docstring.strip(), "a module opens with a sentence saying what it owns"
    assert len(text.splitlines()) <= 300
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < 200, node.name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
            assert body[-1].end_lineno - body[0].lineno < 40, node.name


def test_sizes_in_reports_are_formatted_by_units():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer", "vae"])
    from rich.console import Console

    console = Console(record=True, width=220, file=io.StringIO())
    console.print(recorded.table())
    text = console.export_text()
    for name, nbytes in recorded.components.items():
        assert format_size(nbytes) in text, name
    figure = recorded.plot()
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert labels == [f"{name}\n{format_size(nbytes)}" for name, nbytes in recorded.components.items()]
