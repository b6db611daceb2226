"""Run a pipeline under offload with the observers attached, and compute what the reference model expects."""

from __future__ import annotations

import contextlib

import torch

from reference import Reference
from spy import CallRecorder, MoveSpy, calling, modules_of, nbytes


@contextlib.contextmanager
def diffusers_logs(caplog, level):
    """`caplog` sees the log lines of diffusers' loggers, ours included (they are under `diffusers`, whose library
    logger does not propagate to the root logger), at `level` and above."""
    import logging

    library = logging.getLogger("diffusers")
    attached = caplog.handler in library.handlers  # recent pytest attaches it to non-propagating loggers itself
    if not attached:
        library.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="diffusers"):
            yield
    finally:
        if not attached:
            library.removeHandler(caplog.handler)


def reference_for(pipe, exclude=(), keep=()):
    sizes = {n: nbytes(m) for n, m in modules_of(pipe).items()}
    return Reference(
        sizes,
        type(pipe).model_cpu_offload_seq,
        class_excluded=getattr(type(pipe), "_exclude_from_cpu_offload", []),
        exclude=exclude,
        keep=keep,
    )


def enable_kwargs(exclude, keep):
    kwargs = {"device": "cpu"}
    if exclude:
        kwargs["exclude_from_offload"] = list(exclude)
    if keep:
        kwargs["keep_on_device_during_generation"] = keep
    return kwargs


class Session:
    """A pipeline with a call recorder and a move oracle, offload enabled with the given options.

    The oracle of the moves: with the plugin, the transfer seam (every move a `RecordingTransfer` sees, whatever the
    transfer does underneath); with the patched diffusers, which has no transfer layer, a spy on `Module.to`. The spy
    sees `.to()` calls, and on an accelerator the plugin's evictions drop unchanged weights by default (issue 31),
    which calls none: with the plugin these sessions pass `zero_copy_eviction=False`, so that every move is a
    `.to()` the spy sees. Which component moves when does not depend on it (`test_zero_copy_every_mode.py`,
    `test_stock_moves.py` and `test_fast_by_default.py` check the defaults' moves).
    """

    def __init__(self, pipe, exclude=(), keep=(), ledger=None):
        self.pipe = pipe
        self.recorder = CallRecorder(pipe)
        self.spy = MoveSpy(pipe)
        self.exclude, self.keep = exclude, keep
        self.calls = 0
        self.recordings, self.marks = None, []
        with contextlib.ExitStack() as stack:
            if ledger is not None:
                from diffusers_offload_ext.testing.recording import record_transfers

                self.recordings = stack.enter_context(record_transfers())
            kwargs = enable_kwargs(exclude, keep)
            if ledger is not None:
                kwargs["zero_copy_eviction"] = False
            with self.spy:
                pipe.enable_model_cpu_offload(**kwargs)
        self.ledger = ledger(pipe) if ledger is not None else None

    def call(self, run):
        self.marks.append(self._recorded())
        with self.spy, calling(self.spy, self.calls):
            result = run(self.pipe)
        self.calls += 1
        self.recorder.next_call()
        return result

    def _recorded(self):
        return sum(len(r.calls) for r in self.recordings or ())

    def seen_moves(self):
        """(component, direction, nbytes, call_index) of every move, from the oracle."""
        if self.recordings is None:
            return self.spied_moves()
        names = {id(m): n for n, m in modules_of(self.pipe).items()}
        calls = [call for recording in self.recordings for call in recording.calls]
        moves = []
        for position, call in enumerate(calls):
            index = sum(1 for mark in self.marks if mark <= position) - 1
            moves.append((names[id(call.module)], call.op, call.moved.nbytes, index if index >= 0 else None))
        return moves

    def expected(self):
        """The reference's moves for the traces the recorder saw: (component, direction, nbytes, call_index)."""
        reference = reference_for(self.pipe, self.exclude, self.keep)
        for index, trace in enumerate(self.recorder.calls[: self.calls]):
            reference.call(trace, index)
        return reference

    def on_device(self, accelerator=None):
        """Components on the execution device: read from the tensors on the simulated accelerator; otherwise as
        `doe.offload_status` says (plugin) or as the `.to()` calls left them (patched)."""
        modules = modules_of(self.pipe)
        if accelerator is not None:
            return {n for n, m in modules.items() if accelerator.where(m) == "device"}
        if self.recordings is not None:
            return resident(self.pipe)
        return {n for n, on in self.spy.placement.items() if on}

    def spied_moves(self):
        sizes = {n: nbytes(m) for n, m in modules_of(self.pipe).items()}
        return [(n, d, sizes[n], c) for n, d, c in self.spy.moves()]


def canonical(moves):
    """Moves with each run of consecutive offloads sorted by name.

    The end of a call offloads several components at once, in an order that is an implementation detail (stock's
    `pipe.to("cpu")` walks a set); a chain eviction is a lone offload and is never reordered past an onload.
    """
    out, run = [], []
    for move in moves:
        if move[1] == "offload":
            run.append(move)
            continue
        out.extend(sorted(run, key=str))
        run = []
        out.append(move)
    return out + sorted(run, key=str)


def ledger_moves(ledger):
    return [(r.component, r.direction, r.nbytes, r.call_index) for r in ledger.records]


def hooked_names(pipe):
    from accelerate.hooks import CpuOffload

    return {n for n, m in modules_of(pipe).items() if isinstance(getattr(m, "_hf_hook", None), CpuOffload)}


def resident(pipe):
    """Components on the execution device, as `doe.offload_status` reports them."""
    import diffusers_offload_ext as doe

    return {name for name, c in doe.offload_status(pipe).components.items() if c.resident}


def max_abs_diff(a, b):
    return (torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max().item()
