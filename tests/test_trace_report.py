"""Outputs of a trace: JSON that round-trips, the summary, the rich table and the timeline PNG."""

import json

import pytest
import torch

doe = pytest.importorskip("diffusers_offload_ext")

import toy  # noqa: E402

from diffusers_offload_ext.observe.trace import FORMAT, Trace  # noqa: E402

pytestmark = pytest.mark.plugin_only


class MixedToy(doe.OffloadMixin, toy.TracePipeline):
    pass


@pytest.fixture(scope="module")
def replayed_trace():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer", "vae", "transformer", "vae"])
        pipe(["text_encoder", "transformer", "vae"])
    return recorded


@pytest.fixture(scope="module")
def extension_trace():
    pipe = toy.build(MixedToy)
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=True)
    with doe.trace(pipe) as recorded:
        for _ in range(3):
            pipe(["text_encoder", "transformer", "vae", "transformer", "vae"])
    return recorded


def test_json_round_trips(tmp_path, replayed_trace, extension_trace):
    for recorded in (replayed_trace, extension_trace):
        path = tmp_path / "trace.json"
        recorded.to_json(str(path))
        loaded = Trace.load(str(path))
        assert loaded.to_dict() == recorded.to_dict()
        assert loaded.records == recorded.records and loaded.calls == recorded.calls
        assert loaded.replayed == recorded.replayed
        data = json.loads(path.read_text())
        assert data["format"] == FORMAT and data["replayed"] == recorded.replayed
        assert data["summary"]["total"]["onloads"] == sum(r["direction"] == "onload" for r in data["records"])
    with pytest.raises(RuntimeError, match="loaded from a file"):
        with loaded:
            pass


def test_from_dict_rejects_other_documents():
    with pytest.raises(ValueError, match="Not a"):
        Trace.from_dict({"format": "something else"})
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict({"format": FORMAT, "version": 999})


def test_summary_counts_every_record(extension_trace):
    summary = extension_trace.summary()
    records = extension_trace.records
    assert summary["total"]["onload_bytes"] == sum(r.nbytes for r in records if r.direction == "onload")
    assert summary["total"]["total_bytes"] == sum(r.copied_bytes for r in records)
    for name, counter in summary["per_component"].items():
        assert counter["onloads"] == sum(r.component == name and r.direction == "onload" for r in records)
    assert set(summary["per_call"]) == {"0", "1", "2"}
    # keep_on_device_during_generation: each component moves once each way per call (the class-excluded safety
    # checker goes out and back at the end of each call, as in stock).
    for key, counter in summary["per_call"].items():
        moved = sorted(r.component for r in records if r.call == int(key) and r.direction == "onload")
        assert moved == ["safety_checker", "text_encoder", "transformer", "vae"]
        assert counter["onloads"] == counter["offloads"] == 4
    assert summary["per_source"].keys() == {"extension"}


def _render(table) -> str:
    from rich.console import Console

    console = Console(record=True, width=220)
    console.print(table)
    return console.export_text()


def test_tables_say_what_was_replayed(replayed_trace, extension_trace):
    text = _render(replayed_trace.table())
    assert "REPLAYED" in text and "transformer" in text and "text_encoder" in text
    by_call = _render(replayed_trace.table(by="call"))
    assert "REPLAYED" in by_call and "model-offload" in by_call
    plain = _render(extension_trace.table())
    assert "REPLAYED" not in plain and "no bytes crossed a bus" in plain
    with pytest.raises(ValueError):
        extension_trace.table(by="step")


def _ink(path) -> float:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    return float((pixels[..., :3].mean(axis=-1) < 0.9).mean())


@pytest.mark.parametrize("x", ["step", "time"])
def test_the_timeline_png_is_written(tmp_path, replayed_trace, extension_trace, x):
    for name, recorded in (("replayed", replayed_trace), ("extension", extension_trace)):
        path = tmp_path / f"{name}-{x}.png"
        figure = recorded.plot(str(path), x=x)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert _ink(path) > 0.01
        texts = " ".join(t.get_text() for ax in figure.axes for t in ax.texts) + " ".join(
            t.get_text() for t in figure.texts
        )
        assert ("REPLAYED" in texts) == recorded.replayed
    with pytest.raises(ValueError):
        extension_trace.plot(x="bytes")


def test_a_long_timeline_stays_readable(tmp_path):
    """50 steps x 10 calls: one real call of the tiny Flux pipeline, repeated ten times in the JSON document."""
    tiny = pytest.importorskip("diffusers_offload_ext.tiny")
    if not tiny.available("flux")[0]:
        pytest.skip(tiny.available("flux")[1])
    pipe = tiny.build("flux")
    pipe.enable_model_cpu_offload(device="cpu")
    with torch.no_grad(), doe.trace(pipe) as recorded:
        kwargs = tiny.call_kwargs("flux", preview=True)
        kwargs["num_inference_steps"] = 50
        pipe(**kwargs)
    assert [c.steps for c in recorded.calls] == [50]
    data = recorded.to_dict()
    span = data["calls"][0]["end"] + 0.01
    calls, records = [], []
    for index in range(10):
        call = json.loads(json.dumps(data["calls"][0]))
        call.update(index=index, start=call["start"] + index * span, end=call["end"] + index * span)
        for use in call["uses"]:
            use["t"] += index * span
        calls.append(call)
        for record in data["records"]:
            records.append({**record, "index": len(records), "call": index, "t": record["t"] + index * span})
    long = Trace.from_dict({**data, "calls": calls, "records": records})
    assert sum(r.component == "transformer" for r in long.records) == 2 * 50 * 10
    path = tmp_path / "long.png"
    figure = long.plot(str(path))
    width, height = figure.get_size_inches()
    assert width <= 20 and height <= 12
    assert _ink(path) > 0.02


def _lane_marks(figure, lane):
    """The x extents of the 'component ran' bars and the x of the offload ticks drawn on lane `lane` of a timeline."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_hex

    from diffusers_offload_ext.observe.report.panel import OFFLOAD_COLOR, USE_COLOR

    ax = figure.axes[0]
    runs = []
    for collection in ax.collections:
        if isinstance(collection, PolyCollection) and to_hex(collection.get_facecolor()[0]) == USE_COLOR:
            for path in collection.get_paths():
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                if lane - 0.5 < ys.mean() < lane:
                    runs.append((xs.min(), xs.max()))
    offloads = [
        line.get_xdata()[0]
        for line in ax.lines
        if len(line.get_xdata()) == 2 and line.get_color() == OFFLOAD_COLOR and line.get_ydata()[0] == lane
    ]
    return runs, offloads


@pytest.mark.parametrize("build", ["replayed", "extension"])
def test_the_timeline_draws_each_offload_after_the_run_before_it(build, replayed_trace, extension_trace):
    """The VAE's end-of-call offload shares the 'after the loop' slot with its decode: the decode is drawn first."""
    recorded = replayed_trace if build == "replayed" else extension_trace
    figure = recorded.plot()
    lane = len(recorded.components) - 1 - list(recorded.components).index("vae")
    runs, offloads = _lane_marks(figure, lane)
    assert runs and offloads
    last_run, last_offload = max(runs), max(offloads)
    assert last_run[1] <= last_offload, (last_run, last_offload)
    # ... and every offload that follows a run in the same slot is drawn after that run ends.
    for start, end in runs:
        after = [x for x in offloads if x > start]
        assert not after or min(after) >= end, ((start, end), after)
