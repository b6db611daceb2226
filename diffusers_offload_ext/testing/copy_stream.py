"""`fake_cuda`: a stand-in for `torch.cuda`'s streams and events on the simulated accelerator (`cpu:0`), so that the
transfer's own CUDA code (`pinning/copy_stream.py`, `transfer/copier.py`, `transfer/synchronous.py`) runs in the tests,
with the semantics it depends on modelled adversarially:

- **in flight until waited on**: a non-blocking copy from page-locked memory on a side stream lands when the compute
  stream waits for an event recorded after it, or the host synchronises; until then its destination holds NaN (zeros
  for integers) for the compute stream, so a layer run too early gives a wrong image. Work queued on the side stream
  after the copy sees it (stream order), and an event's `query()` is false until then;
- **write-backs in flight until the host waits**: a non-blocking copy from the device into page-locked host memory
  on the compute stream holds nothing, and its destination holds NaN (zeros for integers) until the host waits for
  an event recorded after it (`Event.synchronize`, counted in `host_syncs`), for the stream or for the device, or
  makes a blocking copy; so host memory read too early is wrong;
- **pageable copies hold the host**: a non-blocking copy from memory that is not page-locked (as
  `testing/page_locking.py`'s fake says; all memory is pageable without it) runs at once, counted in `host_waits` and
  `pageable_async`; so does every blocking copy between host and device, on any stream (`host_waits`);
- **stream order**: the compute stream runs eagerly; each of its operations is numbered, and every device storage it
  touches (allocates, reads or writes) remembers the last number. A copy queued on a side stream into a storage the
  compute stream touched after the last point the side stream waited for (`wait_event`, `wait_stream`) may land
  before that use on a GPU: it raises `StreamOrderError`;
- **per-stream pools**: memory allocated while a side stream is current is recorded (`side_allocations`): the
  caching allocator would never hand it to the compute stream;
- **torn reads**: host memory unregistered while a copy from it is in flight (told by the page-locking fake) makes
  that copy deliver NaN.

Enter it inside a `SimulatedAccelerator` (it reads which tensors are on the device from it).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..transfer import COPY_STREAMS, synchronous
from . import page_locking

_Tensor = torch.Tensor


class StreamOrderError(RuntimeError):
    """A side-stream copy is not ordered after the compute stream's use of the memory it writes."""


class _Copy:
    """One copy queued on a side stream: its destination, the bytes it will deliver, the host pages it reads."""

    __slots__ = ("dst", "value", "pages", "torn", "issued", "clock")

    def __init__(self, dst: torch.Tensor, value: torch.Tensor, pages: set, issued: int, clock: int) -> None:
        self.dst, self.value, self.pages, self.torn = dst, value, pages, False
        self.issued, self.clock = issued, clock

    def deliver(self) -> None:
        with torch._C.DisableTorchFunction():
            if self.torn:
                self.dst.copy_(_poison(self.value))
            else:
                self.dst.copy_(self.value)


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return torch.full_like(tensor, float("nan") if tensor.is_floating_point() else 0)


class FakeStream:
    """A stream: the compute stream (`compute=True`) runs eagerly; a side stream queues copies until they land."""

    def __init__(self, cuda: "FakeCuda", name: str, compute: bool = False) -> None:
        self.cuda, self.name, self.compute = cuda, name, compute
        self.queued: List[_Copy] = []  # issued copies not yet landed for the compute stream
        self.issued = 0
        self.landed = 0
        self.waited = 0  # the compute stream's operation number this stream last waited for

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"

    def land(self, upto: Optional[int] = None) -> None:
        """Every copy issued before number `upto` (all if `None`) lands."""
        upto = self.issued if upto is None else upto
        while self.queued and self.landed < upto:
            copy = self.queued.pop(0)
            copy.deliver()
            self.landed += 1
            self.cuda.landed.append((copy.issued, self.cuda.number, copy.clock))

    def wait_event(self, event: "FakeEvent") -> None:
        if event.stream is None or event.stream is self:
            return
        if event.stream.compute:
            self.waited = max(self.waited, event.mark)
        else:
            event.stream.land(event.mark)  # this stream runs eagerly: the copies must be there before it goes on

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent()
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        if self.compute:
            self.cuda.host_sync()
        self.land()

    def query(self) -> bool:
        return not self.queued


