"""`ResidencyPolicy`: the residency manager's decisions. Keep components on the device within a memory budget, from
one call to the next if asked, and evict what the predicted future needs least.

A component that does not fit even alone streams its blocks within the limit (`STREAM`, carried out by the runtime,
see `blocks/`); one that fits alone but not beside the resident ones streams in the room they leave instead of
evicting them, when the prediction runs it only once more in the call, the facts say it can in that room (`Facts.stream_rooms`)
and the bytes saved against stock cover a wrong prediction.

Components move to the device only when they run (loading on demand never costs more bytes than loading ahead).
When one would not fit, the resident components that are not running are split into those to keep and those to
evict so as to minimise the host-to-device bytes of the *predicted* future: the trace of the previous call (on the
first call, the chain order), aligned with what this call has run so far (`forecast.py`). Up to `MAX_EXACT` offloaded
components the choice is exact for that prediction (`masks.py`); above, a greedy rule. A shadow of stock's chain on
the same trace bounds the bytes moved: the manager never moves more than stock (see `_credit_allows`).
"""

from __future__ import annotations

from typing import AbstractSet, Iterable, List, Optional, Sequence, Set, Tuple

from ..calls import CallTracker
from ..constants import END, OFFLOAD, ONLOAD, STREAM
from ..policies.base import NOTHING, Decision, Facts, Overflow, Policy
from .choice import exact_choice, greedy_choice
from .masks import Universe
from .forecast import Forecaster
from ..blocks.kept_streams import around_streams, carry, held_bytes, staying
from .limits import ComponentLimits
from .shadow import StockShadow
from .blockwise import block_mode, use_in_blocks

#: Block value tables kept per pipeline (each is larger than a component table).
BLOCK_TABLES = 4

#: Up to this many offloaded components the eviction choice is exact (2**n resident sets); above, a greedy rule.
MAX_EXACT = 8
#: The most runs of uses noted before the forecasts and stock's shadow are told (uses outside any call add up).
UNTOLD = 256


class _Told:
    """An attribute of the policy that its noted uses must reach before it is read (`ResidencyPolicy._catch_up`)."""

    def __set_name__(self, owner, name: str) -> None:
        self.stored = f"_{name}"

    def __get__(self, policy, owner=None):
        if policy is None:
            return self
        policy._catch_up()
        return policy.__dict__[self.stored]


