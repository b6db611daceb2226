"""The "Transfer numbers" table of patches/README.md: one pipeline call of the tiny pipelines under the plugin, as
the transfer ledger records it, priced with the real models' exact component sizes (the shipped model data). The
moves are the same with the patch (the shared test suite checks it).

    python benchmarks/transfer_numbers.py
"""

import torch

import diffusers_offload_ext as doe
from diffusers_offload_ext.models import load_model
from diffusers_offload_ext.testing import tiny

CASES = [
    ("Flux-dev (bf16), 28 steps, preview decoded every step", "flux", "flux-dev", 28, True, "transformer"),
    ("Flux-dev (bf16), 28 steps, no callback", "flux", "flux-dev", 28, False, "transformer"),
    ("SDXL (fp16), 30 steps, no callback", "sdxl", "sdxl", 30, False, "unet"),
]
#: ASSUMED, not measured: pageable host memory over PCIe 4.0 x16, both directions.
BANDWIDTH = 12e9


def ledger_of_one_call(name, steps, preview, **options):
    pipe = tiny.build(name)
    pipe.enable_model_cpu_offload(device="cpu", **options)
    ledger = doe.transfer_ledger(pipe)
    kwargs = tiny.call_kwargs(name, preview=preview)
    kwargs["num_inference_steps"] = steps
    with torch.no_grad():
        pipe(**kwargs)
    return [r for r in ledger.records if r.call_index == 0]


def main():
    doe.install()
    torch.set_num_threads(1)
    print("| scenario | options | onloads | offloads | bytes moved per call | seconds at an assumed 12 GB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, name, model, steps, preview, denoiser in CASES:
        sizes = load_model(model).sizes
        for options_label, options in [
            ("stock", {}),
            ("`keep_on_device_during_generation=True`", {"keep_on_device_during_generation": True}),
            (f'`exclude_from_offload=["{denoiser}"]`', {"exclude_from_offload": [denoiser]}),
        ]:
            records = ledger_of_one_call(name, steps, preview, **options)
            onloads = sum(r.direction == "onload" for r in records)
            offloads = len(records) - onloads
            moved = sum(sizes[r.component] for r in records)
            print(
                f"| {label} | {options_label} | {onloads} | {offloads} | {moved / 1e9:.2f} GB "
                f"| {moved / BANDWIDTH:.2f} |"
            )


if __name__ == "__main__":
    main()
