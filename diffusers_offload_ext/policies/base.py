"""The policy protocol: the events a policy answers and the one decision type it answers with.

A policy decides which component moves when; it never moves anything and knows no torch device. The runtime tells
it what happens (offload armed, a call starts, a component is about to run, the call ends, a release, pipeline code
asking for an eviction) together with the facts of the moment: what is resident and the device facts (component
sizes, how much the device can hold). It answers with a `Decision`, which the runtime carries out in order (and,
when a component ran out of device memory, with the next rung of the recovery: `Policy.on_out_of_memory`). The
replay (`policies.replay`) drives the same objects over a recorded trace, so predictions and real ledgers come from
one piece of code.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, FrozenSet, Mapping, NamedTuple, Optional, Tuple

from ..constants import KEEP, OFFLOAD, ONLOAD, PREFETCH, STREAM
from ..recovery.rungs import next_rung

#: `(direction, component)`: one move, `direction` being `ONLOAD`, `OFFLOAD`, `PREFETCH` (an onload ahead of use),
#: `STREAM` (the component runs block by block within the room left) or `KEEP` (it keeps the blocks its
#: `Decision.kept` entry names).
Move = Tuple[str, str]


class Keep(NamedTuple):
    """What a `KEEP` move asks of one component: the `blocks` it keeps on the device (never empty: a component that
    keeps none is offloaded), whether its `ring` of device buffers is held (for its other blocks, while it runs), and
    `why`, in words (what `doe.offload_status` and the trace show)."""

    blocks: FrozenSet[str]
    ring: bool
    why: str = ""


class Overflow(NamedTuple):
    """A component that streams its blocks within `limit` bytes: it did not fit in the room the budget left even
    alone (it is loaded alone where it cannot stream), or not beside the resident components (`limit` is the room
    they leave)."""

    component: str
    nbytes: int
    limit: int


class Decision(NamedTuple):
    """What a policy wants done: `moves` in order, an `overflow` to warn about (or `None`), and for each `KEEP` move
    the blocks the component keeps (`kept`)."""

    moves: Tuple[Move, ...] = ()
    overflow: Optional[Overflow] = None
    kept: Optional[Mapping[str, Keep]] = None

    @classmethod
    def of(cls, moves, overflow: Optional[Overflow] = None, kept: Optional[Mapping[str, Keep]] = None) -> "Decision":
        return cls(tuple(moves), overflow, dict(kept) if kept else None)


NOTHING = Decision()


class Facts(NamedTuple):
    """Device facts a policy may need, passed in with every event.

    Args:
        sizes (`Mapping[str, int]`): Current bytes of each component (parameters and buffers).
        capacity (`Callable[[int], Optional[int]]`, *optional*): Given the bytes of weights resident now, the bytes
            the device can hold now (`None`: no limit known). Only on devices whose free memory can be read.
        stream_rooms (`Mapping[str, int]`, *optional*): The fewest bytes each component can run block by block in
            (any room at least that large will do); a component absent cannot. `None`: streaming beside the resident
            components is never considered (a component that fits alone is then loaded whole).
        streaming (`Mapping[str, int]`, *optional*): The components streaming their blocks now and the bytes each
            holds on the device (its kept blocks and ring), which count in place of its size while it is resident
            (with `keep_on_device_between_generations`, also between calls). `None` or absent: its size counts.
        blocks (`Mapping[str, Tuple[Item, ...]]`, *optional*): The blocks of each component that can stream
            (`blocks.choice.Item`: its key, bytes kept, uses and ring slot; the rest, `"<rest>"`, first). With them a
            residency policy decides block by block (`residency/blockwise.py`). `None`: component by component.
        kept (`Mapping[str, Tuple[FrozenSet[str], int]]`, *optional*): For each component streaming its blocks now,
            the blocks it keeps on the device and the bytes of its ring (0 when its ring is not held).
        runs (`Mapping[str, Mapping[int, FrozenSet[str]]]`, *optional*): For a component whose uses run different
            blocks (a VAE's encode and decode), the blocks each use of it in a call ran (by its index in the call),
            as learnt by its last stream; absent: every use runs the blocks `blocks` marks as run.
    """

    sizes: Mapping[str, int]
    capacity: Optional[Callable[[int], Optional[int]]] = None
    stream_rooms: Optional[Mapping[str, int]] = None
    streaming: Optional[Mapping[str, int]] = None
    blocks: Optional[Mapping[str, tuple]] = None
    kept: Optional[Mapping[str, tuple]] = None
    runs: Optional[Mapping[str, Mapping[int, FrozenSet[str]]]] = None


class Policy:
    """Base of every policy: no-op answers.

    Attributes:
        order (`Tuple[str, ...]`): Every module component, in the pipeline's order (moves of one event follow it).
        calls (`CallTracker` or `None`): The call tracker the policy reads, if it reads one (the replay drives it).
        hooked (`FrozenSet[str]`): Components with an offload hook (the ones `on_use` is called for).
        watched (`FrozenSet[str]`): Components that no hook offloads but whose use is reported to `on_use` too.
        stays (`FrozenSet[str]`): Components this policy never evicts (`exclude_from_offload`, and what else the
            policy keeps on the device for good); the runtime keeps no host copy of them.
    """

    order: Tuple[str, ...] = ()
    calls = None
    hooked: FrozenSet[str] = frozenset()
    watched: FrozenSet[str] = frozenset()
    stays: FrozenSet[str] = frozenset()

    def on_enable(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        """Offload is armed (outside a call, or again at a call's end when no call is tracked)."""
        return NOTHING

    def on_call_start(self, calls) -> Decision:
        """A pipeline call starts; `calls` is the `CallTracker` (its `history` holds the completed calls)."""
        return NOTHING

    def on_use(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        """Hooked component `name` is about to run."""
        return NOTHING

    def on_call_end(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        """The call's end-of-call offload (`maybe_free_model_hooks()`); the call's trace is already in history."""
        return self.on_enable(resident, facts)

    def on_release(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        """`doe.release(pipe)`: evict every hooked component that is resident."""
        return Decision.of(
            (OFFLOAD, n) for n in self.order if n in resident and n in self.hooked and n not in self.stays
        )

    def on_offload_request(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        """Pipeline code called the component's `hook.offload()`."""
        return NOTHING

    def on_shared_load(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        """Another pipeline put `name`, a component this one shares, on the device; make room if needed."""
        return NOTHING

    def on_out_of_memory(
        self, name: str, resident: AbstractSet[str], facts: Facts, running=(), held: int = 0, least=None
    ) -> Decision:
        """Hooked component `name` ran out of device memory (in its forward, or while it was loaded): the next rung of
        the recovery (`recovery/rungs.py`). First the other resident components that may leave (hooked, not kept for
        good, not `running`), in the pipeline's order; when none is left, `name` streams its blocks in less room
        (given the device bytes it `held` and the `least` room it can stream in): its kept blocks go. `NOTHING` at its
        smallest residency."""
        moves, room = next_rung(name, self.order, resident, self.hooked, self.stays, running, held, least)
        if not moves:
            return NOTHING
        return Decision.of(moves, None if room is None else Overflow(name, int(facts.sizes[name]), room))


def apply(moves, resident: set) -> None:
    """Update `resident` as if `moves` had been carried out."""
    for direction, name in moves:
        if direction in (ONLOAD, PREFETCH, STREAM, KEEP):
            resident.add(name)
        else:
            resident.discard(name)
