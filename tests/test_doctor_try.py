"""doctor --try: which fixes are planned (capability read first), interleaved runs judged beyond the
measured spread, numerics on the first losses, measured gains replacing estimates, the fixes injected
in a real loop (in this process), and one end-to-end run on a tiny script."""
import json
import os
import sys
import textwrap
import time

import pytest
import torch
from helpers import another_process_spinning, separable_loader
from torch import nn
from torch.utils.data import DataLoader

from torchspeed.doctor import fixes as fx
from torchspeed.doctor.recorder import Recorder
from torchspeed.doctor.trying import apply_measured, markdown_tried, note_load, print_tried, step_times, try_fixes
from torchspeed.measure import OthersLoad

LOADER = {"name": "DataLoader #1", "num_workers": 0, "batch_size": 8, "batches": 9, "training": True,
          "pin_memory": False, "persistent_workers": False}


def _payload(device="cpu", mixed="fp32", convs=3, optimizers=("SGD",), **extra):
    s = {"device": device, "cores": 2, "torch_threads": 2, "loaders": [dict(LOADER)], "autocast": False,
         "model": {"convs": convs}, "input": {"shape": [8, 3, 32, 32], "channels_last": False},
         "optimizers": list(optimizers), "optimizer_options": {o: {"fused": None, "foreach": None} for o in optimizers},
         "mixed_precision": {"name": mixed, "reason": f"capability says {mixed}"}, "cudnn_benchmark": False}
    s.update(extra)
    return {"settings": s, "findings": [], "steady": {"phases": {"eval": 0.0}}}


def test_plan_reads_the_capability_before_any_hardware_fix():
    run, skipped = fx.plan(_payload())
    names = [n for n, _ in run]
    assert names == ["workers", "workers", "channels_last", "fused_optimizer"]
    assert [v for n, v in run if n == "workers"] == [1, 2]  # measured candidates on 2 cores
    why = {s["fix"]: s["reason"] for s in skipped}
    assert why["bf16"].startswith("needs bf16 hardware: capability says fp32")
    assert "needs CUDA" in why["fp16"] and "needs CUDA" in why["cudnn_benchmark"] and "needs CUDA" in why["pin_memory"]
    assert "compile" not in names and why["compile"].startswith("the loop is not measured")  # compute-bound loops only
    assert why["fast_loader"].startswith("the loop's DataLoader does not read image files")  # tensors, not files
    run, _ = fx.plan(_payload(mixed="bf16"))
    assert ("bf16", True) in run
    run, skipped = fx.plan(_payload(device="cuda", mixed="fp16"))
    assert {"fp16", "cudnn_benchmark", "pin_memory"} <= {n for n, _ in run}
    run, skipped = fx.plan(_payload(), ["compile", "bf16"])
    assert run == [("compile", "whole")] and skipped[0]["fix"] == "bf16"  # no repeated block: whole only
    from torchspeed.doctor.launch import run_doctor

    # one check of the names, before anything runs (the script does not even exist)
    with pytest.raises(ValueError, match="unknown fix 'turbo'; choose from workers, fast_loader, persistent_workers, "):
        run_doctor([sys.executable, "no_such_script.py"], try_fixes=["channels_last", "turbo"], console=False)


def _raw(step_s, losses=(2.3, 2.1, 1.9), prints=([1, 2],), steps=6):
    return {"status": "stopped", "windows": [{"wall": 9.0}] + [{"wall": step_s}] * (steps - 1),
            "losses": list(losses), "batch_prints": [list(p) for p in prints]}


