"""`StreamLessons`: what the streams of one pipeline learn from a call (the order their blocks run in, how often each
runs, which blocks each use of a component runs) and when it becomes the plan of the next calls: at a call's end,
unless the call failed (a partial pass: blocks that did not run would weigh nothing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from .items import block_choice

if TYPE_CHECKING:  # pragma: no cover
    from .streamer import BlockStreamer


class StreamLessons:
    """A mixin for `BlockStreams` (its `active` streamers, `choices`, `rooms`, `learned`, `this_call`, `runs`)."""

    active: Dict
    learned: Dict
    this_call: Dict

    def unlearn(self, name: str) -> None:
        """What component `name`'s stream counted since its last call's end ran for another pipeline sharing it."""
        streamer = self.active[name]
        streamer.uses = dict.fromkeys(streamer.uses, 0)

    def replanned(self) -> list:
        """The streams that, weighed by the uses their blocks had in this call, would keep other blocks (or size their
        ring otherwise) within the room they were given: started without knowing their uses (a first call keeps the
        VAE's encoder blocks for a decode). Stopped at the call's end, they start again with the better plan."""
        stale = []
        for name, streamer in self.active.items():
            if name in self.rooms and any(streamer.uses.values()):  # a stream the policy keeps is its to change
                choice, _, _ = block_choice(streamer.component, self.rooms[name], dict(streamer.uses))
                now = self.choices[name]
                if choice is None or (set(choice.kept), choice.slot_bytes) != (set(now.kept), now.slot_bytes):
                    stale.append(name)
        return stale

    def begin_use(self, name: str, index: int) -> None:
        """Component `name` runs for the `index`-th time in the call: what its blocks run now is that use's."""
        streamer = self.active.get(name)
        if streamer is not None:
            streamer.use_index = index

    def _keep_runs(self, name: str, streamer: BlockStreamer) -> None:
        if streamer.runs_by_use:
            found = {i: frozenset(blocks) for i, blocks in streamer.runs_by_use.items()}
            self._runs_this_call.setdefault(name, {}).update(found)
        streamer.runs_by_use, streamer.use_index = {}, None

    def end_call(self, failed: bool) -> None:
        """The call in progress ended: what its streams learned is the plan of the next calls, unless it `failed` (a
        partial pass: blocks that did not run would weigh nothing). A stream that stays between calls learns what
        this call ran and counts the next call's uses afresh."""
        for name, streamer in self.active.items():
            self._keep_runs(name, streamer)
        if not failed:
            for name, found in self._runs_this_call.items():
                self.runs.setdefault(name, {}).update(found)
        self._runs_this_call = {}
        if not failed:
            self.learned.update(self.this_call)
            for name, streamer in self.active.items():
                if any(streamer.uses.values()):
                    if streamer.seen:  # a pass that never repeated (one decode) is the order too
                        streamer._learned()
                    self.learned[name] = (tuple(streamer.ran or streamer.runs), dict(streamer.uses))
        self.this_call.clear()
        for streamer in self.active.values():
            streamer.uses = dict.fromkeys(streamer.uses, 0)

    def _learn(self, name: str, streamer: BlockStreamer) -> None:
        self._keep_runs(name, streamer)
        for held in (self.choices, self.plans, self.rooms, self.built, self.why):
            held.pop(name, None)
        if any(streamer.uses.values()):
            learned = self.this_call if self.calls.in_call else self.learned
            learned[name] = (tuple(streamer.ran or streamer.runs), dict(streamer.uses))
