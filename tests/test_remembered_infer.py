"""optimize remembers its winner: the next search builds only the baseline and the winner, checks the
winner's accuracy again and times nothing; refresh, another key or a damaged entry search again; a
remembered winner that now fails the accuracy guard starts a new search; a busy search is not kept."""
import glob
import json
import os

import pytest
import torch
from helpers import tiny_convnet

import torchspeed.infer.result as result_module
import torchspeed.infer.search as search
from torchspeed.cli import main
from torchspeed.runtime import cache_dir

X = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """A quiet machine for these tests (other tests load the cores): no wait, nothing called busy."""
    monkeypatch.setattr(search, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(result_module, "busy_warning", lambda others_cores: None)


@pytest.fixture
def timed(monkeypatch):
    """How many searches timed their variants."""
    calls = []
    real = search.time_variants

    def counting(rows, *a, **k):
        calls.append([r.name for r in rows])
        return real(rows, *a, **k)

    monkeypatch.setattr(search, "time_variants", counting)
    return calls


class Guard:
    """An eval_fn: every variant scores 1.0, except the all-zeros custom variant once `zeros_ok` is False."""

    def __init__(self):
        self.zeros_ok = True

    def __call__(self, run):
        out = run(X.repeat(4, 1, 1, 1))
        return 1.0 if self.zeros_ok or out.abs().sum() > 0 else 0.0


def _zeros(model):
    return lambda x: torch.zeros(x.shape[0], 2)  # far faster than any real variant: it wins the search


def _optimize(model, **kw):
    kw = {"runtimes": "torch", "precisions": "fp32", "batch_sizes": (1,), "repeats": 3, "min_time_s": 0.005, **kw}
    return search.optimize(model, X, **kw)


def test_the_winner_is_recalled_checked_and_not_timed(timed, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="torchspeed.infer")
    model, guard = tiny_convnet(), Guard()
    first = _optimize(model, eval_fn=guard, extra_candidates={"zeros": _zeros})
    assert first.best.name == "zeros" and first.remembered is None and len(timed) == 1
    scored = []
    second = _optimize(model, eval_fn=lambda run: scored.append(run) or guard(run), extra_candidates={"zeros": _zeros})
    assert len(timed) == 1  # nothing timed
    assert second.remembered.startswith("remembered from ") and "zeros" in second.remembered
    assert [r.name for r in second.table] == ["eager fp32", "zeros"]  # only the baseline and the winner built
    assert len(scored) == 2 and second.best.name == "zeros"  # the accuracy guard ran on the winner again
    assert second.best.latency_ms == first.best.latency_ms  # the remembered timings, said to be such
    assert second.to_dict()["remembered"] == second.remembered
    assert f"optimize: {second.remembered}" in caplog.text


def test_refresh_another_key_or_a_damaged_entry_search_again(timed):
    model = tiny_convnet()
    _optimize(model)
    _optimize(model, refresh=True)
    assert len(timed) == 2
    _optimize(model, batch_sizes=(2,))  # other batch sizes: another decision
    assert len(timed) == 3
    _optimize(tiny_convnet(width=4))  # another structure: another decision
    assert len(timed) == 4
    for path in glob.glob(os.path.join(cache_dir("decisions", "optimize"), "*.json")):
        with open(path, "w") as f:
            f.write('{"version": 1, "parts": [], "decision": 3')
    assert _optimize(model).remembered is None and len(timed) == 5
    assert _optimize(model).remembered and len(timed) == 5


def test_a_remembered_winner_that_fails_the_guard_now_starts_a_new_search(timed):
    model, guard = tiny_convnet(), Guard()
    assert _optimize(model, eval_fn=guard, extra_candidates={"zeros": _zeros}).best.name == "zeros"
    guard.zeros_ok = False  # the same winner now loses accuracy (new weights, new data, ...)
    again = _optimize(model, eval_fn=guard, extra_candidates={"zeros": _zeros})
    assert again.remembered is None and len(timed) == 2  # searched and timed again
    assert again["zeros"].status == "rejected" and again.best.name != "zeros"


def test_a_winner_that_no_longer_builds_starts_a_new_search(timed):
    model, guard = tiny_convnet(), Guard()
    assert _optimize(model, eval_fn=guard, extra_candidates={"zeros": _zeros}).best.name == "zeros"

    def broken(model):
        raise RuntimeError("this runtime is gone")

    again = _optimize(model, eval_fn=guard, extra_candidates={"zeros": broken})
    assert again.remembered is None and len(timed) == 2 and again["zeros"].status == "failed"


def test_a_busy_search_is_not_remembered_and_says_so(timed, monkeypatch):
    monkeypatch.setattr(result_module, "busy_warning", lambda others_cores: "the machine was busy: a test says so")
    model = tiny_convnet()
    busy = _optimize(model)
    assert busy.to_dict()["busy_warning"] == "the machine was busy: a test says so"
    assert _optimize(model).remembered is None and len(timed) == 2


def test_timing_waits_for_a_quiet_machine_first(monkeypatch):
    waits = []
    monkeypatch.setattr(search, "QUIET_WAIT_S", 3.0)
    monkeypatch.setattr(search, "wait_for_quiet_machine", lambda max_s, **kw: waits.append(max_s))
    _optimize(tiny_convnet())
    assert waits == [3.0]


NET = """
import torch
from torch import nn

def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))
"""


def test_cli_optimize_recalls_and_refresh_searches_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    (tmp_path / "nets.py").write_text(NET)
    args = ["optimize", f"{tmp_path / 'nets.py'}:net", "--input-shape", "1,3,8,8", "--runtimes", "torch",
            "--precisions", "fp32", "--batch-sizes", "1"]
    assert main(args + ["--json", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["remembered"] is None
    capsys.readouterr()
    assert main(args + ["--json", str(tmp_path / "b.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["remembered"].startswith("remembered from ") and "--refresh measures again" in out
    assert main(args + ["--refresh", "--json", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["remembered"] is None