class FakeEvent:
    """`torch.cuda.Event`: the point of a stream it was recorded at."""

    def __init__(self, *args, **kwargs) -> None:
        self.stream: Optional[FakeStream] = None
        self.mark = 0

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.stream = stream if stream is not None else FakeCuda.active.current
        self.mark = self.stream.cuda.number if self.stream.compute else self.stream.issued

    def query(self) -> bool:
        return self.stream is None or self.stream.compute or self.stream.landed >= self.mark

    def synchronize(self) -> None:
        if self.stream is not None and self.stream.compute:
            self.stream.cuda.host_sync(self.mark)
        elif self.stream is not None:
            self.stream.land(self.mark)

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        (stream or FakeCuda.active.current).wait_event(self)


def _device_argument(args: tuple, kwargs: dict):
    """`(device, non_blocking)` of a `Tensor.to(...)` call (`device` `None` when it names none)."""
    device, non_blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)) and device is None:
            device = arg
        elif isinstance(arg, bool):
            non_blocking = arg
    return (torch.device(device) if device is not None else None), non_blocking


class FakeCuda(TorchFunctionMode):
    """The fake's state: the streams, the numbered compute operations, and what was counted.

    Attributes:
        host_waits (`int`): Copies between host and device that held the host (blocking ones, pageable ones).
        pageable_async (`int`): Of those, the ones asked to be non-blocking (from pageable memory).
        side_allocations (`Dict[int, torch.Tensor]`): Device storages allocated while a side stream was current.
        issued (`List[int]`): The compute operation number at which each side-stream copy was queued.
        landed (`List[Tuple[int, int, int]]`): `(queued at, landed at, clock when queued)` of each landed copy: compute
            operation numbers, and the `clock` (every call the fake sees ticks it).
        waits (`List[str]`): What held the host, one entry per copy counted in `host_waits`.
        host_syncs (`int`): Times the host waited for the compute stream's work (an event's, the stream's or the
            device's `synchronize`).
        transfers (`list`): The `CopyStreamTransfer`s made for `prefetch=True`.
    """

    active: Optional["FakeCuda"] = None

    def __init__(self, sim) -> None:
        super().__init__()
        self.sim = sim
        self.number = 0
        self.clock = 0
        self.touched: Dict[int, int] = {}
        self.compute_stream = FakeStream(self, "compute", compute=True)
        self.current = self.compute_stream
        self.side: List[FakeStream] = []
        self.host_waits = self.pageable_async = 0
        self.side_allocations: Dict[int, torch.Tensor] = {}
        self.issued: List[int] = []
        self.landed: List[Tuple[int, int, int]] = []
        self.waits: List[str] = []
        self.transfers: list = []
        self.host_syncs = 0
        self._homing: List[Tuple[torch.Tensor, torch.Tensor, int]] = []  # write-backs not yet waited for by the host

    # -- torch.cuda -------------------------------------------------------------------------------------------------
    def new_stream(self, device=None, priority=0, **kwargs) -> FakeStream:
        self.side.append(FakeStream(self, f"side{len(self.side)}"))
        return self.side[-1]

    @contextlib.contextmanager
    def stream(self, stream: Optional[FakeStream]):
        saved = self.current
        self.current = stream if stream is not None else saved
        try:
            yield
        finally:
            if not self.current.compute:
                self._show(self.current, False)  # what compute sees of copies it did not wait for: garbage
            self.current = saved

    def synchronize(self, device=None) -> None:
        self.host_sync()
        for stream in self.side:
            stream.land()

    def host_sync(self, upto: Optional[int] = None) -> None:
        """The host waits for the compute stream's work up to operation `upto` (all if `None`): the write-backs queued
        before it land in host memory."""
        self.host_syncs += 1
        self._land_home(upto)

    def _land_home(self, upto: Optional[int] = None) -> None:
        waiting = []
        for dst, value, number in self._homing:
            if upto is None or number <= upto:
                with torch._C.DisableTorchFunction():
                    dst.copy_(value)
            else:
                waiting.append((dst, value, number))
        self._homing = waiting

    # -- operations ---------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.clock += 1
        if func is _Tensor.copy_ or func is _Tensor.to:
            moved = self._transfer(func, args, kwargs)
            if moved is not NotImplemented:
                return moved
        if not self.current.compute:
            self._show(self.current, True)  # later work on a stream sees its earlier copies
        result = func(*args, **kwargs)
        self._account(args, kwargs, result)
        return result

    def _ptr(self, tensor: torch.Tensor) -> int:
        with torch._C.DisableTorchFunction():
            return tensor.untyped_storage().data_ptr()

    def _on_device(self, tensors) -> list:
        return [t for t in tensors if isinstance(t, _Tensor) and self.sim.is_on_device(t)]

    def _account(self, args, kwargs, result) -> None:
        inputs = [*args, *kwargs.values()]
        inputs += [t for a in inputs if isinstance(a, (list, tuple)) for t in a]
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        if self.current.compute:
            used = self._on_device(inputs + outputs)
            if used:  # an operation on the device
                self.number += 1
            for tensor in used:
                self.touched[self._ptr(tensor)] = self.number
        else:
            known = {self._ptr(t) for t in self._on_device(inputs)}
            for tensor in self._on_device(outputs):
                if self._ptr(tensor) not in known:  # new memory, not a view
                    self.side_allocations[self._ptr(tensor)] = tensor  # kept alive: its address stays its own

    def _show(self, stream: FakeStream, visible: bool) -> None:
        with torch._C.DisableTorchFunction():
            for copy in stream.queued:
                copy.dst.copy_(copy.value if visible else _poison(copy.value))

    def _transfer(self, func, args, kwargs):
        if func is _Tensor.copy_:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            to_device = self.sim.is_on_device(dst) and not self.sim.is_on_device(src)
            crosses = to_device or (self.sim.is_on_device(src) and not self.sim.is_on_device(dst))
        else:
            src = args[0]
            device, non_blocking = _device_argument(args, kwargs)
            to_device = device == self.sim.device and not self.sim.is_on_device(src)
            crosses = to_device or (device is not None and device.type == "cpu" and device.index is None
                                    and self.sim.is_on_device(src))  # fmt: skip
        if not crosses:
            return NotImplemented
        memory = page_locking.active()
        nbytes = src.numel() * src.element_size()
        locked = to_device and (not nbytes or (memory is not None and memory.locked(src.data_ptr(), nbytes)))
        if not nbytes:
            return func(*args, **kwargs)  # nothing to copy: PyTorch returns at once
        home = func is _Tensor.copy_ and not to_device and memory is not None
        if home and non_blocking and self.current.compute and memory.locked(args[0].data_ptr(), nbytes):
            return self._home(func, args, kwargs)
        if not (non_blocking and locked):
            self.host_waits += 1
            self.waits.append(f"{'h2d' if to_device else 'd2h'} {func.__name__} {tuple(src.shape)}")
            self.pageable_async += bool(non_blocking)
            self._land_home()  # a blocking copy waits for the compute stream's earlier work
            self.current.land()
            result = func(*args, **kwargs)
            self._account(args, kwargs, result)
            return result
        if self.current.compute:
            result = func(*args, **kwargs)
            self._account(args, kwargs, result)
            return result
        return self._queue(func, args, kwargs, src, memory, nbytes)

    def _home(self, func, args, kwargs):
        """A non-blocking write-back into page-locked host memory on the compute stream: it holds nothing, and its
        destination reads NaN until the host waits for it."""
        result = func(*args, **kwargs)
        self._account(args, kwargs, result)
        dst = args[0]
        with torch._C.DisableTorchFunction():
            value = dst.clone()
            dst.copy_(_poison(value))
        self._homing.append((dst, value, self.number))
        return result

    def _queue(self, func, args, kwargs, src, memory, nbytes):
        stream = self.current
        if func is _Tensor.copy_:
            last = self.touched.get(self._ptr(args[0]), 0)
            if last > stream.waited:
                raise StreamOrderError(
                    f"a copy on {stream.name} writes device memory the compute stream used at operation {last}, "
                    f"after the last point {stream.name} waited for ({stream.waited}): on a GPU it may land first"
                )
        result = func(*args, **kwargs)  # the simulator counts the bytes; they are held back until they land
        dst = args[0] if func is _Tensor.copy_ else result
        if func is _Tensor.to:
            self.side_allocations[self._ptr(dst)] = dst
        with torch._C.DisableTorchFunction():
            value = dst.clone()
            dst.copy_(_poison(value))
        pages = set(memory.pages(src.data_ptr(), nbytes))
        stream.queued.append(_Copy(dst, value, pages, self.number, self.clock))
        stream.issued += 1
        self.issued.append(self.number)
        return result

    def torn(self, pages: set) -> None:
        """Host `pages` were unregistered (the page-locking fake tells): copies reading them deliver garbage."""
        for stream in self.side:
            for copy in stream.queued:
                copy.torn = copy.torn or bool(copy.pages & pages)


