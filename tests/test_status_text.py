"""What is where, and why (issue 34, point 6): `print(doe.offload_status(pipe))` is a table in the options' words,
every ordinary eviction says why in the ledger (`cause`), and arming logs one line of what will stay, stream or be
held. On the plain CPU and on the simulated accelerator."""

import logging

import pytest
from harness import diffusers_logs

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the ledger and offload_status")

import diffusers_offload_ext as doe  # noqa: E402
import toy  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("accelerator", "installed")]
CALL = ["text_encoder", "text_encoder_2", "transformer", "vae"]


def offloads(pipe):
    return [(r.component, r.cause) for r in doe.transfer_ledger(pipe).records if r.direction == "offload"]


def test_the_chain_s_evictions_say_why():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    pipe(CALL)
    assert offloads(pipe) == [
        ("text_encoder", "room for text_encoder_2"),
        ("text_encoder_2", "room for transformer"),
        ("transformer", "room for vae"),
        ("vae", "end of call"),
        ("safety_checker", "end of call"),  # the class's round trip: out and back in at every arming, as stock does
    ]
    assert all(r.cause is None for r in doe.transfer_ledger(pipe).records if r.direction == "onload")


def test_the_budget_s_evictions_and_a_release_say_why():
    pipe = toy.build()
    sizes = {n: doe.module_nbytes(getattr(pipe, n)) for n in CALL}
    # Room for the transformer and little else: the text encoders leave when it loads.
    budget = sizes["transformer"] + sizes["vae"] + doe.module_nbytes(pipe.safety_checker)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    pipe(CALL)
    causes = dict(offloads(pipe))
    assert causes["text_encoder"].startswith("room for ") and causes["text_encoder_2"] == "room for transformer"
    doe.release(pipe)
    assert {cause for _, cause in offloads(pipe)[-2:]} == {"release"}


def test_the_status_prints_as_a_table_in_the_options_words():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(
        device="cpu", exclude_from_offload=["controlnet"], keep_on_device_between_generations=True
    )
    pipe(CALL)
    text = str(doe.offload_status(pipe))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100 and len(lines) >= 2 + 1 + len(doe.offload_status(pipe).components)
    head = " ".join(lines[:2])
    assert "keep_on_device_between_generations=True" in head and "exclude_from_offload=['controlnet']" in head
    assert "keep_between" not in text and "keep_all" not in text and "zero_copy=" not in text
    header = next(line for line in lines if line.startswith("component"))
    assert header.split() == ["component", "where", "size", "blocks", "why"]
    rows = {line.split()[0]: line for line in lines if line.split()[0] in doe.offload_status(pipe).components}
    assert "exclude_from_offload" in rows["controlnet"]
    assert "the pipeline class keeps it" in rows["safety_checker"]
    assert "kept on the device within memory_budget" in rows["vae"]
    doe.release(pipe)
    status = doe.offload_status(pipe)
    assert status.components["vae"].why == "evicted (release); loaded again when it runs"
    assert "evicted (release)" in str(status)


def test_arming_logs_one_line_of_what_stays_and_what_moves(caplog):
    pipe = toy.build()
    with diffusers_logs(caplog, logging.INFO):
        pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer"])
        pipe(CALL)  # the end of the call arms again, unchanged: no line
        pipe.enable_model_cpu_offload()  # unchanged: no line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Model offload armed")]
    assert len(lines) == 1
    assert "on the device for good: transformer, safety_checker" in lines[0]
    assert "evicted by the next in the chain: text_encoder, text_encoder_2, vae, controlnet" in lines[0]
    caplog.clear()
    with diffusers_logs(caplog, logging.INFO):
        pipe.enable_model_cpu_offload(exclude_from_offload=[], memory_budget="1GiB")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Model offload armed")]
    assert len(lines) == 1 and "memory_budget='1.00GiB'" in lines[0] and "within memory_budget 1.00 GiB" in lines[0]
