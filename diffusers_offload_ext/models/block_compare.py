"""The `block_residency` entry of a plan: how the components that do not fit the budget stream their blocks, the
modelled block-granular optimum across components, and bytes and seconds per generation of the residency manager,
that optimum, sequential, group and stock offload, each with the bandwidth and the overlap it assumes.

The optimum is a model, not a replay: every block of every offloaded component is an item whose uses are its
component's uses per generation (a denoiser block once per forward, a text-encoder layer once per call), the most
used are kept on the device for good (`policies.choose_blocks`: greedy, within one block of the best static choice,
with the ring inside the room) and the others stream at each use. A component's rest, when it is not kept, is loaded
when the component runs and held beside the ring while it runs (every subset of rests is tried). The runtime does
not do this: it keeps whole components and streams only those that do not fit (or run once beside the others).
"""

from __future__ import annotations

from typing import Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..blocks.choice import Item, choose_blocks
from ..units import format_size
from .block_model import REST, BlockPlans

#: Up to this many components the rests kept by the optimum are chosen exactly (2**n subsets); above, rests stream
#: through the ring like blocks.
MAX_RESTS = 10


class GlobalPlan(NamedTuple):
    """The optimum's blocks: `kept` keys on the device for good, `streamed` keys; `kept_bytes`, `ring_bytes`,
    `rest_bytes` (the largest rest held beside the ring while its component runs), `streamed_bytes` per generation
    (each streamed block's bytes times its uses) and `device_bytes` (their most on the device at once)."""

    kept: Tuple
    streamed: Tuple
    kept_bytes: int
    ring_bytes: int
    rest_bytes: int
    streamed_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.kept_bytes + self.ring_bytes + self.rest_bytes


def global_plan(items: Sequence[Item], room: int, rests: Iterable = ()) -> Optional[GlobalPlan]:
    """The blocks of several components to keep for good within `room` bytes, the ring and a held rest included,
    that stream the fewest bytes per generation; `None` when not even the ring fits.

    Args:
        items (`Sequence[Item]`): Every block of every component, with its uses per generation.
        room (`int`): Device bytes for all of them.
        rests (`Iterable`): The keys of the components' rests (held beside the ring when not kept).
    """
    rests = [i for i in items if i.key in set(rests)]
    if len(rests) > MAX_RESTS:
        rests = []
    blocks = [i for i in items if i not in rests]
    best = None
    for mask in range(1 << len(rests)):
        kept = [r for k, r in enumerate(rests) if mask >> k & 1]
        loose = [r for k, r in enumerate(rests) if not mask >> k & 1]
        held = max((r.nbytes for r in loose if r.uses), default=0)
        plan = choose_blocks(blocks, room - held - sum(r.nbytes for r in kept))
        if plan is None:
            continue
        candidate = GlobalPlan(
            kept=tuple(i.key for i in items if i.key in plan.kept or i in kept),
            streamed=tuple(i.key for i in items if i.key in plan.streamed or i in loose),
            kept_bytes=plan.kept_bytes + sum(r.nbytes for r in kept),
            ring_bytes=plan.ring_bytes,
            rest_bytes=held,
            streamed_bytes=plan.streamed_bytes + sum(r.nbytes * r.uses for r in loose),
        )
        if best is None or (candidate.streamed_bytes, candidate.device_bytes) < (
            best.streamed_bytes,
            best.device_bytes,
        ):
            best = candidate
    return best


def model_items(plans: BlockPlans, components: Sequence[str], call: Sequence[str]) -> List[Item]:
    """`(component, block)` items of every block of `components`, each used as often as its component in `call`."""
    return [
        Item((name, block), nbytes, call.count(name))
        for name in components
        for block, nbytes in plans.blocks(name).items()
    ]


class Cost(NamedTuple):
    """One generation's copies: `serial` host-to-device bytes that add in full, `d2h` bytes copied back, and
    `passes` `(count, bytes each)` of blocks streamed during a denoiser forward (hidden behind its compute up to the
    compute time), all host-to-device at `rate` bytes per second."""

    serial: float
    d2h: float
    passes: Tuple[Tuple[int, float], ...]
    rate: int

    @property
    def nbytes(self) -> float:
        return self.serial + self.d2h + sum(count * each for count, each in self.passes)


def seconds(cost: Cost, d2h_rate: int, forwards: int, step: Optional[float]) -> float:
    """Seconds of one generation: without `step`, the copies alone; with `step` (seconds of one denoiser forward
    without offload), the denoiser's compute plus every serial copy plus what each pass takes beyond `step`."""
    serial = cost.serial / cost.rate + cost.d2h / d2h_rate
    if step is None:
        return serial + sum(count * each / cost.rate for count, each in cost.passes)
    return forwards * step + serial + sum(count * max(0.0, each / cost.rate - step) for count, each in cost.passes)


