"""remembered.recall_or_measure, the one recall-or-measure-then-remember: a remembered value is used
only when it still decodes, a damaged entry is measured again, a busy or empty measurement is not
kept, and under torchrun rank 0's memory is every rank's (ranks.broadcast_json)."""
import json
import os
import textwrap

import pytest
from helpers import cpu_torchrun

from torchspeed import remembered
from torchspeed.ranks import DistEnv, env, world

PARTS = {"model": "m", "batch": [8, 3]}


class Counter:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def _decide(measure, decode=lambda m: m.decision["x"], busy=lambda v: False, encode=None, refresh=False,
            parts=PARTS):
    encode = encode or (lambda v: ({"x": v}, f"x={v}"))
    return remembered.recall_or_measure("testkind", parts, measure, decode=decode, encode=encode, busy=busy,
                                        refresh=refresh)


def test_measured_once_then_recalled_with_its_memory():
    measure = Counter(3)
    assert _decide(measure) == (3, None)
    value, memory = _decide(Counter(99))
    assert value == 3 and memory.figure == "x=3" and memory.describe().startswith("remembered from ")
    assert measure.calls == 1


def test_a_decision_that_no_longer_applies_or_does_not_decode_is_measured_again():
    _decide(Counter(3))
    assert _decide(Counter(4), decode=lambda m: None) == (4, None)  # no longer possible: measured, replaced
    assert _decide(Counter(5))[0] == 4
    assert _decide(Counter(6), decode=lambda m: m.decision["missing"]) == (6, None)  # KeyError: measured


def test_a_busy_or_empty_measurement_is_used_but_not_kept():
    assert _decide(Counter(3), busy=lambda v: True) == (3, None)
    assert _decide(Counter(4), encode=lambda v: None) == (4, None)
    assert remembered.recall("testkind", PARTS) is None


def test_refresh_measures_and_replaces_and_no_parts_keeps_nothing():
    _decide(Counter(3))
    assert _decide(Counter(7), refresh=True) == (7, None)
    assert _decide(Counter(8))[0] == 7
    assert _decide(Counter(9), parts=None) == (9, None)


@pytest.mark.parametrize("content", ["[]", "null", '"text"', "{", '{"version": 1}', "[" * 100000 + "]" * 100000])
def test_a_damaged_entry_of_any_shape_is_measured_again(content):
    _decide(Counter(3))
    path = remembered._path("testkind", PARTS)  # noqa: SLF001 - the test damages the file itself
    with open(path, "w") as f:
        f.write(content)
    assert _decide(Counter(4)) == (4, None)


def test_a_decision_with_a_wrong_type_is_refused_by_its_decoder():
    _decide(Counter(3))
    path = remembered._path("testkind", PARTS)  # noqa: SLF001
    data = json.load(open(path))
    data["decision"] = ["x", 3]
    with open(path, "w") as f:
        json.dump(data, f)
    assert _decide(Counter(4)) == (4, None)


def test_the_torchrun_identity_is_read_in_one_place(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert env() == DistEnv(4, 2, 0) and env().distributed and not env().is_main
    assert world() == (4, 2) and world(num_replicas=2) == (2, 2) and world(1, 0) == (1, 0)
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match="RANK='two'.*must be integers"):
        env()


SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch.distributed as dist
    from torchspeed import ranks, remembered
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["TORCHSPEED_CACHE"] = os.path.join(sys.argv[1], f"cache{rank}")  # rank 1 remembers nothing
    if rank == 0:
        remembered.remember("testkind", {"k": 1}, {"x": 41}, "x=41")
    calls = []
    value, memory = remembered.recall_or_measure(
        "testkind", {"k": 1}, lambda: calls.append(1) or rank, decode=lambda m: m.decision["x"],
        encode=lambda v: ({"x": v}, str(v)))
    again = ranks.broadcast_json({"from": rank, "list": [1, 2.5, None]})
    line = json.dumps({"rank": rank, "value": value, "measured": len(calls), "again": again}) + "\\n"
    sys.stdout.write(line)  # one write, flushed at once: the ranks share the pipe, their lines must not interleave
    sys.stdout.flush()
    dist.destroy_process_group()
''')


def test_under_torchrun_rank_0s_memory_is_every_ranks(tmp_path):
    proc = cpu_torchrun(SCRIPT, tmp_path, name="recall.py")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(d["rank"] for d in lines) == [0, 1]
    for d in lines:  # rank 1 had no memory of its own: it took rank 0's and measured nothing
        assert d["value"] == 41 and d["measured"] == 0 and d["again"] == {"from": 0, "list": [1, 2.5, None]}
    assert not os.path.exists(tmp_path / "cache1" / "decisions" / "testkind") or \
        not os.listdir(tmp_path / "cache1" / "decisions" / "testkind")  # only rank 0 writes
