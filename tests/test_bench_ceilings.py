"""Ceilings: cached per machine (round trip, another machine or version ignored), a ceiling keeps the best
measurement, rows' % of ceiling arithmetic, the int8 route chosen among those that work, time windows."""
import dataclasses
import json

import pytest
from helpers import fake_clock

from torchspeed import measure
from torchspeed.bench import budget, ceilings
from torchspeed.bench.rows import Row

MACHINE = {"cpu": "Test CPU", "arch": "x86_64", "cores": 2, "isa": {"avx2": True}, "gpus": [], "torch": "2.14.1",
           "torch_threads": 2, "python": "3.11"}


def _ceilings(fp32=150.0, **more):
    items = {"fp32": {"value": fp32, "unit": "GFLOP/s", "route": "torch.mm", "what": "fp32 GEMM"},
             "int8": {"value": 555.0, "unit": "GOP/s", "route": "onnxruntime MatMulInteger", "what": "int8 GEMM"},
             "decode": {"value": 5740.0, "unit": "img/s", "route": "simplejpeg-fast", "what": "2 x 2,870"}}
    items.update(more)
    return {"version": ceilings.VERSION, "machine": dict(MACHINE), "measured_at": "2026-11-23 02:40 UTC",
            "load_avg_1min": 0.1, "items": items}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_round_trip_per_machine(cache):
    c = _ceilings()
    path = ceilings.save(c)
    assert path.startswith(str(cache)) and json.loads(open(path).read())["items"]["fp32"]["value"] == 150.0
    assert ceilings.load_cached(dict(MACHINE)) == c
    assert ceilings.load_cached(dict(MACHINE, torch_threads=1, python="3.12")) == c  # not part of the key
    assert ceilings.load_cached(dict(MACHINE, cores=4)) is None            # another machine
    assert ceilings.load_cached(dict(MACHINE, isa={"avx2": True, "amx_bf16": True})) is None
    with open(path, "w") as f:
        json.dump(dict(c, version=ceilings.VERSION + 1), f)
    assert ceilings.load_cached(dict(MACHINE)) is None                     # another format
    with open(path, "w") as f:
        f.write('{"version": ')
    assert ceilings.load_cached(dict(MACHINE)) is None                     # damaged: measured again


def test_a_gpu_cache_without_a_ceiling_rows_are_judged_against_is_measured_again(cache):
    gpu = {name: {"value": 100.0, "unit": "GFLOP/s"} for name in ceilings.GPU_CEILING.values()}
    c = _ceilings(**gpu)
    ceilings.save(c)
    assert ceilings.load_cached(dict(MACHINE)) == c
    del c["items"]["gpu_int8"]  # a cache written before that ceiling was measured
    ceilings.save(c)
    assert ceilings.load_cached(dict(MACHINE)) is None


def test_get_reads_the_cache_and_refresh_keeps_the_best(cache, monkeypatch):
    import torchspeed.runtime as rt

    monkeypatch.setattr(rt, "describe", lambda: dict(MACHINE))
    ceilings.save(_ceilings(fp32=150.0))
    monkeypatch.setattr(ceilings, "measure", lambda progress=None: pytest.fail("measured despite the cache"))
    got = ceilings.get()
    assert got["source"] == "cache" and got["items"]["fp32"]["value"] == 150.0

    slower = _ceilings(fp32=90.0, mem_bw={"value": 20.0, "unit": "GB/s"})  # a loaded moment: lower figures
    slower["items"]["decode"]["value"] = 6000.0
    monkeypatch.setattr(ceilings, "measure", lambda progress=None: slower)
    got = ceilings.get(refresh=True)
    assert got["source"] == "measured"
    assert got["items"]["fp32"]["value"] == 150.0 and got["items"]["fp32"]["kept_from"] == "2026-11-23 02:40 UTC"
    assert got["items"]["decode"]["value"] == 6000.0 and got["items"]["mem_bw"]["value"] == 20.0
    assert ceilings.load_cached(dict(MACHINE))["items"]["fp32"]["value"] == 150.0


