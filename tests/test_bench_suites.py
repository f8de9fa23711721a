"""The data and train suites end to end on small stand-ins (the conftest photos, a tiny model, short
windows): every stage runs, in order, and the JSON has the rows and figures the report reads. No speed
claims: the figures of such a run mean nothing."""
import json
import sys

import pytest
from helpers import tiny_convnet


@pytest.fixture
def small_demo(photo_folder, tmp_path, monkeypatch):
    """The demo photos replaced by the 24 conftest photos, the caches in a temporary directory, the peers'
    libraries missing (each is a skipped row)."""
    import torchspeed.data.demo as demo

    monkeypatch.setenv("TORCHSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "demo_folder", lambda n: photo_folder)
    for name in ("nvidia", "nvidia.dali", "litdata"):
        monkeypatch.setitem(sys.modules, name, None)
    return photo_folder


@pytest.mark.slow
def test_data_suite_runs_every_stage_on_small_photos(small_demo, monkeypatch):
    from torchspeed.bench.suites import data

    for name, value in (("BATCH", 4), ("CROP", 32), ("SHORT_SIDE", 48)):
        monkeypatch.setattr(data, name, value)
    said = []
    result = data.run(quick=True, progress=said.append, budget_s=2.0)
    json.dumps(result)
    names = [r["technique"] for r in result["rows"]]
    assert names == ["baseline", "baseline_tuned", "torchspeed", "dali_cpu", "litdata"]
    timed = result["rows"][:3]
    assert all(r["unit"] == "img/s" and r["min"] <= r["median"] <= r["max"] and r["ceiling"] == "decode" for r in timed)
    assert [r["headline"] for r in timed] == [False, False, True]
    assert result["rows"][0]["ratio"] == pytest.approx(1.0)
    assert result["ratio_vs_tuned"] == pytest.approx(result["torchspeed_img_s"] / result["baseline_tuned_img_s"])
    assert all(r["what"].startswith("skipped: ") and r["peer"] for r in result["rows"][3:])
    assert len(result["limits"]) == 2 and len(result["notes"]) == 3
    assert any(s.startswith("round 3/3: torchspeed") for s in said)


@pytest.mark.slow
def test_train_suite_runs_every_stage_on_a_tiny_model(small_demo, monkeypatch):
    import torchvision

    from torchspeed.bench.suites import train

    for name, value in (("BATCH", 4), ("CROP", 32), ("SHORT_SIDE", 48)):
        monkeypatch.setattr(train, name, value)
    monkeypatch.setattr(train, "_subset", lambda n, quick: list(range(24)))
    monkeypatch.setattr(torchvision.models, "resnet18", lambda num_classes: tiny_convnet(num_classes, batchnorm=True))
    said = []
    result = train.run(quick=True, progress=said.append, budget_s=4.0)
    json.dumps(result)
    rows = {r["technique"]: r for r in result["rows"]}
    assert list(rows)[:3] == ["plain PyTorch", "+ tuned loader", "+ fast data pipeline"]
    assert list(rows)[-3:] == ["+ channels_last", "+ torch.compile", "torchspeed auto"]
    assert rows["plain PyTorch"]["cumulative"] == pytest.approx(1.0) and rows["plain PyTorch"]["calls"] >= 2
    assert rows["+ tuned loader"]["what"].startswith("not run: --quick")
    assert rows["torchspeed auto"]["headline"] is True and rows["torchspeed auto"]["median"] > 0
    assert all(r["unit"] == "samples/s" and r["flops_per_item"] > 0 for r in rows.values())
    assert result["ratio"] == pytest.approx(rows["torchspeed auto"]["cumulative"])
    assert result["compile"] == {"tried": False, "reason": "not tried: quick mode budget"}
    assert "accelerate" in result and "early_stopping" in result and result["limits"][0]["goal"]
    assert "start" in result["phase_s"] and said[-1] == "done"
    # a 4 s budget is spent before the Trainer-vs-hand-written comparison: quick mode leaves it to the full report
    assert result["trainer_overhead_pct"] is None and result["trainer_overhead"] == {"tried": False,
                                                                                      "reason": "quick mode budget"}
    assert any(n.startswith("Trainer overhead vs a hand-written loop: not measured") for n in result["notes"])
    choice = result["loader_choice"]  # the fast pipeline's loader, chosen with the training step in the loop
    assert choice["table"] and choice["setting"] in rows["+ fast data pipeline"]["what"]
    assert all(r.get("others_cores", 0) >= 0 for r in rows.values()), [r.get("others_cores") for r in rows.values()]


@pytest.mark.slow
def test_infer_suite_runs_every_stage_on_a_tiny_demo_model(monkeypatch):
    import torch

    import torchspeed.bench.demo_model as dm
    from torchspeed.bench.suites import infer

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (96, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.arange(96) % 10
    demo = dm.DemoModel(tiny_convnet(10).eval(), images[:64], labels[:64], images[64:], labels[64:], 32,
                        dm.IMAGENET_MEAN, dm.IMAGENET_STD, accuracy=0.1)
    monkeypatch.setattr(dm, "load_demo_model", lambda progress=False: demo)
    result = infer.run(quick=True, progress=lambda s: None)
    json.dumps(result)
    rows = result["rows"]
    assert rows[0]["technique"] == "resnet18 b1: eager fp32" and rows[0]["ratio"] == pytest.approx(1.0)
    assert all({"p90", "output_error", "batch", "flops_per_item", "ceiling"} <= set(r) for r in rows if not r.get("peer"))
    assert [r["technique"] for r in rows if r.get("headline")] == ["resnet18 b8: torchspeed best"]
    assert any(r.get("peer") for r in rows) and result["best_variant"] and result["ratio"] > 0
    assert "resnet18_guard_32px" in result["models"] and result["models"]["resnet18"]["candidates"]


def test_infer_rows_of_a_model_on_a_gpu_show_fp16_and_the_gpu_providers():
    from types import SimpleNamespace

    from torchspeed.bench.suites import infer

    def ran(ms, precision):
        return SimpleNamespace(name=precision, status="ok", reason="", passed=True, metric_drop=0.0,
                               latency_ms={1: {"p50_ms": ms, "min_ms": ms, "max_ms": ms, "p90_ms": ms}},
                               rel_l2_error=0.0, precision=precision, p50_ms=lambda b: ms)

    class Result(dict):
        def fastest_at(self, b):
            return self["fp16 + channels_last"]

    res = Result({"eager fp32": ran(2.0, "fp32"), "fused fp32": ran(1.5, "fp32"),
                  "fp16 + channels_last": ran(1.0, "fp16"),
                  "onnxruntime-cuda fp32": SimpleNamespace(status="skipped", reason="no CUDAExecutionProvider",
                                                           latency_ms={})})
    gpu_table = infer.ROWS[:3] + infer.GPU_ROWS + infer.ROWS[3:]
    on_gpu = [r.technique for r in infer._variant_rows("m", res, 1, 1e9, gpu_table)]
    assert on_gpu == ["m b1: eager fp32", "m b1: fused", "m b1: fp16 + channels_last", "m b1: ONNX Runtime CUDA fp32",
                      "m b1: torchspeed best"]
    on_cpu = [r.technique for r in infer._variant_rows("m", res, 1, 1e9)]
    assert on_cpu == ["m b1: eager fp32", "m b1: fused", "m b1: torchspeed best"]  # fp16 is not a CPU's row
