"""Decisions remembered in the cache: keyed by what they depend on, damaged files ignored, refreshable."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from torchspeed import remembered


def test_recall_returns_what_was_remembered_for_the_same_parts_only():
    parts = {"model": "abc", "batch": [[8, 3, 32, 32], "float32", "cpu"], "world": 1}
    assert remembered.recall("accelerate", parts) is None
    mem = remembered.remember("accelerate", parts, {"precision": "bf16"}, "bf16, 41.2 ms/step")
    back = remembered.recall("accelerate", parts)
    assert back == mem and back.decision == {"precision": "bf16"}
    assert back.describe().startswith("remembered from ") and "(bf16, 41.2 ms/step)" in back.describe()
    assert remembered.recall("accelerate", {**parts, "world": 2}) is None
    assert remembered.recall("loader", parts) is None  # another kind of decision


def test_damaged_or_foreign_files_are_ignored(tmp_path):
    parts = {"x": 1}
    remembered.remember("loader", parts, {"threads": 2}, "2 threads")
    folder = os.path.join(os.environ["TORCHSPEED_CACHE"], "decisions", "loader")
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder)]
    with open(path, "w") as f:
        f.write("{not json")
    assert remembered.recall("loader", parts) is None
    with open(path, "w") as f:
        json.dump({"version": remembered.VERSION, "parts": {"x": 2}, "decision": {}, "figure": "",
                   "measured_on": "2026-01-01"}, f)
    assert remembered.recall("loader", parts) is None  # a file whose parts differ (a hash collision) is not trusted
    assert remembered.forget("loader") == 1 and remembered.recall("loader", parts) is None


def test_model_fingerprint_follows_structure_not_weights():
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    assert remembered.model_fingerprint(a) == remembered.model_fingerprint(b)  # other weights, same structure
    assert remembered.model_fingerprint(a) != remembered.model_fingerprint(nn.Linear(4, 3))
    assert remembered.model_fingerprint(a) != remembered.model_fingerprint(nn.Sequential(nn.Linear(4, 2)))
    assert remembered.shapes_of((torch.zeros(2, 3), {"y": torch.zeros(2, dtype=torch.int64)})) == [
        [[2, 3], "float32", "cpu"], {"y": [[2], "int64", "cpu"]}]


def test_forget_removes_one_kind_or_all_and_refuses_a_path():
    import pytest

    remembered.remember("loader", {"x": 1}, {"threads": 2}, "2 threads")
    remembered.remember("decoder", {"x": 1}, {"decoder": "simplejpeg"}, "simplejpeg")
    assert remembered.forget("loader") == 1
    assert remembered.recall("loader", {"x": 1}) is None and remembered.recall("decoder", {"x": 1}) is not None
    for bad in ("", "..", "../decisions", os.sep + "tmp"):
        with pytest.raises(ValueError, match="not a kind of remembered decision"):
            remembered.forget(bad)
    assert remembered.recall("decoder", {"x": 1}) is not None  # nothing removed by a refused call
    assert remembered.forget() == 1 and remembered.recall("decoder", {"x": 1}) is None
