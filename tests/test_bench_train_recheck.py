"""The train suite's rows are cumulative: a row slower than the row above is timed again, interleaved with
it and on a batch in memory, and says what that found. Fake rows (sleeps on a fake clock: each takes exactly
what it says, on a busy machine too) stand in for training steps."""
import pytest
from helpers import FakeClock, fake_clock

from torchspeed import measure as timing
from torchspeed.bench import budget, suite_kit
from torchspeed.bench.budget import Budget
from torchspeed.bench.suite_kit import Windows
from torchspeed.bench.suites import train
from torchspeed.train import loader_choice

CLOCK = FakeClock()  # the time of every fake row, and of what times them (patched in by `suite`)


class Loader:
    """Batches that take `wait_s` each to make (the data side of a row)."""

    def __init__(self, wait_s=0.0):
        self.wait_s = wait_s

    def __iter__(self):
        while True:
            CLOCK.sleep(self.wait_s)
            yield "batch"


def sleeper(seconds):
    return lambda batch: CLOCK.sleep(seconds)


load = {"cores": 0.0}  # other processes' cores during a re-measure, as the suite sees them


@pytest.fixture
def suite(monkeypatch):
    load["cores"] = 0.0
    fake_clock(monkeypatch, timing, budget, suite_kit, loader_choice, clock=CLOCK)
    monkeypatch.setattr(train, "BATCH", 1)
    monkeypatch.setattr("torchspeed.measure.wait_for_quiet_machine",
                        lambda max_s=10.0, **k: type("Q", (), {"waited_s": 0.0, "others_cores": 0.0, "busy": False})())
    monkeypatch.setattr("torchspeed.train.loader_choice.OthersLoad", lambda: type("L", (), {"cores": lambda self: load["cores"]})())
    s = train._TrainSuite(quick=True, progress=False, budget_s=6.0)
    s.windows = Windows(Budget(6.0), s.say, rows=6)
    s.flops = 1.0
    return s


def measure(suite, name, loader, step):
    return suite.measure(name, train._Feed(train._Stream(loader), step), name)


def test_a_row_slower_because_its_step_is_slower_says_so(suite):
    measure(suite, "above", Loader(), sleeper(0.01))
    measure(suite, "slower step", Loader(), sleeper(0.03))
    row = suite.rows[-1]
    assert row.remeasured["step_alone_s"] > row.remeasured["above_step_alone_s"]
    assert "the step itself is slower" in row.vs_above and row.vs_above.startswith("first timed at ")
    assert row.median == pytest.approx(row.remeasured["samples_s"]) and row.calls == 2  # quick: 2 rounds
    assert suite.results["rechecks"]["slower step"]["why"] == row.vs_above


def test_a_row_slower_because_of_its_data_says_so(suite):
    measure(suite, "above", Loader(), sleeper(0.01))
    measure(suite, "slow loader", Loader(0.03), sleeper(0.01))
    assert "so the difference is the data" in suite.rows[-1].vs_above


def test_a_row_still_slower_on_a_busy_machine_names_the_load(suite):
    load["cores"] = 1.5
    measure(suite, "above", Loader(), sleeper(0.01))
    measure(suite, "slower step", Loader(), sleeper(0.03))
    assert suite.rows[-1].vs_above.endswith("other processes used 1.5 cores meanwhile, so the machine may be the "
                                            "cause: re-run on a quiet machine")


def test_a_row_slower_only_in_its_first_window_is_not_slower_after_all(suite, monkeypatch):
    slow = {"on": True}

    def noisy(batch):  # slow while its window is timed, then as fast as the row above
        CLOCK.sleep(0.03 if slow["on"] else 0.01)

    recheck = suite.recheck

    def quiet_again(*args):
        slow["on"] = False
        recheck(*args)

    monkeypatch.setattr(suite, "recheck", quiet_again)
    measure(suite, "above", Loader(), sleeper(0.01))
    measure(suite, "noisy", Loader(), noisy)
    assert suite.rows[-1].vs_above.endswith("not slower (the first window was noise)")


def test_a_row_faster_than_the_row_above_is_not_timed_again(suite):
    measure(suite, "above", Loader(), sleeper(0.02))
    measure(suite, "faster", Loader(), sleeper(0.005))
    assert suite.rows[-1].vs_above is None and suite.rows[-1].remeasured is None
    assert "rechecks" not in suite.results and suite.rows[-1].others_cores is not None


def test_the_report_shows_the_reason_beside_the_row():
    from torchspeed.bench.report import suite_table
    from torchspeed.bench.rows import Row

    rows = [Row("plain", 10.0, 9.0, 11.0, "samples/s", what="plain loop").to_dict(),
            Row("+ x", 8.0, 7.0, 9.0, "samples/s", what="x on", vs_above="first timed at 5.0 samples/s; the step "
                "itself is slower: 0.2 vs 0.1 s on a batch in memory").to_dict(),
            Row("+ y", 12.0, 11.0, 13.0, "samples/s", what="y on", others_cores=1.4).to_dict()]
    table = suite_table({"rows": rows})
    assert "x on. **Slower than the row above at first:** first timed at 5.0" in table
    assert "y on. **Busy:** other processes used 1.4 cores while this row was timed" in table


def test_a_re_measured_row_takes_the_interleaved_ratio_to_the_row_above():
    """The row above was timed in its own window, the re-measured row against it under the same load: its
    speed-up is the row above's times the interleaved ratio, not its figure over a figure timed apart."""
    from torchspeed.bench.rows import Row

    rows = [Row("plain PyTorch", 16.0, unit="samples/s"), Row("+ a", 32.0, unit="samples/s"),
            Row("+ b", 11.0, unit="samples/s", remeasured={"ratio_to_above": 1.25}),
            Row.not_run("+ c", "quick", "samples/s"), Row("+ d", 48.0, unit="samples/s")]
    train.speedups(rows, 16.0)
    assert [r.cumulative for r in rows] == [1.0, 2.0, 2.5, None, 3.0]
    assert rows[2].ratio == rows[2].cumulative
