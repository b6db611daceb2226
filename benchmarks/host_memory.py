"""Issue 32's measurement on the CPU: a FLUX pipeline (the tiny test pipeline's other components) whose transformer
has 544 MiB of float32 weights (2 double and 11 single blocks of width 768), saved with `save_pretrained`
(safetensors), loaded in a fresh process with `from_pretrained` and with `doe.load_file_backed`, offloaded on the
plain CPU (`cpu:0`) with `host_memory_budget`, called twice; then once more with the host budget turned off. It
prints the growth of the process's anonymous memory (`RssAnon`, `/proc/self/status`; sampled every 2 ms for the
peaks) from before loading, and whether the images equal no offload's (computed in this process).

    PYTHONPATH=. python benchmarks/host_memory.py [--budget 32MiB] [--folder DIR] [--double 2 --single 11]
"""

import argparse
import os
import sys
import tempfile

import torch

from diffusers_offload_ext.constants import MiB
from diffusers_offload_ext.testing import host_rss, tiny
from diffusers_offload_ext.units import parse_size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="32MiB")
    parser.add_argument("--folder", help="where the pipeline is (written there if it is not)")
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=11)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = args.folder or tempfile.mkdtemp(prefix="host-memory-")
    if not os.path.exists(os.path.join(folder, "model_index.json")):
        host_rss.build(folder, args.double, args.single)
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    weights = sum(t.numel() * t.element_size() for t in pipe.transformer.parameters())
    reference = tiny.run(pipe, "flux")
    del pipe
    bound = parse_size(args.budget) + 48 * MiB
    print(f"transformer: {weights / MiB:.1f} MiB; host_memory_budget={args.budget!r}; bound {bound / MiB:.0f} MiB\n")
    print("| loader | loading: peak, after | two calls: peak, after | within the bound | images equal | one call "
          "without a host budget |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for loader in ("from_pretrained", "helper"):
        found = host_rss.measure(folder, loader, args.budget)
        grown = {k: (found[k] - found["before"]) / MiB for k in ("load_peak", "loaded", "calls_peak", "called")}
        equal = all(torch.equal(image, reference) for image in found["images"])
        without = (found["without"] - found["called"]) / MiB
        name = "`from_pretrained`" if loader == "from_pretrained" else "`doe.load_file_backed`"
        print(
            f"| {name} | +{grown['load_peak']:.1f}, +{grown['loaded']:.1f} MiB | +{grown['calls_peak']:.1f}, "
            f"+{grown['called']:.1f} MiB | {'yes' if grown['calls_peak'] * MiB <= bound else 'NO'} | "
            f"{'yes' if equal else 'NO'} | +{without:.1f} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
