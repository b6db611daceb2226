"""Items 1-4 and 9 of the core issue on the trace pipeline: exact moves against the reference model and the spy."""

import pytest
import toy
from harness import Session, canonical, hooked_names, ledger_moves
from spy import EXEC, modules_of

pytestmark = pytest.mark.usefixtures("accelerator")  # each test on the plain CPU and on the simulated accelerator

PREVIEW = ["text_encoder", "text_encoder_2"] + ["transformer", "vae"] * 3 + ["vae"]
PLAIN = ["text_encoder", "text_encoder_2"] + ["transformer"] * 3 + ["vae"]
OUT_OF_CHAIN = ["text_encoder", "controlnet", "transformer", "controlnet", "transformer", "vae"]
TRACES = {"plain": PLAIN, "preview": PREVIEW, "out_of_chain": OUT_OF_CHAIN}
OPTIONS = {
    "stock": ((), ()),
    "exclude": (("transformer",), ()),
    "keep_all": ((), True),
    "keep_some": ((), ("transformer", "vae")),
    "both": (("text_encoder_2",), True),
}


def run_session(doe, trace, exclude, keep, calls=3):
    pipe = toy.build()
    session = Session(pipe, exclude, keep, ledger=doe.transfer_ledger if doe else None)
    for _ in range(calls):
        session.call(lambda p: p(trace))
    return session


def observed(session):
    return ledger_moves(session.ledger) if session.ledger is not None else session.spied_moves()


@pytest.mark.plugin_only  # exact moves on the CPU, which stock accelerate hooks can't show: see test_pipelines.py
@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_moves_match_reference(installed, trace, option):
    exclude, keep = OPTIONS[option]
    session = run_session(installed, TRACES[trace], exclude, keep)
    reference = session.expected()
    assert canonical(observed(session)) == canonical(reference.moves)
    # The spy saw one `.to()` per move and no other `.to()` on a component.
    assert observed(session) == session.spied_moves()
    assert len(session.spy.calls) == len(reference.moves)


@pytest.mark.plugin_only  # exact moves on the CPU, which stock accelerate hooks can't show: see test_pipelines.py
def test_stock_chain_policy_by_hand(installed):
    """One hand-checked case, so that the reference model itself is checked too."""
    session = run_session(installed, PREVIEW, (), (), calls=1)
    moves = [(n, d) for n, d, _, c in canonical(session.expected().moves) if c == 0]
    assert moves == [
        ("text_encoder", "onload"),
        ("text_encoder", "offload"),
        ("text_encoder_2", "onload"),
        ("text_encoder_2", "offload"),
        ("transformer", "onload"),
        ("transformer", "offload"),  # the preview decode evicts the transformer...
        ("vae", "onload"),
        ("transformer", "onload"),  # ...which comes back for the next step
        ("transformer", "offload"),
        ("transformer", "onload"),
        # the last decode evicts the transformer, then the call ends; canonical() sorts this run of offloads
        ("safety_checker", "offload"),  # stock re-uploads the class-excluded component at every call end
        ("transformer", "offload"),
        ("vae", "offload"),
        ("safety_checker", "onload"),
    ]
    assert [(n, d) for n, d, _, c in canonical(observed(session)) if c == 0] == moves


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_end_state_equals_stock(installed, option):
    exclude, keep = OPTIONS[option]
    session = run_session(installed, PREVIEW, exclude, keep, calls=2)
    pipe = session.pipe
    on_device = {n for n, on in session.spy.placement.items() if on}
    assert on_device == set(exclude) | {"safety_checker"}
    # The excluded components have a hook too (it evicts their chain predecessor), which nothing offloads.
    assert hooked_names(pipe) == set(modules_of(pipe)) - {"safety_checker"}
    assert len(pipe._all_hooks) == len(hooked_names(pipe)) - len(exclude)
    for name in hooked_names(pipe):
        assert modules_of(pipe)[name]._hf_hook.execution_device == EXEC
    assert pipe._execution_device == EXEC


def test_keep_defers_eviction_to_call_end(installed):
    session = run_session(installed, PREVIEW, (), True, calls=1)
    moves = [(n, d) for n, d, _, _ in observed(session)]
    # Every component used comes up once and goes down once, at the end.
    ups = [n for n, d in moves if d == "onload" and n != "safety_checker"]
    assert ups == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    downs = [n for n, d in moves if d == "offload" and n != "safety_checker"]
    assert downs == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert moves.index(("text_encoder", "offload")) > moves.index(("vae", "onload"))


def test_exclude_moves_once(installed):
    session = run_session(installed, PREVIEW, ("transformer",), (), calls=3)
    transformer = [(d, c) for n, d, _, c in observed(session) if n == "transformer"]
    assert transformer == [("onload", None)]


@pytest.mark.plugin_only
def test_ledger_bytes_are_exact(installed):
    session = run_session(installed, PLAIN, (), (), calls=1)
    sizes = {
        n: sum(t.numel() * t.element_size() for t in m.state_dict().values())
        for n, m in modules_of(session.pipe).items()
    }
    for record in session.ledger.records:
        assert record.nbytes == sizes[record.component]
    summary = session.ledger.summary()
    assert summary["onloads"] == sum(1 for r in session.ledger.records if r.direction == "onload")
    assert summary["total_bytes"] == sum(r.nbytes for r in session.ledger.records)
    assert summary["per_call"][0]["onload_bytes"] == sum(
        r.nbytes for r in session.ledger.records if r.direction == "onload" and r.call_index == 0
    )