def test_a_ceiling_measured_on_a_busy_machine_is_never_cached(cache, monkeypatch):
    """The load reading is injected: a measurement beside 1.6 busy cores judges only the report it was taken
    for (marked busy), is not cached, and the next run measures again; once quiet, it is kept."""
    import torchspeed.runtime as rt

    monkeypatch.setattr(rt, "describe", lambda: dict(MACHINE))
    busy = dict(_ceilings(fp32=76.0), others_cores=1.6)
    monkeypatch.setattr(ceilings, "measure", lambda progress=None: busy)
    got = ceilings.get()
    assert got["source"] == "measured" and got["busy_cores"] == 1.6 and ceilings.busy_cores(got) == 1.6
    assert got["items"]["fp32"]["value"] == 76.0
    assert ceilings.load_cached(dict(MACHINE)) is None  # not the machine's ceiling

    calls = []
    monkeypatch.setattr(ceilings, "measure", lambda progress=None: calls.append(1) or dict(_ceilings(), others_cores=0.1))
    got = ceilings.get()  # measured again (nothing cached), quiet this time: kept
    assert calls == [1] and ceilings.busy_cores(got) is None and got["source"] == "measured"
    assert ceilings.load_cached(dict(MACHINE))["items"]["fp32"]["value"] == 150.0

    # a refresh beside a busy process keeps the quiet cache, and says it did not keep the new one
    monkeypatch.setattr(ceilings, "measure", lambda progress=None: dict(_ceilings(fp32=500.0), others_cores=1.2))
    got = ceilings.get(refresh=True)
    assert got["source"] == "cache" and ceilings.busy_cores(got) is None and got["items"]["fp32"]["value"] == 150.0
    assert "1.2 cores" in got["not_kept"]["why"] and "not kept" in got["not_kept"]["why"]
    assert ceilings.load_cached(dict(MACHINE))["items"]["fp32"]["value"] == 150.0  # the busy 500 never cached
    # a cache file claiming a busy reading (hand-edited, or another tool's) is not trusted either
    ceilings.save(dict(_ceilings(), busy_cores=1.0))
    assert ceilings.load_cached(dict(MACHINE)) is None


