"""The shared demo model: its data helpers (fast) and the real trained model (slow: built once, cached)."""
import pytest
import torch

from torchspeed.bench import demo_model as dm


def _fake() -> dm.DemoModel:
    g = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (30, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.arange(30) % 10
    return dm.DemoModel(torch.nn.Identity(), imgs[:20], labels[:20], imgs[20:], labels[20:], 8,
                        dm.IMAGENET_MEAN, dm.IMAGENET_STD, 0.0)


def test_batches_normalise_and_cover_the_split():
    d = _fake()
    got = list(d.batches("train", 8))
    assert [len(y) for _, y in got] == [8, 8, 4]
    x0 = got[0][0]
    assert x0.dtype == torch.float32 and x0.shape == (8, 3, 8, 8)
    expect = (d.train_images[0, 0].float() / 255 - dm.IMAGENET_MEAN[0]) / dm.IMAGENET_STD[0]
    assert torch.allclose(x0[0, 0], expect)
    assert sum(len(y) for _, y in d.batches("heldout", 3, limit=7)) == 7
    with pytest.raises(ValueError, match="split must be"):
        next(d.batches("test"))


def test_evaluate_counts_top1_for_tensor_and_ndarray_runs():
    d = _fake()
    labels = d.heldout_labels

    def oracle(x):
        return torch.nn.functional.one_hot(labels[: len(x)], 10).float()  # one batch covers the split

    assert d.evaluate(oracle, batch_size=64) == 1.0
    assert d.evaluate(lambda x: torch.zeros(len(x), 10).numpy(), batch_size=64) == pytest.approx(0.1)


@pytest.mark.slow
def test_trained_demo_model_contract_and_int8_accuracy():
    from torchspeed.infer.search import optimize

    d = dm.load_demo_model()
    assert len(d.heldout_images) >= 1000 and d.heldout_images.dtype == torch.uint8
    size = d.input_size
    assert size == d.heldout_images.shape[-1] == d.train_images.shape[-1]
    assert 0.5 <= d.accuracy <= 0.95, d.accuracy
    assert not d.model.training
    # a fresh copy per call
    assert dm.load_demo_model().model is not d.model
    calib = list(d.batches("train", 32, limit=128))
    res = optimize(d.model, torch.randn(1, 3, size, size), calib_data=calib,
                   eval_fn=lambda run: d.evaluate(run, limit=400), backends=["torch", "onnxruntime", "openvino"],
                   precisions=["fp32", "int8"], measure=False, exporter="torchscript")
    assert abs(res.baseline_metric - d.evaluate(d.model, limit=400)) < 1e-9
    for name in ("onnxruntime int8", "openvino int8"):
        c = res[name]
        assert c.status == "ok" and c.metric_drop <= 0.01, (name, c.status, c.reason, c.metric_drop)
