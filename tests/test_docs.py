"""Every code block of the README, CONTRIBUTING.md and docs/ runs as written, on the tiny pipelines.

Python blocks of one file run in order in one namespace, as a reader would paste them into one session, with three
stand-ins for what this machine lacks: `from_pretrained` returns the tiny pipeline of that class (no download);
its calls use the tiny pipeline's image size, step count and sequence length; and the accelerator that device
detection finds is the simulated one (`cpu:0`), under which a layer running on host weights fails. In bash blocks
the `diffusers-offload ...` lines run (in-process, exit code 0 expected). A block preceded by
`<!-- not run: why -->` is skipped with that reason: installs, `make`, signatures.
"""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

pytestmark = pytest.mark.plugin_only  # the examples use `diffusers_offload_ext`, which the patched stack lacks

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (?P<why>\S.*?) -->$")
#: The tiny pipeline that stands in for each pipeline class the examples load.
TINY_OF = {
    "StableDiffusionPipeline": "sd15",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxImg2ImgPipeline": "flux_img2img",
    "WanPipeline": "wan21",
    "StableDiffusionControlNetPipeline": "sd_controlnet",
}
#: Call arguments that always take the tiny pipeline's value (a real size would take minutes on the CPU).
TINY_SIZES = ("height", "width", "num_inference_steps", "max_sequence_length", "num_frames")


def blocks(path):
    """(language, first line number, code, why-not-run or None) for each fenced block of `path`."""
    found, language, start, lines, previous = [], None, 0, [], ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = FENCE.match(line)
        if language is None and fence:
            marker = NOT_RUN.match(previous.strip())
            language, start, lines, why = fence.group(1), number + 1, [], marker and marker.group("why")
        elif language is not None and line.strip() == "```":
            found.append((language, start, "\n".join(lines) + "\n", why))
            language = None
        elif language is not None:
            lines.append(line)
        if line.strip():
            previous = line
    assert language is None, f"{path.name}: a code block opened at line {start} is never closed"
    return found


def runnable(path):
    return [b for b in blocks(path) if b[0] in ("python", "bash") and b[3] is None]


def test_the_documents_have_blocks_to_run():
    """The extraction finds what is there: a change to the fence syntax must not make this suite pass vacuously."""
    counts = {path.name: len(runnable(path)) for path in DOCUMENTS}
    assert counts["README.md"] >= 6, counts
    assert sum(counts.values()) >= 9, counts


def test_skipped_blocks_say_why():
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for comment in re.findall(r"<!-- not run.*?-->", text):
            assert NOT_RUN.match(comment), f"{path.name}: {comment!r} gives no reason"


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """Tiny pipelines for `from_pretrained`, the simulated accelerator for device detection; restores everything."""
    diffusers = pytest.importorskip("diffusers")
    import diffusers_offload_ext as doe
    from diffusers_offload_ext.testing import tiny
    from diffusers_offload_ext.testing.simulated_accelerator import DEVICE, SimulatedAccelerator

    pipeline_utils = pytest.importorskip("diffusers.pipelines.pipeline_utils")
    if not hasattr(pipeline_utils, "get_device"):
        pytest.skip("diffusers < 0.33 assumes CUDA when no device is given: the examples are checked on newer ones")
    import diffusers.utils.torch_utils as torch_utils

    for module in (pipeline_utils, torch_utils):
        monkeypatch.setattr(module, "get_device", lambda: str(DEVICE))
    sized = {}

    def tiny_class(cls, name):
        if cls not in sized:

            def __call__(self, *args, **kwargs):
                defaults = tiny.call_kwargs(name)
                kwargs.update({k: defaults[k] for k in TINY_SIZES if k in defaults})
                for key in ("image", "strength", "negative_prompt", "generator"):
                    if key in defaults:
                        kwargs.setdefault(key, defaults[key])
                return super(sized[cls], self).__call__(*args, **kwargs)

            sized[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        return sized[cls]

    def from_pretrained(cls, *args, **kwargs):
        names = [TINY_OF[c.__name__] for c in cls.__mro__ if c.__name__ in TINY_OF]
        if not names:
            pytest.fail(f"the docs load {cls.__name__}, which has no tiny stand-in: add it to TINY_OF")
        available, why = tiny.available(names[0])
        if not available:
            pytest.skip(why)
        pipe = tiny.build(names[0])
        pipe.__class__ = tiny_class(cls, names[0])
        return pipe

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.chdir(tmp_path)  # files the examples write (timeline.png, trace.json)
    was_installed = doe.is_installed()
    with SimulatedAccelerator() as accelerator:
        yield accelerator
    if doe.is_installed() and not was_installed:
        doe.uninstall()


def run_bash(code, where):
    from diffusers_offload_ext.cli import main

    for line in code.splitlines():
        command = shlex.split(line, comments=True)
        if not command:
            continue
        assert command[0] == "diffusers-offload", f"{where}: only `diffusers-offload` runs here; mark the block"
        if command[1:2] == ["demo"]:
            command.append("--json")  # the same run, without the terminal table
        with contextlib.redirect_stdout(io.StringIO()) as out:
            code_returned = main(command[1:])
        assert code_returned == 0, f"{where}: `{line.strip()}` exited {code_returned}:\n{out.getvalue()[-2000:]}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(path, stand_ins):
    todo = runnable(path)
    if not todo:
        pytest.skip(f"{path.name} has no block to run")
    namespace = {"__name__": "__docs__"}
    for language, line, code, _ in todo:
        where = f"{path.relative_to(ROOT)}, block at line {line}"
        if language == "bash":
            run_bash(code, where)
            continue
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as error:  # the block and its line in the failure message
            raise AssertionError(f"{where} failed: {error!r}") from error
