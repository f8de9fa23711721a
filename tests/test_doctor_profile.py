"""doctor.profile on synthetic loops, the phase clock, the verdict and the loop rules."""
import time

import pytest
import torch
from helpers import tiny_convnet
from torch import nn
from torch.utils.data import DataLoader, Dataset

import torchspeed as ts
from torchspeed.doctor import phases as phases_mod
from torchspeed.doctor.phases import PhaseClock, verdict
from torchspeed.doctor.rules import loop_findings


class SleepyData(Dataset):
    """Images that take 30 ms each to load: a loop fed by it waits for data."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        time.sleep(0.03)
        return torch.randn(3, 8, 8), i % 4


def test_sleepy_loader_is_data_bound_and_flags_no_workers():
    m = tiny_convnet(classes=4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rep = ts.doctor.profile(m, DataLoader(SleepyData(), batch_size=4), opt, nn.CrossEntropyLoss(), steps=3, warmup=1)
    assert rep.verdict == "data-bound", rep.evidence
    assert rep.phases["data"] >= 3 * 4 * 0.03  # at least the sleeps of the measured batches
    assert rep.steps == 3 and rep.settings["loaders"][0]["num_workers"] == 0
    speed = [f for f in rep.findings if f.severity == "speed"]
    assert speed[0].rule == "loader-no-workers" and speed[0].expected_gain > 0
    d = rep.to_dict()
    assert set(d["phases"]) >= {"data", "copy", "forward", "backward", "optimizer", "other"}
    assert {"rule", "message", "fix", "expected_gain"} <= set(d["findings"][0])


def test_heavy_model_is_compute_bound_and_really_trains():
    # wide convs on 48x48 images: compute dominates even on a loaded machine
    m = nn.Sequential(nn.Conv2d(3, 48, 3, padding=1), nn.ReLU(), nn.Conv2d(48, 48, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 4))
    before = m[0].weight.detach().clone()
    batches = [(torch.randn(8, 3, 48, 48), torch.randint(0, 4, (8,))) for _ in range(3)]  # in memory: no data cost
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rep = ts.doctor.profile(m, batches, opt, nn.CrossEntropyLoss(), steps=4, warmup=1)
    assert rep.verdict == "compute-bound", rep.evidence
    assert not torch.equal(before, m[0].weight)
    known = sum(v for k, v in rep.phases.items() if k != "other")
    assert known <= rep.wall_s * 1.001 and rep.phases["forward"] > 0 and rep.phases["backward"] > 0
    assert rep.throughput == pytest.approx(4 * 8 / rep.wall_s)
    assert "loader-no-workers" not in [f.rule for f in rep.findings]  # a list is not a DataLoader
    assert "Verdict: compute-bound" in str(rep)


def test_profile_flags_double_softmax_first():
    m = nn.Sequential(nn.Linear(6, 3), nn.Softmax(dim=1))
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,)))]
    rep = ts.doctor.profile(m, batches, torch.optim.SGD(m.parameters(), lr=0.1), nn.CrossEntropyLoss(), steps=2)
    assert rep.findings[0].rule == "double-softmax" and rep.findings[0].severity == "bug"


def test_profile_rejects_no_steps_an_empty_loader_and_batches_without_targets():
    m = tiny_convnet(classes=4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="steps"):
        ts.doctor.profile(m, [], opt, nn.CrossEntropyLoss(), steps=0)
    with pytest.raises(ValueError, match="no batches"):
        ts.doctor.profile(m, [], opt, nn.CrossEntropyLoss(), steps=1)
    with pytest.raises(ValueError, match="inputs, targets"):
        ts.doctor.profile(m, [torch.randn(2, 3, 8, 8)], opt, nn.CrossEntropyLoss(), steps=1)


def test_phase_clock_is_exclusive(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(phases_mod.time, "perf_counter", lambda: now[0])
    c = PhaseClock()
    c.enter("data")           # t=0
    now[0] = 1.0
    c.enter("copy")           # nested: pauses data
    now[0] = 3.0
    c.exit()
    now[0] = 4.0
    c.exit()
    now[0] = 10.0
    wall, ph = c.boundary()
    assert wall == 10.0 and ph["data"] == 2.0 and ph["copy"] == 2.0 and ph["other"] == 6.0
    c.enter("forward")        # open across the boundary: charged to each window up to it
    now[0] = 12.0
    wall, ph = c.boundary()
    assert wall == 2.0 and ph["forward"] == 2.0 and ph["other"] == 0.0


def test_verdict_from_the_shares_of_data_compute_and_other_and_the_gpu_busy_time():
    base = dict.fromkeys(("data", "copy", "forward", "backward", "optimizer", "other"), 0.0)
    assert verdict({**base, "data": 6, "forward": 4}, 10)[0] == "data-bound"
    assert verdict({**base, "data": 1, "forward": 8, "other": 1}, 10)[0] == "compute-bound"
    assert verdict({**base, "data": 1, "forward": 4, "other": 5}, 10)[0] == "overhead-bound"
    assert verdict({**base, "forward": 9}, 10, gpu_busy_s=2.0)[0] == "overhead-bound"  # GPU starved by launches


def facts(**settings):
    s = {"loaders": [], "cores": 2, "torch_threads": 2, "cpu_bf16": False, "cuda_available": False}
    s.update(settings)
    return {"device": "cpu", "steps": 10, "wall_s": 10.0, "verdict": "compute-bound", "settings": s,
            "phases": {"data": 1.0, "copy": 0.0, "forward": 4.0, "backward": 4.0, "optimizer": 0.5, "other": 0.5}}


def test_loop_rules_fire_and_rank_bugs_first_then_by_expected_gain():
    ld = {"name": "DataLoader #1", "num_workers": 4, "pin_memory": True, "batch_size": 8, "persistent_workers": False,
          "batches": 10, "training": True, "startup_s": [1.0, 0.8, 0.8]}
    f = loop_findings(facts(loaders=[ld], parallel="DataParallel", train_mode_eval_forwards=3, cpu_bf16=True,
                            cpu_amx=True))
    rules = [x.rule for x in f]
    assert rules[0] == "train-mode-eval"  # bugs first
    for r in ("pin-memory-without-cuda", "cpu-oversubscribed", "data-parallel", "loader-not-persistent", "no-autocast"):
        assert r in rules, rules
    gains = [x.expected_gain for x in f if x.severity == "speed"]
    assert gains == sorted(gains, reverse=True)
    # a clean fp32 loop on a CPU without native bf16: only the note that bf16 would be emulated there
    assert [(x.rule, x.severity, x.expected_gain) for x in loop_findings(facts())] == [("bf16-emulated", "info", 0.0)]


def test_bf16_advice_names_the_capability_read_and_quotes_no_figure_from_elsewhere():
    native = {x.rule: x for x in loop_findings(facts(cpu_bf16=True, cpu_bf16_flags=["avx512_bf16"]))}["no-autocast"]
    assert native.expected_gain > 0 and "avx512_bf16" in native.message and "--try bf16" in native.message
    emulated = {x.rule: x for x in loop_findings(facts())}["bf16-emulated"]
    assert "no native bf16" in emulated.message and emulated.expected_gain == 0.0
    cuda = {**facts(cuda_capability=[8, 0]), "device": "cuda"}
    tc = {x.rule: x for x in loop_findings(cuda)}["no-autocast"]
    assert "tensor cores" in tc.message and "--try bf16,fp16" in tc.message
    for f in loop_findings(facts(loaders=[{"name": "DataLoader #1", "num_workers": 4, "batches": 3}], cpu_bf16=True,
                                 parallel="DataParallel", cores=2)) + [emulated, tc]:
        said = f"{f.message} {f.gain_basis} {f.fix}"
        for quoted in ("x of", "measured 0.", "article", "typically", "report"):
            assert quoted not in said, (f.rule, said)


def test_ranking_uses_what_try_measured():
    from torchspeed.doctor.trying import apply_measured

    payload = {"findings": [loop_findings(facts(cpu_bf16=True, cpu_bf16_flags=["amx_bf16"]))[0].to_dict(),
                            {"rule": "loader-no-workers", "severity": "speed", "expected_gain": 0.05,
                             "gain_basis": "overlap", "message": "m"}]}
    assert payload["findings"][0]["rule"] == "no-autocast" and payload["findings"][0]["expected_gain"] > 0.05
    row = {"name": "bf16", "fix": "bf16", "speedup": 1.01, "step_s": 0.99, "baseline_step_s": 1.0, "spread": 0.1,
           "kept": False, "verdict": "within the spread"}
    apply_measured(payload, [row], ["python", "t.py"])
    assert [f["rule"] for f in payload["findings"]] == ["loader-no-workers", "no-autocast"]  # the guess gave way
    auto = payload["findings"][1]
    assert auto["expected_gain"] == 0.0 and auto["measured"] == "within the spread" and "measured by" in auto["gain_basis"]
    payload["findings"][1]["expected_gain"] = 0.01
    kept = {**row, "speedup": 1.6, "step_s": 0.625, "kept": True, "verdict": "kept"}
    apply_measured(payload, [kept], ["python", "t.py"])
    assert payload["findings"][0]["rule"] == "no-autocast" and payload["findings"][0]["expected_gain"] == 0.375


def test_host_syncs_per_step_are_a_finding_on_cuda_only():
    cuda = {**facts(host_syncs=30), "device": "cuda"}  # 3 reads per step, as the instrument counts them on CUDA
    f = {x.rule: x for x in loop_findings(cuda)}["host-syncs"]
    assert f.message.startswith("3.0 host syncs per step") and "read it every N steps" in f.fix
    assert "host-syncs" not in {x.rule for x in loop_findings({**cuda, "settings": {**cuda["settings"], "host_syncs": 10}})}
    assert "host-syncs" not in {x.rule for x in loop_findings(facts(host_syncs=30))}  # a read on CPU is free


def test_profile_reads_tuple_and_dict_batches():
    m = tiny_convnet(classes=4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    for batch in ((x, y, "extra"), {"image": x, "label": y}, {"pixels": x, "cls": y}):  # any 2-key dict: in order
        rep = ts.doctor.profile(m, [batch], opt, nn.CrossEntropyLoss(), steps=1, warmup=0)
        assert rep.steps == 1 and rep.throughput == pytest.approx(4 / rep.wall_s)
    with pytest.raises(ValueError, match=r"inputs, targets.*yielded dict with keys \['a', 'b', 'c'\]"):
        ts.doctor.profile(m, [{"a": x, "b": y, "c": y}], opt, nn.CrossEntropyLoss(), steps=1)


def test_gpu_busy_is_the_union_of_busy_intervals():
    """Overlapping kernels (two streams) count once; idle gaps between them do not count."""
    from torchspeed.doctor.phases import busy_time

    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)  # the 1 s gap is idle
    assert busy_time([(0.0, 2.0), (1.0, 3.0)]) == pytest.approx(3.0)  # overlap counted once
    assert busy_time([(5.0, 6.0), (0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)  # nested, unsorted
    assert busy_time([(0.0, 1.0), (1.0, 2.0), (4.0, 4.0), (3.0, 2.5)]) == pytest.approx(2.0)  # touching; empty


def test_profile_runs_a_hugging_face_style_model_on_dict_batches():
    from dataclasses import dataclass

    from torchspeed.batches import BatchFormat
    from torchspeed.doctor import profile

    @dataclass
    class Out:
        logits: torch.Tensor

    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, pixel_values=None, attention_mask=None):
            return Out(self.fc(pixel_values * attention_mask))

    g = torch.Generator().manual_seed(0)
    batches = [{"pixel_values": torch.randn(4, 6, generator=g), "attention_mask": torch.ones(4, 6),
                "labels": torch.randint(0, 3, (4,), generator=g)} for _ in range(6)]
    model = HF()
    before = model.fc.weight.detach().clone()
    rep = profile(model, batches, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                  steps=3, warmup=1)
    assert rep.steps == 3 and not torch.equal(before, model.fc.weight)
    class TwoInputs(HF):
        def forward(self, x, m):
            return super().forward(pixel_values=x, attention_mask=m)

    two = TwoInputs()
    named = profile(two, [(b["pixel_values"], b["attention_mask"], b["labels"]) for b in batches],
                    torch.optim.SGD(two.parameters(), lr=0.1), nn.functional.cross_entropy, steps=2, warmup=1,
                    batch_format=BatchFormat(inputs=(0, 1), target=2, logits=lambda o: o.logits))
    assert named.steps == 2


def test_a_loader_without_workers_is_a_finding_only_where_the_loop_waits_for_it():
    ld = {"name": "DataLoader #1", "num_workers": 0, "batch_size": 8, "batches": 10, "training": True}
    waits = {x.rule: x for x in loop_findings(facts(loaders=[ld]))}["loader-no-workers"]  # 10% of the step
    assert waits.expected_gain == pytest.approx(0.1)
    assert "fast_loader" not in waits.fix  # token or tensor data: no JPEG decoding to make cheaper
    quiet = facts(loaders=[ld])
    quiet["phases"]["data"], quiet["phases"]["forward"] = 0.1, 4.9  # 1% of the step
    assert "loader-no-workers" not in [x.rule for x in loop_findings(quiet)]
    images = {**ld, "images": {"supported": True, "train": True, "dataset": "ImageFolder", "samples": 24, "crop": 32}}
    on_images = {x.rule: x for x in loop_findings(facts(loaders=[images]))}["loader-no-workers"]
    assert "ts.data.fast_loader" in on_images.fix and "--try fast_loader,workers" in on_images.command
