"""The residency policy's forecast: the predicted events of this call and the next ones, and the exact value tables
over resident sets for them, cached across calls and policies of one pipeline."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..constants import END
from .prediction import chain_after, predict_rest

#: Value tables kept per pipeline (a new configuration starts afresh past this).
CACHE_ENTRIES = 32


class Forecast:
    """Predicted events (`END` between calls), the position of the next one, and the value tables before each."""

    __slots__ = ("model", "events", "terminal", "tables", "pos", "done")

    def __init__(self, model: Tuple[str, ...], events: List[str], terminal=None, tables=None, done=()) -> None:
        self.model = model
        self.events = events
        self.terminal = terminal
        self.tables = tables
        self.pos = 0
        self.done = tuple(done)  # the uses of the call in progress before the first event


class Forecaster:
    """Forecasts for one universe of offloaded components.

    Args:
        universe (`masks.Universe`, `BlockUniverse` or `None`): The components (or their blocks) as bit masks;
            `None` when there are too many for exact tables (then only the predicted events are kept).
        keep_between (`bool`): Whether components stay on the device from one call to the next.
        cache (`dict`): Value tables shared by the policies of one pipeline.
        entries (`int`, defaults to `CACHE_ENTRIES`): Most tables kept in `cache` (it starts afresh past this).
    """

    def __init__(self, universe, keep_between: bool, cache: dict, entries: int = CACHE_ENTRIES) -> None:
        self.universe = universe
        self.keep_between = keep_between
        self.cache = cache
        self.entries = entries
        self.forecast: Optional[Forecast] = None

    def _key(self, kind: str, model: Tuple[str, ...]) -> tuple:
        u = self.universe
        return (kind, u.names, tuple(u.sizes), u.avail, self.keep_between, model)

    def _remember(self, key, value):
        if len(self.cache) >= self.entries:
            self.cache.clear()
        self.cache[key] = value
        return value

    def steady(self, model: Tuple[str, ...]) -> Tuple[List[float], int]:
        key = self._key("steady", model)
        found = self.cache.get(key)
        if found is None:
            found = self._remember(key, self.universe.steady_values(model, self.keep_between))
        return found

    def start(self, model: Tuple[str, ...], decisions_possible: bool) -> None:
        """Forecast from the start of a call: the model call, repeated over one period of the steady state."""
        if self.universe is None or not decisions_possible:
            # No decision to make (or no exact one): the steady values are computed if ever needed.
            self.forecast = Forecast(model, list(model) + [END])
            return
        steady, period = self.steady(model)
        self.forecast = Forecast(
            model, (list(model) + [END]) * period, steady, self.cache.get(self._key("tables", model))
        )

    def advance(self, name: str, times: int = 1) -> None:
        """`name` ran `times` times in a row: move along the forecast, or drop it when the call went another way."""
        forecast = self.forecast
        if forecast is None:
            return
        events, pos = forecast.events, forecast.pos
        while times and pos < len(events) and events[pos] == name:
            pos, times = pos + 1, times - 1
        forecast.pos = pos
        if times:
            self.forecast = None

    def end_call(self, model: Tuple[str, ...], decisions_possible: bool) -> None:
        """A call ended: step over the forecast's `END`, or forecast afresh from `model` (the call that just ended)."""
        forecast = self.forecast
        if forecast is not None and forecast.pos < len(forecast.events) and forecast.events[forecast.pos] == END:
            forecast.pos += 1
        else:
            forecast = None
        if forecast is None or forecast.pos >= len(forecast.events) or forecast.model != model:
            self.start(model, decisions_possible)
        else:
            self.forecast = forecast

    def values(self, current: Sequence[str], model: Tuple[str, ...], chain: Sequence[str], learned: bool):
        """Value table (per resident mask) before the next predicted event."""
        forecast = self.forecast
        if forecast is None:
            rest = predict_rest(current, model, chain=chain, learned=learned)
            # Before any trace is recorded, the next calls are predicted to repeat this one as seen so far plus
            # its predicted rest (closer to the truth than the chain order once the call has shown its shape).
            future = model if learned else tuple(current) + tuple(rest)
            forecast = self.forecast = Forecast(model, rest + [END], self.steady(future)[0], done=current)
        if forecast.tables is None:
            if forecast.terminal is None:
                forecast.terminal = self.steady(forecast.model)[0]
            forecast.tables = self.universe.backward(
                forecast.events, forecast.terminal, self.keep_between, forecast.done
            )
            if forecast.events and forecast.pos == 0 and not current:
                self._remember(self._key("tables", forecast.model), forecast.tables)
        return forecast.tables[min(forecast.pos, len(forecast.tables) - 1)]

    def upcoming(self, current: Sequence[str], model: Tuple[str, ...], chain: Sequence[str], learned: bool):
        """The predicted events from now on, this call's rest and (when components stay between calls) the next."""
        forecast = self.forecast
        if forecast is not None:
            rest = forecast.events[forecast.pos :]
        else:
            rest = predict_rest(current, model, chain=chain, learned=learned) + [END]
        return rest + list(model) if self.keep_between else rest

    def first_call_guesses(self, current: Sequence[str], model: Tuple[str, ...], chain: Sequence[str]):
        """On the first call, at a component not seen before in the call: value tables for two guesses about the
        rest of the call (`first_call_events`). Only one table (none returned) when the two agree or no loop is
        possible."""
        guesses = self.first_call_events(current, model, chain)
        if guesses is None:
            return []
        tables = []
        for guess in guesses:
            steady, _ = self.steady(tuple(current) + tuple(guess))
            tables.append(self.universe.backward(guess + [END], steady, self.keep_between)[0])
        return tables

    @staticmethod
    def first_call_events(current: Sequence[str], model: Tuple[str, ...], chain: Sequence[str]):
        """`(prediction, loop)`: two guesses about the rest of a first call, at a component not seen before in it. The
        prediction (the chain goes on; for the last chain component, the call ends), and a loop: the component that
        ran before it runs again, then this one, as a denoiser followed by a preview decode would (only right after
        a short run of it: one denoising step, or two calls of it for a separate guidance pass). `None` when the two
        agree or no loop is possible."""
        current = tuple(current)
        name = current[-1] if current else None
        if name is None or name in current[:-1] or len(current) < 2:
            return None
        start = len(current) - 2
        while start > 0 and current[start - 1] == current[len(current) - 2]:
            start -= 1
        unit = current[start:]
        if len(unit) > 3:
            return None  # after a long run (a whole denoising loop) this is the final decode, not a preview
        loop = list(unit) * 8 + chain_after(unit, chain)
        rest = predict_rest(current, model, chain=chain, learned=False)
        return None if loop == rest else (rest, loop)
