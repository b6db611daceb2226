"""Every pipeline class: the options reach each class of the installed diffusers that has `model_cpu_offload_seq` or
its own `enable_model_cpu_offload`, or are rejected with an error naming the class and the reason; a combined
pipeline is armed whole and runs to the same images as without offload, its views agreeing with its sub-pipelines'."""

import inspect

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the patch's overrides are tested in the patch")

import diffusers  # noqa: E402
import diffusers_offload_ext as doe  # noqa: E402
import toy  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers_offload_ext.marks import ADAPTED  # noqa: E402
from diffusers_offload_ext.runtime.combined import combined_layout  # noqa: E402
from diffusers_offload_ext.runtime.overrides import own_override, support  # noqa: E402

pytestmark = pytest.mark.plugin_only
NEW = (
    "exclude_from_offload",
    "keep_on_device_during_generation",
    "memory_budget",
    "keep_on_device_between_generations",
)


def pipeline_classes():
    """Every pipeline class diffusers exports (importing each; those whose optional dependencies are missing are
    left out), with a model offload sequence or an `enable_model_cpu_offload` of its own."""
    found = []
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            cls = getattr(diffusers, name)
        except Exception:  # an optional dependency is missing
            continue
        if isinstance(cls, type) and issubclass(cls, DiffusionPipeline) and cls is not DiffusionPipeline:
            if getattr(cls, "model_cpu_offload_seq", None) or own_override(cls) is not None:
                found.append(cls)
    return found


CLASSES = pipeline_classes()


def test_the_walk_finds_the_pipelines_and_their_overrides():
    assert len(CLASSES) > 50
    overriding = {c.__name__ for c in CLASSES if own_override(c) is not None}
    assert {"AudioLDM2Pipeline", "KandinskyV22Img2ImgCombinedPipeline"} <= overriding


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_options_are_accepted_or_rejected_clearly(installed, cls):
    supported, reason = support(cls)
    assert reason
    parameters = inspect.signature(cls.enable_model_cpu_offload).parameters
    assert all(name in parameters and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in NEW)
    if own_override(cls) is not None:
        assert getattr(cls.enable_model_cpu_offload, ADAPTED) is own_override(cls)
    if supported:
        return
    pipe = cls.__new__(cls)  # nothing is built: the check comes before anything else
    before = dict(vars(pipe))
    for name, value in (("exclude_from_offload", ["vae"]), ("keep_on_device_during_generation", True)):
        with pytest.raises(TypeError, match=rf"`{cls.__name__}\.enable_model_cpu_offload` cannot take \['{name}'\]"):
            pipe.enable_model_cpu_offload(**{name: value})
    assert vars(pipe) == before


def test_uninstall_restores_every_override():
    overriding = [c for c in CLASSES if "enable_model_cpu_offload" in vars(c)]
    before = {c: vars(c)["enable_model_cpu_offload"] for c in overriding}
    doe.install()
    try:
        assert all(vars(c)["enable_model_cpu_offload"] is not before[c] for c in overriding)

        class Later(diffusers.AudioLDM2Pipeline):  # defined after install(): adapted too
            def enable_model_cpu_offload(self, gpu_id=None, device="cuda"):
                return "own"

        assert getattr(Later.enable_model_cpu_offload, ADAPTED).__qualname__.endswith("Later.enable_model_cpu_offload")
    finally:
        doe.uninstall()
    assert all(vars(c)["enable_model_cpu_offload"] is before[c] for c in overriding)
    assert getattr(Later.enable_model_cpu_offload, ADAPTED, None) is None


def test_the_mixin_adapts_an_override_below_it():
    class Mine(doe.OffloadMixin, diffusers.AudioLDM2Pipeline):
        pass

    with pytest.raises(TypeError, match=r"`Mine\.enable_model_cpu_offload` cannot take .*sub-modules"):
        Mine.__new__(Mine).enable_model_cpu_offload(exclude_from_offload=["vae"])


class Toy(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)


@pytest.mark.parametrize(
    "cls, sequence",
    [
        (
            "StableCascadeCombinedPipeline",
            ("prior_image_encoder", "prior_text_encoder", "prior_prior", "text_encoder", "decoder", "vqgan"),
        ),
        ("WuerstchenCombinedPipeline", ("prior_text_encoder", "prior_prior", "text_encoder", "decoder", "vqgan")),
    ],
)
def test_combined_pipelines_without_a_sequence_get_their_sub_pipelines_chains(installed, cls, sequence):
    cls = getattr(diffusers, cls)
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    modules = ("text_encoder", "decoder", "vqgan", "prior_prior", "prior_text_encoder", "prior_image_encoder")
    pipe = cls(**{n: Toy() if n in modules else None for n in names})
    assert combined_layout(pipe).sequence == sequence
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["decoder"])
    status = doe.offload_status(pipe)
    assert status.enabled and status.chain == sequence  # the excluded decoder keeps its place: it still evicts
    assert "decoder" in pipe._exclude_from_cpu_offload and "decoder" in pipe.decoder_pipe._exclude_from_cpu_offload
    assert pipe.decoder_pipe._all_hooks == [] and pipe.prior_pipe._all_hooks == []  # the sub-pipelines hold none
    assert pipe.decoder_pipe._execution_device == pipe._execution_device == torch.device("cpu", 0)
    pipe.remove_all_hooks()
    assert "decoder" not in (getattr(pipe.decoder_pipe, "_exclude_from_cpu_offload", None) or [])


