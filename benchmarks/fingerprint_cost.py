"""What change detection costs, as a ratio to one plain read of the same bytes in the same run: `fingerprints` of a
bfloat16 component-like set of tensors (64 of 1M elements, 400 of 3072) against `torch.sum` of the same bytes read
as int64 words (the fastest full read torch offers) and against `.sum()` in bfloat16 (what `benchmarks/gpu_probes.py`
compares with), on the CPU with one thread, best of `--repeats`; with `--previous COMMIT` also that commit's
`fingerprints` (read with `git show`, so run it from a git checkout). Times on a shared machine are noise except as
ratios within one run. The goal (issue 22) is at most 1.5x one plain read. For reference it also times the cheapest
one-operation alternative, a weighted sum of the int64 words with odd weights (`torch.dot` per chunk, CPU only): it
sees any single changed word, but no linear sum modulo 2**64 sees a word's top bit flipped in an even number of
words (`w.neg_()` of a float64 tensor of even size, two sign flips of bfloat16 elements four apart), so
`fingerprints` does not use it.

    PYTHONPATH=. python benchmarks/fingerprint_cost.py [--previous a4ef570] [--device cuda]
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

from diffusers_offload_ext.transfer import fingerprint as current
from diffusers_offload_ext.pinning.bandwidth import best_seconds


def previous_module(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:diffusers_offload_ext/transfer/fingerprint.py"],
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--previous", help="also time this commit's fingerprints")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tensors = [torch.randn(1 << 20).to(torch.bfloat16).to(device) for _ in range(64)]
    tensors += [torch.randn(3072).to(torch.bfloat16).to(device) for _ in range(400)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    words = [t.view(torch.int64) for t in tensors]  # every size here is a multiple of 8 bytes
    runs = {
        "plain read (int64 sum)": lambda: [w.sum() for w in words],
        "plain read (bf16 sum)": lambda: [t.sum() for t in tensors],
        "fingerprints": lambda: current.fingerprints(tensors),
    }
    if device.type == "cpu":  # integer dot products are not implemented on CUDA
        weights = torch.arange(1, (1 << 18) + 1, dtype=torch.int64, device=device) * current._GOLDEN | 1
        runs["weighted int64 sum (rejected)"] = lambda: [
            torch.dot(w[i : i + weights.numel()], weights[: w[i : i + weights.numel()].numel()])
            for w in words
            for i in range(0, w.numel(), weights.numel())
        ]
    if args.previous:
        old = previous_module(args.previous)
        runs[f"fingerprints at {args.previous}"] = lambda: old.fingerprints(tensors)
    seconds = {label: best_seconds(run, args.repeats, sync) for label, run in runs.items()}
    read = seconds["plain read (int64 sum)"]
    print(
        f"{nbytes / 1e6:.0f} MB of bfloat16 weights in {len(tensors)} tensors, {device}, 1 thread, best of {args.repeats}:"
    )
    for label, value in seconds.items():
        print(f"  {label:<30} {value:.4f} s  {nbytes / value / 1e9:6.2f} GB/s  {value / read:5.2f}x one plain read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
