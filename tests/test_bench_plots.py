"""The report's plots are readable: every text inside the figure, a legend wherever colour carries meaning,
batch sizes apart, the allowed accuracy drop drawn, pruning's before and after side by side."""
import pytest

pytest.importorskip("matplotlib")

from torchspeed.bench import report  # noqa: E402

LONG = "a technique whose name is far too long to fit beside its bar on one line without wrapping it"


def _lat(technique, batch, median, drop=None, ceiling="fp32", pct=50.0):
    return {"technique": technique, "median": median, "min": median * 0.9, "max": median * 1.1, "unit": "ms",
            "ratio": 1.0, "metric_drop": drop, "batch": batch, "ceiling": ceiling, "achieved": pct,
            "pct_of_ceiling": pct, "what": ""}


RESULTS = {
    "data": {"rows": [
        {"technique": "baseline", "median": 345.0, "unit": "img/s", "ratio": 1.0, "what": ""},
        {"technique": LONG, "median": 4088.0, "unit": "img/s", "ratio": 11.8, "ceiling": "decode",
         "achieved": 4088.0, "pct_of_ceiling": 26.0, "what": ""},
    ]},
    "train": {"rows": [
        {"technique": "plain PyTorch", "median": 22.0, "unit": "samples/s", "ratio": 1.0, "cumulative": 1.0,
         "ceiling": "fp32", "achieved": 77.0, "pct_of_ceiling": 48.0, "what": ""},
        {"technique": "+ bf16 autocast", "median": 80.0, "unit": "samples/s", "ratio": 3.6, "cumulative": 3.6,
         "ceiling": "bf16", "achieved": 300.0, "pct_of_ceiling": 140.0, "what": ""},
    ]},
    "infer": {"max_metric_drop": 0.01, "rows": [
        _lat("resnet18 b1: eager fp32", 1, 47.9, 0.0),
        _lat("resnet18 b1: ONNX Runtime INT8", 1, 14.8, -0.003, "int8", 72.0),
        _lat("resnet18 b1: torchspeed best", 1, 14.8, -0.003, "int8", 72.0),
        _lat(f"resnet18 b8: {LONG}", 8, 353.0, 0.0),
        _lat("resnet18 b8: OpenVINO INT8", 8, 109.0, 0.004, "int8", 78.0),
    ]},
    "compress": {
        "prune": {"report": {"latency_before_ms": 16.2, "latency_after_ms": 6.75},
                  "batched": {"batch": 64, "original_ms": 196.1, "pruned_ms": 58.8}},
        "rows": [
            {"technique": "unpruned, batch 1", "median": 16.2, "unit": "ms", "ratio": 1.0, "what": ""},
            {"technique": "pruned", "median": 6.75, "unit": "ms", "ratio": 2.4, "what": ""},
            {"technique": "  same, batch 64", "median": 58.8, "unit": "ms", "ratio": 3.3, "what": ""},
            {"technique": "student", "median": 0.579, "unit": "top-1", "metric_drop": 0.07, "what": ""},
        ]},
    "design": {"rows": [
        {"technique": f"G{i} {LONG} - paper: fastest; here: holds", "median": 30.0 + i, "unit": "ms", "what": ""}
        for i in range(1, 5)]},
}


@pytest.fixture
def rendered(tmp_path, monkeypatch):
    """(the files each suite wrote, {file name: figure}, {file name: texts outside the figure}) for RESULTS,
    the texts found as each figure is saved (before the report closes it)."""
    figures, outside = {}, {}
    save = report._save_png

    def keep(fig, path):
        save(fig, path)
        name = path.rsplit("/", 1)[-1]
        figures[name], outside[name] = fig, _texts_outside(fig)

    monkeypatch.setattr(report, "_save_png", keep)
    written = {name: report.plot_suite(name, result, str(tmp_path)) for name, result in RESULTS.items()}
    return written, figures, outside


