"""Quantized components from the real libraries (issue 20, items 1 and 7), in `make test-quant`'s venv: the tiny FLUX
pipeline saved with `save_pretrained` and reloaded through bitsandbytes (NF4, FP4, 8-bit), GGUF, torchao,
optimum-quanto and diffusers' layerwise casting (`diffusers_offload_ext/testing/quantized.py`, which also says the
two test-only workarounds). Bytes are counted from the storages, as `torch.save` writes them (GGUF: as the file holds
them); the simulated accelerator runs every backend, and still raises on a quantized layer left on the host."""

import io
import zipfile

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: byte counts")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import quantized, tiny  # noqa: E402
from budget_watch import MovesWithin  # noqa: E402

pytestmark = pytest.mark.plugin_only
NAME = "flux"
QUANTIZED = ("transformer", "text_encoder_2")
MIXING = "Expected all tensors to be on the same device, but found at least two devices"


def backend_param(backend):
    ok, why = quantized.available(backend)
    return pytest.param(backend, marks=pytest.mark.skipif(not ok, reason=why))


BACKENDS = [backend_param(b) for b in quantized.BACKENDS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return quantized.save(str(tmp_path_factory.mktemp("tiny-flux")))


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of the storages `torch.save` writes for `module`'s parameters and buffers (one file per storage)."""
    buffer = io.BytesIO()
    torch.save({**dict(module.named_parameters()), **dict(module.named_buffers())}, buffer)
    return sum(info.file_size for info in zipfile.ZipFile(buffer).infolist() if "/data/" in info.filename)


def gguf_bytes(path: str) -> int:
    import gguf

    return sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors)


def true_bytes(backend: str, saved: str, name: str, module: torch.nn.Module) -> int:
    if backend == "gguf" and name == "transformer":  # GGUFParameter does not pickle: the file says
        return gguf_bytes(f"{saved}/{quantized.GGUF_FILE}")
    return stored_bytes(module)


