"""A busy machine is noticed: other processes' CPU while compare() times is recorded and worded."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import another_process_spinning

from torchspeed import measure

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")


def test_another_process_spinning_during_compare_is_counted():
    with another_process_spinning():
        c = measure.compare({"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.01)}, repeats=10)
    assert c.others_cores is not None and c.others_cores > 0.5  # the loop alone uses about one core
    assert "busy" in measure.busy_warning(c.others_cores) and c.to_dict()["others_cores"] == c.others_cores


def test_this_process_trees_own_work_is_not_counted_as_others():
    load = measure.OthersLoad()
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() - t < 0.6: pass"])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.6:  # this process spins too
        pass
    child.wait()
    own = load.cores()
    assert own is not None
    # both spinners are ours: what is left is other processes' load, well under the ~2 cores we just used
    assert own < 1.5


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


# an "agent" starting a spinning rank and a measuring rank, as torchrun starts local ranks
_AGENT = r"""
import os, subprocess, sys
env = dict(os.environ, LOCAL_WORLD_SIZE="2", **({"TORCHELASTIC_RUN_ID": "run"} if sys.argv[1] == "torchrun" else {}))
spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"], env=env)
rank = subprocess.run([sys.executable, "-c", "import time\nfrom torchspeed import measure\ntime.sleep(0.5)\n"
                       "load = measure.OthersLoad()\ntime.sleep(1.5)\nprint(load.cores())"],
                      env=env, capture_output=True, text=True, check=True)
spin.wait()
print(rank.stdout.strip())
"""


def test_other_local_ranks_are_the_jobs_own_load_not_other_processes():
    def others(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _AGENT, mode], capture_output=True, text=True, check=True,
                             timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return float(out.stdout.strip().splitlines()[-1])

    plain, under_torchrun = others("plain"), others("torchrun")
    assert plain > 0.5  # the spinning sibling: another process's core
    assert under_torchrun < plain - 0.5  # the same sibling as a local rank of the same torchrun job
