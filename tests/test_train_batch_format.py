"""Trainer, accelerate and evaluate beyond (x, y): Hugging Face-style dict batches and dataclass/dict
outputs, tuple batches for a two-input model, through torchspeed.batches.BatchFormat. The models are
tiny and written here (no downloads)."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from torchspeed.batches import BatchFormat
from torchspeed.train import Trainer, accelerate

FIXED = dict(precision="fp32", channels_last=False, compile=False, progress=False)


@dataclass
class ImageClassifierOutput:  # the shape of a transformers ModelOutput: a dataclass with .logits
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyHFClassifier(nn.Module):
    """forward(pixel_values=None, labels=None) -> an output with .logits (and .loss when labels are given),
    as Hugging Face image classifiers do."""

    def __init__(self, as_dict=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)
        self.as_dict = as_dict
        self.calls = []

    def forward(self, pixel_values=None, labels=None):
        self.calls.append((pixel_values is not None, labels is not None))
        logits = self.head(torch.relu(self.conv(pixel_values)).mean((2, 3)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"logits": logits} if self.as_dict else ImageClassifierOutput(logits=logits, loss=loss)


class DictImages(torch.utils.data.Dataset):
    def __init__(self, n=96, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = (self.x[:, 0].mean((1, 2)) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _loader(**kw):
    return torch.utils.data.DataLoader(DictImages(**kw), batch_size=16, shuffle=True,
                                       generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("as_dict", [False, True])
def test_hugging_face_style_model_trains_and_evaluates(as_dict):
    model = TinyHFClassifier(as_dict)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), nn.functional.cross_entropy,
                 **FIXED)
    before = tr.evaluate(_loader())  # evaluate-before-fit, dict batches
    res = tr.fit(_loader(), _loader(), epochs=4)
    assert res["val_loss"] < before["val_loss"] - 0.1 and res["val_acc"] > 0.75
    assert set(model.calls) == {(True, False)}  # model(pixel_values=...): the label is the target, not an input
    # the same figures by hand
    ds = DictImages()
    with torch.no_grad():
        out = model(pixel_values=ds.x)
    logits = out["logits"] if as_dict else out.logits
    got = tr.evaluate(torch.utils.data.DataLoader(ds, batch_size=32))
    assert got["val_loss"] == pytest.approx(nn.functional.cross_entropy(logits, ds.y).item(), rel=1e-5)
    assert got["val_acc"] == pytest.approx((logits.argmax(1) == ds.y).float().mean().item())


def test_explicit_batch_format_and_measured_settings_on_dict_batches():
    model = TinyHFClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    fmt = {"inputs": ("pixel_values",), "target": "labels", "logits": "logits"}
    # accelerate measures on a dict batch: channels_last is tried on the image inside it
    acc = accelerate(model, opt, precision="fp32", compile=False, example_batch=next(iter(_loader())),
                     loss_fn=nn.functional.cross_entropy, trial_steps=1, batch_format=fmt)
    tried = [c for c in acc.report.candidates if c.setting == "channels_last"]
    assert [c.value for c in tried] == ["NCHW", "NHWC"] and all(c.step_s > 0 for c in tried)
    tr = Trainer(acc, loss_fn=nn.functional.cross_entropy, progress=False)  # the format accelerate was given
    assert tr.batch_format == BatchFormat(inputs=("pixel_values",), target="labels", logits="logits")
    before = tr.evaluate(_loader())["val_loss"]
    assert tr.fit(_loader(), _loader(), epochs=3)["val_loss"] < before


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, a, b):
        return self.a(a) + self.b(b), "aux"  # a tuple output: the logits come first


def test_tuple_batches_for_a_two_input_model():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 4, generator=g), torch.randn(64, 3, generator=g)
    y = (a[:, 0] + b[:, 0] > 0).long()
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(a, b, y), batch_size=16)
    model = TwoInputs()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.functional.cross_entropy,
                 batch_format=BatchFormat(inputs=(0, 1), target=2), **FIXED)
    before = tr.evaluate(dl)["val_loss"]
    res = tr.fit(dl, dl, epochs=5)
    assert res["val_loss"] < before and res["val_acc"] > 0.7


def test_a_batch_without_a_target_is_named():
    unlabeled = [{"pixel_values": torch.randn(4, 3, 8, 8)}]
    model = TinyHFClassifier()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    with pytest.raises(ValueError, match=r"no target.*pixel_values.*batch_format=BatchFormat\(target=KEY\)"):
        tr.fit(unlabeled, epochs=1)
    with pytest.raises(ValueError, match="names 'label_ids', which the batch does not have"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                batch_format={"target": "label_ids"}, **FIXED).evaluate(_loader())