def replayed_costs(moved, denoisers: Iterable[str], rate: int) -> Tuple[Cost, Optional[Cost]]:
    """The first and the steady generation (the mean of the last period of the replayed ones; `None` after a
    single generation) of a replayed strategy (`generations.Generations`)."""

    def cost(index: int) -> Cost:
        m, passes = moved.calls[index], moved.passes[index] if moved.passes else {}
        streamed = [passes[d] for d in denoisers if d in passes]
        serial = m.h2d - sum(nbytes for _, nbytes in streamed)
        return Cost(serial, m.d2h, tuple((count, nbytes / count) for count, nbytes in streamed), rate)

    if len(moved.calls) < 2:
        return cost(0), None
    last = [cost(i) for i in range(len(moved.calls))[-(moved.period or 1) :]]
    mean = Cost(
        sum(c.serial for c in last) / len(last),
        sum(c.d2h for c in last) / len(last),
        tuple(p for c in last for p in c.passes),
        rate,
    )
    return cost(0), mean._replace(passes=tuple((count / len(last), each) for count, each in mean.passes))


def streaming_entry(plans: BlockPlans, name: str, size: int, room: int, forwards: int, stays: bool = False) -> dict:
    """How component `name` (`size` bytes, larger than `room`) streams, or why it cannot; `stays`: its stream stays
    between generations (kept between them, no steady generation copies its kept blocks again)."""
    plan = plans.plan(name, room)
    entry = {"component_bytes": size, "forwards_per_generation": forwards, "available": plan is not None}
    if plan is None:
        least = plans.least_room(name)
        needs = "it has no repeated blocks" if least is None else f"it needs at least {format_size(least)} to stream"
        entry["reason"] = (
            f"{name} cannot stream in the {format_size(max(room, 0))} the budget leaves it: {needs} (its rest, any "
            "block larger than the ring's buffers, and a ring of 3 buffers), so these do not fit (the runtime loads "
            "it alone, over the budget); raise --vram or lower --reserve"
        )
        return entry
    return dict(
        entry,
        blocks={"resident": list(plan.kept), "streamed": list(plan.streamed)},
        kept_bytes=plan.kept_bytes,
        ring_bytes=plan.ring_bytes,
        slots=plan.slots,
        device_bytes=plan.device_bytes,
        streamed_bytes_per_forward=plan.streamed_bytes,
        kept_between_generations=stays,
    )


#: The rows of the comparison, in the order they are shown.
ROWS = {
    "budget": "budget, pin_memory=False",
    "budget_pinned": "budget (defaults on CUDA: pin_memory, prefetch)",
    "optimum": "static block optimum (modelled)",
    "sequential": "sequential",
    "group": "group (block level)",
    "stock": "stock",
}
BANDWIDTH_NOTE = (
    "budget (the recommended call as it runs on CUDA by default, as with pin_memory=True, prefetch=True), the block "
    "optimum and group offload (use_stream=True) copy from page-locked host memory at the pinned rate; budget with "
    "pin_memory=False copies from pageable memory at the host-to-device rate, nothing hidden behind compute, as do "
    "stock and sequential offload (stock copies evictions back at the device-to-host rate)"
)
OVERLAP_COPIES = (
    "seconds are the copies alone: no compute, nothing overlapped (give --step-seconds, the seconds of one denoiser "
    "forward on the card without offload, to model seconds per image with streamed copies hidden behind compute)"
)
OVERLAP_COMPUTE = (
    "seconds per image = {forwards} denoiser forwards x {step:g} s (--step-seconds; the text encoders' and the VAE's "
    "compute not counted) + the copies; ASSUMED overlap: the blocks streamed during a denoiser forward (budget and "
    "optimum with prefetch=True, group offload with use_stream=True) are hidden behind its compute up to its "
    "compute time, only the excess adds; every other copy (whole components, kept blocks, text-encoder blocks, "
    "stock's and sequential offload's moves) adds in full"
)


def optimum_costs(optimum: GlobalPlan, items: Sequence[Item], denoisers, rate: int) -> Tuple[Cost, Cost]:
    """First and steady generation of the block optimum: its kept blocks copied once, the others at each use."""
    streamed, uses, keys = {}, {}, set(optimum.streamed)
    for item in items:
        if item.key in keys:
            streamed[item.key[0]] = streamed.get(item.key[0], 0) + item.nbytes
            uses[item.key[0]] = item.uses
    passes = tuple((uses[d], streamed[d]) for d in denoisers if streamed.get(d) and uses[d])
    others = sum(nbytes * uses[name] for name, nbytes in streamed.items() if name not in denoisers)
    return Cost(optimum.kept_bytes + others, 0, passes, rate), Cost(others, 0, passes, rate)


