"""A busy machine is noticed: other processes' CPU while compare() times is recorded and worded."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import another_process_spinning

from torchspeed import measure

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc"),
              pytest.mark.real_load]  # the load of other processes, as it is (conftest fakes a quiet machine)


def test_another_process_spinning_during_compare_is_counted():
    with another_process_spinning():
        c = measure.compare({"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.01)}, repeats=10)
    assert c.others_cores is not None and c.others_cores > 0.5  # the loop alone uses about one core
    assert "busy" in measure.busy_warning(c.others_cores) and c.to_dict()["others_cores"] == c.others_cores


def test_this_process_trees_own_work_is_not_counted_as_others():
    """This process and a child spin; what OthersLoad calls other processes' is the machine's busy time over
    the same seconds less this tree's own (os.times: this process and its reaped child), however busy the
    machine is."""
    t0, machine0, mine0 = time.perf_counter(), measure.machine_busy_cpu_seconds(), os.times()
    load = measure.OthersLoad()
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() - t < 0.6: pass"])
    spun = time.process_time()
    while time.process_time() - spun < 0.6:  # this process spins too
        pass
    child.wait()
    others = load.cores()
    wall, machine, mine = time.perf_counter() - t0, measure.machine_busy_cpu_seconds() - machine0, os.times()
    own = sum(b - a for a, b in zip(mine0[:4], mine[:4]))  # user + system, of this process and its children
    assert others is not None and own >= 0.6
    assert others * wall == pytest.approx(machine - own, abs=0.25)  # the ~1 CPU-second we spun is not others'


def test_busy_warning_words_only_real_load():
    assert measure.busy_warning(None) is None
    assert measure.busy_warning(measure.BUSY_CORES / 2) is None
    assert "1.2 of" in measure.busy_warning(1.2)


def test_the_job_is_torchruns_agent_tree_when_it_started_several_local_ranks(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert measure.job_root_pid() == os.getpid()  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    assert measure.job_root_pid() == os.getppid()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert measure.job_root_pid() == os.getpid()  # a single local rank: its own tree is the job


# an "agent" starting a spinning rank and a measuring rank, as torchrun starts local ranks. The measuring rank
# reads the load twice over the same seconds, as a torchrun rank (TORCHELASTIC_RUN_ID set: the agent's tree is
# the job) and as a plain process, and reads the spinning sibling's own CPU time: the load of the machine's other
# processes (a busy machine's included) is the same in both readings, so they differ by the sibling alone,
# whose CPU time the rank waits for (a busy machine gives it a small share of a core).
_RANK = r"""
import os, time
from torchspeed import measure
sibling = int(os.environ["SIBLING"])
time.sleep(0.3)
os.environ["TORCHELASTIC_RUN_ID"] = "run"
job = measure.OthersLoad()
del os.environ["TORCHELASTIC_RUN_ID"]
alone = measure.OthersLoad()
t0, spun0 = time.perf_counter(), measure.process_tree_cpu_seconds(sibling)
spun = 0.0
while spun < 0.5 and time.perf_counter() - t0 < 60:  # until the sibling used half a CPU-second, busy machine or not
    time.sleep(0.25)
    spun = measure.process_tree_cpu_seconds(sibling) - spun0
under_torchrun, plain, wall = job.cores(), alone.cores(), time.perf_counter() - t0
print(plain * wall, under_torchrun * wall, spun)  # CPU-seconds over the same wall time
"""
_AGENT = r"""
import os, subprocess, sys
spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    rank = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True, check=True,
                          env=dict(os.environ, LOCAL_WORLD_SIZE="2", SIBLING=str(spin.pid)))
finally:
    spin.kill()
print(rank.stdout.strip())
"""


def test_other_local_ranks_are_the_jobs_own_load_not_other_processes():
    out = subprocess.run([sys.executable, "-c", _AGENT, _RANK], capture_output=True, text=True, check=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    plain, under_torchrun, sibling = map(float, out.stdout.split())  # CPU-seconds
    assert sibling >= 0.5  # the sibling spun
    assert plain - under_torchrun == pytest.approx(sibling, abs=0.15)  # the same sibling, the job's own as a rank
