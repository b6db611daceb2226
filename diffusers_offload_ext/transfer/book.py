"""The book of placements: for every module the extension moves, one entry shared by every pipeline that holds it
(where it is when the tensors cannot tell, its host copy, its size and first tensor, whether its structure changed).

Structure changes are seen as they happen: torch's global registration hooks report every sub-module, parameter and
buffer assigned anywhere, and the book marks the entry of the component it belongs to as `dirty`, so that the next
use re-reads the component (a replaced `conv_in` brings host weights) at constant cost per forward otherwise. While
Dynamo traces a compiled forward, which builds modules of its own (a UNet's mid block slices `self.resnets[1:]`), the
hooks return at once: they add nothing to its graph.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..storages import module_storage_nbytes
from .host_copy import HostCopy


def first_tensor(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The module's first parameter, or first buffer; `None` if it has neither."""
    for tensor in module.parameters():
        return tensor
    for tensor in module.buffers():
        return tensor
    return None


def module_nbytes(module: torch.nn.Module) -> int:
    """Bytes of the storages behind `module`'s parameters and buffers, seen through tensor subclasses and including
    their quantization state (bitsandbytes, GGUF, torchao, optimum-quanto), each storage counted once.

    Example:
        ```py
        >>> import torch
        >>> from diffusers_offload_ext import module_nbytes
        >>> module_nbytes(torch.nn.Linear(4, 2))  # 8 weights and 2 biases, 4 bytes each
        40
        ```
    """
    return module_storage_nbytes(module)


class Entry:
    """What the book knows of one component module.

    Attributes:
        resident (`bool`): On the execution device: the one record of it, which every pipeline holding the module
            reads (where host and device share memory it is all there is; elsewhere the tensors say, and it follows
            them). `Entry.flips` counts its changes, of every entry: a reader may keep what it derived until it moves.
        host_copy (`HostCopy` or `None`): Its host tensors, kept while it is on the device (zero-copy eviction).
        sentinel (`torch.Tensor` or `None`): Its first tensor: where it is, is where the component is said to be.
        nbytes (`int`): Its bytes (parameters and buffers), as of the last `refresh`.
        dirty (`bool`): A sub-module, parameter or buffer was assigned since the last `refresh`.
        changes (`int`): How many times one was assigned, ever (`refresh` does not reset it).
    """

    __slots__ = ("_resident", "host_copy", "sentinel", "nbytes", "dirty", "changes", "__weakref__")

    #: How many times any entry's `resident` changed, process-wide.
    flips = 0

    def __init__(self) -> None:
        self._resident = False
        self.host_copy: Optional[HostCopy] = None
        self.sentinel: Optional[torch.Tensor] = None
        self.nbytes = 0
        self.dirty = True
        self.changes = 0

    @property
    def resident(self) -> bool:
        return self._resident

    @resident.setter
    def resident(self, value: bool) -> None:
        value = bool(value)
        if value is not self._resident:
            self._resident = value
            Entry.flips += 1


def _compiling() -> bool:
    """Whether Dynamo is tracing the code running now (a registration hook it traced would break the graph)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


class Book:
    """Entries per module, held weakly: a module nobody refers to any more leaves the book."""

    def __init__(self) -> None:
        self._entries: "weakref.WeakKeyDictionary[torch.nn.Module, Entry]" = weakref.WeakKeyDictionary()
        # Every sub-module of a booked component -> the component's entry (weakly on both sides).
        self._owner: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
        self._hooks = None

    def entry(self, module: torch.nn.Module) -> Entry:
        """The entry of `module`, made (and read) on first use."""
        entry = self._entries.get(module)
        if entry is None:
            entry = self._entries[module] = Entry()
            self._listen()
            self.refresh(module, entry)
        return entry

    def get(self, module: torch.nn.Module) -> Optional[Entry]:
        return self._entries.get(module)

    def refresh(self, module: torch.nn.Module, entry: Optional[Entry] = None) -> Entry:
        """Re-read `module`'s first tensor, size and sub-modules (one walk); clears `dirty`."""
        entry = entry if entry is not None else self.entry(module)
        reference = weakref.ref(entry)
        for sub in module.modules():
            self._owner[sub] = reference
        entry.sentinel = first_tensor(module)
        entry.nbytes = module_nbytes(module)
        entry.dirty = False
        return entry

    def _listen(self) -> None:
        if self._hooks is not None:
            return
        registration = torch.nn.modules.module
        self._hooks = [
            registration.register_module_module_registration_hook(self._assigned),
            registration.register_module_parameter_registration_hook(self._assigned),
            registration.register_module_buffer_registration_hook(self._assigned),
        ]

    def _assigned(self, parent, name, value):
        if _compiling():
            return None  # a module built inside a compiled forward (`self.resnets[1:]`) is no structure change
        reference = self._owner.get(parent)
        entry = reference() if reference is not None else None
        if entry is not None:
            entry.dirty = True
            entry.changes += 1
        return None


#: The one book of the process: a module shared by several pipelines has one entry.
BOOK = Book()
