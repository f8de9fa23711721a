"""Decisions remembered in the cache: keyed by what they depend on, read back as data that is checked
(schema, size and depth limits: what does not check out is dropped, logged once and measured again),
refreshable."""
from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from torch import nn

from torchspeed import remembered
from torchspeed.train.memory_plan import MemoryPlanResult, PlanRow, ProbeRow

ACCELERATE = {"precision": "bf16", "channels_last": True, "compile": False, "tf32": None, "cudnn_benchmark": None,
              "logits_width": 10}
LOADER_ROW = {"num_workers": 2, "threads": 1, "prefetch_factor": 2, "persistent_workers": True, "pin_memory": False,
              "items_per_s": 812.5, "final": False}
LOADER = {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True, "pin_memory": False, "throughput": 812.5,
          "table": [LOADER_ROW], "threads": 1, "tuning_s": 3.2, "others_cores": None, "waited_s": 0.0,
          "remembered": None}
DECODER = {"decoder": "simplejpeg", "table": [{"decoder": "simplejpeg", "us_per_image": 812.0, "threads": 1,
                                               "psnr_db": 100.0}, {"decoder": "pil", "us_per_image": None,
                                                                   "psnr_db": None, "error": "cannot"}]}
OPTIMIZE = {"winner": "onnxruntime-fp32", "runtime": "onnxruntime", "precision": "fp32",
            "latency_ms": {"torch-fp32": {"1": {"p50": 1.5, "p90": 1.7}}, "onnxruntime-fp32": {"1": {"p50": 0.9}}}}
MEMORY_PLAN = MemoryPlanResult(
    micro_batch=16, accumulation=4, effective_batch=64, predicted_peak_bytes=150 << 20, budget_bytes=200 << 20,
    margin=0.1, device="cpu", source="cpu allocator (profiler)", fixed_bytes=120 << 20, per_sample_bytes=1 << 20,
    checkpointed=2, checkpointed_names=["layers.0", "layers.1"],
    probes=[ProbeRow(micro_batch=8, peak_bytes=130 << 20)],
    table=[PlanRow(16, 4, 2, 150 << 20, 0.01, "kept")]).to_dict()
VALID = {"accelerate": ACCELERATE, "loader": LOADER, "decoder": DECODER, "loader_step": {"setting": [2, 1]},
         "optimize": OPTIMIZE, "memory_plan": MEMORY_PLAN}


def _entry_path(kind, parts):
    return remembered._path(kind, parts)  # noqa: SLF001 - the tests damage the file itself


def test_recall_returns_what_was_remembered_for_the_same_parts_only():
    parts = {"model": "abc", "batch": [[8, 3, 32, 32], "float32", "cpu"], "world": 1}
    assert remembered.recall("accelerate", parts) is None
    mem = remembered.remember("accelerate", parts, ACCELERATE, "bf16, 41.2 ms/step")
    back = remembered.recall("accelerate", parts)
    assert back == mem and back.decision == ACCELERATE
    assert back.describe().startswith("remembered from ") and "(bf16, 41.2 ms/step)" in back.describe()
    assert remembered.recall("accelerate", {**parts, "world": 2}) is None
    assert remembered.recall("loader", parts) is None  # another kind of decision


def test_damaged_or_foreign_files_are_ignored(tmp_path):
    parts = {"x": 1}
    remembered.remember("testkind", parts, {"threads": 2}, "2 threads")
    folder = os.path.join(os.environ["TORCHSPEED_CACHE"], "decisions", "testkind")
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder)]
    with open(path, "w") as f:
        f.write("{not json")
    assert remembered.recall("testkind", parts) is None and not os.path.exists(path)  # dropped
    with open(path, "w") as f:
        json.dump({"version": remembered.VERSION, "parts": {"x": 2}, "decision": {}, "figure": "",
                   "measured_on": "2026-01-01"}, f)
    assert remembered.recall("testkind", parts) is None  # a file whose parts differ (a hash collision) is not trusted
    assert remembered.forget("testkind") == 1 and remembered.recall("testkind", parts) is None


@pytest.mark.parametrize("kind", sorted(remembered.SCHEMAS))
def test_every_kind_of_decision_round_trips_through_its_schema(kind):
    """Each kind's decision as its encoder writes it is recalled as it was (the schema is not stricter
    than the encoders: a second run recalls instead of measuring)."""
    assert remembered.remember(kind, {"k": 1}, VALID[kind], "a figure").decision == VALID[kind]
    assert remembered.recall(kind, {"k": 1}).decision == VALID[kind]