def test_try_interleaves_the_baseline_and_keeps_only_gains_beyond_the_spread():
    payload = _payload()
    payload["findings"] = [{"rule": "no-channels-last", "severity": "speed", "expected_gain": 0.08, "gain_basis": "x"},
                           {"rule": "loader-no-workers", "severity": "speed", "expected_gain": 0.05, "gain_basis": "y"}]
    base = iter([1.00, 1.05, 1.00, 1.02, 1.00])  # run-to-run spread 5% (with the first run, 1.00)
    fixed = {"workers=1": _raw(0.98), "workers=2": _raw(0.70, prints=([2, 1],)),  # other batches: changes results
             "channels_last": _raw(0.80), "fused_optimizer": _raw(0.97, losses=(2.3, 2.0, 1.5))}
    calls = []

    def launch(spec, title):
        calls.append(title)
        if title == "baseline":
            return _raw(next(base))
        if title.startswith("combined"):
            return _raw(0.75)
        return fixed[title]

    t = try_fixes(_raw(1.0), payload, launch, fx.plan(payload))
    assert calls == ["workers=1", "baseline", "workers=2", "baseline", "channels_last", "baseline",
                     "fused_optimizer", "baseline",  # interleaved
                     "channels_last", "baseline"]  # the kept fix measured again; no combination of one fix
    assert t["spread"] == pytest.approx(0.05)
    rows = {r["fix"]: r for r in t["tried"]}
    assert rows["channels_last"]["kept"] and rows["channels_last"]["speedup"] == pytest.approx(1.01 / 0.8)  # baselines around its runs: 1.05, 1.00, 1.02, 1.00
    assert rows["channels_last"]["runs"] == 2 and rows["workers=1"]["runs"] == 1
    assert rows["workers=1"]["verdict"] == "within the spread" and not rows["workers=1"]["kept"]
    assert rows["workers=2"]["numerics_ok"] is False and rows["workers=2"]["verdict"] == "changes results"
    assert rows["fused_optimizer"]["numerics_ok"] is False  # loss 1.5 vs 1.9: beyond 1e-3
    assert t["tried"][0]["fix"] == "channels_last"  # ranked: kept first, by speed-up
    assert "channels_last" in rows["channels_last"]["code"]
    apply_measured(payload, t["tried"], ["python", "t.py"])
    f = {x["rule"]: x for x in payload["findings"]}
    assert f["no-channels-last"]["expected_gain"] == pytest.approx(1 - 0.8 / 1.01, abs=1e-3) and f["no-channels-last"]["measured"] == "kept"
    assert f["loader-no-workers"]["expected_gain"] == 0.0 and f["loader-no-workers"]["measured_gain"] > 0  # within the spread
    assert f["no-channels-last"]["estimated_gain"] == 0.08 and "measured by doctor --try" in f["no-channels-last"]["gain_basis"]


def test_fixes_measured_without_a_gain_keep_the_order_of_their_estimates():
    """Measured within the spread, both fall to a gain of 0: the one estimated larger still comes first, not
    the one whose name sorts first."""
    payload = {"findings": [{"rule": "loader-no-workers", "severity": "speed", "expected_gain": 0.0, "gain_basis": "a"},
                            {"rule": "no-channels-last", "severity": "speed", "expected_gain": 0.2, "gain_basis": "b"}]}
    row = {"name": "", "speedup": 1.02, "step_s": 0.98, "baseline_step_s": 1.0, "spread": 0.05, "kept": False,
           "verdict": "within the spread"}
    tried = [{**row, "name": "workers", "fix": "workers=2"}, {**row, "name": "channels_last", "fix": "channels_last"}]
    apply_measured(payload, tried, ["python", "t.py"])
    assert [f["rule"] for f in payload["findings"]] == ["no-channels-last", "loader-no-workers"]
    assert all(f["expected_gain"] == 0.0 for f in payload["findings"])


def test_a_kept_fix_that_does_not_hold_on_its_second_run_is_dropped():
    """One quiet minute during a fix's run is not a gain: the second (fix, baseline) pair must agree."""
    fix_runs = iter([0.5, 1.0])

    def launch(spec, title):
        return _raw(1.0) if title == "baseline" else _raw(next(fix_runs))

    (row,) = try_fixes(_raw(1.0), _payload(), launch, fx.plan(_payload(), ["channels_last"]))["tried"]
    assert row["runs"] == 2 and row["step_s"] == pytest.approx(0.75) and row["speedup"] == pytest.approx(1 / 0.75)
    assert row["kept"]  # 1.33x over both runs, beyond a zero spread
    fix_runs = iter([0.5, 1.0])
    base = iter([1.0, 1.6])  # now the baseline itself swings by 60% on the confirming run

    def launch2(spec, title):
        return _raw(next(base)) if title == "baseline" else _raw(next(fix_runs))

    (row,) = try_fixes(_raw(1.0), _payload(), launch2, fx.plan(_payload(), ["channels_last"]))["tried"]
    assert row["runs"] == 2 and not row["kept"] and row["verdict"] == "within the spread"