def _texts_outside(fig):
    """The drawn texts whose extent falls outside the figure (1 pixel of tolerance): tick labels through each
    axis's own extent (which counts only the ticks it draws), every other visible text one by one."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # the layout as saved
    box = fig.bbox

    def out(e):
        return e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1

    ticks, outside = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((id(tick.label1), id(tick.label2)))
        if out(ax.get_tightbbox(renderer)):
            outside.append(f"axes {ax.get_title()!r}")
    for t in fig.findobj(Text):
        if id(t) not in ticks and t.get_visible() and t.get_text().strip() and out(t.get_window_extent(renderer)):
            outside.append(t.get_text())
    return outside


def test_every_plot_is_written_and_keeps_its_text_inside(rendered, tmp_path):
    written, figures, outside = rendered
    assert written == {
        "data": ["data_ceiling.png", "data.png"],
        "train": ["train_ceiling.png", "train_speedup.png"],
        "infer": ["infer_ceiling.png", "infer_latency.png", "infer_accuracy_vs_latency.png"],
        "compress": ["compress_latency.png"],
        "design": ["design_latency.png"],
    }
    for fname, fig in figures.items():
        assert (tmp_path / fname).read_bytes()[:4] == b"\x89PNG"
        assert outside[fname] == [], fname


def test_colours_that_mean_a_precision_have_a_legend(rendered):
    _, figures, _ = rendered
    for fname, precisions in {"data_ceiling.png": {"decode"}, "train_ceiling.png": {"fp32", "bf16"},
                              "infer_ceiling.png": {"fp32", "int8"}}.items():
        legend = figures[fname].axes[0].get_legend()
        assert legend is not None, fname
        labels = {t.get_text() for t in legend.get_texts()}
        assert labels == {f"{p} ceiling" for p in precisions}, fname
        colours = {tuple(p.get_facecolor()) for p in figures[fname].axes[0].patches}
        assert len(colours) == len(precisions), fname  # one colour per precision, as the legend says


def test_every_ceiling_a_row_is_judged_against_has_a_colour_apart_from_the_others_in_its_plot():
    from torchspeed.bench.ceilings import GPU_CEILING, PRECISION_CEILING
    from torchspeed.bench.report import PRECISION_COLOURS

    cpu = set(PRECISION_CEILING.values()) | {"decode"}
    gpu = {GPU_CEILING[p] for p in ("fp32", "bf16", "fp16", "int8")}
    assert cpu | gpu | {"nvjpeg"} <= PRECISION_COLOURS.keys()
    for group in (cpu, gpu, {"decode", "nvjpeg"}):  # the ceilings one suite's plot can show together
        assert len({PRECISION_COLOURS[c] for c in group}) == len(group), group


def test_batch_sizes_apart_and_the_allowed_drop_drawn(rendered):
    _, figures, _ = rendered
    latency = figures["infer_latency.png"].axes
    assert [ax.get_title() for ax in latency] == ["Inference latency, batch 1", "Inference latency, batch 8"]
    assert [len(ax.patches) for ax in latency] == [3, 2]
    accuracy = figures["infer_accuracy_vs_latency.png"].axes
    assert [ax.get_title() for ax in accuracy] == ["Accuracy vs latency, batch 1", "Accuracy vs latency, batch 8"]
    for ax in accuracy:
        lines = [ln for ln in ax.get_lines() if "allowed drop" in ln.get_label()]
        assert len(lines) == 1 and list(lines[0].get_ydata()) == [1.0, 1.0]  # 0.01 top-1 = 1 percentage point
        assert ax.get_legend() is not None


def test_pruning_shows_before_and_after_at_each_batch(rendered):
    _, figures, _ = rendered
    axes = figures["compress_latency.png"].axes
    assert len(axes) == 2
    for ax, (before, after) in zip(axes, [(16.2, 6.75), (196.1, 58.8)]):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["unpruned", "pruned"]
        assert [p.get_height() for p in ax.patches] == [before, after]
