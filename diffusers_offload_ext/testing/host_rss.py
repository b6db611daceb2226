"""Measuring host memory by kind around a pipeline's loading and calls, in a fresh process (so that the process's
anonymous memory, `RssAnon` in `/proc/self/status`, is this run's alone): a tiny FLUX pipeline whose transformer is
as large as asked, saved with `save_pretrained` (safetensors) and loaded with `from_pretrained` or
`doe.load_file_backed`, then called twice with offload (on the plain CPU, `cpu:0`) and a host budget.

`build(folder, ...)` writes the pipeline; `measure(folder, ...)` runs the child (`python -m
diffusers_offload_ext.testing.host_rss CHILD-ARGS`) and returns what it measured: anonymous memory before loading
(imports done), its peak while loading (sampled every 2 ms by a thread), after loading, its peak over the two calls
and after them, then once more after a call with the host budget turned off (what it costs without one). The child
imports what loading imports before it measures, so that it is not counted as the pipeline's. Used by
`tests/test_host_memory.py` (a small transformer) and `benchmarks/host_memory.py` (the issue's 544 MiB one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, Optional

import torch

from ..host.memory import process_memory


def transformer_config(double: int, single: int) -> dict:
    """A FLUX transformer that fits the tiny pipeline's other components (`testing/tiny.py`), with `double` and
    `single` blocks of width 768 (each about 81 and 34 MiB in float32)."""
    return dict(
        patch_size=1, in_channels=16, num_layers=double, num_single_layers=single, attention_head_dim=64,
        num_attention_heads=12, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(8, 28, 28),
    )  # fmt: skip


def build(folder: str, double: int, single: int) -> int:
    """Write the tiny FLUX pipeline with that transformer to `folder` (`save_pretrained`, safetensors); returns the
    transformer's bytes."""
    import diffusers

    from . import tiny

    pipe = tiny.build("flux")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        pipe.transformer = diffusers.FluxTransformer2DModel(**transformer_config(double, single)).eval()
    pipe.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())


class _Peak:
    """The most `RssAnon` seen by a thread sampling every 2 ms while the block runs."""

    def __enter__(self):
        self.peak, self._stop = anonymous(), False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, anonymous())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, anonymous())


def anonymous() -> int:
    return process_memory().get("RssAnon", 0)


def child(folder: str, loader: str, budget: Optional[str], images: str, threads: str = "0") -> Dict[str, int]:
    """In the child process: load, arm, call twice, call once without the host budget; the figures in bytes. With
    `threads` (not 0), torch computes with that many threads (as the parent, for images equal to its own)."""
    if int(threads):
        torch.set_num_threads(int(threads))
    import diffusers

    import diffusers_offload_ext as doe

    from . import tiny

    doe.install()

    def load():
        return doe.load_file_backed(folder) if loader == "helper" else diffusers.FluxPipeline.from_pretrained(folder)

    _warm_up()
    found = {"before": anonymous()}
    with _Peak() as peak:
        pipe = load()
    found.update(load_peak=peak.peak, loaded=anonymous())
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget=budget)
    with _Peak() as peak:
        made = [tiny.run(pipe, "flux") for _ in range(2)]
    found.update(calls_peak=peak.peak, called=anonymous())
    torch.save(made, images)
    pipe.enable_model_cpu_offload(host_memory_budget="off")
    tiny.run(pipe, "flux")
    found["without"] = anonymous()
    return found


def _warm_up() -> None:
    """Import what loading the pipeline imports (transformers' models and tokenizers, the pipeline's module), so that
    it is this process's before the measurement and does not count as the pipeline's."""
    import diffusers.pipelines.flux.pipeline_flux  # noqa: F401
    from diffusers import AutoencoderKL, FluxTransformer2DModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # noqa: F401


def measure(folder: str, loader: str = "from_pretrained", budget: str = "32MiB", timeout: int = 600) -> dict:
    """Run `child` in a fresh process; returns its figures and `images` (the two calls' images)."""
    images = os.path.join(folder, f"images-{loader}.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = [sys.executable, "-m", __name__, folder, loader, budget, images, str(torch.get_num_threads())]
    done = subprocess.run(code, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring child failed:\n{done.stderr[-4000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["images"] = torch.load(images)
    return found


if __name__ == "__main__":
    print(json.dumps(child(*sys.argv[1:6])))
