"""An independent model of what model offload should move, written as the hooks are: one object per hooked
component with a pointer to its chain predecessor. Used to check the real ledger; shares no code with the package."""

from __future__ import annotations


class _Component:
    def __init__(self, name, size):
        self.name = name
        self.size = size
        self.on_device = False
        self.before = None  # the chain predecessor's _Component
        self.hooked = False
        self.kept = False


class Reference:
    """Stock's model offload as accelerate's chained `CpuOffload` hooks do it, plus the two options: an excluded
    component never leaves the device, and when it runs it still evicts its predecessor in the chain; a kept one is
    not evicted before the end of the call.

    Args:
        sizes: bytes of every module component, in the pipeline's order.
        seq: the class's `model_cpu_offload_seq`.
        class_excluded: the class's `_exclude_from_cpu_offload`.
        exclude: `exclude_from_offload`.
        keep: `keep_on_device_during_generation` (True or names).
    """

    def __init__(self, sizes, seq, class_excluded=(), exclude=(), keep=()):
        self.components = {n: _Component(n, s) for n, s in sizes.items()}
        self.seq = seq
        self.class_excluded = set(class_excluded)
        self.moves = []
        self.call_index = None
        self.enable(exclude, keep)

    def enable(self, exclude=(), keep=()):
        """(Re-)enable offload with these options, from wherever the components are now."""
        self.exclude = set(exclude)
        self.watching = True  # the excluded components have a hook too, which only evicts their predecessor
        previous = None
        chained = []
        for component in self.components.values():
            component.hooked, component.before = False, None
        for name in self.seq.split("->"):
            if name in self.components and name not in chained:
                component = self.components[name]
                component.hooked = name not in self.exclude
                component.before = previous
                previous = component
                chained.append(name)
        for name, component in self.components.items():
            if name not in chained and name not in self.exclude and name not in self.class_excluded:
                component.hooked = True
        for component in self.components.values():
            named = keep not in (False, None, True) and component.name in keep
            component.kept = component.hooked and (keep is True or named)
        self.chained = set(chained) - self.exclude
        self._arm()

    def remove_hooks(self):
        for component in self.components.values():
            component.hooked, component.before, component.kept = False, None, False
        self.watching = False

    def hooked(self):
        """Components with a hook: the offloaded ones, and the excluded ones."""
        return {n for n, c in self.components.items() if c.hooked or (self.watching and n in self.exclude)}

    def _move(self, component, on):
        if component.on_device != on:
            component.on_device = on
            self.moves.append((component.name, "onload" if on else "offload", component.size, self.call_index))

    def _arm(self):
        # Stock: everything to the host, then the class-excluded ones (not in the chain) to the device.
        # Ours: what the user excluded stays on the device and is never moved again; with anything excluded, the
        # class-excluded ones outside the chain stay too (only the hooks move components then).
        held = self.exclude | (self.class_excluded - self.chained) if self.exclude else set()
        for component in self.components.values():
            if component.name not in held:
                self._move(component, False)
        for component in self.components.values():
            if component.name in self.class_excluded and component.name not in self.chained | self.exclude:
                self._move(component, True)
        for component in self.components.values():
            if component.name in self.exclude:
                self._move(component, True)

    def use(self, name):
        component = self.components[name]
        if name not in self.hooked():
            return
        before = component.before
        if before is not None and before.on_device and not before.kept and before.name not in self.exclude:
            self._move(before, False)
        self._move(component, True)

    def call(self, trace, call_index, fail_at=None):
        """One pipeline call; with `fail_at`, it raises before event `fail_at` (the plugin still ends the call)."""
        self.call_index = call_index
        for index, name in enumerate(trace):
            if index == fail_at:
                break
            self.use(name)
        if any(c.hooked for c in self.components.values()):
            self._arm()
        self.call_index = None

    def resident(self):
        return {n for n, c in self.components.items() if c.on_device}