def _edited(decision, path, value):
    out = json.loads(json.dumps(decision))
    *inner, last = path
    target = out
    for p in inner:
        target = target[p]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return out


_DELETE = object()
WRONG = [  # (kind, where, value) edits a decision checked by its schema: each dropped and measured again
    ("accelerate", ["precision"], "int4"), ("accelerate", ["logits_width"], "wide"),
    ("accelerate", ["compile"], "yes please"), ("accelerate", ["channels_last"], [1]), ("accelerate", ["tf32"], 1),
    ("accelerate", ["logits_width"], True), ("accelerate", ["logits_width"], 0), ("accelerate", ["precision"], _DELETE),
    ("loader", ["num_workers"], -1), ("loader", ["num_workers"], "2"), ("loader", ["throughput"], "fast"),
    ("loader", ["table"], None), ("loader", ["table", 0, "items_per_s"], None), ("loader", ["pin_memory"], 0),
    ("loader", ["table"], [LOADER_ROW] * 10_001),  # a huge table
    ("decoder", ["decoder"], 7), ("decoder", ["decoder"], {"a": 1}), ("decoder", ["table"], "fast"),
    ("decoder", ["table"], [1, 2]), ("decoder", ["table", 0, "us_per_image"], "quick"),
    ("decoder", ["table", 0, "error"], "x" * 70_000),  # a huge string
    ("loader_step", ["setting"], [2, "one"]), ("loader_step", ["setting"], None),
    ("loader_step", ["setting"], [True, 1]),
    ("optimize", ["winner"], None), ("optimize", ["latency_ms", "torch-fp32", "1", "p50"], "slow"),
    ("optimize", ["latency_ms"], [1, 2]),
]


@pytest.mark.parametrize("kind,where,value", WRONG, ids=[f"{k}-{'.'.join(map(str, w))}" for k, w, _ in WRONG])
def test_a_decision_that_does_not_check_out_is_dropped_logged_once_and_measured_again(kind, where, value, caplog):
    parts = {"k": 1}
    calls = []

    def decide():
        return remembered.recall_or_measure(kind, parts, lambda: calls.append(1) or "measured",
                                            decode=lambda m: "recalled", encode=lambda v: (VALID[kind], "figure"),
                                            what=f"the {kind}")

    remembered.remember(kind, parts, VALID[kind], "figure")
    path = _entry_path(kind, parts)
    entry = json.load(open(path))
    entry["decision"] = _edited(entry["decision"], where, value)
    json.dump(entry, open(path, "w"))
    with caplog.at_level(logging.INFO, logger="torchspeed"):
        assert decide() == ("measured", None)  # dropped and measured: the caller's decode never saw it
        assert decide()[0] == "recalled"  # the new measurement was kept in its place
    damaged = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 1 and damaged[0].startswith(f"the {kind}: ") and "measuring again" in damaged[0], damaged
    assert path in damaged[0]
    assert calls == [1]


@pytest.mark.parametrize("content", [
    "[]", "null", '"text"', "{", '{"version": 1}', "[" * 100_000 + "]" * 100_000, "{}",
    "NaN", '{"version": 1, "parts": {"k": 1}, "decision": {"x": NaN}, "figure": "", "measured_on": "2026-01-01"}',
    '{"version": 1, "parts": {"k": 1}, "decision": {}, "figure": "\\u001b[2J", "measured_on": "2026-01-01"}',
    '{"version": 1, "parts": {"k": 1}, "decision": {}, "figure": "", "measured_on": "yesterday"}',
    '{"version": 1, "parts": {"k": 1}, "decision": {}, "figure": "", "measured_on": "2026-01-01", "x": '
    + "[" * 40 + "]" * 40 + "}",
    '{"version": 1, "parts": {"k": 1}, "decision": {"x": 1' + "0" * 30
    + '}, "figure": "", "measured_on": "2026-01-01"}',
], ids=["list", "null", "text", "torn", "envelope-only", "deep", "empty", "nan", "nan-in-decision",
        "terminal-escape-in-figure", "bad-date", "deep-field", "huge-int"])