def comparison(loaded, request, call, moved: Mapping, optimum, items, denoisers, budget: int, room: int) -> dict:
    """Each row's bytes and seconds, first and steady generation, and whether its weights fit."""
    sizes = loaded.sizes
    hooked = {item.key[0] for item in items}
    pinned, pageable = request.pinned_rate, request.h2d_rate
    group = Cost(sum(sizes[n] for n in call if n in hooked and n not in denoisers), 0, (), pinned)
    everything = Cost(sum(sizes[n] for n in call if n in hooked), 0, (), pageable)
    costs = {
        "budget": replayed_costs(moved["residency"], (), pageable),  # the call as recommended
        "budget_pinned": replayed_costs(moved["residency"], denoisers, pinned),
        "optimum": optimum_costs(optimum, items, denoisers, pinned) if optimum is not None else None,
        "sequential": (everything, everything),
        "group": (group._replace(passes=tuple((call.count(d), sizes[d]) for d in denoisers)),) * 2,
        "stock": replayed_costs(moved["stock"], (), pageable),
    }
    forwards = sum(call.count(d) for d in denoisers)
    rows = {}
    for key, pair in costs.items():
        if pair is None:
            continue
        first, steady = pair[0], pair[1] if request.generations > 1 else None
        rows[key] = {
            "label": ROWS[key],
            "first_generation_bytes": first.nbytes,
            "steady_generation_bytes": steady.nbytes if steady is not None else None,
            "seconds_first": seconds(first, request.d2h_rate, forwards, request.step_seconds),
            "seconds_steady": seconds(steady, request.d2h_rate, forwards, request.step_seconds) if steady else None,
        }
    rows["budget"]["fits"] = moved["residency"].peak <= budget  # the round-trip components included
    rows["budget_pinned"]["fits"] = rows["budget"]["fits"]
    if "optimum" in rows:
        rows["optimum"]["fits"] = optimum.device_bytes <= room
    rows["stock"]["fits"] = moved["stock"].peak + loaded.fixed_bytes <= request.vram
    return rows


def optimum_entry(plans: BlockPlans, optimum, hooked) -> dict:
    """The `optimum` entry of `block_residency`: the static block optimum's kept blocks and bytes."""
    if optimum is None:
        return {"available": False, "reason": "not even a ring of 3 of the smallest blocks fits"}
    kept = {n: [key[1] for key in optimum.kept if key[0] == n] for n in hooked}
    return dict(
        available=True,
        blocks={n: {"kept": kept[n], "of": len(plans.blocks(n))} for n in hooked},
        **{f: getattr(optimum, f) for f in ("kept_bytes", "ring_bytes", "rest_bytes", "device_bytes")},
        streamed_bytes_per_generation=optimum.streamed_bytes,
    )


def block_residency(
    loaded, request, call, plans: BlockPlans, moved: Mapping, budget: Optional[int], exact: bool = False
) -> dict:
    """The `block_residency` entry of a plan (see the module docstring); `budget` is the residency manager's
    (`None` when the reserve leaves none). With `exact`, also the block optimum's row (`block_optimum.py`: seconds
    of numpy) and the budget row's ratio to it."""
    arranged = loaded.layout.arrange()
    sizes = loaded.sizes
    hooked = [n for n in arranged.hooked if n in sizes]
    if budget is None or not hooked:
        return {"needed": False, "reason": "no memory budget to plan for" if hooked else "no component is offloaded"}
    room = budget - sum(sizes[n] for n in arranged.round_trip if n in sizes)
    if sum(sizes[n] for n in hooked) <= room:
        reason = "every offloaded component fits the budget together: nothing streams, and blocks would save nothing"
        return {"needed": False, "room_bytes": room, "reason": reason}
    items = model_items(plans, hooked, call)
    optimum = global_plan(items, room, [(n, REST) for n in hooked])
    onloaded = moved["residency"].loaded
    stays = {
        n: len(onloaded) > 1 and n not in onloaded[-1] for n in hooked
    }  # its kept blocks not copied in a steady one
    streaming = {
        n: streaming_entry(plans, n, sizes[n], room, call.count(n), stays[n]) for n in hooked if sizes[n] > room
    }
    entry = {"needed": True, "budget_bytes": budget, "room_bytes": room, "streaming": streaming}
    entry["optimum"] = optimum_entry(plans, optimum, hooked)
    denoisers = [d for d in loaded.denoisers if d in hooked]
    entry["rows"] = comparison(loaded, request, call, moved, optimum, items, denoisers, budget, room)
    if exact:
        from .block_optimum import add_optimum

        add_optimum(entry["rows"], plans, hooked, call, sizes, room, request.h2d_rate)
    forwards = sum(call.count(d) for d in denoisers)
    entry["assumptions"] = {
        "pinned_bytes_per_s": request.pinned_rate,
        "pageable_bytes_per_s": request.h2d_rate,
        "d2h_bytes_per_s": request.d2h_rate,
        "step_seconds": request.step_seconds,
        "bandwidth": BANDWIDTH_NOTE,
        "overlap": (
            OVERLAP_COPIES
            if request.step_seconds is None
            else OVERLAP_COMPUTE.format(forwards=forwards, step=request.step_seconds)
        ),
    }
    return entry
