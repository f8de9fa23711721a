"""build_directory: a cached directory appears whole or not at all, and leaves nothing behind."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from torchspeed.atomic import build_directory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_built_directory_is_whole_with_usual_permissions(tmp_path):
    def build(tmp):
        with open(os.path.join(tmp, "a.txt"), "w") as f:
            f.write("x")

    final = build_directory(tmp_path / "cache" / "thing", build)
    assert open(os.path.join(final, "a.txt")).read() == "x"
    mode = stat.S_IMODE(os.stat(final).st_mode)
    assert mode == 0o777 & ~_umask(), oct(mode)  # not mkdtemp's private 0700
    assert build_directory(final, lambda tmp: pytest.fail("rebuilt")) == final  # cached: not built again


def test_interrupted_build_leaves_nothing_and_stale_temporaries_are_cleaned(tmp_path):
    def fail(tmp):
        open(os.path.join(tmp, "half.txt"), "w").close()
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        build_directory(tmp_path / "thing", fail)
    assert os.listdir(tmp_path) == []
    dead = tmp_path / f".thing.build-{_dead_pid()}-abc"
    live = tmp_path / f".thing.build-{os.getppid()}-def"  # a running process: its build is left alone
    other = tmp_path / f".other.build-{_dead_pid()}-ghi"   # another directory's temporary: not ours to judge
    for d in (dead, live, other):
        d.mkdir()
    build_directory(tmp_path / "thing", lambda tmp: None)
    assert sorted(os.listdir(tmp_path)) == sorted([other.name, live.name, "thing"])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
