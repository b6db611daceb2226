"""`StockShadow`: stock's chain replayed beside the residency manager on the same trace, so that the manager can
keep its promise never to move more bytes than stock would have."""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Sequence, Set


class StockShadow:
    """What stock's chain would hold and would have moved, beside what the manager has moved.

    An eviction of something stock still holds may cost one reload that stock does not pay; the manager allows it
    only while what it has saved so far (the credit) covers that, so it never moves more bytes than stock, whatever
    the trace, even when its prediction is wrong.

    Args:
        chain (`Sequence[str]`): Stock's chain.
        hooked (`Iterable[str]`): The components with hooks.
        zero_copy (`bool`): Whether the manager's evictions are free (stock copies every eviction back).
    """

    def __init__(self, chain: Sequence[str], hooked: Iterable[str], zero_copy: bool) -> None:
        self.previous: Dict[str, str] = dict(zip(chain[1:], chain))
        self.hooked = frozenset(hooked)
        self.zero_copy = zero_copy
        #: What stock holds now.
        self.holds: Set[str] = set()
        self.stock_moved = 0
        self.moved = 0
        #: False once stock's own resident set exceeded the budget: stock is then no bound to keep.
        self.fits = True

    @property
    def credit(self) -> int:
        return self.stock_moved - self.moved

    def use(self, name: str, sizes: Mapping[str, int], avail: Optional[int]) -> None:
        """`name` runs: stock evicts its chain predecessor (copying it back) and loads it."""
        before = self.previous.get(name)
        if before in self.holds:
            self.holds.discard(before)
            self.stock_moved += sizes[before]
        if name in self.hooked and name not in self.holds:
            self.holds.add(name)
            self.stock_moved += sizes[name]
            if avail is not None and sum(sizes[n] for n in self.holds) > avail:
                self.fits = False

    def arm(self, sizes: Mapping[str, int]) -> None:
        """Offload armed: stock copies everything it holds back to the host."""
        self.stock_moved += sum(sizes[n] for n in self.holds)
        self.holds = set()

    def count(self, onloaded: int = 0, evicted: int = 0) -> None:
        """The manager moved `onloaded` bytes up and evicted `evicted` bytes (copied back unless zero-copy)."""
        self.moved += onloaded + (0 if self.zero_copy else evicted)

    def allows(self, u, keep: int, pool: int, bit: int) -> bool:
        """Whether keeping mask `keep` of `pool` (evicting the rest) while `bit` loads keeps stock's bound: a reload
        for each component stock holds and the manager would not; without zero-copy, the copies of this eviction
        and the ones owed later for what the manager holds beyond stock (stock already paid for evicting those)."""
        stock = u.mask(self.holds)
        copies = 0 if self.zero_copy else 1
        owed = u.mask_bytes[pool & ~keep] + u.mask_bytes[keep & ~stock]
        return self.credit >= u.mask_bytes[stock & ~(keep | bit)] + copies * owed

    def protected(self, others: Iterable[str], sizes: Mapping[str, int], room: int) -> Set[str]:
        """For the greedy rule: the components to evict last (stock holds them), while the bound can be kept."""
        protected = {n for n in others if n in self.holds}
        worst = (1 if self.zero_copy else 2) * sum(sizes.values())
        if not self.fits or sum(sizes[n] for n in protected) > room or self.credit >= worst:
            return set()
        return protected