_PATCHED = ("Stream", "Event", "current_stream", "default_stream", "stream", "synchronize")


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """Within the block (entered inside a `SimulatedAccelerator`), `torch.cuda`'s streams and events are the fake's,
    the simulated accelerator's transfers use them (`STREAM_DEVICES`), and `prefetch=True` on it gets the real
    `CopyStreamTransfer`. Yields the `FakeCuda`."""
    modes = torch.overrides._get_current_function_mode_stack()
    sims = [m for m in modes if getattr(m, "_is_simulated_accelerator", False)]
    if not sims:
        raise RuntimeError("enter `fake_cuda()` inside a `SimulatedAccelerator()`: it reads where tensors are from it")
    from ..pinning.copy_stream import CopyStreamTransfer

    cuda = FakeCuda(sims[-1])
    saved = {name: getattr(torch.cuda, name) for name in _PATCHED}
    devices = getattr(synchronous, "STREAM_DEVICES", set())
    saved_streamed, had_cpu = COPY_STREAMS.get("cpu"), "cpu" in devices

    def streamed(device):
        cuda.transfers.append(CopyStreamTransfer(device))
        return cuda.transfers[-1]

    replacements = dict(
        Stream=cuda.new_stream,
        Event=FakeEvent,
        current_stream=lambda device=None: cuda.current,
        default_stream=lambda device=None: cuda.compute_stream,
        stream=cuda.stream,
        synchronize=cuda.synchronize,
    )
    for name, value in replacements.items():
        setattr(torch.cuda, name, value)
    saved_record = torch.Tensor.__dict__.get("record_stream")
    torch.Tensor.record_stream = lambda tensor, stream: None  # its arguments are parsed before any mode sees them
    COPY_STREAMS["cpu"] = streamed
    devices.add("cpu")
    memory = page_locking.active()
    if memory is not None:
        memory.readers.append(cuda)
    FakeCuda.active = cuda
    try:
        with cuda:
            yield cuda
    finally:
        FakeCuda.active = None
        cuda.synchronize()
        if memory is not None:
            memory.readers.remove(cuda)
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        if saved_record is None:
            del torch.Tensor.record_stream
        else:
            torch.Tensor.record_stream = saved_record
        if saved_streamed is None:
            COPY_STREAMS.pop("cpu", None)
        else:
            COPY_STREAMS["cpu"] = saved_streamed
        if not had_cpu:
            devices.discard("cpu")


@contextlib.contextmanager
def fake_copy_stream() -> Iterator[List]:
    """`fake_cuda()` yielding the list of `CopyStreamTransfer`s made (enter it inside a `SimulatedAccelerator`)."""
    with fake_cuda() as cuda:
        yield cuda.transfers