def test_two_kept_fixes_are_measured_together_last():
    payload = _payload()
    fixed = {"workers=1": _raw(0.8), "workers=2": _raw(0.9), "channels_last": _raw(0.8), "fused_optimizer": _raw(1.0)}

    def launch(spec, title):
        if title == "baseline":
            return _raw(1.0)
        if title.startswith("combined"):
            assert spec == {"workers": 1, "channels_last": True}  # the best kept candidate of each fix
            return _raw(0.6)
        return fixed[title]

    t = try_fixes(_raw(1.0), payload, launch, fx.plan(payload))
    last = t["tried"][-1]
    assert last["fix"] == "combined: workers=1 + channels_last" and last["kept"]
    assert "num_workers=1" in last["code"] and "channels_last" in last["code"]


def test_numerics_tolerances_by_kind():
    base = {"losses": [2.0, 1.8, 1.6], "batch_prints": [[[0, 1]], [[1, 1]]]}
    assert fx.numerics("channels_last", base, {"losses": [2.0, 1.8001, 1.6]})["ok"] is True
    assert fx.numerics("channels_last", base, {"losses": [2.0, 1.81, 1.6]})["ok"] is False
    assert fx.numerics("bf16", base, {"losses": [2.01, 1.82, 1.62]})["ok"] is True  # precision: 5e-2
    assert fx.numerics("bf16", base, {"losses": [2.5, 1.8, 1.6]})["ok"] is False
    # loader fixes: the same batches in the same order, whatever the losses (augmentation draws differ)
    assert fx.numerics("workers", base, {"losses": [2.2], "batch_prints": [[[0, 1]], [[1, 1]]]})["ok"] is True
    assert fx.numerics("workers", base, {"losses": [2.0], "batch_prints": [[[1, 0]], [[1, 1]]]})["ok"] is False
    assert fx.numerics("threads", base, {"losses": []})["ok"] is None  # no loss seen: not judged


def test_compile_numerics_are_not_judged_where_dropout_draws_other_random_numbers():
    """Compiled, dropout draws its masks from inductor's generator, not eager's: the losses differ with the
    maths unchanged (a Hugging Face model's default dropout 0.1), so compile's numerics are not judged there."""
    base = {"losses": [2.0, 1.8], "settings": {"model": {"dropout": 0.1}}}
    num = fx.numerics("compile", base, {"losses": [2.01, 1.79]})
    assert num["ok"] is None and "dropout (p=0.1)" in num["tolerance"] and "fallback_random" in num["tolerance"]
    base["settings"]["model"]["dropout"] = 0.0
    assert fx.numerics("compile", base, {"losses": [2.01, 1.79]})["ok"] is False  # no dropout: judged
    assert fx.numerics("channels_last", {**base, "settings": {"model": {"dropout": 0.1}}},
                       {"losses": [2.01, 1.79]})["ok"] is False  # eager fixes draw eager's numbers: judged


def test_the_model_settings_name_its_largest_dropout():
    from torchspeed.doctor.loop_setup import model_settings

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Dropout2d(0.25), nn.Linear(4, 2))
    assert model_settings(model)["dropout"] == 0.25
    assert model_settings(nn.Linear(4, 2))["dropout"] == 0.0


def test_compile_steps_exclude_the_compiling_step():
    raw = {"windows": [{"wall": 1.0}, {"wall": 30.0}, {"wall": 0.5}, {"wall": 0.5}], "compile_window": 0}
    assert step_times(raw) == [0.5, 0.5]


class _Probe(nn.Module):
    """A conv net that remembers whether autocast was on and what memory format its input had (what the
    injected fixes change, which the shared test models do not record)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 3)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu"), x.is_contiguous(memory_format=torch.channels_last)))
        return self.head(self.conv(x).mean((2, 3)))


def test_fixes_injected_into_a_real_loop_and_undone():
    dl_init, sgd_init, threads = DataLoader.__init__, torch.optim.SGD.__init__, torch.get_num_threads()
    rec = Recorder()
    rec.install()
    rec.inject({"channels_last": True, "bf16": True, "fused_optimizer": True, "threads": 1, "workers": 1})
    try:
        torch.set_num_threads(2)  # the script's own setting is ignored under the threads fix
        assert torch.get_num_threads() == 1
        loader = separable_loader(8, 4)
        assert loader.num_workers == 1 and loader.persistent_workers
        model = _Probe()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert opt.defaults["fused"] is True
        outs = []
        for x, y in [(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))] * 2:
            out = model(x)
            outs.append(out.dtype)
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        rec.uninstall()
    assert model.seen == [(True, True), (True, True)]  # bf16 autocast on, inputs channels_last
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert outs == [torch.float32, torch.float32]  # the loss is computed in fp32, as the printed code does
    assert DataLoader.__init__ is dl_init and torch.optim.SGD.__init__ is sgd_init
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads


SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    torch.set_num_threads(1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=8, shuffle=True)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    while True:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(float(loss))
""")


