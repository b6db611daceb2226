"""What the activations of each call shape need, learnt: the shape read from a call's arguments, the device memory a
call used beyond the pipeline's weights (on CUDA, from the allocator's peak through `transfer/memory.py`), and what
out-of-memory errors taught. The automatic budget's reserve, and the budget's limit, for a shape come from here."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..residency.reserve import MAX_MISSES, reserve_for
from ..transfer import memory

#: The call arguments that make a call's shape (besides how many prompts and the input image's size).
SHAPE_ARGUMENTS = ("height", "width", "num_frames", "num_images_per_prompt", "num_videos_per_prompt", "batch_size")
#: Call shapes remembered per pipeline (the least recently used is forgotten first).
MAX_SHAPES = 32

Shape = Tuple[Tuple[str, object], ...]


def call_shape(args: tuple, kwargs: dict) -> Shape:
    """The shape of a pipeline call, from its arguments: `SHAPE_ARGUMENTS` given as integers, how many prompts (a
    list of them, or `prompt_embeds`' batch) and the input `image`'s height and width. Arguments left to the pipeline's
    defaults are not in it (the same defaults give the same shape)."""
    shape = [(name, kwargs[name]) for name in SHAPE_ARGUMENTS if _integer(kwargs.get(name))]
    prompt = kwargs.get("prompt", args[0] if args else None)
    embeds = kwargs.get("prompt_embeds")
    if isinstance(prompt, (list, tuple)):
        shape.append(("prompts", len(prompt)))
    elif prompt is None and isinstance(embeds, torch.Tensor) and embeds.dim():
        shape.append(("prompts", int(embeds.shape[0])))
    size = _image_size(kwargs.get("image"))
    if size is not None:
        shape.append(("image", size))
    return tuple(shape)


def describe(shape: Shape) -> str:
    """`"height=1024, width=1024"`; `"default arguments"` for the empty shape."""
    return ", ".join(f"{name}={value}" for name, value in shape) or "default arguments"


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _image_size(image) -> Optional[Tuple[int, int]]:
    if isinstance(image, (list, tuple)) and image:
        image = image[0]
    if isinstance(image, torch.Tensor) and image.dim() >= 2:
        return int(image.shape[-2]), int(image.shape[-1])
    size = getattr(image, "size", None)  # a PIL image: (width, height)
    if isinstance(size, tuple) and len(size) == 2 and all(_integer(v) for v in size):
        return size[1], size[0]
    return None


class LearntShape(NamedTuple):
    """What was learnt of one call shape (`OffloadStatus.learnt`).

    Args:
        shape (`str`): The call's shape (`"height=1024, width=1024"`).
        activations (`Dict[str, int]`): For each component, the most device memory a completed call of this shape
            used beyond the weights while it ran (CUDA: the allocator's peak); empty where never measured.
        reserve (`int` or `None`): What the automatic budget leaves free for calls of this shape: the least any
            component needs (its activations and a margin); `None` where never measured (`memory_reserve` then).
        fitted (`Dict[str, int]`): For each component that ran out of device memory, the bytes of weights on the
            device when it ran again and completed: the most the budget allows while it runs.
        recoveries (`int`): Out-of-memory errors of this shape that the offload recovered from.
    """

    shape: str
    activations: Dict[str, int]
    reserve: Optional[int]
    fitted: Dict[str, int]
    recoveries: int


class _Learnt:
    __slots__ = ("activations", "misses", "fitted", "recoveries", "teach")

    def __init__(self) -> None:
        self.activations: Dict[str, int] = {}
        self.misses: Dict[str, int] = {}
        self.fitted: Dict[str, int] = {}
        self.recoveries = 0
        self.teach = True  # the next call of this shape is measured

    def reserves(self) -> Dict[str, int]:
        return {n: reserve_for(a, self.misses.get(n, 0)) for n, a in self.activations.items()}


class Activations:
    """One pipeline's learnt activations, by call shape and component, and the measuring of the call in progress (a
    session's).

    A call is measured in segments, one per component use (to the next use, or the call's end): at a segment's end
    the allocator's peak since its start, minus the pipeline's weights on the device during it and what the process
    held there before the call, is what that component needed (with the pipeline code that followed it). Measuring
    resets the allocator's peak at every segment, so only the calls that teach are measured: the first of a shape
    until one completes, and the next after an out-of-memory error in a call that was not measured.
    """

    def __init__(self) -> None:
        self.shapes: "OrderedDict[Shape, _Learnt]" = OrderedDict()
        self.shape: Shape = ()
        #: Bumped whenever something is learnt (the budget is chosen again before the next call).
        self.version = 0
        self.measuring = False
        self._held = self._base = 0
        self._running: Optional[str] = None
        self._seen: Dict[str, int] = {}

    def expect(self, shape: Shape) -> None:
        """The next call has `shape` (the budget for it is chosen before it starts)."""
        self.shape = tuple(shape)

    def _entry(self, make: bool = False) -> Optional[_Learnt]:
        entry = self.shapes.get(self.shape)
        if entry is None and make:
            entry = self.shapes[self.shape] = _Learnt()
            while len(self.shapes) > MAX_SHAPES:
                self.shapes.popitem(last=False)
        if entry is not None:
            self.shapes.move_to_end(self.shape)
        return entry

    def plan(self, default: int) -> Tuple[int, Dict[str, int], Dict[str, int]]:
        """`(reserve, beyond, fitted)` for the expected shape: the reserve the automatic budget leaves (the least any
        measured component needs, else `default`); for each measured component, what it needs beyond that reserve
        while it runs; and the weights each component's out-of-memory errors showed to fit beside it."""
        entry = self.shapes.get(self.shape)
        if entry is None:
            return default, {}, {}
        reserves = entry.reserves()
        reserve = min(reserves.values()) if reserves else default
        return reserve, {n: r - reserve for n, r in reserves.items() if r > reserve}, dict(entry.fitted)

    # -- measuring (the session calls these) ---------------------------------------------------------------------
    def begin(self, device: torch.device, held: int) -> None:
        """A call starts with `held` bytes of the pipeline's weights on `device`: measure it where the peak can be
        read."""
        entry = self.shapes.get(self.shape)
        teaches = entry is None or entry.teach
        self.measuring = teaches and device is not None and memory.peak_bytes(device) is not None
        self._running, self._seen = None, {}
        if self.measuring:
            self._base = max((memory.allocated_bytes(device) or 0) - held, 0)
            self.open(device, held)

    def close(self, device: torch.device) -> None:
        """A segment ends: what it needed beyond the weights counts for the component it ran (before the moves that
        begin the next)."""
        if self.measuring and self._running is not None:
            need = max((memory.peak_bytes(device) or 0) - self._held - self._base, 0)
            self._seen[self._running] = max(self._seen.get(self._running, 0), need)

    def open(self, device: torch.device, held, running: Optional[str] = None) -> None:
        """A segment begins, after the moves, with `held` bytes of weights on the device (an `int`, or a function
        that counts them: called only while measuring); `running`: the component it runs, the same where not given."""
        if self.measuring:
            memory.reset_peak(device)
            self._held = held() if callable(held) else held
            self._running = running or self._running

    def end(self, device: torch.device, failed: bool) -> None:
        """The call ends: a completed call's activations are learnt for its shape (the most seen so far)."""
        if not self.measuring:
            return
        self.close(device)
        self.measuring = False
        if not failed and self._seen:
            entry = self._entry(make=True)
            for name, need in self._seen.items():
                entry.activations[name] = max(entry.activations.get(name, 0), need)
            entry.teach = False
            self.version += 1

    def recovered(self, name: str, held: int, within: bool) -> None:
        """Component `name` ran out of device memory in a call of the current shape and ran again with `held` bytes
        of weights on the device: while it runs, the budget for the shape goes down to them. Where the weights were
        `within` what the budget allowed for it, a reserve already learnt for it was too small: its margin widens."""
        entry = self._entry(make=True)
        self.version += 1
        entry.recoveries += 1
        entry.fitted[name] = min(entry.fitted.get(name, held), held)
        entry.teach = entry.teach or not self.measuring  # a call not measured ran out: the next one is
        if within and name in entry.activations:
            entry.misses[name] = min(entry.misses.get(name, 0) + 1, MAX_MISSES)

    def status(self) -> Tuple[LearntShape, ...]:
        """What was learnt, oldest shape first."""
        found = []
        for shape, e in self.shapes.items():
            reserves = e.reserves()
            reserve = min(reserves.values()) if reserves else None
            found.append(LearntShape(describe(shape), dict(e.activations), reserve, dict(e.fitted), e.recoveries))
        return tuple(found)
