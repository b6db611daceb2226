"""Item 4 through diffusers' real LoRA loading: `load_lora_weights` removes the offload hooks when it recognises a
`CpuOffload`, loads, and calls `enable_model_cpu_offload()` with no argument. The options must survive that."""

import pytest
import tiny_pipelines as tiny
import torch
from harness import Session, hooked_names, max_abs_diff
from spy import modules_of

pytestmark = pytest.mark.usefixtures("accelerator")  # each test on the plain CPU and on the simulated accelerator

peft = pytest.importorskip("peft", reason="LoRA loading needs peft (in the test extra)")


def lora_state_dict(unet):
    """A small LoRA for `unet` in diffusers' format, with non-zero up-projections so that it changes the image."""
    import copy

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    donor = copy.deepcopy(unet)
    donor.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in donor.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return {f"unet.{key}": value for key, value in get_peft_model_state_dict(donor).items()}


@pytest.mark.parametrize("keep", [True, ()])
def test_load_lora_weights_keeps_options(installed, accelerator, detected_device, keep):
    name = "sd15"
    pipe = tiny.build(name)
    session = Session(pipe, exclude=("unet",), keep=keep)
    before = session.call(lambda p: tiny.run(p, name, seed=0))

    pipe.load_lora_weights(lora_state_dict(pipe.unet), adapter_name="tiny")
    # Re-armed by diffusers with no argument (every component has its hook again, the excluded unet's only evicts):
    # the unet is still excluded (it never moves in a call, below), the rest still offloaded.
    assert hooked_names(pipe) == set(modules_of(pipe))
    after = session.call(lambda p: tiny.run(p, name, seed=0))
    assert max_abs_diff(after, before) > 1e-4, "the LoRA did not change the image"
    assert not any(n == "unet" and c is not None for n, _, _, c in session.seen_moves())
    assert session.on_device(accelerator) == {"unet"}
