"""Quantization state that travels with a block: the tensors a parameter carries as attributes (bitsandbytes'
`Params4bit.quant_state`: `absmax`, `code`, a nested `state2`), which a move of the parameter's data alone leaves
behind. A streamed block's state passes through its ring buffer with its weights (`streamed_block.py`); a kept block's
goes to the device with it (`carry`), and its host copy puts the host tensors back (`host_copy.py`)."""

from __future__ import annotations

import torch

from ..storages import tensor_state


def state_of(slots) -> list:
    """`(owner, attribute, host tensor)` of the quantization state the tensors in `slots` carry (`tensor_state`)."""
    found = []
    for sub, is_param, key in slots:
        tensor = (sub._parameters if is_param else sub._buffers).get(key)
        if tensor is not None:
            found += tensor_state(tensor)
    return found


def place_state(states, device: torch.device) -> None:
    """Device copies of `states` put in place of the host tensors (which `states` keeps)."""
    with torch.no_grad():
        for owner, name, host in states:
            setattr(owner, name, host.to(device))


def home(states) -> None:
    """The tensors now in place of `states` copied to the host and put there (an eviction that could not write into
    the host tensors)."""
    with torch.no_grad():
        for owner, name, _ in states:
            setattr(owner, name, getattr(owner, name).to("cpu", copy=True))


def carry(slots, device: torch.device) -> list:
    """`state_of(slots)`, with device copies put in place (`place_state`): the host tensors, to put back later."""
    states = state_of(slots)
    place_state(states, device)
    return states