@pytest.mark.slow  # three runs of a script, each starting torch: ~30-100 s on 2 busy cores
@pytest.mark.timeout(400)
def test_doctor_try_end_to_end(tmp_path, capsys):
    from torchspeed.cli import main

    (tmp_path / "train.py").write_text(SCRIPT)
    code = main(["doctor", "--steps", "3", "--try", "fused_optimizer", "--out", str(tmp_path / "rep"), "--json",
                 str(tmp_path / "d.json"), "--", sys.executable, str(tmp_path / "train.py")])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    (row,) = d["tried"]
    assert set(row) >= {"fix", "baseline_step_s", "step_s", "speedup", "spread", "numerics_ok", "code"}
    assert row["fix"] == "fused_optimizer" and row["numerics_ok"] is True  # same seed, same losses
    assert row["code"] == ("# train.py:8, the script's own call with fused=True added\n"
                           "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)")
    assert len(d["try"]["baseline_runs"]) >= 2 and d["try"]["baseline_reproducible"] is True
    assert "others_cores" in d["try"] and "others_cores" in row and "busy" in d["try"]  # the load, sampled per run
    out = capsys.readouterr().out
    assert "[2/3+] fused_optimizer: median" in out and "[3/3+] baseline: median" in out
    assert "Fixes measured on this script" in out
    assert "## Fixes measured (doctor --try)" in (tmp_path / "rep" / "doctor.md").read_text()
    assert main(["doctor", "--steps", "2", "--try", "--", sys.executable, str(tmp_path / "train.py")]) == 2
    assert "--try needs --steps >= 3" in capsys.readouterr().err


def test_a_speedup_beyond_removing_the_fixed_phases_is_implausible():
    """fused_optimizer can at most remove the optimizer phase (10% here): 3x means the load changed."""
    payload = _payload()
    payload["steady"] = {"wall_s": 10.0, "phases": {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0}}
    assert fx.max_speedup("fused_optimizer", payload) == pytest.approx(1 / 0.9)
    assert fx.max_speedup("threads", payload) is None

    def launch(spec, title):
        return _raw(1.0) if title == "baseline" else _raw(0.33 if title == "fused_optimizer" else 1.0)

    rows = {r["fix"]: r for r in try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["fused_optimizer"]))["tried"]}
    assert not rows["fused_optimizer"]["kept"] and rows["fused_optimizer"]["verdict"].startswith("implausible")


def _try_with_load():
    """A --try of one fix that measures as much as the baseline, each run taking a little wall time."""
    payload = _payload()

    base = iter([1.04, 1.0, 1.04, 1.0])  # a 4% spread between the baseline's runs

    def launch(spec, title):
        time.sleep(0.15)
        return _raw(next(base) if title == "baseline" else 1.01)

    load = OthersLoad()
    t = try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["fused_optimizer"]))
    note_load(t, load.cores())
    return t


def _printed(t):
    from rich.console import Console

    con = Console(width=200, record=True, file=open(os.devnull, "w"))
    print_tried(t, con)
    return con.export_text()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
@pytest.mark.real_load
def test_a_busy_machine_is_named_beside_the_spread_it_caused():
    with another_process_spinning():
        t = _try_with_load()
    assert t["others_cores"] > 0.5 and all(r["others_cores"] > 0.5 for r in t["baseline_runs"][1:])  # the first ran before --try
    (row,) = t["tried"]
    assert row["others_cores"] > 0.5 and row["verdict"] == "within the spread of a busy machine"
    assert t["busy"].startswith("the machine was busy: other processes used") and "measure again on a quiet" in t["busy"]
    assert "the spread of" in t["busy"] and "the machine was busy" in _printed(t)
    assert any("the machine was busy" in line for line in markdown_tried(t))


def test_a_quiet_machine_gets_no_busy_note(monkeypatch):
    monkeypatch.setattr(OthersLoad, "cores", lambda self: 0.0)
    t = _try_with_load()
    assert t["others_cores"] == 0.0 and t["busy"] is None
    assert t["tried"][0]["verdict"] == "within the spread" and t["tried"][0]["others_cores"] == 0.0
    assert "busy" not in _printed(t) and not any("busy" in line for line in markdown_tried(t))
