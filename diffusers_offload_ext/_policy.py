"""The residency policy: which component moves when. Pure Python: no torch, no devices, no hooks.

The runtime (`_state.py`) asks the policy what to do at three moments and carries the answer out:

- `on_use(name, resident)`: a hooked component is about to run;
- `on_enable(resident)`: offload is (re-)armed, which is also what happens at the end of every call;
- `on_offload_request(name, resident)`: pipeline code called `hook.offload()` itself.

Each answer is a list of `(direction, component)` pairs, applied in order. The same policy object drives the
replay of a recorded trace (`replay`), so predictions and the real ledger come from one piece of code.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

ONLOAD = "onload"
OFFLOAD = "offload"
#: In a trace, the end of a pipeline call (`maybe_free_model_hooks()`).
END = "<end of call>"

Move = Tuple[str, str]


class Layout(NamedTuple):
    """Who is chained, who has a hook, who bounces: what `enable_model_cpu_offload` builds from a pipeline."""

    chain: List[str]
    hooked: List[str]
    bounce: List[str]


def layout(
    order: Sequence[str], sequence: Sequence[str], class_excluded: Iterable[str] = (), pinned: Iterable[str] = ()
) -> Layout:
    """The offload layout of a pipeline.

    Args:
        order (`Sequence[str]`): The module components, in the pipeline's order.
        sequence (`Sequence[str]`): `model_cpu_offload_seq` split on `->`.
        class_excluded (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload`.
        pinned (`Iterable[str]`, defaults to `()`): `exclude_from_offload`.

    Returns:
        `Layout`: `chain` (the sequence's components that are present and not pinned, in order), `hooked` (the chain,
        then the components outside it that no list excludes) and `bounce` (class-excluded components outside the
        chain, which stock moves to the host and back whenever offload is armed).
    """
    pinned, class_excluded = set(pinned), set(class_excluded)
    chain = [n for n in dict.fromkeys(sequence) if n in order and n not in pinned]
    rest = [n for n in order if n not in chain and n not in pinned]
    return Layout(
        chain=chain,
        hooked=chain + [n for n in rest if n not in class_excluded],
        bounce=[n for n in rest if n in class_excluded],
    )


class ChainPolicy:
    """Stock's chain policy, with components pinned on the device and components the chain must not evict.

    Args:
        order (`Sequence[str]`): Every module component, in the pipeline's order (end-of-call moves follow it).
        chain (`Sequence[str]`): The hooked components of `model_cpu_offload_seq`, in chain order.
        hooked (`Iterable[str]`): Every component that has an offload hook (the chain and those outside it).
        pinned (`Iterable[str]`, defaults to `()`): `exclude_from_offload`: on the device once, never moved again.
        bounce (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload` components that the
            user did not pin: like stock, they go back to the host and up again whenever offload is armed.
        kept (`Iterable[str]`, defaults to `()`): `keep_on_device_during_generation`: the chain never evicts them.
    """

    def __init__(
        self,
        *,
        order: Sequence[str],
        chain: Sequence[str],
        hooked: Iterable[str],
        pinned: Iterable[str] = (),
        bounce: Iterable[str] = (),
        kept: Iterable[str] = (),
    ) -> None:
        self.order = tuple(order)
        self.chain = tuple(chain)
        self.hooked = frozenset(hooked)
        self.pinned = frozenset(pinned)
        self.bounce = frozenset(bounce)
        self.kept = frozenset(kept)
        self.previous: Dict[str, str] = {later: earlier for earlier, later in zip(self.chain, self.chain[1:])}

    def on_use(self, name: str, resident: Set[str]) -> List[Move]:
        moves: List[Move] = []
        before = self.previous.get(name)
        if before is not None and before in resident and before not in self.kept:
            moves.append((OFFLOAD, before))
        if name not in resident:
            moves.append((ONLOAD, name))
        return moves

    def on_offload_request(self, name: str, resident: Set[str]) -> List[Move]:
        if name in resident and name not in self.kept and name not in self.pinned:
            return [(OFFLOAD, name)]
        return []

    def on_enable(self, resident: Set[str]) -> List[Move]:
        moves: List[Move] = [(OFFLOAD, n) for n in self.order if n in resident and n not in self.pinned]
        moves += [(ONLOAD, n) for n in self.order if n in self.bounce]
        moves += [(ONLOAD, n) for n in self.order if n in self.pinned and n not in resident]
        return moves


def apply(moves: Iterable[Move], resident: Set[str]) -> None:
    """Update `resident` as if `moves` had been carried out."""
    for direction, name in moves:
        if direction == ONLOAD:
            resident.add(name)
        else:
            resident.discard(name)


def replay(
    policy: ChainPolicy,
    trace: Iterable[str],
    sizes: Mapping[str, int],
    resident: Optional[Iterable[str]] = None,
) -> List[Tuple[str, str, int]]:
    """The moves `policy` makes on `trace` (component names, with `END` at the end of each call).

    Args:
        policy (`ChainPolicy`): The policy to replay.
        trace (`Iterable[str]`): Hooked component names in the order they ran; `END` marks a call's end.
        sizes (`Mapping[str, int]`): Bytes of each component.
        resident (`Iterable[str]`, *optional*): Components on the device before the trace. When not given, the
            trace starts with offload being enabled on an all-on-host pipeline, and that enable's moves are counted.

    Returns:
        `List[Tuple[str, str, int]]`: `(direction, component, nbytes)` for every move, in order.
    """
    on_device: Set[str] = set()
    moves: List[Tuple[str, str, int]] = []

    def run(decided: List[Move]) -> None:
        apply(decided, on_device)
        moves.extend((direction, name, sizes[name]) for direction, name in decided)

    if resident is None:
        run(policy.on_enable(on_device))
    else:
        on_device.update(resident)
    for event in trace:
        run(policy.on_enable(on_device) if event == END else policy.on_use(event, on_device))
    return moves
