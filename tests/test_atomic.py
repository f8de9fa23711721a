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


def test_scratch_dirs_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    from torchspeed.atomic import scratch_dir

    dead = tmp_path / f"optimize-{_dead_pid()}-abc"
    live = tmp_path / f"optimize-{os.getppid()}-def"
    for d in (dead, live):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"43 MB")
    scratch = scratch_dir(tmp_path, "optimize-")
    assert os.path.basename(scratch.name).startswith(f"optimize-{os.getpid()}-")
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, os.path.basename(scratch.name)])
    scratch.cleanup()
    assert os.listdir(tmp_path) == [live.name]


def _write_set(version, names):
    def write(tmp):
        for name in names:
            with open(os.path.join(tmp, name), "w") as f:
                f.write(f"{name} v{version}")
    return write


def _contents(d):
    return {n: (d / n).read_text() for n in sorted(os.listdir(d))}


def test_a_failed_publish_puts_the_previous_set_back_exactly(tmp_path, monkeypatch):
    """A write failing at any rename (a full disk) leaves the previous set as it was, and no temporaries."""
    from torchspeed.atomic import publish_files

    for step in range(1, 50):
        d = tmp_path / f"d{step}"
        publish_files(d, _write_set(1, ["a.bin", "b.bin", "last.json"]), last="last.json")
        (d / "user.txt").write_text("the user's own file")
        before = _contents(d)
        calls = {"n": 0}
        real = os.replace

        def replace(src, dst, _real=real):
            calls["n"] += 1
            if calls["n"] == step:
                raise OSError(28, "No space left on device")
            return _real(src, dst)

        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            try:
                publish_files(d, _write_set(2, ["a.bin", "c.bin", "last.json"]), last="last.json",
                              replaces=["a.bin", "b.bin"])
                failed = False
            except OSError:
                failed = True
        if failed:
            assert _contents(d) == before, step
        else:
            assert _contents(d) == {"a.bin": "a.bin v2", "c.bin": "c.bin v2", "last.json": "last.json v2",
                                    "user.txt": "the user's own file"}
            break
    assert step > 1
