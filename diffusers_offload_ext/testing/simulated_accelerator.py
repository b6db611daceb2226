"""SimulatedAccelerator: a torch function mode that makes `cpu:0` a device separate from the host `cpu` in tests.

Tensor subclasses that wrap inner tensors (`__tensor_flatten__`: torchao, optimum-quanto) are where their inner
tensors are: a wrapper moved to the device has its inner tensors tagged too, and an operation on a wrapper whose inner
tensors are on the host while other inputs are on the device raises. Quantization state that a library passes to its
kernels as arguments (bitsandbytes' `quant_state.absmax`, `state.CB`) is checked as any input is.

With a `capacity` (opt-in; unlimited by default, and then nothing is counted) device memory is counted per storage:
weights moved there, buffers made there and the outputs of operations on device tensors (activations). A new storage
that would go past the capacity raises `torch.OutOfMemoryError`, as CUDA's allocator does; a storage is freed when the
last device tensor that holds it dies or leaves the device.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

try:
    from . import simulated_tensors as walk
    from .simulated_memory import StorageCounts
except ImportError:  # loaded by path, outside the package (`tests/simulated_accelerator.py` loads its part first)
    import _simulated_tensors as walk
    from _simulated_memory import StorageCounts

DEVICE = torch.device("cpu", 0)
HOST = torch.device("cpu")
_Tensor = torch.Tensor
_ELSEWHERE = "elsewhere"  # a move to a device that is neither (meta, ...): the result is not on the simulated one


class Transfer(NamedTuple):
    """One tensor that crossed the simulated bus."""

    direction: str  # "h2d" (host to device) or "d2h"
    nbytes: int
    is_parameter: bool  # the source was an nn.Parameter (a Module.to moves its parameters one by one)
    op: str  # the call that moved it: "to", "cpu", "type_as" or "copy_"


class _Tag(weakref.ref):
    """Marks one tensor object as on the device; dies with it. `held`: the storage it counts (with a capacity)."""

    __slots__ = ("key", "held")


class SimulatedAccelerator(StorageCounts, TorchFunctionMode):
    """Within ``with SimulatedAccelerator() as sim:``, tensors moved to ``sim.device`` (``cpu:0``) report that device,
    moves to and from it copy, and an op mixing device and host tensors raises as on CUDA. Not reentrant.

    Args:
        capacity (`int`, *optional*): Bytes of device memory; past it a new storage raises `torch.OutOfMemoryError`.
            `None` (the default): unlimited, and nothing is counted.
    """

    _is_simulated_accelerator = True  # a marker that also holds for a second copy of this file loaded by path

    def __init__(self, capacity: Optional[int] = None) -> None:
        super().__init__()
        self._tags: dict[int, _Tag] = {}  # id(tensor) -> weak reference; per object, never per storage address
        self._copies: list[Transfer] = []
        self._forget_callback = self._forget  # one bound method for all the weak references
        self._start_counts(capacity)

    @property
    def device(self) -> torch.device:
        """The simulated accelerator, ``torch.device("cpu", 0)``; the host is ``torch.device("cpu")``."""
        return DEVICE

    @property
    def copies(self) -> tuple[Transfer, ...]:
        return tuple(self._copies)

    def _total(self, direction: str, count: bool = False) -> int:
        return sum(1 if count else c.nbytes for c in self._copies if c.direction == direction)

    # Bytes and number of tensors that crossed the bus each way (`.to()`, `.cpu()`, `type_as`, cross-device `copy_`).
    h2d_bytes = property(lambda self: self._total("h2d"))
    d2h_bytes = property(lambda self: self._total("d2h"))
    h2d_count = property(lambda self: self._total("h2d", count=True))
    d2h_count = property(lambda self: self._total("d2h", count=True))

    def reset_counters(self) -> None:
        self._copies.clear()

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        ref = self._tags.get(id(tensor))
        return ref is not None and ref() is tensor

    def where(self, module: torch.nn.Module) -> str:
        """Where the module's parameters and buffers are: "device", "host", "mixed" or "empty" (it has none)."""
        tensors = [*module.parameters(), *module.buffers()]
        on_device = sum(self.is_on_device(t) for t in tensors)
        if not tensors:
            return "empty"
        return "device" if on_device == len(tensors) else "host" if on_device == 0 else "mixed"

    def __enter__(self) -> "SimulatedAccelerator":
        modes = getattr(torch.overrides, "_get_current_function_mode_stack", list)()  # private: be careful
        if any(getattr(mode, "_is_simulated_accelerator", False) for mode in modes):
            raise RuntimeError("a SimulatedAccelerator is already active: they cannot be nested (both would be cpu:0)")
        super().__enter__()
        # nn.Parameter(data) calls Tensor._make_subclass, not a torch function: shadow TensorBase's meanwhile.
        torch.Tensor._make_subclass = staticmethod(self._make_subclass)
        # A wrapper subclass made around device tensors (`__tensor_unflatten__`) asks for `device=cpu:0`: made on the
        # host like every simulated device tensor (one real device for it and its inner tensors), and tagged.
        torch.Tensor._make_wrapper_subclass = staticmethod(self._make_wrapper_subclass)
        # Module._apply swaps a wrapper subclass parameter in place (torch.utils.swap_tensors), which refuses tensors
        # that have weak references: our tags are weak references, so they are lifted for the swap and exchanged.
        torch.utils.swap_tensors = self._swap_tensors
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            del torch.Tensor._make_subclass
            del torch.Tensor._make_wrapper_subclass
            torch.utils.swap_tensors = _SWAP_TENSORS
        finally:
            super().__exit__(*exc_info)

    def _swap_tensors(self, t1: torch.Tensor, t2: torch.Tensor) -> None:
        first, second = self.is_on_device(t1), self.is_on_device(t2)
        self._set_tag(t1, False, inner=False)
        self._set_tag(t2, False, inner=False)
        _SWAP_TENSORS(t1, t2)
        self._set_tag(t1, second, inner=False)
        self._set_tag(t2, first, inner=False)

    def _make_subclass(self, cls: type, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = torch._C.TensorBase._make_subclass(cls, data, *args, **kwargs)
        self._set_tag(result, self.is_on_device(data))
        return result

    def _make_wrapper_subclass(self, cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        on_device = device is not None and _is_device(device)
        if on_device:
            kwargs = {**kwargs, "device": HOST}
        result = torch._C.TensorBase._make_wrapper_subclass(cls, *args, **kwargs)
        if on_device:
            self._tag(result, inner=False)  # its inner tensors are set after this, by the subclass
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            special = _SPECIAL.get(func)
        except TypeError:  # an unhashable callable
            special = None
        if special is not None:
            return special(self, func, args, kwargs)
        if kwargs:
            if kwargs.get("device") is not None:
                return self._placed(func, args, kwargs)
            inputs = (*args, *kwargs.values())
        else:
            inputs = args
        on_device, host = self._scan(inputs)
        if on_device and host is not None:
            raise walk.mixing_error(func, host, DEVICE)
        result = func(*args, **kwargs)
        if on_device:
            for out in walk.outputs_of(result, inputs):
                self._tag(out)
        return result

    def _tag(self, tensor: torch.Tensor, inner: bool = True) -> None:
        key = id(tensor)
        ref = self._tags.get(key)
        if ref is None or ref() is not tensor:
            held = self._hold(tensor, None) if self.capacity is not None else None  # may raise: nothing tagged then
            if ref is not None:
                self._release(ref)
            ref = _Tag(tensor, self._forget_callback)
            ref.key, ref.held = key, held
            self._tags[key] = ref
        elif self.capacity is not None:
            ref.held = self._hold(tensor, ref.held)  # `param.data = other`: the object now holds another storage
        if inner and type(tensor) not in walk.PLAIN:
            for part in walk.inner_tensors(
                tensor
            ):  # made inside the subclass's dispatch, where this mode does not look
                self._tag(part)

    def _set_tag(self, tensor: torch.Tensor, on_device: bool, inner: bool = True) -> None:
        if on_device:
            self._tag(tensor, inner)
        elif self.is_on_device(tensor):
            self._release(self._tags.pop(id(tensor)))

    def _forget(self, ref: _Tag) -> None:
        self._release(ref)
        if self._tags.get(ref.key) is ref:
            del self._tags[ref.key]

    # -- device memory (with a capacity) ------------------------------------------------------------------------------
    def _release(self, ref: _Tag) -> None:
        held = getattr(ref, "held", None)
        if held is not None:
            ref.held = None
            self._drop_hold(held)

    def _scan(self, inputs: tuple) -> tuple[bool, Optional[torch.Tensor]]:
        """(some input is on the device, the first host input that cannot mix with it (dim >= 1) or None)."""
        on_device, host, tags = False, None, self._tags
        for arg in inputs:
            if isinstance(arg, _Tensor):
                ref = tags.get(id(arg))
                wrapper = type(arg) not in walk.PLAIN and walk.is_wrapper(arg)
                if ref is not None and ref() is arg:
                    on_device = True
                elif host is None and arg.dim() and not wrapper:  # a wrapper is where its inner tensors are
                    host = arg
                if wrapper:  # its inner tensors are inputs too
                    inside_on_device, inside_host = self._scan(tuple(walk.inner_tensors(arg)))
                    on_device = on_device or inside_on_device
                    host = host if host is not None else inside_host
            elif isinstance(arg, (list, tuple, dict)) and arg:  # the slow path: tensors in containers
                return self._scan(tuple(walk.tensors_in(inputs)))
        return on_device, host

    def _placed(self, func, args: tuple, kwargs: dict):
        """A call with ``device=`` (factories, ``*_like``, ``as_tensor``): the keyword decides; no mixing check."""
        want = _is_device(kwargs["device"])
        if want:  # made on the host, as moves are (`_to`): one real device, whatever a subclass does with storages
            kwargs = {**kwargs, "device": HOST}
        result = func(*args, **kwargs)
        if isinstance(result, _Tensor):
            if any(
                self.is_on_device(t) != want and walk.aliases(result, t)
                for t in walk.tensors_in((*args, *kwargs.values()))
            ):
                result = result.clone()  # as_tensor(t, device=...) hands back t itself
            self._set_tag(result, want)
        return result

    def _moved(self, src: torch.Tensor, result: torch.Tensor, target, op: str) -> torch.Tensor:
        """Tag ``result`` of moving ``src`` to ``target`` (True: device, False: host, None: no device change)."""
        on_device = self.is_on_device(src)
        if target is _ELSEWHERE:
            return result
        if target is None or target == on_device:
            if on_device and result is not src:
                self._tag(result)
            return result
        if type(result) not in walk.PLAIN and walk.is_wrapper(
            result
        ):  # copies of its inner tensors (its `clone` may not keep it)
            result = walk.separate_inner(src, result)
        elif walk.aliases(result, src):
            result = result.clone()  # torch did not copy: on an accelerator it would have
        self._set_tag(result, target)
        self._count(target, result, src, op)
        return result

    def _count(self, to_device: bool, result: torch.Tensor, src: torch.Tensor, op: str) -> None:
        if type(result) not in walk.PLAIN and walk.is_wrapper(
            result
        ):  # its inner tensors crossed, not its dequantized size
            nbytes = sum(t.numel() * t.element_size() for t in walk.inner_tensors(result) if not walk.is_wrapper(t))
        else:
            nbytes = result.numel() * result.element_size()
        self._copies.append(Transfer("h2d" if to_device else "d2h", nbytes, isinstance(src, torch.nn.Parameter), op))

    def _to(self, func, args: tuple, kwargs: dict):
        target = self._to_target(args, kwargs)
        if target is True or target is False:  # torch copies cpu -> cpu:0: ask it for the host, copying only as needed
            if len(args) > 1 and not isinstance(args[1], _Tensor):
                args = (args[0], HOST, *args[2:])
            elif kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": HOST}
        return self._moved(args[0], func(*args, **kwargs), target, "to")

    def _to_target(self, args: tuple, kwargs: dict):
        """True: to the device; False: to the host; None: no device change; _ELSEWHERE: another device (meta...)."""
        first = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("device"))
        if isinstance(first, _Tensor):  # .to(other): other's device
            return self.is_on_device(first)
        if first is None or isinstance(first, torch.dtype):  # .to(dtype, ...), .to(dtype=..., memory_format=...)
            return None
        device = first if isinstance(first, torch.device) else torch.device(first)
        return True if device == DEVICE else False if device == HOST else _ELSEWHERE

    def _cpu(self, func, args: tuple, kwargs: dict):
        return self._moved(args[0], func(*args, **kwargs), False, "cpu")

    def _type_as(self, func, args: tuple, kwargs: dict):
        return self._moved(args[0], func(*args, **kwargs), self.is_on_device(args[1]), "type_as")

    def _copy(self, func, args: tuple, kwargs: dict):
        """``dst.copy_(src)`` may cross devices (and is counted when it does); ``dst`` stays where it is."""
        dst, src = args[0], args[1]
        result = func(*args, **kwargs)
        if self.is_on_device(dst) != self.is_on_device(src):
            self._count(self.is_on_device(dst), dst, src, "copy_")
        return result

    def _take_tag(self, func, args: tuple, kwargs: dict):
        """``param.data = new`` / ``t.set_(source)``: the object now holds the new value, and is where it is."""
        result = func(*args, **kwargs)
        if len(args) > 1 and isinstance(args[1], _Tensor):
            self._set_tag(args[0], self.is_on_device(args[1]))
        return result

    def _new(self, func, args: tuple, kwargs: dict):
        """``t.new_*(...)``: on ``device=`` if given, else where ``t`` is; ``new_tensor(host data)`` is a copy."""
        device = kwargs.get("device")
        on_device = self.is_on_device(args[0]) if device is None else _is_device(device)
        result = func(*args, **kwargs)
        self._set_tag(result, on_device)
        return result

    def _getitem(self, func, args: tuple, kwargs: dict):
        """Host index tensors are fine on the device (CUDA moves them); a device index into a host tensor is not."""
        tensor, index = args[0], args[1]
        on_device = self.is_on_device(tensor)
        if not on_device:
            for idx in index if isinstance(index, (tuple, list)) else (index,):
                if isinstance(idx, _Tensor) and idx.dim() and self.is_on_device(idx):
                    raise walk.mixing_error(func, tensor, DEVICE)
        return self._follows_self(func, args, kwargs)

    def _index_put(self, func, args: tuple, kwargs: dict):
        """``index_put_(indices, values)``: indices may be host tensors; values must be where ``self`` is, or a host
        scalar (0-dim) for a ``self`` on the device."""
        tensor = args[0]
        values = args[2] if len(args) > 2 else kwargs.get("values")
        on_device = self.is_on_device(tensor)
        if isinstance(values, _Tensor) and self.is_on_device(values) != on_device:
            if not on_device or values.dim():
                raise walk.mixing_error(func, values if on_device else tensor, DEVICE)
        return self._follows_self(func, args, kwargs)

    def _follows_self(self, func, args: tuple, kwargs: dict):
        """The result is where ``args[0]`` is, whatever the other arguments (``__deepcopy__``'s memo, indices)."""
        result = func(*args, **kwargs)
        if result is not args[0] and isinstance(result, _Tensor) and self.is_on_device(args[0]):
            self._tag(result)
        return result

    def _to_numpy(self, func, args: tuple, kwargs: dict):
        if self.is_on_device(args[0]):
            raise TypeError(f"can't convert {DEVICE} (simulated accelerator) tensor to numpy. Use Tensor.cpu() first.")
        return func(*args, **kwargs)

    def _device(self, func, args: tuple, kwargs: dict):
        return DEVICE if self.is_on_device(args[0]) else func(*args, **kwargs)

    def _get_device(self, func, args: tuple, kwargs: dict):
        return DEVICE.index if self.is_on_device(args[0]) else func(*args, **kwargs)

    def _parse_to(self, func, args: tuple, kwargs: dict):
        """``Module.to(tensor)`` parses the target with this: the tensor's device is the simulated one if tagged."""
        result = func(*args, **kwargs)
        if args and isinstance(args[0], _Tensor) and self.is_on_device(args[0]):
            return (DEVICE, *result[1:])
        return result

    def _unchecked(self, func, args: tuple, kwargs: dict):
        return func(*args, **kwargs)


_SWAP_TENSORS = torch.utils.swap_tensors


def _is_device(device) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)) == DEVICE


