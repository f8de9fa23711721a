"""The batch adapter: how torchspeed reads batches and outputs that are not `(x, y)` and a tensor."""
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from torchspeed.batches import BatchFormat, map_tensors, split_batch, to_device
from torchspeed.metrics import top1_accuracy


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class HFStyle(nn.Module):
    """A Hugging Face-style classifier: keyword inputs, a dataclass output with `.logits`."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, pixel_values=None, attention_mask=None, labels=None):
        logits = self.fc(pixel_values if attention_mask is None else pixel_values * attention_mask)
        return Output(logits=logits)


def test_auto_rules_for_tuples_known_pairs_and_hf_dicts():
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    assert split_batch((x, y, "extra"))[0] is x
    assert BatchFormat().split({"image": x, "label": y})[1] is y
    inputs, target = BatchFormat().split({"pixel_values": x, "attention_mask": x, "labels": y})
    assert set(inputs) == {"pixel_values", "attention_mask"} and target is y
    inputs, target = BatchFormat().split({"input_ids": x})
    assert target is None and inputs["input_ids"] is x


def test_split_batch_refuses_a_dict_without_a_label():
    with pytest.raises(ValueError, match="label key"):
        split_batch({"pixel_values": torch.zeros(1)})


def test_explicit_keys_indices_and_errors():
    x, m, y = torch.randn(2, 4), torch.ones(2, 4), torch.tensor([0, 1])
    fmt = BatchFormat(inputs=("pixel_values", "attention_mask"), target="y")
    inputs, target = fmt.split({"pixel_values": x, "attention_mask": m, "y": y, "ids": 0})
    assert list(inputs) == ["pixel_values", "attention_mask"] and target is y
    assert BatchFormat(inputs=(0, 1), target=2).split((x, m, y)) == ((x, m), y)
    with pytest.raises(ValueError, match="'labels'.*does not have"):
        BatchFormat(target="labels").split({"pixel_values": x})
    with pytest.raises(ValueError, match="unknown fields"):
        BatchFormat.of({"input": "x"})


def test_forward_and_logits_follow_the_format():
    model = HFStyle()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    fmt = BatchFormat.of({"logits": "logits"})
    inputs, _ = fmt.split({"pixel_values": x, "labels": y})
    out = fmt.forward(model, inputs)
    torch.testing.assert_close(fmt.logits_of(out), model.fc(x))
    assert BatchFormat(logits=lambda o: o.logits * 0).logits_of(out).abs().sum() == 0
    assert BatchFormat().forward(lambda a, b: a + b, (1, 2)) == 3
    with pytest.raises(ValueError, match="no such attribute"):
        BatchFormat(logits="scores").logits_of(out)


def test_top1_accuracy_on_hf_dict_batches_matches_a_hand_count():
    torch.manual_seed(0)
    model = HFStyle().eval()
    batches = [{"pixel_values": torch.randn(6, 4), "labels": torch.randint(0, 3, (6,))} for _ in range(3)]
    with torch.no_grad():
        expected = sum(int((model(pixel_values=b["pixel_values"]).logits.argmax(1) == b["labels"]).sum())
                       for b in batches) / 18
        fmt = BatchFormat()
        got = top1_accuracy(lambda inputs: fmt.forward(model, inputs), batches)
        assert got == pytest.approx(expected)
        limited = top1_accuracy(lambda inputs: fmt.forward(model, inputs), batches, limit=8)
        hand = sum(int((model(pixel_values=b["pixel_values"][:n]).logits.argmax(1) == b["labels"][:n]).sum())
                   for b, n in zip(batches, (6, 2)))
        assert limited == pytest.approx(hand / 8)


def test_map_tensors_keeps_containers_and_leaves_other_values():
    Pair = namedtuple("Pair", "a b")
    a, b, ids = torch.ones(2, 3), torch.zeros(1), torch.arange(3)
    batch = {"x": (a, [b, "tag"]), "pair": Pair(ids, None), "n": 3}
    out = map_tensors(lambda t: t + 1, batch)
    assert type(out["x"]) is tuple and type(out["x"][1]) is list and type(out["pair"]) is Pair
    assert torch.equal(out["x"][0], a + 1) and torch.equal(out["x"][1][0], b + 1) and out["x"][1][1] == "tag"
    assert torch.equal(out["pair"].a, ids + 1) and out["pair"].b is None and out["n"] == 3
    assert torch.equal(batch["x"][0], a)  # the input is not modified
    assert torch.equal(map_tensors(torch.neg, a), -a)
    arrays = map_tensors(lambda v: v * 2, {"i": np.ones(2), "t": a}, leaf=np.ndarray)
    assert arrays["i"].tolist() == [2.0, 2.0] and arrays["t"] is a
    assert map_tensors(type, (1, [2.5]), leaf=object) == (int, [float])


def test_to_device_moves_every_tensor_and_sets_the_layout_of_images():
    Pair = namedtuple("Pair", "x y")
    x, y = torch.randn(2, 3, 4, 4), torch.tensor([0, 1])
    moved = to_device(Pair([x], {"y": y}), "cpu", channels_last=True)
    assert type(moved) is Pair and moved.x[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(moved.x[0], x) and moved.y["y"] is y
    assert to_device(moved.x[0], "cpu", channels_last=False).is_contiguous()


def test_random_input_names_a_shape_with_a_dimension_below_one():
    import pytest

    from torchspeed.batches import random_input

    with pytest.raises(ValueError, match=r"--input-shape 1,0,8,8: every dimension must be >= 1"):
        random_input((1, 0, 8, 8), name="--input-shape")
    assert random_input((2, 3)).shape == (2, 3)
