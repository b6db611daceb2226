"""Seconds to fingerprint a bfloat16 component-like set of tensors (64 of 1M elements, 400 of 3072), on the CPU with
one thread: this version's batched `fingerprints` against the per-element, per-tensor version of commit 39fccac
(read with `git show`, so run it from a git checkout). Times on a shared machine are noise except as a ratio within
one run.

    PYTHONPATH=. python benchmarks/fingerprint_cost.py
"""

import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

from diffusers_offload_ext.transfer import fingerprint as current

PREVIOUS = "39fccac"


def previous_module():
    source = subprocess.run(
        ["git", "show", f"{PREVIOUS}:diffusers_offload_ext/transfer/fingerprint.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("fingerprint_previous", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tensors = [torch.randn(1 << 20).to(torch.bfloat16) for _ in range(64)]
    tensors += [torch.randn(3072).to(torch.bfloat16) for _ in range(400)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    old = previous_module()
    runs = {
        f"previous ({PREVIOUS})": lambda: torch.stack([old.fingerprint(t) for t in tensors]),
        "current": lambda: current.fingerprints(tensors),
    }
    best = {}
    for _ in range(3):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            best[label] = min(best.get(label, float("inf")), time.perf_counter() - start)
    print(f"{nbytes / 1e6:.0f} MB of bfloat16 weights in {len(tensors)} tensors, CPU, 1 thread, best of 3:")
    for label, seconds in best.items():
        print(f"  {label:<20} {seconds:.3f} s")
    print(f"  ratio {best[f'previous ({PREVIOUS})'] / best['current']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
