"""`HostCopy`: a component's host tensors kept while it is on the device, so that evicting it unchanged needs no copy,
and the checks that tell whether it is unchanged.

`module.to(device)` replaces each parameter's `.data` (the `Parameter` object stays) and each buffer (a new tensor);
the host tensors are freed unless someone still refers to them. `HostCopy` refers to them, so that evicting an
unchanged component only puts them back (`restore`). A change made while the component was on the device must never
be lost, so `unchanged` checks, in order of cost:

1. structure: the same sub-modules, parameter and buffer names (LoRA layers added or removed change it);
2. identity: the same `Parameter` objects and buffer tensors, with the same data pointers, shapes, dtypes and strides
   (a replaced tensor, for example `weight.data = fused`, changes it, and so does a reshape through `.data` that
   keeps the pointer: `p.data = p.data.view(4, 6)`), and no gradient;
3. version counters: any in-place operation on the parameter or buffer itself (`p.mul_(2)`, `copy_`,
   `load_state_dict`) bumps `t._version` (inference tensors, made under `torch.inference_mode()`, have none: for
   them only the content check below sees an edit);
4. content: edits through `.data` (`weight.data += delta`, as PEFT's `merge()` fuses a LoRA) bump no counter that
   can be seen from the parameter, so a fingerprint of every device tensor (`fingerprint.py`) is taken right after
   the onload and again before the eviction.

Every check reads the plain tensors behind each parameter and buffer (`parts.py`): a wrapper subclass's inner
tensors (torchao, optimum-quanto), a `Parameter` subclass's storage (bitsandbytes' 4-bit, GGUF) and the quantization
state it carries (`quant_state`'s `absmax`, `code`, ...), so a quantized component unchanged on the device is dropped
like any other, and an edit of any of those tensors is copied back. `restore` puts them all back (a wrapper parameter
swapped in place, as `Module.to()` moves it).

When any check fails, or a tensor cannot be fingerprinted (a sparse tensor, a format whose bytes `__tensor_flatten__`
does not name), the eviction copies the device tensors back, as stock does. So it does when some tensor was not on
the host when the copy was made (a part of the component the user had moved to the device): the copy holds host
tensors only, read from the tensors themselves, so that such a part goes home at the eviction, as stock's
`.to("cpu")` sends it.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ..storages import is_wrapper, tensor_state
from .inference import version_of
from .fingerprint import fingerprints, same
from .parts import Spec, flatten, leaves_of, swap_in_place, unflatten

Slot = Tuple[torch.nn.Module, bool, str, torch.Tensor]


def slots(module: torch.nn.Module, only: Optional[Sequence[tuple]] = None) -> Iterator[Slot]:
    """Every parameter and buffer slot: `(sub-module, is_parameter, name, tensor)`, in a fixed order; with `only`
    (`(sub-module, is_parameter, name)` triples, a block's), those slots that still hold a tensor."""
    if only is not None:
        for sub, is_param, key in only:
            tensor = (sub._parameters if is_param else sub._buffers).get(key)
            if tensor is not None:
                yield sub, is_param, key, tensor
        return
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is not None:
                yield sub, True, key, param
        for key, buffer in sub._buffers.items():
            if buffer is not None:
                yield sub, False, key, buffer


class Held(NamedTuple):
    """One slot's host side: where it is (`sub` held weakly), the object that goes back there (`original`: the
    parameter, or the host buffer), how it is rebuilt (`spec`), its host `leaves` and quantization `states`
    (`(owner, attribute, host tensor)`)."""

    sub: weakref.ref
    is_param: bool
    key: str
    original: torch.Tensor
    spec: Optional[Spec]
    leaves: List[torch.Tensor]
    states: list

    @property
    def hosts(self) -> List[torch.Tensor]:
        return self.leaves + [host for _, _, host in self.states]


def _token(tensor: torch.Tensor):
    """What identifies `tensor` later: a weak reference, or for a wrapper its `id` (a weak reference would stop
    `swap_tensors`, which moves it; its inner tensors are checked by data pointer, version and content)."""
    return id(tensor) if is_wrapper(tensor) else weakref.ref(tensor)


def _is(token, tensor: torch.Tensor) -> bool:
    return token == id(tensor) if isinstance(token, int) else token() is tensor


class HostCopy:
    """The host tensors of one component while it is on the execution device.

    Create it just before the onload, call `seal(module)` just after; at eviction `unchanged(module)` tells whether
    `restore(module)` may replace the copy back. With `only` (a block's slots, see `blocks/find.py`) it covers those
    tensors of `module` alone.
    """

    def __init__(
        self, module: torch.nn.Module, check: bool = True, only: Optional[Sequence[tuple]] = None, shared=False
    ) -> None:
        self.only = None if only is None else tuple(only)
        #: The device reads host memory (the plain CPU under a host budget, `host/staging.py`): a tensor the device
        #: holds at its host tensor's own address has nothing a drop could lose, and is not fingerprinted.
        self.shared = shared
        # A parameter's `.data` (or a wrapper's inner tensors) is a second reference to the host storage: it outlives
        # the onload, which either sets the parameter's `.data`, swaps its contents, or puts a new `Parameter` in its
        # place; the original object is kept too, so that it can come back. Sub-modules are held weakly: the copy
        # never keeps a component alive.
        self.host: List[Held] = []
        for sub, is_param, key, t in slots(module, self.only):
            spec, leaves = flatten(t, detached=is_param)
            self.host.append(Held(weakref.ref(sub), is_param, key, t, spec, leaves, tensor_state(t)))
        #: Every tensor was on the host (or `meta`): else only a copy sends the rest home, and nothing is dropped.
        self.complete = all(at_home(host) for held in self.host for host in held.hosts)
        self.signature: Optional[list] = None
        self.content: Optional[list] = None
        self.check = check  # False: every eviction writes back (`zero_copy_eviction=False` with page-locked copies)

    def _live(self, module: torch.nn.Module) -> Optional[List[Tuple[Slot, List[torch.Tensor]]]]:
        """Each slot now with the plain tensors behind it; `None` where the slots are not those the copy holds."""
        found = list(slots(module, self.only))
        if len(found) != len(self.host):
            return None
        live = []
        for (sub, is_param, key, t), held in zip(found, self.host):
            if sub is not held.sub() or is_param != held.is_param or key != held.key:
                return None
            live.append(((sub, is_param, key, t), leaves_of(t, held.states)))
        return live

    def seal(self, module: torch.nn.Module) -> None:
        """Record what the component looks like on the device, right after the onload."""
        if not self.check or not self.complete:
            return
        live = self._live(module)
        self.content = None if live is None else self._content(live)
        if self.content is None:
            return  # something it cannot read: the eviction will copy
        self.signature = [(_token(t), [_marks(x) for x in leaves]) for (_, _, _, t), leaves in live]

    def _content(self, live) -> Optional[list]:
        """Fingerprints of the plain tensors, a vector per device (`meta` tensors hold no data that could change; with
        `shared`, a tensor the device reads where its host tensor lies has nothing a drop could lose), in a fixed
        order; `None` when some tensor cannot be read."""
        homes = {h.data_ptr() for held in self.host for h in held.hosts if _dense(h)} - {0} if self.shared else ()
        groups: dict = {}
        for _, leaves in live:
            for t in leaves:
                if t.device.type != "meta" and not (homes and _dense(t) and t.data_ptr() in homes):
                    groups.setdefault(t.device, []).append(t)
        content = [(device, fingerprints(tensors)) for device, tensors in groups.items()]
        return None if any(vector is None for _, vector in content) else content

    def unchanged(self, module: torch.nn.Module) -> bool:
        """Whether the device tensors are still exactly the ones `seal` saw, unmodified."""
        if self.signature is None or self.content is None:
            return False
        live = self._live(module)
        if live is None:
            return False
        for ((_, is_param, _, t), leaves), (token, marks) in zip(live, self.signature):
            if not _is(token, t) or len(leaves) != len(marks) or (is_param and t.grad is not None):
                return False
            if any(_marks(x) != mark for x, mark in zip(leaves, marks)):
                return False
        content = self._content(live)
        if content is None or [d for d, _ in content] != [d for d, _ in self.content]:
            return False
        return all(bool(same(now, sealed)) for (_, now), (_, sealed) in zip(content, self.content))  # read once

    def write_back(self, module: torch.nn.Module, copy_home: Optional[Callable] = None) -> bool:
        """Copy the device tensors into the host tensors, in place, and put those back (an eviction that copies but
        keeps the host memory, page-locked as it is): through `copy_home(pairs)` (`Copier.copy_home`: one host wait
        for all of them from page-locked memory on CUDA), else one blocking copy per tensor. False, with nothing
        changed, where the structure, a shape or a dtype changed on the device, a host tensor is an inference tensor,
        or some tensor was not on the host when the copy was made: then a fresh host copy holds them."""
        live = self._live(module)
        if live is None or not self.complete:
            return False
        pairs = []
        for (_, leaves), held in zip(live, self.host):
            hosts = held.hosts
            if len(leaves) != len(hosts):
                return False
            for t, host in zip(leaves, hosts):
                if t.shape != host.shape or t.dtype != host.dtype or t.layout != host.layout or host.is_inference():
                    return False  # an inference tensor cannot be written in place outside inference mode
                if t.data_ptr() != host.data_ptr():
                    pairs.append((host, t))
        if copy_home is not None:
            copy_home(pairs)
        else:
            with torch.no_grad():
                for host, t in pairs:
                    host.copy_(t)
        self.restore(module)
        return True

    def restore(self, module: torch.nn.Module) -> None:
        """Put the host tensors back in place of the device ones: the eviction without a copy."""
        for held in self.host:
            sub = held.sub()
            if sub is not None:
                _put_back(sub, held)
        self.host = []
        self.signature = None
        self.content = None

    def split(self, groups: Mapping[str, Sequence[tuple]]) -> Dict[str, "HostCopy"]:
        """This copy cut in one per group of slots (`groups`: a name -> `(sub-module, is_parameter, name)` triples,
        a block's), each covering those slots alone; none is sealed (`seal` each whose device tensors are known to be
        the host ones)."""
        where = {(id(held.sub()), held.is_param, held.key): held for held in self.host}
        found = {}
        for name, only in groups.items():
            part = HostCopy.__new__(HostCopy)
            part.only = tuple(only)
            part.host = [where[(id(sub), p, key)] for sub, p, key in part.only if (id(sub), p, key) in where]
            part.complete = self.complete and all(at_home(host) for held in part.host for host in held.hosts)
            part.signature, part.content, part.check, part.shared = None, None, self.check, self.shared
            found[name] = part
        return found

    @property
    def nbytes(self) -> int:
        """Bytes of host memory this copy holds."""
        seen = {}
        for held in self.host:
            for host in held.hosts:
                seen[id(host)] = host.numel() * host.element_size()
        return sum(seen.values())


def _dense(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.layout == torch.strided


def at_home(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is host memory (or `meta`, which holds no data): where a host copy may hold it."""
    device = tensor.device
    return device.type == "meta" or (device.type == "cpu" and device.index is None)


def layout(tensor: torch.Tensor) -> tuple:
    """What a copy of `tensor` must keep to stand for it: its data pointer, shape, dtype and stride."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.stride()


def _marks(tensor: torch.Tensor) -> tuple:
    """What an eviction without a copy must find unchanged besides the tensor's identity: its layout and version."""
    return layout(tensor), version_of(tensor)


def _put_back(sub: torch.nn.Module, held: Held) -> None:
    """Slot `held` of `sub` holds its host tensors again, its quantization state too."""
    original = held.original
    if not held.is_param:
        sub._buffers[held.key] = original
    elif held.spec is not None:
        swap_in_place(original, unflatten(held.spec, held.leaves)[0])
        sub._parameters[held.key] = original
    else:
        original.data = held.leaves[0]
        sub._parameters[held.key] = original
    for owner, name, host in held.states:
        setattr(owner, name, host)
