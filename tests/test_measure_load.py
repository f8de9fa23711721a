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
