"""Report rows: each row type writes the columns of its table (the nine shared ones always, the others when
it has them), reads back what an earlier run wrote, and the suite helpers share the budget among windows."""
import json
import math
import time
from pathlib import Path

import pytest

from torchspeed.bench.budget import Budget
from torchspeed.bench.rows import CORE, ContenderRow, LatencyRow, Row, rows_of
from torchspeed.bench.suite_kit import Phases, Windows

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "report" / "results.json"


def test_a_row_writes_the_shared_columns_always_and_the_others_when_it_has_them():
    row = Row(technique="plain", median=40.0, unit="samples/s", what="a loop", ceiling="fp32", headline=False)
    d = row.to_dict()
    assert list(d)[:9] == list(CORE) and d["min"] is None and d["ratio"] is None
    assert d["ceiling"] == "fp32" and d["headline"] is False
    assert "batch" not in d and "peer" not in d and "p90" not in d
    assert Row.from_dict(dict(d, some_future_column=1)) == row  # a column this version does not know is left out
    assert Row.not_run("x", "--quick", "ms").what == "not run: --quick"
    assert Row.skipped("x", "not installed", "img/s", peer=True).to_dict()["peer"] is True


def test_latency_and_contender_rows_write_their_columns_even_when_empty():
    skipped = LatencyRow.of("r18 b1: OpenVINO INT8", None, "skipped: no openvino").to_dict()
    assert math.isnan(skipped["median"]) and math.isnan(skipped["p90"])
    assert skipped["batch"] is None and skipped["ceiling"] is None and skipped["output_error"] is None
    timed = LatencyRow.of("r18 b8: fused", {"p50_ms": 2.0, "min_ms": 1.9, "max_ms": 2.5, "p90_ms": 2.4}, "fused",
                          batch=8, ceiling="fp32", ratio=1.5)
    assert (timed.median, timed.min, timed.max, timed.p90, timed.ratio) == (2.0, 1.9, 2.5, 2.4, 1.5)
    raw = ContenderRow(technique="torchspeed_raw", median=9000.0, unit="img/s", headline=False, ceiling=None)
    assert raw.to_dict()["ceiling"] is None and raw.to_dict()["headline"] is False


def _row_type(suite: str, row: dict) -> type:
    if suite == "infer" and "p90" in row:
        return LatencyRow
    if suite == "data" and "headline" in row:
        return ContenderRow
    return Row


def test_every_row_of_a_published_run_is_written_back_the_same():
    """The rows of docs/report/results.json (a full run), as the suites wrote them (before the orchestrator added
    `achieved` and `pct_of_ceiling`), read back and written again: the same columns and values."""
    results = json.loads(PUBLISHED.read_text())
    for suite in ("data", "train", "infer", "compress", "design"):
        for row in results[suite]["rows"]:
            row = {k: v for k, v in row.items() if k not in ("achieved", "pct_of_ceiling")}
            again = _row_type(suite, row).from_dict(row).to_dict()
            assert json.dumps(again, sort_keys=True) == json.dumps(row, sort_keys=True), (suite, row["technique"])
        assert len(rows_of(results[suite])) == len(results[suite]["rows"])


def test_phases_keep_the_seconds_of_each_progress_step():
    seen = []
    say = Phases(seen.append)
    say("one")
    time.sleep(0.05)
    say("two")
    assert seen == ["one", "two"] and set(say.seconds) == {"start", "one"} and say.seconds["one"] >= 0.0


def test_windows_share_the_budget_and_time_a_row_in_its_window():
    said = []
    windows = Windows(Budget(0.4), said.append, rows=2, setup=2.0)
    assert windows.to_come() == 4.0
    windows.finish("setup")
    row = windows.rate_row("sleep", lambda: time.sleep(0.01), "a nap", items=8, unit="samples", ceiling="fp32")
    assert windows.parts == {"rows": 1, "setup": 0}
    assert said and said[0].startswith("timing sleep (")
    assert row.unit == "samples/s" and row.calls >= 2 and row.min <= row.median <= row.max
    assert row.first_call_s is not None and row.ceiling == "fp32"
    with pytest.raises(TypeError):
        Row(technique="x", no_such_column=1)