def test_measuring_the_ceilings_records_the_cores_others_used(monkeypatch):
    """`measure` reads the load other processes put on the cores over its whole measurement (injected here)."""
    import torch

    from torchspeed import measure as timing

    class Load:
        def cores(self):
            return 1.25

    monkeypatch.setattr(timing, "OthersLoad", Load)
    fake = {"value": 1.0, "unit": "x", "what": "fake"}
    monkeypatch.setattr(ceilings, "gemm_gflops", lambda name, budget_s: dict(fake))
    monkeypatch.setattr(ceilings, "int8_gops", lambda budget_s: dict(fake))
    monkeypatch.setattr(ceilings, "memory_bandwidth", lambda budget_s: dict(fake))
    monkeypatch.setattr(ceilings, "decode_samples", lambda: [b""])
    monkeypatch.setattr(ceilings, "decode_rate", lambda samples, budget_s: dict(fake, route="fake", cores=2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        got = ceilings.measure()
    finally:
        torch.set_num_threads(threads)
    assert got["others_cores"] == 1.25 and got["items"]["decode"]["value"] == 2.0


def test_a_share_of_a_busy_ceiling_says_so_and_judges_no_goal():
    from torchspeed.bench import report

    row = Row(technique="torchspeed", median=600.0, unit="img/s", ceiling="decode", achieved=600.0, pct_of_ceiling=62.0,
              ratio=2.0, headline=True)
    assert ceilings.ceiling_cell(row) == "decode: 600 of 968 img/s (62%)"
    assert ceilings.ceiling_cell(row, busy=True) == "decode: 600 of 968 img/s (62%, busy ceiling)"
    lims = [{"goal": "data >= 60% of the decode-only ceiling (all cores)", "measured": "62%", "met": True, "why": ""},
            {"goal": ">= 2x DALI's CPU pipeline on the same photos", "measured": "2.1x", "met": True, "why": ""}]
    results = {"data": {"rows": [row.to_dict()], "limits": lims, "others_cores": 0.0},
               "ceilings": dict(_ceilings(), busy_cores=1.4)}
    table = "\n".join(report.limits_section(results))
    ceiling_goal = next(line for line in table.splitlines() if "decode-only ceiling" in line)
    assert "not judged: busy ceiling" in ceiling_goal and "| yes |" not in ceiling_goal
    assert "| yes |" in next(line for line in table.splitlines() if "DALI" in line)  # not set against a ceiling
    assert report.suite_cells(results["data"], busy_ceiling=True) == ("600 img/s", "2.00x", "62% decode (busy)", "quiet")
    assert "busy ceiling" in report.suite_table(results["data"], busy_ceiling=True)
    assert any("Busy ceilings" in line for line in report.ceilings_section(results["ceilings"]))
    quiet = dict(results, ceilings=_ceilings())
    assert "| yes |" in "\n".join(report.limits_section(quiet)).split("DALI")[0]


def test_pct_of_ceiling_arithmetic():
    c = _ceilings()
    train = Row(median=28.7, unit="samples/s", ceiling="fp32", flops_per_item=3.57e9)
    assert ceilings.achieved(train) == pytest.approx(28.7 * 3.57)
    assert ceilings.pct_of_ceiling(train, c) == pytest.approx(100 * 28.7 * 3.57 / 150)    # ~68%
    infer = Row(median=63.0, unit="ms", batch=8, ceiling="int8", flops_per_item=3.64e9)
    assert ceilings.pct_of_ceiling(infer, c) == pytest.approx(100 * (8 / 0.063) * 3.64 / 555)
    data = Row(median=2435.0, unit="img/s", ceiling="decode")
    assert ceilings.pct_of_ceiling(data, c) == pytest.approx(100 * 2435 / 5740)
    assert ceilings.pct_of_ceiling(dataclasses.replace(data, ceiling="bf16"), c) is None  # no such ceiling measured
    assert ceilings.pct_of_ceiling(dataclasses.replace(data, median=None), c) is None     # a skipped row
    assert ceilings.pct_of_ceiling(dataclasses.replace(data, median=float("nan")), c) is None
    assert ceilings.pct_of_ceiling(Row(median=5.0, unit="ms", ceiling="fp32"), c) is None  # no batch
    assert ceilings.pct_of_ceiling(data, None) is None

    results = {"data": {"rows": [data.to_dict(), {"median": 1.0, "unit": "img/s"}]}, "design": {"rows": [{"median": 2.0}]}}
    ceilings.annotate(results, c)
    assert results["data"]["rows"][0]["pct_of_ceiling"] == pytest.approx(42.42, abs=0.01)
    assert "pct_of_ceiling" not in results["data"]["rows"][1] and "pct_of_ceiling" not in results["design"]["rows"][0]


def test_int8_ceiling_takes_the_fastest_route_that_works(monkeypatch):
    clock = fake_clock(monkeypatch, measure)  # each route takes exactly its fake's time, on a busy machine too

    def broken(n):
        raise ImportError("no such runtime")

    def fast(n):
        return lambda: clock.sleep(0.0005)

    def slow(n):
        return lambda: clock.sleep(0.002)

    monkeypatch.setattr(ceilings, "INT8_ROUTES", {"a": broken, "b": slow, "c": fast})
    monkeypatch.setattr(ceilings, "_grow", lambda make: (64, make(64)))
    out = ceilings.int8_gops(budget_s=0.1)
    assert out["route"] == "c" and out["unit"] == "GOP/s"
    assert "ImportError: no such runtime" in out["routes"]["a"]["error"]
    assert out["routes"]["b"]["value"] < out["routes"]["c"]["value"] == out["value"]
    monkeypatch.setattr(ceilings, "INT8_ROUTES", {"a": broken})
    assert ceilings.int8_gops(budget_s=0.1)["value"] is None


def test_grow_stops_at_the_first_size_slow_enough_to_time(monkeypatch):
    clock = fake_clock(monkeypatch, measure)
    sizes = []

    def make(n):
        sizes.append(n)
        return lambda: clock.sleep(0.03 if n >= 1024 else 0)

    n, _ = ceilings._grow(make, min_call_s=0.02)
    assert n == 1024 and sizes == [256, 512, 1024]


def test_time_window_is_respected_with_a_tiny_budget(monkeypatch):
    clock = fake_clock(monkeypatch, measure, budget)
    calls = []

    def fn():
        calls.append(1)
        clock.sleep(0.02)

    t0 = clock.perf_counter()
    t = budget.time_in_window(fn, 0.1, name="x", items=4, min_repeats=2, max_repeats=50)
    took = clock.perf_counter() - t0
    assert 2 <= len(t.times_s) <= 5 and len(calls) == len(t.times_s) + 1   # warm-up call + what fits
    assert took < 0.1 + 3 * 0.05 and t.extra["first_s"] >= 0.02 and t.throughput > 0
    t = budget.time_in_window(fn, 0.0, name="y", min_repeats=2)              # never fewer than min_repeats
    assert len(t.times_s) == 2


def test_budget_shares_what_is_left(monkeypatch):
    b = budget.Budget(100.0)
    b.start -= 40.0
    assert b.left() == pytest.approx(60.0, abs=0.5) and b.share(3) == pytest.approx(20.0, abs=0.5)
    assert b.share(100, floor=5.0) == 5.0 and b.allows(50) and not b.allows(70)
    monkeypatch.setenv(budget.ENV, "7")
    assert budget.Budget.of("train", quick=True).seconds == 7.0
    monkeypatch.delenv(budget.ENV)
    assert budget.seconds_for("train", True) < budget.seconds_for("train", False)


def test_every_quick_part_has_a_share_and_the_shares_fit_the_quick_report():
    """`make demo`'s 10 minutes: every part of the quick report (a new suite included) has its share, and the
    shares add up to at most QUICK_LIMIT_S; the one-off preparation has an estimate for the plan."""
    from torchspeed.bench import orchestration, suites

    assert set(suites.SUITE_NAMES) | {"ceilings"} <= set(budget.QUICK_S)
    assert sum(budget.QUICK_S.values()) <= budget.QUICK_LIMIT_S
    assert set(orchestration.PREPARE) == set(budget.PREPARE_S)
    assert budget.CACHED_S["ceilings"] < budget.QUICK_S["ceilings"]


def test_conv_bound_times_every_convolution_alone_and_counts_their_flops():
    import torch

    from torchspeed.bench.suites.train import _train_limit, conv_bound

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    x = torch.randn(2, 3, 8, 8)
    bound = conv_bound(model, x, ceiling_gflops=1.0, repeats=1)
    assert bound["convolutions"] == 2
    # FLOPs: forward 2*N*Cout*H*W*Cin*k*k per conv; backward wrt the weight (both) and the input (second only)
    fwd = [2 * 2 * 8 * 64 * 3 * 9, 2 * 2 * 4 * 64 * 8 * 1]
    expected = fwd[0] * 2 + fwd[1] * 3
    assert bound["gflops"] * bound["seconds"] * 1e9 == pytest.approx(expected, rel=1e-6)
    assert bound["pct_of_fp32_ceiling"] == pytest.approx(100 * bound["gflops"])
    assert all(p.grad is None for p in model.parameters())  # timed without touching the model's gradients
    profile = {"step_s": 1.0, "layout": "NCHW", "conv_bound": bound,
               "categories": {"convolution forward": {"seconds": 0.6, "share_pct": 60.0, "gflops": 10.0}}}
    rep = type("Rep", (), {"channels_last": False})()
    lim = _train_limit(5.0, 1e9, {"fp32": 100.0, "bf16": 200.0}, profile, rep, "fp32")
    # the bound is the faster of the convolutions' rate in the step (10 GFLOP/s = 10%) and alone
    assert lim["bound_pct"] == pytest.approx(max(10.0, bound["gflops"]))  # GFLOP/s = % of a 100 GFLOP/s ceiling
    assert "each of the 2 timed alone" in lim["why"] and f"about {lim['bound_pct']:.0f}%" in lim["why"]
    assert lim["measured"] == "fp32: 5 of 100 GFLOP/s (5%)" and lim["met"] is False


def test_the_train_goal_judges_a_bf16_step_against_the_bf16_ceiling():
    from torchspeed.bench.suites.train import _train_limit

    lim = _train_limit(160.0, 1e9, {"fp32": 100.0, "bf16": 200.0}, None, None, "bf16")
    assert lim["measured"] == "bf16: 160 of 200 GFLOP/s (80%)" and lim["met"] is True  # 160% of fp32's: not the question
    assert "(bf16)" in lim["goal"]
    assert _train_limit(160.0, 1e9, {"fp32": 100.0}, None, None, "bf16")["met"] is None


def test_the_train_suite_on_a_gpu_is_judged_against_the_gpus_ceilings():
    from torchspeed.bench.suites.train import _train_limit, precision_ceilings

    items = {"fp32": {"value": 1385.0}, "bf16": {"value": 4245.0}, "gpu_tf32": {"value": 396985.0},
             "gpu_bf16": {"value": 768744.0}, "gpu_fp16": {"value": 745182.0}}
    names, values = precision_ceilings("cuda", items)
    assert values == {"fp32": 396985.0, "bf16": 768744.0, "fp16": 745182.0}  # never the CPU's 1385
    lim = _train_limit(4072.0, 3.476e9, values, None, None, "fp32", names)
    assert lim["measured"] == "gpu_tf32: 14154 of 396985 GFLOP/s (4%)" and lim["met"] is False
    assert "(gpu_tf32)" in lim["goal"]
    assert precision_ceilings("cpu", items) == ({"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"},
                                                {"fp32": 1385.0, "bf16": 4245.0, "fp16": None})


def test_a_cpu_suite_says_so_where_a_gpu_is_present(monkeypatch):
    import torch

    from torchspeed.bench.suite_kit import cpu_suite_notes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_suite_notes() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    [note] = cpu_suite_notes()
    assert note.startswith("measured on the CPU") and "NVIDIA H200" in note and "not used" in note
