"""hypothesis: a state machine over the API (enable with random options, calls, failing calls, remove_all_hooks,
re-enable, uninstall), the real pipeline next to the reference model, on the plain CPU and on the simulated
accelerator."""

import pytest
import toy
from harness import hooked_names, ledger_moves, reference_for
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from simulated_accelerator import SimulatedAccelerator
from spy import MoveSpy

OFFLOADABLE = ("text_encoder", "text_encoder_2", "transformer", "vae", "controlnet")
traces = st.lists(st.sampled_from(OFFLOADABLE), max_size=25)
name_sets = st.lists(st.sampled_from(OFFLOADABLE), unique=True, max_size=3)
keeps = st.one_of(st.just(()), st.just(True), name_sets)


class OffloadMachine(RuleBasedStateMachine):
    """The real pipeline next to the reference model; every rule is applied to both."""

    #: Run on the simulated accelerator (a subclass sets it).
    simulated = False

    @initialize()
    def setup(self):
        import diffusers_offload_ext as doe

        self.accelerator = SimulatedAccelerator().__enter__() if self.simulated else None
        self.doe = doe
        doe.install()
        self.pipe = toy.build()
        self.spy = MoveSpy(self.pipe).__enter__()
        self.reference = None
        self.options = ((), ())
        self.calls = 0
        self.pinned_class = list(type(self.pipe)._exclude_from_cpu_offload)

    def teardown(self):
        self.spy.__exit__(None, None, None)
        self.doe.uninstall()
        if self.accelerator is not None:
            self.accelerator.__exit__(None, None, None)

    @rule(exclude=st.one_of(st.none(), name_sets), keep=st.one_of(st.none(), keeps))
    def enable(self, exclude, keep):
        note(f"enable(exclude_from_offload={exclude!r}, keep_on_device_during_generation={keep!r})")
        self.pipe.enable_model_cpu_offload(
            device="cpu", exclude_from_offload=exclude, keep_on_device_during_generation=keep
        )
        old_exclude, old_keep = self.options
        self.options = (old_exclude if exclude is None else tuple(exclude), old_keep if keep is None else keep)
        if self.reference is None:
            self.reference = reference_for(self.pipe, *self.options)
        else:
            self.reference.call_index = None
            self.reference.enable(*self.options)

    @precondition(lambda self: self.reference is not None)
    @rule(trace=traces)
    def call(self, trace):
        note(f"pipe({trace!r})")
        self.spy.call_index = self.calls
        self.pipe(trace)
        self.reference.call(trace, self.calls)
        self.calls += 1

    @precondition(lambda self: self.reference is not None)
    @rule(trace=traces.filter(bool), data=st.data(), interrupt=st.booleans())
    def failing_call(self, trace, data, interrupt):
        fail_at = data.draw(st.integers(0, len(trace) - 1))
        note(f"pipe({trace!r}, fail_at={fail_at}, interrupt={interrupt})")
        with pytest.raises(KeyboardInterrupt if interrupt else RuntimeError):
            self.pipe(trace, fail_at=fail_at, interrupt=interrupt)
        self.reference.call(trace, self.calls, fail_at=fail_at)
        self.calls += 1

    @precondition(lambda self: self.reference is not None)
    @rule()
    def remove_all_hooks(self):
        note("remove_all_hooks()")
        self.pipe.remove_all_hooks()
        self.reference.remove_hooks()
        self.options = ((), self.options[1])  # it drops `exclude_from_offload`, as stock drops its instance list

    @precondition(lambda self: self.reference is not None)
    @rule()
    def reenable(self):
        note("enable_model_cpu_offload()  # no arguments, as LoRA loading does")
        self.pipe.enable_model_cpu_offload()
        self.reference.call_index = None
        self.reference.enable(*self.options)

    @rule()
    def uninstall_and_reinstall(self):
        note("uninstall(); a new pipeline is stock; install()")
        self.doe.uninstall()
        fresh = toy.build()
        with pytest.raises(TypeError):
            fresh.enable_model_cpu_offload(device="cpu", exclude_from_offload=[])
        assert not self.doe.offload_status(fresh).enabled
        assert not [key for key in vars(fresh) if "offload_ext" in key]
        self.doe.install()

    @invariant()
    def placement_matches_model(self):
        if self.reference is None:
            return
        on_device = {n for n, on in self.spy.placement.items() if on}
        assert on_device == self.reference.resident()
        assert hooked_names(self.pipe) == self.reference.hooked()
        assert ledger_moves(self.doe.transfer_ledger(self.pipe)) == self.reference.moves

    @invariant()
    def class_attribute_untouched(self):
        assert type(self.pipe)._exclude_from_cpu_offload == self.pinned_class


TestOffloadMachine = pytest.mark.plugin_only(OffloadMachine.TestCase)
TestOffloadMachine.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)


class SimulatedOffloadMachine(OffloadMachine):
    simulated = True


TestSimulatedOffloadMachine = pytest.mark.plugin_only(SimulatedOffloadMachine.TestCase)
TestSimulatedOffloadMachine.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
