"""The residency manager's policy: a memory budget, components kept across calls, trace-informed eviction.

Pure Python, like `_policy.py`: no torch, no devices, no hooks. `ResidencyPolicy` answers the same three questions as
`ChainPolicy` (`on_use`, `on_enable`, `on_offload_request`, each returning `(direction, component)` moves), so the
runtime and `replay` drive it the same way.

How it decides. Components are moved to the device only when they run (loading on demand never costs more bytes than
loading ahead). When one would not fit in the budget, the resident components that are not running are split into
those to keep and those to evict so as to minimise the host-to-device bytes of the *predicted* future: the access trace
recorded on the previous call (on the first call, the `model_cpu_offload_seq` order), aligned with what the current
call has run so far. With at most `MAX_EXACT` offloaded components the choice is exact for that prediction: a dynamic
programme over resident sets (bit masks) gives, for every set, the least bytes the rest of the predicted trace costs
from it. With `keep_between=True` the future also holds the next calls (the same trace again), valued by the
steady-state relative values of an infinite repetition (value iteration), so that a stable workload settles on the
optimum's per-call cost.

`optimal_bytes` is the offline reference: the exact minimum host-to-device bytes for a whole known trace under a
budget, with free eviction, by the same kind of dynamic programme run forward.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from ._policy import END, OFFLOAD, ONLOAD, Move

#: Bytes in a GiB.
GiB = 1 << 30
#: Default `memory_reserve`: what the automatic CUDA budget leaves free for activations.
DEFAULT_RESERVE = 3 * GiB
#: Up to this many offloaded components the eviction choice is exact (2**n resident sets); above, a greedy rule.
MAX_EXACT = 8
#: Completed call traces remembered for prediction (only the latest is used).
HISTORY = 8
#: Value-iteration rounds for the steady-state values of a repeated call.
MAX_ROUNDS = 24

_INF = float("inf")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")
UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_size(text: str) -> Optional[int]:
    """Bytes in `text` (`"20GiB"`, `"12 GB"`, `"1.5GiB"`, `"512MiB"`, `"1024"`, `"24e9"`), or `None` if it does not
    parse.

    Units are case-insensitive; `KB`/`MB`/`GB`/`TB` are powers of 1000, `KiB`/`MiB`/`GiB`/`TiB` powers of 1024.
    Fractions of a byte are dropped; the arithmetic is exact (`"1.5GiB"` is exactly 1.5 * 2**30 bytes).
    """
    match = _SIZE.match(str(text))
    if match is None:
        return None
    unit = _UNITS.get(match.group(3).lower())
    if unit is None:
        return None
    value = Fraction(match.group(1)) * Fraction(10) ** int(match.group(2) or 0) * unit
    return int(value)


def format_size(nbytes: Optional[float]) -> str:
    """`nbytes` in GiB, MiB, KiB or bytes, for messages."""
    if nbytes is None:
        return "unlimited"
    for unit, name in ((GiB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.2f} {name}"
    return f"{int(nbytes)} bytes"


# -- resident sets as bit masks -------------------------------------------------------------------------------------
class _Universe:
    """The offloaded components as bits, each mask's bytes, and which masks fit in `avail` bytes.

    A single component larger than `avail` is still allowed on its own: it is loaded alone (with a warning at run
    time), which is all anyone can do with it.
    """

    def __init__(self, names: Sequence[str], sizes: Mapping[str, int], avail: Optional[int]) -> None:
        self.names = tuple(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.sizes = [int(sizes[name]) for name in self.names]
        self.n = len(self.names)
        self.full = 1 << self.n
        mask_bytes = [0] * self.full
        for mask in range(1, self.full):
            low = mask & -mask
            mask_bytes[mask] = mask_bytes[mask ^ low] + self.sizes[low.bit_length() - 1]
        self.mask_bytes = mask_bytes
        self.avail = avail
        self.feasible = [avail is None or mask_bytes[m] <= avail or (m & (m - 1)) == 0 for m in range(self.full)]

    def mask(self, names: Iterable[str]) -> int:
        mask = 0
        for name in names:
            i = self.index.get(name)
            if i is not None:
                mask |= 1 << i
        return mask

    def names_of(self, mask: int) -> List[str]:
        return [name for i, name in enumerate(self.names) if mask >> i & 1]

    # One event of the backward programme: values before a use of component `i`, from the values after it.
    def before_use(self, after: List[float], i: int) -> List[float]:
        bit, size, full, feasible = 1 << i, self.sizes[i], self.full, self.feasible
        # best[u]: the least value after the event over the sets that may follow from u (subsets holding `bit`).
        best = [after[m] if m & bit and feasible[m] else _INF for m in range(full)]
        for j in range(self.n):
            b = 1 << j
            best = [min(best[m], best[m ^ b]) if m & b else best[m] for m in range(full)]
        return [best[m | bit] if m & bit else best[m | bit] + size for m in range(full)]

    def backward(self, events: Sequence[str], terminal: List[float], keep_between: bool) -> List[List[float]]:
        """`tables[k][mask]`: least future bytes before `events[k]` when `mask` is resident; `tables[-1]` = terminal."""
        tables: List[List[float]] = [terminal] * (len(events) + 1)
        values = terminal
        for k in range(len(events) - 1, -1, -1):
            event = events[k]
            if event == END:
                if not keep_between:
                    values = [values[0]] * self.full  # the call's end evicts everything
            else:
                i = self.index.get(event)
                if i is not None:
                    values = self.before_use(values, i)
            tables[k] = values
        return tables

    def steady_values(self, model: Sequence[str], keep_between: bool) -> Tuple[List[float], int]:
        """Relative values at a call boundary when the model call repeats for ever, and their period in calls.

        Relative value iteration: apply one call's backward programme to the values, subtract the minimum, until an
        iterate repeats. The iterates of such a min-plus system become periodic; `period` is 1 when they converge
        and more when the optimal schedule alternates between calls (the values are then a fixed point of
        `period` calls, and plans must span that many calls to be optimal on average).
        """
        zero: List[float] = [0] * self.full
        if not keep_between:
            return zero, 1
        events = list(model) + [END]
        values = zero
        seen: Dict[Tuple[float, ...], int] = {}
        for round_index in range(MAX_ROUNDS):
            start = self.backward(events, values, True)[0]
            low = min(start)
            relative = tuple(v - low for v in start)
            if relative in seen:
                return list(relative), round_index - seen[relative]
            seen[relative] = round_index
            values = list(relative)
        return values, 1


# -- prediction ---------------------------------------------------------------------------------------------------------
def _chain_after(events: Sequence[str], chain: Sequence[str]) -> List[str]:
    """The chain components after the last chain position `events` reached (what a chain-ordered call does next)."""
    reached = [chain.index(e) for e in events if e in chain]
    return list(chain[max(reached) + 1 :]) if reached else list(chain)


def predict_rest(
    current: Sequence[str],
    model: Sequence[str],
    *,
    chain: Sequence[str] = (),
    learned: bool = True,
    window: int = 8,
    loops: int = 8,
) -> List[str]:
    """The events predicted to follow `current` in this call.

    - `current` is a prefix of `model`: the rest of `model`.
    - With a `learned` model (the previous call's trace): the longest suffix of `current` (at most `window` events)
      found in `model`, at the occurrence that ends nearest to the current position; what followed it there.
    - Otherwise, or if nothing matches: a loop. The longest suffix of `current` that occurred earlier in this call, at
      its latest occurrence, gives a period; the last period repeats `loops` times, then the `chain` goes on after
      the last chain position the loop reached (a denoising loop, then the VAE).
    - Nothing matches at all: the `chain` after the last chain position reached.
    """
    current = tuple(current)
    model = tuple(model)
    k = len(current)
    if k <= len(model) and model[:k] == current:
        return list(model[k:])
    if learned:
        for length in range(min(window, k), 0, -1):
            tail = current[k - length :]
            best = None
            for end in range(length - 1, len(model)):
                if model[end - length + 1 : end + 1] == tail and (
                    best is None or abs(end - k + 1) < abs(best - k + 1)
                ):
                    best = end
            if best is not None:
                return list(model[best + 1 :])
    for length in range(min(window, k - 1), 0, -1):
        tail = current[k - length :]
        for end in range(k - 2, length - 2, -1):
            if current[end - length + 1 : end + 1] == tail:
                unit = current[end + 1 :]
                return list(unit) * loops + _chain_after(unit, chain)
    return _chain_after(current, chain)


class _Plan:
    """Predicted events (`END` between calls), the position of the next one, and the value tables before each."""

    __slots__ = ("model", "events", "terminal", "tables", "pos")

    def __init__(self, model: Tuple[str, ...], events: List[str], terminal, tables=None) -> None:
        self.model = model
        self.events = events
        self.terminal = terminal
        self.tables = tables
        self.pos = 0


class ResidencyPolicy:
    """Keep components on the device within a memory budget; evict what the predicted future needs least.

    Keep one instance for the life of a pipeline's configuration: plans may span calls. The runtime re-creates it
    only when the configuration (components, sizes, budget, options) changes.

    Args:
        order (`Sequence[str]`): Every module component, in the pipeline's order.
        chain (`Sequence[str]`): The offloaded components of `model_cpu_offload_seq`, in chain order (the prediction
            on the first call).
        hooked (`Iterable[str]`): Every component that has an offload hook.
        sizes (`Mapping[str, int]`): Bytes of each component (parameters and buffers).
        pinned (`Iterable[str]`, defaults to `()`): `exclude_from_offload`: on the device once, never moved again.
        bounce (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload`: they run without hooks, so
            they stay on the device like pinned ones (stock moves them out and back at every enable, to no effect).
        budget (`int`, *optional*): Bytes of component weights allowed on the device, pinned and bounce components
            included. `None`: unlimited.
        keep_between (`bool`, defaults to `False`): Keep components on the device at the end of a call (within the
            budget) for the next one; otherwise the end of a call evicts every offloaded component, like stock.
        history (`Iterable[Sequence[str]]`, defaults to `()`): Completed call traces, oldest first.
        current (`Sequence[str]`, defaults to `()`): The trace of the call in progress.
        capacity (`Callable[[int], Optional[int]]`, *optional*): Asked before each onload that might need room, with
            the bytes of weights resident now; returns the bytes the device can hold now (`None`: no limit). The
            runtime passes one on CUDA, where other programs may take memory.
        cache (`dict`, *optional*): Where to keep value tables (shared by policies of one pipeline).
        max_exact (`int`, defaults to `MAX_EXACT`): Above this many offloaded components a greedy rule replaces the
            exact choice: evict what the prediction never uses again, then what it uses last.
        zero_copy (`bool`, defaults to `True`): Whether evictions are free (zero-copy eviction) when the policy
            counts the bytes it moves against stock's.
        measure (`Callable[[str], int]`, *optional*): Current bytes of a component. Asked before each onload that
            might need room, for the component and the resident ones, so that weights added since (LoRA layers,
            new parameters) count against the budget at once.
    """

    def __init__(
        self,
        *,
        order: Sequence[str],
        chain: Sequence[str],
        hooked: Iterable[str],
        sizes: Mapping[str, int],
        pinned: Iterable[str] = (),
        bounce: Iterable[str] = (),
        budget: Optional[int] = None,
        keep_between: bool = False,
        history: Iterable[Sequence[str]] = (),
        current: Sequence[str] = (),
        capacity: Optional[Callable[[int], Optional[int]]] = None,
        cache: Optional[dict] = None,
        max_exact: int = MAX_EXACT,
        zero_copy: bool = True,
        measure: Optional[Callable[[str], int]] = None,
    ) -> None:
        hooked = set(hooked)
        self.order = tuple(order)
        self.hooked = tuple(n for n in self.order if n in hooked)
        self._hooked_set = frozenset(self.hooked)
        self.chain = tuple(n for n in dict.fromkeys(chain) if n in hooked)
        self.pinned = frozenset(pinned)
        self.bounce = frozenset(bounce)
        self.fixed = self.pinned | self.bounce
        self.sizes = {name: int(nbytes) for name, nbytes in sizes.items()}
        self.fixed_bytes = sum(self.sizes[n] for n in self.fixed if n in self.sizes)
        self.budget = budget
        self.avail = None if budget is None else max(int(budget) - self.fixed_bytes, 0)
        self.keep_between = bool(keep_between)
        self.history: List[Tuple[str, ...]] = [tuple(t) for t in history][-HISTORY:]
        self.current: List[str] = []
        self.capacity = capacity
        self.cache = cache if cache is not None else {}
        self.exact = len(self.hooked) <= max_exact
        self.universe = _Universe(self.hooked, self.sizes, self.avail) if self.exact else None
        self.measure = measure
        #: `(component, nbytes, limit)` when the last onload did not fit even alone (it was loaded alone).
        self.last_overflow: Optional[Tuple[str, int, Optional[int]]] = None
        # A shadow of stock's chain policy on the same trace, and the bytes both have moved over the bus (stock
        # copies every eviction back; the manager's zero-copy evictions are free). An eviction of something stock
        # still holds may cost one reload that stock does not pay; the manager allows it only while what it has
        # saved so far covers that (the "credit"), so it never moves more bytes than stock, whatever the trace, even
        # when its prediction is wrong.
        self.zero_copy = bool(zero_copy)
        self._previous = dict(zip(self.chain[1:], self.chain))
        self._stock: Set[str] = set()
        self.stock_moved = 0
        self.moved = 0
        #: False once stock's own resident set exceeded the budget: stock is then no bound to keep.
        self.stock_fits = True
        self._plan: Optional[_Plan] = self._model_plan()
        for name in current:
            self._advance(name)

    @property
    def config(self) -> tuple:
        """What a policy's decisions depend on besides the trace (the runtime reuses a policy while it is equal)."""
        sizes = tuple(sorted(self.sizes.items()))
        options = (self.budget, self.keep_between, self.zero_copy)
        return (self.order, self.chain, self.hooked, self.pinned, self.bounce, sizes) + options

    # -- the protocol ---------------------------------------------------------------------------------------------
    def on_use(self, name: str, resident: Set[str]) -> List[Move]:
        self._advance(name)
        if name in resident or name not in self._hooked_set:
            return []
        self.last_overflow = None
        others = [n for n in self.hooked if n in resident and n != name]
        if self.measure is not None:
            self._measure([name] + others)
        need = self.sizes[name]
        limit = self._limit(resident)
        self.moved += need
        if limit is None or need + sum(self.sizes[n] for n in others) <= limit:
            return [(ONLOAD, name)]
        if need > limit:
            self.last_overflow = (name, need, limit)
            keep: Set[str] = set()
        else:
            keep = self._choose(name, others, limit)
        evicted = [n for n in others if n not in keep]
        if not self.zero_copy:
            self.moved += sum(self.sizes[n] for n in evicted)
        return [(OFFLOAD, n) for n in evicted] + [(ONLOAD, name)]

    def on_enable(self, resident: Set[str]) -> List[Move]:
        """Arm offload; at the end of a call (a trace in progress), the call's trace joins the history."""
        plan = self._plan
        self.stock_moved += sum(self.sizes[n] for n in self._stock)
        self._stock = set()
        if self.current:
            self.history.append(tuple(self.current))
            del self.history[:-HISTORY]
            self.current = []
            if plan is not None and plan.pos < len(plan.events) and plan.events[plan.pos] == END:
                plan.pos += 1
            else:
                plan = None
        else:
            plan = None
        if plan is None or plan.pos >= len(plan.events) or plan.model != self.model:
            plan = self._model_plan()
        self._plan = plan
        others = [n for n in self.hooked if n in resident]
        if not self.keep_between:
            moves: List[Move] = [(OFFLOAD, n) for n in others]
        else:
            keep = set(others)
            if self.avail is not None and sum(self.sizes[n] for n in others) > self.avail:
                keep = self._choose(None, others, self.avail)
            moves = [(OFFLOAD, n) for n in others if n not in keep]
        if not self.zero_copy:
            self.moved += sum(self.sizes[n] for _, n in moves)
        moves += [(ONLOAD, n) for n in self.order if n in self.fixed and n not in resident]
        return moves

    def on_offload_request(self, name: str, resident: Set[str]) -> List[Move]:
        # Pipeline code asking for an eviction: the budget already guarantees room, and an eviction the manager did
        # not plan only costs a reload.
        return []

    def on_call_start(self, history: Iterable[Sequence[str]]) -> None:
        """A pipeline call begins: take the runtime's record of completed calls (failed calls are not in it)."""
        history = [tuple(t) for t in history][-HISTORY:]
        if history != self.history or self.current:
            self.history = history
            self.current = []
            self._plan = self._model_plan()

    # -- prediction ---------------------------------------------------------------------------------------------------
    @property
    def model(self) -> Tuple[str, ...]:
        """The call the next calls are predicted to repeat: the last one, or the chain order before any."""
        return self.history[-1] if self.history else self.chain

    def _advance(self, name: str) -> None:
        self.current.append(name)
        before = self._previous.get(name)
        if before in self._stock:
            self._stock.discard(before)
            self.stock_moved += self.sizes[before]
        if name in self._hooked_set and name not in self._stock:
            self._stock.add(name)
            self.stock_moved += self.sizes[name]
            if self.avail is not None and sum(self.sizes[n] for n in self._stock) > self.avail:
                self.stock_fits = False
        plan = self._plan
        if plan is not None:
            if plan.pos < len(plan.events) and plan.events[plan.pos] == name:
                plan.pos += 1
            else:
                self._plan = None

    def _steady(self, model: Tuple[str, ...]) -> Tuple[List[float], int]:
        key = ("steady", self.hooked, tuple(self.universe.sizes), self.avail, self.keep_between, model)
        found = self.cache.get(key)
        if found is None:
            found = self._remember(key, self.universe.steady_values(model, self.keep_between))
        return found

    def _remember(self, key, value):
        if len(self.cache) >= 32:
            self.cache.clear()
        self.cache[key] = value
        return value

    def _model_plan(self) -> _Plan:
        """A plan from the start of a call: the model call, repeated over one period of the steady state."""
        model = self.model
        fits = self.avail is None or sum(self.sizes[n] for n in self.hooked) <= self.avail
        if not self.exact or (fits and self.capacity is None):
            # No decision to make (or no exact one): the steady values are computed if ever needed.
            return _Plan(model, list(model) + [END], None)
        steady, period = self._steady(model)
        events = (list(model) + [END]) * period
        key = ("tables", self.hooked, tuple(self.universe.sizes), self.avail, self.keep_between, model)
        return _Plan(model, events, steady, self.cache.get(key))

    def _values(self) -> List[float]:
        """Value table (per resident mask) before the next predicted event."""
        plan = self._plan
        if plan is None:
            rest = predict_rest(self.current, self.model, chain=self.chain, learned=bool(self.history))
            # Before any trace is recorded, the next calls are predicted to repeat this one as seen so far plus
            # its predicted rest (closer to the truth than the chain order once the call has shown its shape).
            future = self.model if self.history else tuple(self.current) + tuple(rest)
            steady, _ = self._steady(future)
            plan = self._plan = _Plan(self.model, rest + [END], steady)
        if plan.tables is None:
            if plan.terminal is None:
                plan.terminal = self._steady(plan.model)[0]
            plan.tables = self.universe.backward(plan.events, plan.terminal, self.keep_between)
            if plan.events and plan.pos == 0 and not self.current:
                key = ("tables", self.hooked, tuple(self.universe.sizes), self.avail, self.keep_between, plan.model)
                self._remember(key, plan.tables)
        return plan.tables[min(plan.pos, len(plan.tables) - 1)]

    def _upcoming(self) -> List[str]:
        plan = self._plan
        if plan is not None:
            rest = plan.events[plan.pos :]
        else:
            rest = predict_rest(self.current, self.model, chain=self.chain, learned=bool(self.history)) + [END]
        if self.keep_between:
            rest = rest + list(self.model)
        return rest

    # -- choice ---------------------------------------------------------------------------------------------------------
    def _choose(self, name: Optional[str], others: List[str], limit: int) -> Set[str]:
        """Which of `others` to keep with `name` (`None`: at a call boundary) within `limit` bytes."""
        need = self.sizes[name] if name is not None else 0
        if not self.exact:
            return self._choose_greedy(others, limit - need)
        u = self.universe
        tables = self._first_call_guesses() if name is not None and not self.history else []
        if len(tables) < 2:
            tables = [self._values()]
        bit = u.mask([name]) if name is not None else 0
        pool = u.mask(others)
        room = limit - need
        candidates = []
        sub = pool
        while True:
            nbytes = u.mask_bytes[sub]
            # At a call boundary a component that does not fit even alone may stay, alone (it ran that way).
            if nbytes <= room or sub == 0 or (name is None and sub & (sub - 1) == 0):
                candidates.append((sub, nbytes))
            if sub == 0:
                break
            sub = (sub - 1) & pool
        if name is not None and self.stock_fits:
            # The credit: keep stock's bound (see `__init__`).
            credit = self.stock_moved - self.moved
            stock = u.mask(self._stock)
            copies = 0 if self.zero_copy else 1

            def risk(keep: int) -> int:
                # A reload for each component stock holds and the manager would not; without zero-copy, the copies
                # of this eviction and the ones owed later for what the manager holds beyond stock (stock already
                # paid for evicting those).
                owed = u.mask_bytes[pool & ~keep] + u.mask_bytes[keep & ~stock]
                return u.mask_bytes[stock & ~(keep | bit)] + copies * owed

            allowed = [c for c in candidates if credit >= risk(c[0])]
            if allowed:
                candidates = allowed
        if len(tables) == 1:
            table = tables[0]
            best_mask = min(candidates, key=lambda c: (table[c[0] | bit], -c[1]))[0]
        else:
            # Two guesses about the rest of a first call: the least worst regret over both.
            lows = [min(table[c | bit] for c, _ in candidates) for table in tables]

            def score(candidate):
                values = [table[candidate[0] | bit] for table in tables]
                return (max(v - low for v, low in zip(values, lows)), sum(values), -candidate[1])

            best_mask = min(candidates, key=score)[0]
            self._plan = None  # the next events tell which guess was right; plan again then
        return set(u.names_of(best_mask))

    def _first_call_guesses(self) -> List[List[float]]:
        """On the first call, at a component not seen before in the call: value tables for two guesses about the
        rest of the call. The prediction (the chain goes on; for the last chain component, the call ends), and a
        loop: the component that ran before it runs again, then this one, as a denoiser followed by a preview
        decode would (only right after a short run of it: one denoising step, or two calls of it for a separate
        guidance pass). Only one table when the two agree or no loop is possible."""
        current = tuple(self.current)
        name = current[-1]
        if name in current[:-1] or len(current) < 2:
            return []
        start = len(current) - 2
        while start > 0 and current[start - 1] == current[len(current) - 2]:
            start -= 1
        unit = current[start:]
        if len(unit) > 3:
            return []  # after a long run (a whole denoising loop) this is the final decode, not a preview
        loop = list(unit) * 8 + _chain_after(unit, self.chain)
        rest = predict_rest(current, self.model, chain=self.chain, learned=False)
        if loop == rest:
            return []
        tables = []
        for guess in (rest, loop):
            steady, _ = self._steady(current + tuple(guess))
            tables.append(self.universe.backward(guess + [END], steady, self.keep_between)[0])
        return tables

    def _choose_greedy(self, others: List[str], room: int) -> Set[str]:
        upcoming = self._upcoming()
        first: Dict[str, int] = {}
        for position, event in enumerate(upcoming):
            first.setdefault(event, position)
        protected = [n for n in others if n in self._stock]
        credit = self.stock_moved - self.moved
        worst = (1 if self.zero_copy else 2) * sum(self.sizes.values())
        if not self.stock_fits or sum(self.sizes[n] for n in protected) > room or credit >= worst:
            protected = []
        # Evict first what is never used again, then what is used last; larger first on ties; what stock holds last.
        ranked = sorted(others, key=lambda n: (n in protected, n in first, -first.get(n, 0), -self.sizes[n]))
        keep = set(others)
        held = sum(self.sizes[n] for n in others)
        for victim in ranked:
            if held <= room:
                break
            keep.discard(victim)
            held -= self.sizes[victim]
        return keep

    def _measure(self, names: List[str]) -> None:
        """Take the components' current sizes; when one changed, the plan's tables are stale."""
        changed = False
        for name in names:
            nbytes = int(self.measure(name))
            if nbytes != self.sizes.get(name):
                self.sizes[name] = nbytes
                changed = True
        if changed:
            self.fixed_bytes = sum(self.sizes[n] for n in self.fixed if n in self.sizes)
            self.avail = None if self.budget is None else max(int(self.budget) - self.fixed_bytes, 0)
            if self.exact:
                self.universe = _Universe(self.hooked, self.sizes, self.avail)
            self._plan = None

    def _limit(self, resident: Set[str]) -> Optional[int]:
        limit = self.avail
        if self.capacity is not None:
            held = self.fixed_bytes + sum(self.sizes[n] for n in self.hooked if n in resident)
            capacity = self.capacity(held)
            if capacity is not None:
                room = max(int(capacity) - self.fixed_bytes, 0)
                limit = room if limit is None else min(limit, room)
        return limit


# -- the offline optimum ------------------------------------------------------------------------------------------------
class Optimum(NamedTuple):
    """Result of `optimal_bytes`.

    Args:
        total (`int`): Least host-to-device bytes for the whole trace.
        after_call (`List[int]`): Least bytes for the calls up to and including each `END` (the optimum of that
            prefix of the trace on its own). `after_call[0]` is the best first call; the difference of the last two
            entries is the steady-state cost of one more call.
    """

    total: int
    after_call: List[int]


def optimal_bytes(
    trace: Iterable[str],
    sizes: Mapping[str, int],
    budget: Optional[int] = None,
    *,
    fixed: Iterable[str] = (),
    keep_between: bool = True,
) -> Optimum:
    """The exact least host-to-device bytes to run `trace` within `budget`, evicting for free at any time.

    Everything starts on the host; the running component must be on the device; components in `fixed` are always
    there and count against the budget. A component that does not fit even alone may run alone. With
    `keep_between=False` every call's end empties the device, as stock does.

    Args:
        trace (`Iterable[str]`): Component names in the order they ran; `END` marks the end of each call.
        sizes (`Mapping[str, int]`): Bytes of each component.
        budget (`int`, *optional*): Bytes allowed on the device; `None`: unlimited.
        fixed (`Iterable[str]`, defaults to `()`): Components always on the device (not moved, not counted as moves).
        keep_between (`bool`, defaults to `True`): Whether components may stay on the device from one call to the next.

    Returns:
        `Optimum`: `total` and `after_call`.
    """
    trace = list(trace)
    fixed = set(fixed)
    names = [n for n in dict.fromkeys(trace) if n != END and n not in fixed]
    avail = None if budget is None else max(int(budget) - sum(sizes[n] for n in fixed), 0)
    u = _Universe(names, sizes, avail)
    full = u.full
    reach: List[float] = [_INF] * full
    reach[0] = 0
    after_call: List[int] = []
    for event in trace:
        if event == END:
            if not keep_between:
                reach = [min(reach)] + [_INF] * (full - 1)
            after_call.append(int(min(reach)))
            continue
        if event in fixed:
            continue
        i = u.index[event]
        bit, size = 1 << i, u.sizes[i]
        # Free eviction: a set is reachable at the cost of its cheapest superset.
        down = list(reach)
        for j in range(u.n):
            b = 1 << j
            down = [down[m] if m & b else min(down[m], down[m | b]) for m in range(full)]
        reach = [min(down[m], down[m ^ bit] + size) if m & bit and u.feasible[m] else _INF for m in range(full)]
    return Optimum(int(min(reach)), after_call)


# -- simulation (for tests and benchmarks) -------------------------------------------------------------------------------
class Simulation(NamedTuple):
    """Result of `simulate`.

    Args:
        moves (`List[Tuple[str, str, int, str, Optional[int]]]`): `(direction, component, nbytes, kind, call_index)`
            for every move, like the ledger's records (`call_index` `None` for the moves of the first enable).
        peak (`int`): Most bytes of weights on the device at once.
        per_call (`List[int]`): Bytes that crossed the bus in each call (host-to-device copies plus device-to-host
            copies; dropped evictions are free).
    """

    moves: List[Tuple[str, str, int, str, Optional[int]]]
    peak: int
    per_call: List[int]

    @property
    def copied(self) -> int:
        return sum(nbytes for _, _, nbytes, kind, _ in self.moves if kind == "copy")

    @property
    def onloaded(self) -> int:
        return sum(nbytes for direction, _, nbytes, _, _ in self.moves if direction == ONLOAD)


def simulate(policy, trace: Iterable[str], sizes: Mapping[str, int], *, zero_copy: bool = False) -> Simulation:
    """Replay `trace` (with `END` markers) through `policy` from an all-on-host pipeline, as the runtime would.

    Args:
        policy (`ChainPolicy` or `ResidencyPolicy`): The policy.
        trace (`Iterable[str]`): Component names in the order they ran; `END` marks the end of each call.
        sizes (`Mapping[str, int]`): Bytes of each component.
        zero_copy (`bool`, defaults to `False`): Evictions only drop the device copy (the weights never change in a
            replay), as the runtime does with `zero_copy_eviction` on.

    Returns:
        `Simulation`: the moves (with their kind and call index), the peak bytes on the device, bytes per call.
    """
    resident: Set[str] = set()
    moves: List[Tuple[str, str, int, str, Optional[int]]] = []
    per_call: List[int] = []
    state = {"peak": 0, "call": None}

    def run(decided: List[Move]) -> None:
        for direction, name in decided:
            kind = "drop" if direction == OFFLOAD and zero_copy else "copy"
            moves.append((direction, name, sizes[name], kind, state["call"]))
            if direction == ONLOAD:
                resident.add(name)
            else:
                resident.discard(name)
            if kind == "copy" and state["call"] is not None:
                per_call[state["call"]] += sizes[name]
        state["peak"] = max(state["peak"], sum(sizes[n] for n in resident))

    run(policy.on_enable(resident))
    in_call = False
    for event in trace:
        if not in_call:
            state["call"] = len(per_call)
            per_call.append(0)
            in_call = True
        if event == END:
            run(policy.on_enable(resident))
            in_call = False
        else:
            run(policy.on_use(event, resident))
    return Simulation(moves, state["peak"], per_call)
