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
    """Stock's model offload as accelerate's chained `CpuOffload` hooks do it, plus the two options.

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
        previous = None
        chained = []
        for component in self.components.values():
            component.hooked, component.before = False, None
        for name in self.seq.split("->"):
            if name in self.components and name not in self.exclude and name not in chained:
                component = self.components[name]
                component.hooked = True
                component.before = previous
                previous = component
                chained.append(name)
        for name, component in self.components.items():
            if name not in chained and name not in self.exclude and name not in self.class_excluded:
                component.hooked = True
        for component in self.components.values():
            named = keep not in (False, None, True) and component.name in keep
            component.kept = component.hooked and (keep is True or named)
        self.chained = set(chained)
        self._arm()

    def remove_hooks(self):
        for component in self.components.values():
            component.hooked, component.before, component.kept = False, None, False

    def hooked(self):
        return {n for n, c in self.components.items() if c.hooked}

    def _move(self, component, on):
        if component.on_device != on:
            component.on_device = on
            self.moves.append((component.name, "onload" if on else "offload", component.size, self.call_index))

    def _arm(self):
        # Stock: everything to the host, then the class-excluded ones (not in the chain) to the device.
        # Ours: what the user excluded stays on the device and is never moved again.
        for component in self.components.values():
            if component.name not in self.exclude:
                self._move(component, False)
        for component in self.components.values():
            if component.name in self.class_excluded and component.name not in self.chained | self.exclude:
                self._move(component, True)
        for component in self.components.values():
            if component.name in self.exclude:
                self._move(component, True)

    def use(self, name):
        component = self.components[name]
        if not component.hooked:
            return
        before = component.before
        if before is not None and before.on_device and not before.kept:
            self._move(before, False)
        self._move(component, True)

    def call(self, trace, call_index, fail_at=None):
        """One pipeline call; with `fail_at`, it raises before event `fail_at` (the plugin still ends the call)."""
        self.call_index = call_index
        for index, name in enumerate(trace):
            if index == fail_at:
                break
            self.use(name)
        if self.hooked():
            self._arm()
        self.call_index = None

    def resident(self):
        return {n for n, c in self.components.items() if c.on_device}
