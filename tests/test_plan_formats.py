"""`plan --dtype` with quantized formats (issue 20, item 8): NF4/FP4, bitsandbytes 8-bit and GGUF layouts sized from
their own layouts, per component (`--dtype transformer=nf4,text_encoder_2=int8`). That the sizes are the real
libraries' bytes is tested against them in `tests/test_quantized.py` (`make test-quant`)."""

import json
import math

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the planner")

from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.models import plan  # noqa: E402
from diffusers_offload_ext.models.block_model import BlockPlans  # noqa: E402
from diffusers_offload_ext.models.errors import PlanError  # noqa: E402
from diffusers_offload_ext.models.recorded import load_recorded  # noqa: E402

pytestmark = pytest.mark.plugin_only
GiB = 1 << 30


def counts(component):
    return load_recorded("flux-dev")["components"][component]


def test_formats_are_sized_from_their_layouts_with_the_rest_in_the_component_dtype():
    result = plan("flux-dev", dtypes=["transformer=nf4,text_encoder_2=int8", "vae=q8_0"])
    components = result["components"]
    transformer, t5 = counts("transformer"), counts("text_encoder_2")
    elements, rows, matrices = transformer["linear"]
    # NF4: 64 values in 32 bytes and a float32 absmax, a 64-byte code per weight; the rest stays bfloat16.
    nf4 = math.ceil(elements / 64) * 36 + matrices * 64 + (transformer["floating"] - elements) * 2
    assert components["transformer"]["nbytes"] == nf4 and components["transformer"]["dtype"] == "nf4"
    assert components["transformer"]["rest_dtype"] == "bfloat16"
    elements, rows, matrices = t5["linear"]
    assert components["text_encoder_2"]["nbytes"] == elements + 4 * rows + (t5["floating"] - elements) * 2
    assert 0 < elements < t5["floating"]  # T5's `wo` stays unquantized, as transformers keeps it
    assert components["text_encoder"]["dtype"] == "bfloat16"  # untouched
    assert 6 * GiB < components["transformer"]["nbytes"] < 7 * GiB  # FLUX.1-dev NF4 as users download it


def test_repeated_and_comma_separated_overrides_agree():
    joined = plan("flux-dev", dtypes=["transformer=Q4_K,text_encoder_2=nf4"])
    repeated = plan("flux-dev", dtypes=["transformer=q4_k", "text_encoder_2=NF4"])
    assert joined["components"] == repeated["components"]


def test_block_sizes_in_a_format_add_up_to_the_component():
    dtypes = {"text_encoder": "bfloat16", "text_encoder_2": "int8", "transformer": "nf4", "vae": "q8_0"}
    blocks = BlockPlans("flux-dev", dtypes)
    result = plan("flux-dev", dtypes=[f"{n}={d}" for n, d in dtypes.items()])
    for name, dtype in dtypes.items():
        if dtype in ("nf4", "int8"):  # block rows split exactly as the component's (q8_0: rounded per block)
            assert sum(blocks.blocks(name).values()) == result["components"][name]["nbytes"], name


def test_an_unknown_format_lists_the_known_ones(capsys):
    with pytest.raises(PlanError, match=r"unknown dtype 'q9_9'.*nf4.*int8.*q8_0"):
        plan("flux-dev", dtypes=["transformer=q9_9"])
    code, out, _ = cli.main(["plan", "--model", "flux-dev", "--dtype", "transformer", "--json"]), None, None
    out = capsys.readouterr().out
    assert code == 2 and "COMPONENT=DTYPE[,COMPONENT=DTYPE...]" in json.loads(out)["error"]


def test_a_quantized_flux_fits_a_16_gib_card_where_bf16_does_not(capsys):
    args = ["plan", "--model", "flux-dev", "--vram", "16GiB", "--json"]
    assert cli.main(args) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--dtype", "transformer=nf4,text_encoder_2=int8"]) == 0
    quantized = json.loads(capsys.readouterr().out)
    assert not bf16["strategies"]["exclude_denoiser"]["fits_with_reserve"]
    assert quantized["strategies"]["exclude_denoiser"]["fits_with_reserve"]  # the transformer stays on the card
    assert quantized["block_residency"].get("needed") is False  # nothing streams


def test_an_8_bit_component_is_held_where_it_is_loaded_never_moved(capsys):
    """bitsandbytes 8-bit components cannot move (the runtime never moves them, `offload_status` says "cannot
    move"): the plan holds T5 on the card, in every peak, and moves only the others (issue 34, point 4)."""
    result = plan("flux-dev", vram="24GiB", dtypes=["transformer=nf4,text_encoder_2=int8"], reserve="3GiB")
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    assert result["cannot_move"] == ["text_encoder_2"] and "text_encoder_2" not in result["call_trace"]
    movable = sizes["text_encoder"] + sizes["transformer"] + sizes["vae"]
    stock = result["strategies"]["stock"]
    assert stock["mean_bytes_per_generation_including_setup"] == 2 * movable  # T5's bytes never cross
    assert stock["peak_bytes"] == sizes["transformer"] + sizes["text_encoder_2"]
    exclude = result["strategies"]["exclude_denoiser"]
    assert exclude["setup_bytes"] == sizes["transformer"]
    assert exclude["peak_bytes"] == sizes["transformer"] + sizes["text_encoder_2"] + sizes["text_encoder"]
    # The budget counts it: the residency manager's policy gets what it leaves.
    residency = result["strategies"]["residency"]
    assert residency["budget_bytes"] == 21 * GiB - sizes["text_encoder_2"]
    assert any("text_encoder_2" in note and "cannot move" in note for note in result["notes"])
