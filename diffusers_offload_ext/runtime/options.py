"""The options of `enable_model_cpu_offload`, in one table (`OPTIONS`: name, type, default, validation, sticky merge,
docs), the options in force (`OffloadOptions`), and what is made from the table: the merge of new arguments with
the options in force, the signature of the extended method and of the overrides' adapter, their docstring's
arguments, and the README's options table.

Adding an option: one `Option` row here (its validator and merge in `validation.py` when none fits), its field in
`OffloadOptions`, and its behaviour; `tools/options_table.py --write` writes the README's table again.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Mapping
from typing import Iterable
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ..constants import DEFAULT_RESERVE
from . import validation as check


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword-only option of `enable_model_cpu_offload`.

    Args:
        name (`str`): The keyword.
        annotation (`Any`): Its type in the signature (always with `None`: the value set before stays).
        types (`str`): Its types, as the docstring says them.
        default (`str`): What is in force before it is ever given, as the docs say it.
        validate (`Callable`): `(name, value, components) -> normalised value`; raises before anything changes.
        merge (`Callable`): `(option, options in force, value or validation.KEEP, components, fields so far) ->
            {OffloadOptions field: value}`: the sticky merge.
        field (`str`): The `OffloadOptions` field it sets.
        values (`str`): What it accepts, for the README's table.
        summary (`str`): What it does, in one line, for the README's table.
        doc (`str`): What it does, for the method's docstring.
    """

    name: str
    annotation: Any
    types: str
    default: str
    validate: Callable
    merge: Callable
    field: str
    values: str
    summary: str
    doc: str


NAMES = Union[str, Iterable[str], None]
SIZE = Union[int, str, None]