def test_a_damaged_entry_of_any_shape_is_dropped(content):
    parts = {"k": 1}
    remembered.remember("testkind", parts, {"x": 1}, "x=1")
    path = _entry_path("testkind", parts)
    with open(path, "w") as f:
        f.write(content)
    assert remembered.recall("testkind", parts) is None and not os.path.exists(path)


def test_a_multi_megabyte_entry_is_not_read_whole():
    import tracemalloc

    parts = {"k": 1}
    remembered.remember("testkind", parts, {"x": 1}, "x=1")
    path = _entry_path("testkind", parts)
    entry = json.load(open(path))
    entry["decision"]["padding"] = " " * (16 << 20)
    json.dump(entry, open(path, "w"))
    tracemalloc.start()
    try:
        assert remembered.recall("testkind", parts) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # at most the limit (1 MiB) was read, never the 16 MiB
    assert not os.path.exists(path)


def test_a_fifo_in_place_of_an_entry_is_dropped_without_blocking():
    parts = {"k": 1}
    path = _entry_path("testkind", parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)  # opening it for reading would wait for a writer forever
    assert remembered.recall("testkind", parts) is None and not os.path.exists(path)


def test_a_decision_its_encoder_writes_wrong_is_not_kept(caplog):
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        remembered.remember("accelerate", {"k": 1}, {"precision": "bf16"}, "bf16")  # fields missing
    assert remembered.recall("accelerate", {"k": 1}) is None
    assert any("does not match its schema" in r.getMessage() for r in caplog.records)


def test_read_json_and_check_are_the_bounded_reader_for_other_caches(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"version": 1, "rows": [{"n": 1, "name": "a"}] * 3}))
    limits = remembered.Limits(bytes=1000, depth=4, items=10, text=20)
    doc = remembered.read_json(path, limits)
    schema = {"version": int, "rows": [{"n": range(0, 10), "name": re.compile(r"[a-z]+"), "extra?": bool}]}
    remembered.check(doc, schema, limits)
    for bad, said in (({"version": 1, "rows": [{"n": 10, "name": "a"}]}, r"rows\[0\]\.n = 10 is not an integer in"),
                      ({"version": 1, "rows": [{"name": "a"}]}, r"rows\[0\] has no 'n'"),
                      ({"version": 1.5, "rows": []}, "version = 1.5 is not an integer"),
                      ({"version": 1, "rows": [{"n": 1, "name": "A"}]}, "name"),
                      ({"version": 1, "rows": [{"n": 1, "name": "a"}] * 11}, "11 items, over the limit of 10")):
        with pytest.raises(ValueError, match=said):
            remembered.check(bad, schema, limits, where="cache")
    path.write_text(" " * 1001)
    with pytest.raises(ValueError, match="larger than 1,000 bytes"):
        remembered.read_json(path, limits)
    path.write_text('{"x": Infinity}')
    with pytest.raises(ValueError, match="Infinity"):
        remembered.read_json(path, limits)


def test_model_fingerprint_follows_structure_not_weights():
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    assert remembered.model_fingerprint(a) == remembered.model_fingerprint(b)  # other weights, same structure
    assert remembered.model_fingerprint(a) != remembered.model_fingerprint(nn.Linear(4, 3))
    assert remembered.model_fingerprint(a) != remembered.model_fingerprint(nn.Sequential(nn.Linear(4, 2)))
    assert remembered.shapes_of((torch.zeros(2, 3), {"y": torch.zeros(2, dtype=torch.int64)})) == [
        [[2, 3], "float32", "cpu"], {"y": [[2], "int64", "cpu"]}]


def test_forget_removes_one_kind_or_all_and_refuses_a_path():
    remembered.remember("loader", {"x": 1}, LOADER, "2 workers")
    remembered.remember("decoder", {"x": 1}, DECODER, "simplejpeg")
    assert remembered.forget("loader") == 1
    assert remembered.recall("loader", {"x": 1}) is None and remembered.recall("decoder", {"x": 1}) is not None
    for bad in ("", "..", "../decisions", os.sep + "tmp"):
        with pytest.raises(ValueError, match="not a kind of remembered decision"):
            remembered.forget(bad)
    assert remembered.recall("decoder", {"x": 1}) is not None  # nothing removed by a refused call
    assert remembered.forget() == 1 and remembered.recall("decoder", {"x": 1}) is None