class ResidencyPolicy(ComponentLimits, Policy):
    """Keep components on the device within a memory budget; evict what the predicted future needs least.

    Keep one instance for the life of a pipeline's configuration: forecasts may span calls.

    Args:
        order (`Sequence[str]`): Every module component, in the pipeline's order.
        chain (`Sequence[str]`): The offloaded components of `model_cpu_offload_seq`, in chain order (the prediction
            on the first call).
        hooked (`Iterable[str]`): Every component that has an offload hook.
        sizes (`Mapping[str, int]`): Bytes of each component when the policy is made (`Facts.sizes` updates them).
        excluded (`Iterable[str]`, defaults to `()`): `exclude_from_offload`: on the device once, never moved again.
        round_trip (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload`: they run without
            hooks, so they stay on the device like excluded ones (stock's round trip at every arm moves them to no
            effect).
        budget (`int`, *optional*): Bytes of component weights allowed on the device, excluded and round-trip
            components included. `None`: unlimited.
        keep_between (`bool`, defaults to `False`): Keep components on the device at the end of a call (within the
            budget) for the next one; otherwise the end of a call evicts every offloaded component, like stock.
        calls (`CallTracker`, *optional*): The pipeline's call tracker (its history is the prediction); a fresh one
            when not given.
        cache (`dict`, *optional*): Where to keep value tables (shared by the policies of one pipeline).
        max_exact (`int`, defaults to `MAX_EXACT`): Above this many offloaded components a greedy rule replaces the
            exact choice: evict what the prediction never uses again, then what it uses last.
        zero_copy (`bool`, defaults to `True`): Whether evictions are free (zero-copy eviction) when the policy
            counts the bytes it moves against stock's.
        dynamic_capacity (`bool`, defaults to `False`): Whether `Facts.capacity` will bound the room (free device
            memory read before onloads, on CUDA); forecasts then hold value tables even when the budget fits everything.
        limits (`Mapping[str, int]`, *optional*): The most bytes of weights (excluded included) on the device while
            a component runs, where its activations need more room than the budget leaves (`ComponentLimits`).
    """

    def __init__(
        self,
        *,
        order: Sequence[str],
        chain: Sequence[str],
        hooked: Iterable[str],
        sizes,
        excluded: Iterable[str] = (),
        round_trip: Iterable[str] = (),
        budget: Optional[int] = None,
        keep_between: bool = False,
        calls: Optional[CallTracker] = None,
        cache: Optional[dict] = None,
        max_exact: int = MAX_EXACT,
        zero_copy: bool = True,
        dynamic_capacity: bool = False,
        limits=None,
    ) -> None:
        hooked = set(hooked)
        self.order = tuple(order)
        self.hooked = frozenset(hooked)
        self.offloaded = tuple(n for n in self.order if n in hooked)
        self.chain = tuple(n for n in dict.fromkeys(chain) if n in hooked)
        self.excluded = frozenset(excluded)
        self.round_trip = frozenset(round_trip)
        self.stays = self.excluded | self.round_trip
        self.sizes = {name: int(nbytes) for name, nbytes in sizes.items()}
        self.budget = budget
        self.keep_between = bool(keep_between)
        self.calls = calls if calls is not None else CallTracker()
        self.exact = len(self.offloaded) <= max_exact
        self.zero_copy = bool(zero_copy)
        self.dynamic_capacity = bool(dynamic_capacity)
        self.limits = {name: int(nbytes) for name, nbytes in (limits or {}).items()}
        #: Uses not yet told to the forecasts and stock's shadow (`_catch_up`), as `[name, times in a row]`: a use
        #: that decides nothing only notes it, and whatever reads them (`forecaster`, `block_forecaster`, `shadow`)
        #: is told first.
        self._untold: List[list] = []
        self._forecaster = Forecaster(None, self.keep_between, cache if cache is not None else {})
        #: The forecast over blocks, when decisions are made block by block (`blockwise.py`) and they are few.
        self._block_forecaster = Forecaster(None, self.keep_between, {}, BLOCK_TABLES)
        self._resize()
        self._shadow = StockShadow(self.chain, self.hooked, self.zero_copy)
        self._version = self.calls.version
        self._uses_since_arm = 0
        #: Components streaming beside the resident ones that ran in this call, predicted to run no more in it.
        self.beside: Set[str] = set()
        #: Those that streamed beside the others in an earlier call and stayed (between calls): not run in this call.
        self.carried: Set[str] = set()
        self._start_forecast()
        for name in self.calls.current:
            self._untold.append([name, 1])

    #: The forecast over components, over blocks (when decisions are made block by block, `blockwise.py`), and stock's
    #: chain on the same uses (the bound on the bytes moved): each told every use noted so far before it is read.
    forecaster = _Told()
    block_forecaster = _Told()
    shadow = _Told()

    @property
    def config(self) -> tuple:
        """What the decisions depend on besides the trace (the runtime reuses a policy while it is equal)."""
        sizes = tuple(sorted(self.sizes.items()))
        options = (self.budget, self.keep_between, self.zero_copy, tuple(sorted(self.limits.items())))
        return (self.order, self.chain, self.offloaded, self.excluded, self.round_trip, sizes) + options

    @property
    def model(self) -> Tuple[str, ...]:
        """The call the next calls are predicted to repeat: the last one, or the chain order before any."""
        return self.calls.history[-1] if self.calls.history else self.chain

    # -- the protocol ---------------------------------------------------------------------------------------------
    def on_call_start(self, calls: CallTracker) -> Decision:
        self._catch_up()
        self.beside.clear()  # what stayed of them between calls is `carried`
        if calls.version != self._version or self._uses_since_arm:
            self._version = calls.version
            self._uses_since_arm = 0
            self._start_forecast()
        return NOTHING

    def on_use(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        untold = self._untold
        if untold and untold[-1][0] == name:
            untold[-1][1] += 1  # a run of one component's uses (a denoiser's steps) is one entry
        else:
            untold.append([name, 1])
        if (
            self.avail is None
            and name in resident
            and name not in self.limits
            and name not in self.beside
            and name not in self.carried
            and len(untold) < UNTOLD
        ):
            return NOTHING  # on the device, no budget to keep: nothing to decide (a hot path: every hooked forward)
        self._catch_up()
        if name in self.hooked and block_mode(self, facts):
            # A stream an out-of-memory recovery started stays as it is for the rest of the call (as run again now).
            return NOTHING if self.is_streaming(name) else use_in_blocks(self, name, resident, facts)
        if name in self.beside and name in resident:  # the prediction was wrong
            return load_again(self, name, resident, facts)
        carry(self, name, resident)
        if name in resident and name in self.limits:
            return self.within_limit(name, resident, facts, choose)
        if name in resident:  # more than the budget may be on the device: moved there from outside (`pipe.to`)
            return self.within_budget(name, resident, facts, choose) if name in self.hooked else NOTHING
        if name not in self.hooked:
            return NOTHING
        return self.noting(self._load(name, resident, facts))

    def _load(self, name: str, resident: AbstractSet[str], facts: Facts, beside: bool = True) -> Decision:
        """`name` runs from the host: load it (or stream it, see `stream_beside`), evicting what it must."""
        others = [n for n in self.offloaded if n in resident and n != name]
        self._measure(facts, [name] + others)
        need = self.sizes[name]
        limit = self._limit(resident, facts, name)
        self.shadow.count(onloaded=need)
        gone, others, limit = around_streams(self, name, others, limit, facts)
        first = [(OFFLOAD, n) for n in gone]
        if limit is None or need + sum(self.sizes[n] for n in others) <= limit:
            return Decision.of(first + [(ONLOAD, name)])
        overflow = None
        if need > limit:
            overflow, keep = Overflow(name, need, limit), set()
        else:
            keep = choose(self, name, others, limit)
            streams = stream_beside(self, name, others, keep, limit, facts) if beside else None
            if streams is not None:
                self.beside.add(name)
                return Decision.of(first + list(streams.moves), streams.overflow)
        evicted = [n for n in others if n not in keep]
        self.shadow.count(evicted=sum(self.sizes[n] for n in evicted))
        moves = first + [(OFFLOAD, n) for n in evicted] + [(STREAM if overflow else ONLOAD, name)]
        return Decision.of(moves, overflow)

    def on_enable(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        self._catch_up()
        self.beside.clear()
        self.carried.clear()
        self._uses_since_arm = 0
        self._version = self.calls.version
        self._start_forecast()
        return self._arm(resident, facts)

    def on_call_end(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        self._catch_up()
        self.carried = (self.carried | self.beside) if self.keep_between else set()
        self.beside.clear()
        self._uses_since_arm = 0
        self._version = self.calls.version
        self.forecaster.end_call(self.model, self._decisions_possible())
        self.block_forecaster.end_call(self.model, True)
        return self._arm(resident, facts)

    def on_shared_load(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        return shared_load(self, name, resident, facts)

    # -- decisions --------------------------------------------------------------------------------------------------
    def _arm(self, resident: AbstractSet[str], facts: Facts) -> Decision:
        """Offload armed (enable, or a call's end): what stays for the next call (a streaming component at the bytes
        it holds, the first to go when they do not all fit), and the always-resident ones up."""
        self.shadow.arm(self.sizes)
        others = [n for n in self.offloaded if n in resident]
        if not self.keep_between:
            moves: List = [(OFFLOAD, n) for n in others]
        else:
            keep = staying(self, others, facts, choose)
            moves = [(OFFLOAD, n) for n in others if n not in keep]
        self.shadow.count(evicted=sum(held_bytes(self, n, facts) for _, n in moves))
        moves += [(ONLOAD, n) for n in self.order if n in self.stays and n not in resident]
        return Decision.of(moves)

    # -- bookkeeping ------------------------------------------------------------------------------------------------
    def _catch_up(self) -> None:
        """Tell the forecasts and stock's shadow the uses noted since they were last told, in order."""
        if not self._untold:
            return
        untold, self._untold = self._untold, []
        for name, times in untold:
            self._uses_since_arm += times
            self._shadow.use(name, self.sizes, self.avail)  # the same again in a row changes nothing in stock's chain
            self._forecaster.advance(name, times)
            self._block_forecaster.advance(name, times)

    def _decisions_possible(self) -> bool:
        fits = self.avail is None or sum(self.sizes[n] for n in self.offloaded) <= self.avail
        return not fits or self.dynamic_capacity

    def _start_forecast(self) -> None:
        self.forecaster.start(self.model, self._decisions_possible())
        self.block_forecaster.start(self.model, True)

    def _resize(self) -> None:
        stays_bytes = sum(self.sizes[n] for n in self.stays if n in self.sizes)
        self.avail = None if self.budget is None else max(int(self.budget) - stays_bytes, 0)
        self.universe = Universe(self.offloaded, self.sizes, self.avail) if self.exact else None
        self._forecaster.universe = self.universe
        self._forecaster.forecast = None

    def _measure(self, facts: Facts, names: List[str]) -> None:
        """Take the components' current sizes; when one changed, the forecast's tables are stale."""
        changed = [n for n in names if n in facts.sizes and int(facts.sizes[n]) != self.sizes.get(n)]
        if changed:
            self._catch_up()  # the uses before were at the sizes then
            self.sizes.update({n: int(facts.sizes[n]) for n in changed})
            self._resize()


def shared_load(policy: ResidencyPolicy, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
    """A component another pipeline shares was loaded by that pipeline's call: the resident ones go where they no
    longer fit beside it."""
    others = [n for n in policy.offloaded if n in resident and n != name]
    held = sum(held_bytes(policy, n, facts) for n in others) + (
        policy.sizes.get(name, 0) if name in policy.hooked else 0
    )
    limit = policy._limit(resident, facts)
    if limit is None or held <= limit:
        return Decision()
    room = limit - (policy.sizes.get(name, 0) if name in policy.hooked else 0)
    keep = choose_greedy(policy, others, room)
    return Decision.of((OFFLOAD, n) for n in others if n not in keep)


def stream_beside(policy: ResidencyPolicy, name: str, others: List[str], keep: Set[str], limit: int, facts: Facts):
    """Stream `name` in the room the resident components leave instead of evicting some of them, when the
    prediction runs it no more in this call (a text encoder): its bytes cross the bus once either way, and what
    would have been evicted does not have to come back. `None` when that does not apply, and while what has been
    saved against stock does not cover a wrong prediction (on a first call the chain order predicts that a denoiser
    runs once): `name` is loaded whole at its next use in the call (`ResidencyPolicy.on_use`), and without
    zero-copy its stream's kept blocks are copied back and the resident ones beyond stock's owe their copies."""
    if facts.stream_rooms is None or all(n in keep for n in others):
        return None
    wrong = policy.sizes[name]
    if not policy.zero_copy:  # and the copies owed for what is kept beyond stock's (stock paid for evicting those)
        wrong += policy.sizes[name] + sum(policy.sizes[n] for n in others if n not in policy.shadow.holds)
    if policy.shadow.fits and policy.shadow.credit < wrong:
        return None
    upcoming = policy.forecaster.upcoming(policy.calls.current, policy.model, policy.chain, bool(policy.calls.history))
    rest = upcoming[: upcoming.index(END)] if END in upcoming else upcoming
    room = limit - sum(policy.sizes[n] for n in others)
    least = facts.stream_rooms.get(name)
    if name in rest or room <= 0 or least is None or room < least:
        return None
    return Decision(((STREAM, name),), Overflow(name, policy.sizes[name], room))


def choose(policy: ResidencyPolicy, name: Optional[str], others: List[str], limit: int) -> Set[str]:
    """Which of `others` to keep with `name` (`None`: at a call boundary) within `limit` bytes."""
    room = limit - (policy.sizes[name] if name is not None else 0)
    if not policy.exact:
        return choose_greedy(policy, others, room)
    learned = bool(policy.calls.history)
    tables = []
    if name is not None and not learned:
        tables = policy.forecaster.first_call_guesses(policy.calls.current or [name], policy.model, policy.chain)
    if len(tables) < 2:
        tables = [policy.forecaster.values(policy.calls.current, policy.model, policy.chain, learned)]
    keep = exact_choice(policy.universe, name, others, room, tables, policy.shadow)
    if len(tables) > 1:
        policy.forecaster.forecast = None  # the next events tell which guess was right; forecast again then
    return keep


def load_again(policy: ResidencyPolicy, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
    """`name` streamed beside the resident components, predicted to run no more in the call, runs again: its stream
    stops and it is loaded whole (evicting as usual), rather than streamed at every further use."""
    policy.beside.discard(name)
    policy.shadow.count(evicted=policy.sizes[name])
    load = policy._load(name, set(resident) - {name}, facts, beside=False)
    return Decision.of([(OFFLOAD, name)] + list(load.moves), load.overflow)


def choose_greedy(policy: ResidencyPolicy, others: List[str], room: int) -> Set[str]:
    """Above `max_exact` components: which of `others` to keep within `room` bytes, by the greedy rule."""
    upcoming = policy.forecaster.upcoming(policy.calls.current, policy.model, policy.chain, bool(policy.calls.history))
    protected = policy.shadow.protected(others, policy.sizes, room)
    return greedy_choice(upcoming, others, policy.sizes, room, protected)