#: Every option, in the signature's order.
OPTIONS: Tuple[Option, ...] = (
    Option(
        "exclude_from_offload", NAMES, "`str` or `List[str]`", "`None`", check.excluded_names, check.present_names,
        field="exclude_from_offload",
        values="a component name or a list of them",
        summary="Moved to the execution device once, never offloaded; one of the chain still evicts its predecessor.",
        doc="""Components moved to the execution device once and never offloaded (not moved at the end of a call).
            One of the `model_cpu_offload_seq` chain still evicts its predecessor when it runs, as stock's would.""",
    ),
    Option(
        "keep_on_device_during_generation", Union[bool, str, Iterable[str], None], "`bool`, `str` or `List[str]`",
        "`None`", check.all_or_names, check.all_or_present_names,
        field="keep",
        values="`True`, `False`, a component name or a list of them",
        summary="Not evicted by the chain until the call ends. No effect (a warning says so) with the manager on.",
        doc="""Components (`True`: all of them) that, once on the device, stay there until the pipeline call ends,
            instead of being evicted when the next model of the chain runs (for example when a step callback
            decodes a preview with the VAE). At the end of the call everything goes back to the CPU, as in stock.
            With the residency manager on it has no effect (the manager evicts only to make room; a warning says
            so, and `doe.offload_status` reports no component as `"kept"`); it stays in force for when it is off.""",
    ),
    Option(
        "memory_budget", SIZE, "`int` or `str`", "`None`", check.size_or_auto, check.replace,
        field="memory_budget",
        values='`int` bytes, a size (`"20GiB"`, `"12GB"`, `"512MiB"`, `"1.5 GiB"`), `"auto"`',
        summary="Turns the residency manager on: the most bytes of weights on the device, excluded ones included. "
        '`"auto"` clears it.',
        doc="""Turns on the residency manager with an upper bound on the bytes of component weights (parameters and
            buffers) kept on the execution device at any time, excluded components included: bytes (`int`) or a
            size with a unit (`"20GiB"`, `"12GB"`, `"512MiB"`, `"1.5 GiB"`; `GB` = 10**9 bytes, `GiB` = 2**30).
            Components move to the device when they run; when one does not fit, the resident components that are
            not running and that the access trace of the previous call needs least are evicted. A component larger
            than the whole budget runs alone (one warning). `"auto"` clears a budget set before: the manager then
            uses the automatic budget (with `keep_on_device_between_generations=True`) or is off.""",
    ),
    Option(
        "memory_reserve", SIZE, "`int` or `str`", '`"3GiB"`', check.reserve, check.replace,
        field="memory_reserve",
        values="`int` bytes or a size",
        summary="Only for the automatic budget on CUDA: left free for the activations of a call shape not seen yet.",
        doc="""Only for the automatic budget on CUDA (no `memory_budget`, `keep_on_device_between_generations=True`):
            the budget is the free device memory at enable time plus the weights the pipeline already holds there,
            minus this reserve for activations, until a call of the same shape (height, width, frames, batch) was
            measured: then the reserve is what that shape was seen to need, and a margin. On other devices the
            automatic budget is unlimited.""",
    ),
    Option(
        "keep_on_device_between_generations", Optional[bool], "`bool`", "`False`", check.flag, check.replace,
        field="keep_between",
        values="`bool`",
        summary="Turns the residency manager on; the end of a call keeps components on the device (within the budget).",
        doc="""Turns on the residency manager and keeps components on the device at the end of a call (within the
            budget), so that the next call does not upload them again; a component that streams its blocks keeps
            its kept blocks there, so that only its streamed blocks cross. `diffusers_offload_ext.release(pipe)`
            evicts them explicitly.""",
    ),
    Option(
        "zero_copy_eviction", Optional[bool], "`bool`",
        "not set: on on an accelerator; on the plain CPU with the residency manager only",
        check.flag, check.replace,
        field="zero_copy",
        values="`bool`",
        summary="Evictions of unchanged components drop the device copy instead of copying back. Not set: on on an "
        "accelerator (every mode); on the plain CPU with the residency manager only.",
        doc="""Keep the host copy of each component's weights while it is on the device, so that an eviction only drops
            the device copy (no device-to-host copy; host memory stays at stock's peak, all weights on the host). A
            change made while on the device (in-place edits, replaced tensors, LoRA fusing) is detected and copied
            back. Which component moves when never changes, only how. Not set: on wherever the execution device's
            memory is not the host's (CUDA, XPU, MPS; every mode, the defaults included); on the plain CPU with the
            residency manager or a host budget only. `True`: in every mode on any device. `False`: every eviction copies, like stock.""",
    ),
    Option(
        "pin_memory", Union[bool, str, None], '`bool` or `"auto"`',
        'not set: `"auto"` on an accelerator, off on the plain CPU', check.bool_or_auto, check.replace,
        field="pin_memory",
        values='`bool` or `"auto"`',
        summary='Page-lock the host copies in place. `"auto"` (the default on an accelerator): where the device '
        "supports it (CUDA) and its self-check passed; `True` raises elsewhere.",
        doc="""Page-lock the host copies of offloaded components in place (no second copy, exact size, within a host
            budget of half the host's memory, a quarter on Windows; spent first on the components that move most),
            so that onloads copy at page-locked speed without a host wait per tensor. `"auto"`: where the device
            supports it (CUDA), once a self-check on the device (a small buffer page-locked, copied there and back,
            compared) passed; otherwise the copies stay pageable (one info line says why). `True`: raise where the
            device type cannot page-lock. The host copies are kept while components are on the device, and an
            eviction that must copy writes into them. Not set: `"auto"` on an accelerator (or with
            `prefetch=True`), off on the plain CPU. `False`: pageable copies, like stock.""",
    ),
    Option(
        "prefetch", Optional[bool], "`bool`", "not set: on where host copies are page-locked and copy streams exist",
        check.flag, check.prefetch_merge,
        field="prefetch",
        values="`bool`",
        summary="The next component's onload (the manager's prediction, or the next in the chain) starts on a copy "
        "stream while the current one runs, from page-locked memory. Not set: on where both exist (CUDA).",
        doc="""While a component runs, start the onload of the next one on a copy stream (CUDA), from page-locked host
            memory; the compute stream waits for it before that component runs. With the residency manager, the
            next is the one the previous call ran next, when the budget has room for both; in the chain modes (the
            defaults, `exclude_from_offload`, `keep_on_device_during_generation`), the next component of the chain,
            when the device's free memory holds it beside everything there (never ahead where that would not fit).
            Which component is where when it runs does not change. Not set: on wherever host copies are page-locked
            and the device has copy streams. `True` with `pin_memory=False` raises a `ValueError`; on a device
            without copy streams it has no effect. `False`: onloads are made when the component runs.""",
    ),
    Option(
        "host_memory_budget", SIZE, "`int` or `str`", "`None`: no host budget", check.host_size, check.host_merge,
        field="host_budget",
        values='`int` bytes, a size (`"24GiB"`), `"auto"`, `"off"`',
        summary="The most host RAM the weights may hold (page-locked, anonymous, host copies); weights beyond it stay "
        'in their safetensors files. `"auto"`: from the cgroup limit and available RAM, less a margin.',
        doc="""The most host memory (RAM) the offloaded pipeline's weights may hold: page-locked memory (weights and a
            small staging ring), anonymous memory (weights copied or converted on loading, host copies kept for
            evictions without a copy); weights mapped from their safetensors files, which the kernel may drop and
            read again, do not count. Weights beyond the budget stay in their files: anonymous ones are re-mapped
            onto the checkpoint file (after their bytes are compared with it), and they are copied to the device
            from there through a page-locked staging ring. Evictions of unchanged components then drop the device
            copy (as with `zero_copy_eviction=True`; `False` is refused). `"auto"`: the cgroup's memory limit and
            the memory available now, plus what the pipeline already holds, less a margin (an eighth of the host,
            1 to 4 GiB). `"off"` clears it. A budget above the host's memory, or below what must stay in RAM, raises
            a `ValueError` before anything changes. `doe.offload_status(pipe).host_bytes` reports host bytes by
            kind.""",
    ),
)  # fmt: skip
#: The option names, in the signature's order.
NEW_OPTIONS = tuple(option.name for option in OPTIONS)


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The options in force on one pipeline (what `None` arguments keep on the next enable).

    Args:
        exclude_from_offload (`Tuple[str, ...]`, defaults to `()`): Components excluded from offload: on the
            execution device for good.
        keep_all (`bool`, defaults to `False`): `keep_on_device_during_generation=True` (every offloaded component).
        keep (`Tuple[str, ...]`, defaults to `()`): Components named in `keep_on_device_during_generation`.
        memory_budget (`int`, *optional*): Explicit `memory_budget` in bytes; `None`: the automatic one.
        memory_reserve (`int`, defaults to 3 GiB): `memory_reserve` in bytes.
        keep_between (`bool`, defaults to `False`): `keep_on_device_between_generations`.
        zero_copy (`bool`, *optional*): `zero_copy_eviction`; `None` (not set): on on an accelerator, on the plain CPU
            with the residency manager or a host budget only (`runtime/fast_paths.py`).
        pin_memory (`bool` or `"auto"`, *optional*): `pin_memory`; `None` (not set): `"auto"` on an accelerator.
        prefetch (`bool`, *optional*): `prefetch`; `None` (not set): on where host copies are page-locked and the
            device has copy streams.
        host_budget (`int` or `"auto"`, *optional*): `host_memory_budget` (`"auto"`: read at each arming); `None`:
            no host budget (`host_budgeted`).

    What is on for a pipeline's device is `FastPaths` (`runtime/fast_paths.py`, `doe.offload_status(pipe).fast_paths`).
    """

    exclude_from_offload: Tuple[str, ...] = ()
    keep_all: bool = False
    keep: Tuple[str, ...] = ()
    memory_budget: Optional[int] = None
    memory_reserve: int = DEFAULT_RESERVE
    keep_between: bool = False
    zero_copy: Optional[bool] = None
    pin_memory: Union[bool, str, None] = None
    prefetch: Optional[bool] = None
    host_budget: Union[int, str, None] = None

    @property
    def host_budgeted(self) -> bool:
        """Whether a host budget is in force (`host_memory_budget` set, not `"off"`)."""
        return self.host_budget is not None and self.host_budget != check.OFF

    def without_exclusion(self) -> "OffloadOptions":
        """These options, `exclude_from_offload` reset (`remove_all_hooks()` drops it, as stock drops its list)."""
        return dataclasses.replace(self, exclude_from_offload=())

    @property
    def residency(self) -> bool:
        """Whether the residency manager is on: a `memory_budget` was set or `keep_on_device_between_generations`."""
        return self.memory_budget is not None or self.keep_between

    @property
    def keeps_nothing(self) -> bool:
        """`keep_on_device_during_generation` is in force but means nothing: the residency manager is on."""
        return self.residency and (self.keep_all or bool(self.keep))

    def kept(self, offloaded: Iterable[str]) -> frozenset:
        """The names among `offloaded` that the chain must not evict (none with the residency manager on: it evicts
        only to make room)."""
        if self.residency:
            return frozenset()
        offloaded = list(offloaded)
        return frozenset(offloaded) if self.keep_all else frozenset(n for n in self.keep if n in offloaded)


def resolve_options(previous: OffloadOptions, components: Mapping[str, Any], **arguments: Any) -> OffloadOptions:
    """Validate the new arguments (every one, in the table's order, before anything changes), then merge them with
    the options in force (`None` keeps what was set before).

    Raises:
        `TypeError`: an argument of the wrong type.
        `ValueError`: a name that is not a component, or whose component is not a `torch.nn.Module`; a size that does
            not parse, is negative or is a bool; `prefetch=True` with `pin_memory=False`.
    """
    values = {}
    for option in OPTIONS:
        value = arguments.get(option.name)
        values[option.name] = check.KEEP if value is None else option.validate(option.name, value, components)
    fields: Dict[str, Any] = {}
    for option in OPTIONS:
        fields.update(option.merge(option, previous, values[option.name], components, fields))
    return OffloadOptions(**fields)


def take(method: str, given: Mapping[str, Any]) -> Dict[str, Any]:
    """The options among keyword arguments `given` to `method`; a name that is none raises as Python would."""
    unknown = [name for name in given if name not in NEW_OPTIONS]
    if unknown:
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")
    return dict(given)


def signature(function: Callable) -> inspect.Signature:
    """`function`'s signature (`self`, `gpu_id`, `device`, `**options`) with one keyword-only parameter per option."""
    parameters = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=o.annotation)
        for o in OPTIONS
    ]
    return inspect.Signature(parameters + options, return_annotation=None)


def docstring(function: Callable) -> str:
    """`function`'s docstring with its `{options}` line replaced by the options' argument entries."""
    entries = []
    for option in OPTIONS:
        entries.append(f"        {option.name} ({option.types}, *optional*, defaults to {option.default}):")
        entries.append(textwrap.indent(textwrap.dedent("    " * 3 + option.doc), " " * 12))
    return function.__doc__.replace("        {options}", "\n".join(entries))


def markdown_table() -> str:
    """The README's options table."""
    lines = ["| option | values | default | what it does |", "| --- | --- | --- | --- |"]
    for option in OPTIONS:
        lines.append(f"| `{option.name}` | {option.values} | {option.default} | {option.summary} |")
    return "\n".join(lines)