KANDINSKY_OPTIONS = {
    "exclude": {"exclude_from_offload": ["unet"]},
    "keep": {"keep_on_device_during_generation": True},
    "keep_between": {"keep_on_device_between_generations": True},
    "budget": {"memory_budget": "1MiB"},
}
_reference = {}


def kandinsky_reference():
    from diffusers_offload_ext.testing import tiny_combined

    if "image" not in _reference:
        _reference["image"] = tiny_combined.run(tiny_combined.build_kandinsky22_img2img_combined())
    return _reference["image"]


@pytest.mark.usefixtures("accelerator")
@pytest.mark.parametrize("option", KANDINSKY_OPTIONS)
def test_a_combined_pipeline_armed_whole_gives_the_same_images(installed, accelerator, option):
    from diffusers_offload_ext.testing import tiny_combined

    pipe = tiny_combined.build_kandinsky22_img2img_combined()
    pipe.enable_model_cpu_offload(device="cpu", **KANDINSKY_OPTIONS[option])
    for _ in range(2):
        assert (tiny_combined.run(pipe) - kandinsky_reference()).abs().max() <= 1e-3
    status = doe.offload_status(pipe)
    ledger = doe.transfer_ledger(pipe)
    calls = {r.call_index for r in ledger if r.call_index is not None}
    assert status.enabled and calls == (
        {0} if option == "keep_between" else {0, 1}
    )  # kept: the 2nd call moves nothing
    excluded = set(KANDINSKY_OPTIONS[option].get("exclude_from_offload", ()))
    assert set(pipe._exclude_from_cpu_offload) == {"prior_prior"} | excluded
    assert set(getattr(pipe.decoder_pipe, "_exclude_from_cpu_offload", None) or ()) >= excluded
    for sub in (pipe.prior_pipe, pipe.decoder_pipe):
        assert sub._execution_device == pipe._execution_device == torch.device("cpu", 0)
    resident = {n for n, c in status.components.items() if c.resident}
    if accelerator is not None:  # the tensors say where they are
        assert resident == {n for n in status.components if accelerator.where(getattr(pipe, n)) == "device"}
    if option != "keep_between":  # the end of each call sends back what stock would
        assert resident == {"prior_prior"} | excluded


def test_a_combined_pipeline_without_options_keeps_its_own_offload(installed):
    from diffusers_offload_ext.testing import tiny_combined

    pipe = tiny_combined.build_kandinsky22_img2img_combined()
    pipe.enable_model_cpu_offload(device="cpu")  # the class's override: its sub-pipelines are armed, as in stock
    assert not doe.offload_status(pipe).enabled
    assert pipe.prior_pipe._all_hooks and pipe.decoder_pipe._all_hooks
    assert (tiny_combined.run(pipe) - kandinsky_reference()).abs().max() <= 1e-3


class NoChain(toy.TracePipeline):
    """Like diffusers' `LTXLatentUpsamplePipeline`: `model_cpu_offload_seq = ""`, which stock accepts (every model is
    then hooked outside the chain)."""

    model_cpu_offload_seq = ""


class PlainTo(toy.Block):
    """Like StableUnCLIP's image normalizer: a component whose own `.to()` takes no `non_blocking`."""

    def to(self, *args):
        return super().to(*args)


@pytest.mark.parametrize("option", [{}, {"keep_on_device_during_generation": True}, {"memory_budget": "1MiB"}])
def test_an_empty_sequence_is_accepted_as_in_stock(installed, accelerator, option):
    pipe = toy.build(NoChain)
    pipe.enable_model_cpu_offload(device="cpu", **option)
    status = doe.offload_status(pipe)
    assert status.enabled and status.chain == ()
    assert {c.role for n, c in status.components.items() if n != "safety_checker"} <= {"outside chain", "kept"}
    pipe(["text_encoder", "transformer", "vae"])  # on the simulator a layer on host weights would raise
    assert not {n for n, c in doe.offload_status(pipe).components.items() if c.resident} - {"safety_checker"}


def test_a_component_whose_to_takes_no_non_blocking(installed, accelerator):
    pipe = toy.build()
    pipe.register_modules(controlnet=PlainTo(toy.WIDTHS["controlnet"]))
    pipe.enable_model_cpu_offload(device="cpu", zero_copy_eviction=True, keep_on_device_during_generation=True)
    pipe(["text_encoder", "controlnet", "transformer", "vae"])
    kinds = {r.component: r.kind for r in doe.transfer_ledger(pipe).records if r.direction == "offload"}
    assert kinds["controlnet"] == "drop"