_S = SimulatedAccelerator
_SPECIAL = {
    _Tensor.device.__get__: _S._device,
    _Tensor.get_device: _S._get_device,
    _Tensor.to: _S._to,
    _Tensor.cpu: _S._cpu,
    _Tensor.type_as: _S._type_as,
    _Tensor.copy_: _S._copy,
    _Tensor.data.__set__: _S._take_tag,
    _Tensor.set_: _S._take_tag,
    _Tensor.__getitem__: _S._getitem,
    _Tensor.__setitem__: _S._unchecked,
    _Tensor.__deepcopy__: _S._follows_self,
    **{getattr(_Tensor, name): _S._follows_self for name in ("view_as", "expand_as", "reshape_as")},  # only sizes
    _Tensor.index_put_: _S._index_put,
    _Tensor.index_put: _S._index_put,
    torch.index_put_: _S._index_put,
    torch.index_put: _S._index_put,
    _Tensor.numpy: _S._to_numpy,
    _Tensor.__array__: _S._to_numpy,
    torch._C._nn._parse_to: _S._parse_to,
    torch._has_compatible_shallow_copy_type: _S._unchecked,
    **{getattr(_Tensor, name): _S._new for name in dir(_Tensor) if name.startswith("new_")},
    # Metadata of one tensor: nothing to check or tag (a fast path, and the most frequent calls).
    **{
        getattr(_Tensor, name).__get__: _S._unchecked for name in ("shape", "dtype", "ndim", "requires_grad", "layout")
    },
    **{getattr(_Tensor, name): _S._unchecked for name in ("dim", "size", "numel", "is_floating_point", "__len__")},
}