def naive_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_nbytes_and_blocks_count_the_real_storages(saved, backend):
    pipe = quantized.load(backend, saved)
    for name in QUANTIZED:
        module = getattr(pipe, name)
        expected = true_bytes(backend, saved, name, module)
        assert doe.module_nbytes(module) == expected, name
        assert sum(block_sizes(module).values()) == expected, name
    fp32 = naive_bytes(tiny.build(NAME).text_encoder_2)
    if backend != "gguf":  # GGUF quantizes the transformer only
        assert doe.module_nbytes(pipe.text_encoder_2) < 0.75 * fp32  # quantized, and counted so


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_simulated_accelerator_runs_every_backend(saved, backend):
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    reference = tiny.run(quantized.load(backend, saved), NAME)
    with SimulatedAccelerator() as sim:
        pipe = quantized.load(backend, saved, device=sim.device)  # 8-bit: loaded onto the device, as on a GPU
        pipe.to(sim.device)
        assert {sim.where(getattr(pipe, name)) for name in QUANTIZED} == {"device"}
        assert torch.equal(tiny.run(pipe, NAME), reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_quantized_transformer_left_on_the_host_still_raises_on_the_simulated_accelerator(saved, backend):
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = quantized.load(backend, saved)
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name != "transformer":
                module.to(sim.device)
        assert sim.where(pipe.transformer) == "host"
        with pytest.raises(RuntimeError, match=MIXING):
            pipe(**tiny.call_kwargs(NAME, pipe=pipe))


def planned_bytes(saved: str, name: str, module: torch.nn.Module, fmt: str) -> int:
    """The planner's bytes for component `name` in format `fmt`, from its config alone (built on meta)."""
    import json

    from diffusers_offload_ext.models.meta import count_elements
    from diffusers_offload_ext.models.sizes import component_bytes

    with open(f"{saved}/{name}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    ignored = ("architectures", "transformers_version", "dtype", "torch_dtype")
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ignored}
    return component_bytes(count_elements(type(module).__name__, None, config), fmt, "float32")


@pytest.mark.parametrize(
    "backend, fmt, tolerance",
    [
        pytest.param(*case, marks=pytest.mark.skipif(not quantized.available(case[0])[0], reason="not installed"))
        for case in (("nf4", "nf4", 0), ("fp4", "fp4", 0), ("int8", "int8", 0), ("gguf", "q8_0", 0.01))
    ],
)
def test_plan_sizes_a_format_from_its_own_layout(saved, backend, fmt, tolerance):
    # Exact for bitsandbytes (T5's `wo` stays unquantized, as its class says); GGUF within 1 %: the test's file
    # keeps the one weight whose rows do not split into Q8_0 blocks (x_embedder, 16 wide) in float32.
    pipe = quantized.load(backend, saved)
    names = ("transformer",) if backend == "gguf" else QUANTIZED
    for name in names:
        module = getattr(pipe, name)
        assert planned_bytes(saved, name, module, fmt) == pytest.approx(
            doe.module_nbytes(module), rel=tolerance, abs=0
        )


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("part", [0, -1], ids=["its-data", "its-last-part"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_edit_of_a_quantized_weight_on_the_device_survives_an_eviction_without_a_copy(saved, backend, part):
    # Zero-copy eviction sees into every storage of a quantized weight: its data (int8 rows, packed 4-bit, GGUF
    # blocks) and its last part (a scale, bitsandbytes' quantization state); an edit of either is copied back.
    from diffusers_offload_ext.storages import tensor_parts
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = quantized.load(backend, saved, device=sim.device)
        options = dict(zero_copy_eviction=True, keep_on_device_between_generations=True, memory_budget="1GiB")
        pipe.enable_model_cpu_offload(device="cpu", **options)
        layer, edited = pipe.transformer.proj_out, []

        def edit(p, step, timestep, kwargs):
            if step == 0:
                storage = tensor_parts(layer.weight)[part]
                with torch.no_grad():
                    storage.add_(1)
                edited.append(storage.detach().cpu().clone())
            return kwargs

        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=edit)
        doe.release(pipe)
        assert torch.equal(tensor_parts(layer.weight)[part].detach().cpu(), edited[0])


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("backend", [backend_param(b) for b in quantized.BACKENDS if b != "int8"])
def test_an_unchanged_quantized_component_is_evicted_without_a_copy(saved, backend):
    # Layerwise casting is the documented exception: its hooks cast every weight to the compute dtype before each
    # forward and back after it, into new tensors (the same bits, other data pointers), so its evictions copy.
    from diffusers_offload_ext.storages import tensor_parts
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = quantized.load(backend, saved)
        before = {n: [t.clone() for p in getattr(pipe, n).parameters() for t in tensor_parts(p)] for n in QUANTIZED}
        pipe.enable_model_cpu_offload(device="cpu", zero_copy_eviction=True)
        image = tiny.run(pipe, NAME)
        copied_back = sim.d2h_bytes
        expected = tiny.run(quantized.load(backend, saved).to(sim.device), NAME)
        after = {n: [t for p in getattr(pipe, n).parameters() for t in tensor_parts(p)] for n in QUANTIZED}
        assert not [t for parts in after.values() for t in parts if sim.is_on_device(t)]  # all home
    offloads = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload" and r.component in QUANTIZED]
    assert offloads and {r.kind for r in offloads} == {"copy" if backend == "layerwise" else "drop"}
    if backend != "layerwise":
        assert copied_back <= image.numel() * image.element_size()  # nothing but the image came back
    assert torch.equal(image, expected)
    assert all(torch.equal(a, b) for n in QUANTIZED for a, b in zip(after[n], before[n]))


EIGHT_BIT = pytest.mark.skipif(not quantized.available("int8")[0], reason="needs bitsandbytes")


@EIGHT_BIT
@pytest.mark.usefixtures("installed")
def test_eight_bit_components_are_shown_cannot_move_and_an_option_naming_one_says_so_once(saved, caplog):
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = quantized.load("int8", saved, device=sim.device)
        with caplog.at_level("WARNING", logger="diffusers_offload_ext"):
            pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer"])
            pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer"])  # already said
        said = [r.getMessage() for r in caplog.records if "cannot move" in r.getMessage()]
        status = doe.offload_status(pipe)
        tiny.run(pipe, NAME)
    assert len(said) == 1 and "['transformer']" in said[0] and "bitsandbytes 8-bit" in said[0]
    for name in QUANTIZED:  # the README's `doe.offload_status(pipe).components["transformer"]`
        component = status.components[name]
        assert (component.role, component.where, component.resident) == ("cannot move", "device", True)
        assert "bitsandbytes 8-bit" in component.why and component.nbytes == doe.module_nbytes(getattr(pipe, name))
    assert status.resident_bytes == sum(doe.module_nbytes(getattr(pipe, n)) for n in QUANTIZED)
    assert all(r.component not in QUANTIZED for r in doe.transfer_ledger(pipe).records)


@EIGHT_BIT
@pytest.mark.usefixtures("installed")
def test_eight_bit_components_count_against_the_budget_at_every_move(saved):
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = quantized.load("int8", saved, device=sim.device)
        fixed = sum(doe.module_nbytes(getattr(pipe, n)) for n in QUANTIZED)
        others = [doe.module_nbytes(m) for n, m in pipe.components.items() if n in ("vae", "text_encoder")]
        budget = fixed + max(others) + 1  # every movable component fits alone, not both beside the fixed ones
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
        # Measured from the tensors after every move (the 8-bit ones included): a component loaded whole that comes to
        # keep only some of its blocks has no ledger record per block it already held.
        watch = MovesWithin(pipe, sim, budget)
        for _ in range(2):
            tiny.run(pipe, NAME)
        watch.remove()
    assert watch.moves and watch.over == [] and watch.most > fixed
    assert [r for r in doe.transfer_ledger(pipe).records if r.call_index == 1]  # not everything could stay


STREAMING = [backend_param(b) for b in quantized.BACKENDS if b != "int8"]


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("backend", STREAMING)
def test_a_quantized_transformer_streams_within_the_budget_at_every_move_its_state_in_the_ring(saved, backend):
    # The ledger's bytes are the storages' (quantization state included); the device storages the components reach
    # after each block ran (a ring buffer counts whole, a state copied outside it too) stay within the budget.
    from diffusers_offload_ext.storages import tensor_parts
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        expected = tiny.run(quantized.load(backend, saved).to(sim.device), NAME)
        pipe = quantized.load(backend, saved)
        budget = int(doe.module_nbytes(pipe.transformer) * 0.8)
        peaks, statuses = [], []

        def measure(*_):
            storages = {}
            for module in [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]:
                for tensor in [*module.parameters(), *module.buffers()]:
                    for part in tensor_parts(tensor):
                        if sim.is_on_device(part):
                            storage = part.untyped_storage()
                            storages[storage.data_ptr()] = storage.nbytes()
            peaks.append(sum(storages.values()))

        def callback(p, step, timestep, kwargs):
            statuses.append(doe.offload_status(p).components["transformer"].blocks)
            return kwargs

        for block in [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]:
            block.register_forward_hook(measure)
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
        watch = MovesWithin(pipe, sim, budget)
        images = pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=callback).images
        watch.remove()
        image = torch.as_tensor(images).detach().to(device="cpu", dtype=torch.float32)
    blocks = block_sizes(pipe.transformer)
    streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None and r.component == "transformer"]
    assert streamed and all(r.nbytes == blocks[r.block] for r in streamed)  # storage bytes, state included
    assert torch.equal(image, expected)
    assert statuses[0] is not None and statuses[0].streamed
    assert watch.moves and watch.over == []  # at every move, from the tensors (quantization state included)
    assert peaks and max(peaks) <= budget
