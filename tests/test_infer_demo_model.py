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


def test_image_loader_is_deterministic_crops_and_normalises():
    images = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(10)
    a = dm.ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), crop=8, seed=1)
    b = dm.ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), crop=8, seed=1)
    assert len(a) == 2
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.shape == (4, 3, 8, 8)
    a.set_epoch(1)
    assert not torch.equal(next(iter(a))[1], next(iter(b))[1])
    whole = dm.ImageTensorLoader(images, labels, 10, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    x, y = next(iter(whole))
    flipped = torch.stack([img if torch.allclose(x[i], (img.float() / 255 - 0.5) / 0.25, atol=1e-5)
                           else img.flip(2) for i, img in enumerate(images[[int(v) for v in y]])])
    torch.testing.assert_close(x, (flipped.float() / 255 - 0.5) / 0.25)
    shifted = dm.ImageTensorLoader(images, labels, 10, (0.0,) * 3, (1 / 255,) * 3, pad=2, seed=3)
    xs, ys = next(iter(shifted))
    assert xs.shape == (10, 3, 16, 16)
    # every output is a (possibly flipped) translation of its source image by at most 2 pixels
    for img, out in zip(images[[int(v) for v in ys]].float(), xs):
        padded = torch.nn.functional.pad(img[None], (2, 2, 2, 2), mode="reflect")[0]
        windows = [padded[:, i:i + 16, j:j + 16] for i in range(5) for j in range(5)]
        assert any(torch.allclose(out, w, atol=1e-3) or torch.allclose(out, w.flip(2), atol=1e-3) for w in windows)
    with pytest.raises(ValueError, match="crop 32"):
        dm.ImageTensorLoader(images, labels, 4, (0.5,) * 3, (0.25,) * 3, crop=32)


def test_train_loader_is_the_training_split_shuffled_and_augmented():
    d = _fake()
    loader = d.train_loader(8, pad=1, seed=4)
    assert isinstance(loader, dm.ImageTensorLoader) and len(loader) == 2  # 20 images: the partial batch dropped
    xs, ys = zip(*loader)
    assert all(x.shape == (8, 3, 8, 8) and x.dtype == torch.float32 for x in xs)
    assert len(set(torch.cat(ys).tolist())) == 10 and torch.equal(torch.cat(ys), torch.cat(list(zip(*d.train_loader(8, pad=1, seed=4)))[1]))


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
                   eval_fn=lambda run: d.evaluate(run, limit=400), runtimes=["torch", "onnxruntime", "openvino"],
                   precisions=["fp32", "int8"], measure=False, exporter="torchscript")
    assert abs(res.baseline_metric - d.evaluate(d.model, limit=400)) < 1e-9
    for name in ("onnxruntime int8", "openvino int8"):
        c = res[name]
        assert c.status == "ok" and c.metric_drop <= 0.01, (name, c.status, c.reason, c.metric_drop)
