"""optimize() beyond one tensor in and one tensor out, through torchspeed.batches.BatchFormat: a
Hugging Face-style model (forward(pixel_values) returning an output with `.logits`) fed dict batches,
a model returning a dict, a two-input model, and a text-style model with integer ids. All written here,
no downloads."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import torchspeed as ts
from torchspeed.batches import BatchFormat
from torchspeed.infer.search import optimize

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")


@dataclass
class ImageClassifierOutput:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class TinyViTLike(nn.Module):
    """Takes `pixel_values` by name and returns a dataclass with `.logits`, like a transformers model."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(16, classes)

    def forward(self, pixel_values):
        h = self.features(pixel_values)
        return ImageClassifierOutput(logits=self.classifier(h), hidden=h)


class DictOut(TinyViTLike):
    def forward(self, pixel_values):
        return {"logits": super().forward(pixel_values).logits, "aux": pixel_values.mean()}


def _task(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    palette = torch.tensor([[1.0, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1]])
    x = palette[y].view(n, 3, 1, 1) * 0.5 + torch.randn(n, 3, 16, 16, generator=g) * 2.0
    return x, y


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = TinyViTLike()
    x, y = _task(768, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(0, len(x), 64):
        loss = nn.functional.cross_entropy(model(pixel_values=x[i:i + 64]).logits, y[i:i + 64])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _dict_batches(n, seed, bs=32):
    x, y = _task(n, seed)
    return [{"pixel_values": x[i:i + bs], "labels": y[i:i + bs]} for i in range(0, n, bs)]


def test_hf_style_model_with_dict_batches_and_dataclass_output(hf_model, tmp_path):
    calib, held_out = _dict_batches(128, 1), _dict_batches(256, 2)

    def eval_fn(run):
        return ts.metrics.top1_accuracy(run, held_out)  # the auto format splits {"pixel_values", "labels"}

    r = optimize(hf_model, {"pixel_values": torch.randn(1, 3, 16, 16)}, calib_data=calib, eval_fn=eval_fn,
                 max_metric_drop=0.05, runtimes="torch,onnxruntime,openvino", precisions="fp32,int8",
                 batch_sizes=(1, 2), exporter="torchscript", repeats=1, min_time_s=0.0)
    assert r.baseline_metric > 0.6
    for name in ("eager fp32", "fused fp32", "onnxruntime fp32", "openvino fp32"):
        assert r[name].status == "ok" and r[name].max_rel_error < 1e-3, (name, r[name].reason)
    for name in ("onnxruntime int8", "openvino int8"):
        assert r[name].metric is not None and r[name].status in ("ok", "rejected"), (name, r[name].reason)
    ort = r["onnxruntime fp32"].runner
    assert ort.input_names == ["pixel_values"]  # named input in the ONNX graph
    r["onnxruntime fp32"].save(tmp_path / "a")
    back = ts.infer.load(tmp_path / "a")
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        ref = hf_model(pixel_values=x).logits
    assert torch.allclose(back({"pixel_values": x}), ref, atol=1e-4)
    assert r.best is not None and r.to_dict()["candidates"][0]["name"] == "eager fp32"


def test_explicit_format_and_a_dict_output():
    model = DictOut().eval()
    fmt = BatchFormat(inputs="pixel_values", target="labels", logits="logits")
    r = optimize(model, {"pixel_values": torch.randn(1, 3, 16, 16)}, calib_data=_dict_batches(64, 3),
                 batch_format=fmt, runtimes="torch,onnxruntime", precisions="fp32", batch_sizes=(1,),
                 exporter="torchscript", measure=False)
    assert r["onnxruntime fp32"].status == "ok" and r["onnxruntime fp32"].max_rel_error < 1e-3
    assert r["eager fp32"].input_shape == {"pixel_values": [1, 3, 16, 16]}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(2, 4)

    def forward(self, x, extra):
        return self.a(x) + self.b(extra), x.sum()


def test_tuple_inputs_and_tuple_output():
    r = optimize(TwoInputs().eval(), (torch.randn(1, 6), torch.randn(1, 2)), runtimes="torch,onnxruntime",
                 precisions="fp32", batch_sizes=(1, 3), repeats=1, min_time_s=0.0, exporter="torchscript")
    assert r["onnxruntime fp32"].status == "ok" and r["onnxruntime fp32"].max_rel_error < 1e-3
    assert r["onnxruntime fp32"].runner.input_names == ["input_0", "input_1"]
    assert r["onnxruntime fp32"].p50_ms(3) > 0


class TinyTextModel(nn.Module):
    """input_ids + attention_mask by name (integer tensors), `.logits` out: dynamic INT8 territory."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 3))

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return ImageClassifierOutput(logits=self.mlp(h.sum(1) / attention_mask.sum(1, keepdim=True)))


def test_text_style_integer_inputs_run_in_onnx_runtime():
    torch.manual_seed(0)
    example = {"input_ids": torch.randint(0, 50, (1, 7)), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    r = optimize(TinyTextModel().eval(), example, runtimes="torch,onnxruntime", precisions="fp32,int8",
                 batch_sizes=(2,), repeats=1, min_time_s=0.0, exporter="torchscript")
    assert r["onnxruntime fp32"].status == "ok" and r["onnxruntime fp32"].max_rel_error < 1e-3
    dyn = r["onnxruntime int8 dynamic"]
    assert dyn.status in ("ok", "rejected") and dyn.rel_l2_error is not None, dyn.reason
    assert r["eager fp32"].p50_ms(2) > 0


def test_dynamo_export_keeps_named_inputs_and_reads_the_logits(tmp_path):
    model = TinyViTLike().eval()
    rep = ts.infer.export_onnx(model, {"pixel_values": torch.randn(1, 3, 16, 16)}, tmp_path / "m.onnx")
    assert rep.exporter == "dynamo", rep.fallback_reason
    assert rep.input_names == ["pixel_values"] and max(rep.max_error.values()) < 1e-4
    plain = ts.infer.export_onnx(nn.Sequential(nn.Linear(4, 2)).eval(), torch.randn(1, 4), tmp_path / "p.onnx")
    assert plain.exporter == "dynamo" and plain.input_names == ["input"], plain.fallback_reason
