"""Faults in training and checkpoints, grouped by what is promised: one run per checkpoint directory
(another run's checkpoints are never deleted, resumed or overwritten; a used or unwritable --out fails
before any data is read), `train --out` never replaces a user's file, a resume with nothing of its run
to continue is refused, a run stopped by max_steps can be continued, every checkpoint verified (bit
flips and torn files named), nothing in a checkpoint runs, temp files of interrupted writes cleaned,
a SIGKILL during a checkpoint write loses nothing, metrics.csv keeps its integers, and a model with
the wrong number of class outputs is named before training.

The resume task, its straight run and the comparison come from test_train_resume (SIGKILL mid-epoch
then a bit-identical resume is tested there).
"""
import csv
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import test_train_resume as resume_tests
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.cli import main
from torchspeed.runtime import deterministic, seed_everything
from torchspeed.safeload import UnsafeFileError
from torchspeed.train import Checkpoint, Trainer, last_checkpoint, load_file
from torchspeed.train import checkpoint as ckpt

N, _assert_same = resume_tests.N, resume_tests._assert_same
task, straight = resume_tests.task, resume_tests.straight  # its fixtures: the resume task and its straight run

FAST = ["--crop", "32", "--batch-size", "8", "--num-workers", "0", "--threads", "1", "--precision", "fp32",
        "--channels-last", "off", "--compile", "off", "--no-progress"]
TINY = ["--model", os.path.join(os.path.dirname(__file__), "helpers.py") + ":tiny_convnet", "--model-kwargs"]


class NeverRead:
    """A loader that fails the test if anything iterates it."""

    def __len__(self):
        return 8

    def __iter__(self):
        raise AssertionError("data was read before the checkpoint directory was checked")


def _steps(d, run_id=None):
    return [s for s, _ in ckpt.list_checkpoints(d, run_id)]


def _files(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if n.startswith("step-")}


def _one_line(capsys):
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture
def no_data_read(monkeypatch):
    """Fail the test if the recipe splits (reads) its data; yields a function that lets it read again."""
    import torchspeed.recipes

    real = torchspeed.recipes.train_val_split

    def never(*a, **k):
        raise AssertionError("data was read")

    monkeypatch.setattr(torchspeed.recipes, "train_val_split", never)
    yield lambda: monkeypatch.setattr(torchspeed.recipes, "train_val_split", real)


def _copy_checkpoint(src_dir, step, dst_dir):
    for n in (f"step-{step:08d}.pt", f"step-{step:08d}.pt.json"):
        shutil.copyfile(src_dir / n, dst_dir / n)
    return dst_dir / f"step-{step:08d}.pt"


# ------------------------------------------------------------------ one run per checkpoint directory
def test_new_run_into_used_directory_refuses_then_overwrite_starts_clean(task, tmp_path):
    d = tmp_path / "ck"
    old, train, val = task.build(d, every=1)
    old.fit(train, val, epochs=3, max_steps=12)  # the earlier run: steps 11 and 12 kept
    assert _steps(d) == [11, 12]
    before = _files(d)

    new, train, val = task.build(d, every=1)
    with pytest.raises(ValueError) as e:
        new.fit(NeverRead(), val, epochs=3, max_steps=2)  # refused before any data is read
    msg = str(e.value)
    assert repr(str(d)) in msg and "resume" in msg and "overwrite" in msg
    assert _files(d) == before and load_file(last_checkpoint(d))["global_step"] == 12  # nothing lost

    # overwrite: a clean start; the new run's checkpoints survive its own pruning, though the deleted
    # run's step numbers were higher
    new, train, val = task.build(None, extra=[Checkpoint(d, every_n_steps=1, keep_last=2, overwrite=True)])
    new.fit(train, val, epochs=3, max_steps=3)
    assert _steps(d) == [2, 3] and ckpt.read_run(d) == new.run_id != old.run_id
    assert not (d / "step-00000011.pt").exists() and not (d / "step-00000012.pt.json").exists()
    assert load_file(last_checkpoint(d))["run_id"] == new.run_id


def test_resume_and_pruning_see_only_their_own_run(task, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tr, train, val = task.build(a, every=1)
    tr.fit(train, val, epochs=3, max_steps=3)
    other, train, val = task.build(b, every=1)
    other.fit(train, val, epochs=3, max_steps=9)
    for n in ("step-00000009.pt", "step-00000009.pt.json"):  # another run's newer checkpoint lands in a
        (a / n).write_bytes((b / n).read_bytes())
    assert _steps(a) == [2, 3] and _steps(a, other.run_id) == [9]

    tr2, train, val = task.build(a, every=1)
    tr2.fit(train, val, epochs=3, max_steps=5, resume="last")
    assert tr2.run_id == tr.run_id and tr2.global_step == 5  # resumed step 3 of its own run, not step 9
    assert _steps(a) == [4, 5] and (a / "step-00000009.pt").is_file()  # pruning left the other run alone


def test_cli_train_into_used_out(task, tmp_path, photo_folder, no_data_read, capsys):
    out = tmp_path / "run"
    old, train, val = task.build(out / "checkpoints", every=1)
    old.fit(train, val, epochs=3, max_steps=12)  # an earlier run with higher step numbers
    before = _files(out / "checkpoints")
    fast = ["--model", "mobilenet_v3_small", "--crop", "32", "--batch-size", "8", "--num-workers", "0",
            "--threads", "1", "--precision", "fp32", "--channels-last", "off", "--compile", "off", "--no-progress"]
    assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(out), *fast]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert repr(str(out)) in err and "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert _files(out / "checkpoints") == before

    assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(out), "--resume",
                 "--overwrite", *fast]) == 2
    assert "give one of them" in capsys.readouterr().err

    blocked = tmp_path / "file.txt"
    blocked.write_text("not a directory")
    assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(blocked / "run"), *fast]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert repr(str(blocked / "run")) in err and "cannot be written" in err and "Traceback" not in err
    assert blocked.read_text() == "not a directory"

    no_data_read()  # lets the data be read again
    assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(out), "--overwrite", *fast]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["step"] == 22 // 8 and s["checkpoint"].endswith(f"step-{s['step']:08d}.pt")  # the new run's own
    assert os.path.isfile(s["checkpoint"]) and s["run_id"] == ckpt.read_run(out / "checkpoints") != old.run_id


# ------------------------------------------------------------------ train --out never replaces a user's file
def test_train_out_holding_a_users_file_is_refused_and_the_file_kept(tmp_path, photo_folder, no_data_read, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.pt").write_bytes(b"my own weights")
    for flags in ([], ["--overwrite"]):
        assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(out), *TINY, '{"classes": 3}',
                     *flags, *FAST]) == 2
        err = _one_line(capsys)
        assert "'model.pt'" in err and "never replaced" in err and "Traceback" not in err
    assert os.listdir(out) == ["model.pt"] and (out / "model.pt").read_bytes() == b"my own weights"


def test_train_out_records_what_it_wrote_and_adopts_an_unmarked_earlier_run(tmp_path, photo_folder, capsys):
    from torchspeed.outputs import MARKER

    out = tmp_path / "run"
    args = ["train", "--data", str(photo_folder), "--epochs", "2", "--out", str(out), *TINY, '{"classes": 3}', *FAST]
    assert main([*args, "--max-steps", "1"]) == 0
    written = ["checkpoints", "metrics.csv", "model.pt", "summary.json"]
    assert json.loads((out / MARKER).read_text())["written"] == written
    (out / MARKER).unlink()  # as a folder written before the marker existed
    assert main([*args, "--max-steps", "2", "--resume"]) == 0  # adopted: it is torchspeed's, and continued
    assert json.loads((out / MARKER).read_text())["written"] == written
    assert json.loads((out / "summary.json").read_text())["step"] == 2


# ------------------------------------------------------------------ resume says what it does
def test_resume_with_nothing_to_continue_is_refused_before_any_data_is_read(task, tmp_path, photo_folder,
                                                                         no_data_read, capsys):
    typo, empty = tmp_path / "typo", tmp_path / "empty"
    empty.mkdir()
    for out, says in ((typo, "does not exist"), (empty, "does not exist")):
        assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(out), "--resume",
                     *TINY, '{"classes": 3}', *FAST]) == 2
        err = _one_line(capsys)
        assert repr(str(out)) in err and says in err and "drop --resume" in err and "Traceback" not in err
    assert not typo.exists() and os.listdir(empty) == []

    tr, _, val = task.build(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="does not exist, so there is no checkpoint to continue"):
        tr.fit(NeverRead(), val, epochs=1, resume="last")  # the API refuses too, before any data is read
    assert not (tmp_path / "ck").exists()


def test_another_runs_checkpoint_is_named_never_resumed_never_overwritten(task, tmp_path, photo_folder, no_data_read,
                                                                          capsys):
    a, b = tmp_path / "run" / "checkpoints", tmp_path / "b"
    mine, train, val = task.build(a, every=1)
    mine.fit(train, val, epochs=3, max_steps=2)
    other, train, val = task.build(b, every=1)
    other.fit(train, val, epochs=3, max_steps=5)
    copied = _copy_checkpoint(b, 5, a)
    before = copied.read_bytes()

    # the resumed run would save step 5 itself: refused before training, naming the copy
    tr, train, val = task.build(a, every=1)
    with pytest.raises(ValueError, match="step-00000005.pt.*never overwritten"):
        tr.fit(train, val, epochs=3, max_steps=6, resume="last")
    assert _steps(a, mine.run_id) == [1, 2] and copied.read_bytes() == before
    with pytest.raises(ckpt.CheckpointError, match="never overwritten"):  # a save never replaces it either
        ckpt.save_file(copied, {"format": ckpt.FORMAT, "run_id": mine.run_id, "global_step": 5})
    assert copied.read_bytes() == before

    # none of the directory's own run left: --resume names the copy and refuses, never starting at step 0
    for step in (1, 2):
        os.unlink(a / f"step-{step:08d}.pt")
        os.unlink(a / f"step-{step:08d}.pt.json")
    assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(a.parent), "--resume",
                 *TINY, '{"classes": 3}', *FAST]) == 2
    err = _one_line(capsys)
    assert f"step-00000005.pt (run {other.run_id})" in err and "never resumed or overwritten" in err
    assert "Traceback" not in err and copied.read_bytes() == before
    tr, _, val = task.build(a, every=1)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint of its run {mine.run_id}"):
        tr.fit(NeverRead(), val, epochs=3, max_steps=6, resume="last")
    assert copied.read_bytes() == before and ckpt.read_run(a) == mine.run_id


def test_a_run_stopped_by_max_steps_checkpoints_where_it_stopped(task, straight, tmp_path):
    deterministic(True)
    try:
        tr, train, val = task.build(tmp_path, every=None)  # checkpoints at epoch ends only: 8 batches an epoch
        tr.fit(train, val, epochs=3, max_steps=3)
        assert _steps(tmp_path) == [3]
        seed_everything(7)
        tr, train, val = task.build(tmp_path, every=None)
        assert tr.fit(train, val, epochs=3, max_steps=N, resume="last")["step"] == N
        _assert_same(tr.module.state_dict(), straight[0])  # continued from step 3, as if never stopped
    finally:
        deterministic(False)


# ------------------------------------------------------------------ every checkpoint verified
def _big_run(d, max_steps, resume=None):
    """Two optimizer steps of a 64 MiB model: a large checkpoint is verified like any other."""
    seed_everything(0)
    model = nn.Linear(4096, 4096, bias=False)  # 4096 * 4096 * 4 bytes = 64 MiB
    x = torch.randn(4, 4096)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=2)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), nn.functional.mse_loss, precision="fp32",
                 channels_last=False, compile=False, callbacks=[Checkpoint(d, every_n_steps=1, keep_last=2)],
                 progress=False)
    tr.fit(loader, epochs=1, max_steps=max_steps, resume=resume)
    return tr


def test_bit_flip_in_a_64mib_checkpoint_is_caught_and_resume_falls_back(tmp_path, caplog):
    d = tmp_path / "ck"
    tr = _big_run(d, 2)
    good, bad = d / "step-00000001.pt", d / "step-00000002.pt"
    assert bad.stat().st_size >= 64 << 20
    weights_1 = load_file(good)["model"]
    data = bytearray(bad.read_bytes())
    mid = len(data) // 2 // 4096 * 4096
    data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])  # a flipped 4 KiB block
    bad.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="corrupt") as e:
        load_file(bad)
    assert repr(str(bad)) in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        tr.load_checkpoint(bad)  # an explicit path: refused, not replaced

    with caplog.at_level(logging.WARNING, logger="torchspeed.train"):
        tr2 = _big_run(d, 1, resume="last")  # the newest fails its check: the one before is loaded
    assert tr2.global_step == 1
    _assert_same(tr2.module.state_dict(), weights_1)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(bad) in warned and "before it instead" in warned


def test_torn_checkpoints_are_named_and_none_good_is_an_error(task, tmp_path, caplog):
    tr, train, val = task.build(tmp_path, every=1)
    tr.fit(train, val, epochs=1, max_steps=4)
    three, four = tmp_path / "step-00000003.pt", tmp_path / "step-00000004.pt"
    four.write_bytes(four.read_bytes()[:-3000])  # torn: the end is missing
    with pytest.raises(ckpt.CheckpointError, match="truncated") as e:
        load_file(four)
    assert repr(str(four)) in str(e.value)
    assert last_checkpoint(tmp_path) == str(three)  # never listed as complete
    with caplog.at_level(logging.WARNING, logger="torchspeed.train"):
        tr2, train, val = task.build(tmp_path, every=1)
        tr2.fit(train, val, epochs=1, max_steps=3, resume="last")
    assert tr2.global_step == 3 and str(four) in caplog.text

    data = bytearray(three.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    three.write_bytes(bytes(data))
    tr3, train, val = task.build(tmp_path, every=1)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .* passes its check") as e:
        tr3.fit(train, val, epochs=1, max_steps=5, resume="last")
    assert str(three) in str(e.value) and str(four) in str(e.value)
    os.unlink(str(three) + ".json")  # and one without its record
    with pytest.raises(ckpt.CheckpointError, match="cannot be verified"):
        load_file(three)


# ------------------------------------------------------------------ nothing in a checkpoint runs
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # loading with pickle would create the marker file


def test_malicious_pickle_in_a_checkpoint_is_refused_and_runs_nothing(task, tmp_path):
    tr, train, val = task.build(tmp_path, every=2)
    tr.fit(train, val, epochs=1, max_steps=2)
    path = tmp_path / "step-00000002.pt"
    state = load_file(path)
    marker = tmp_path / "pwned"
    state["evil"] = _Evil(str(marker))
    torch.save(state, path)
    rec = json.loads((tmp_path / "step-00000002.pt.json").read_text())
    rec["files"]["step-00000002.pt"] = ckpt._hash_file(str(path))  # even with a record that matches
    (tmp_path / "step-00000002.pt.json").write_text(json.dumps(rec))
    for attempt in (lambda: load_file(path), lambda: tr.fit(train, val, epochs=1, max_steps=4, resume=path),
                    lambda: task.build(tmp_path)[0].fit(train, val, epochs=1, max_steps=4, resume="last")):
        with pytest.raises(UnsafeFileError) as e:
            attempt()
        assert repr(str(path)) in str(e.value) and "weights_only=False" not in str(e.value)
    assert not marker.exists()


# ------------------------------------------------------------------ temp files of interrupted writes
def test_stale_temps_are_cleaned_only_when_no_live_process_holds_the_directory(task, tmp_path):
    tr, train, val = task.build(tmp_path, every=2)
    tr.fit(train, val, epochs=1, max_steps=2)
    stale = [tmp_path / ".step-00000004.pt.x1y2.tmp", tmp_path / ".step-00000004.pt.json.abcd.tmp"]
    for p in stale:
        p.write_bytes(b"PK\x03\x04 partial")
    (tmp_path / ".step-00000006.tmp").mkdir()  # a sharded write's temp directory
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")

    fd = os.open(tmp_path / ".lock", os.O_RDWR)  # as if another live process trained here
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ValueError, match="in use by another training process"):
            tr.fit(train, val, epochs=1, max_steps=4, resume="last")
        assert all(p.exists() for p in stale)  # a live writer's temp files are left alone
    finally:
        os.close(fd)
    tr.fit(train, val, epochs=1, max_steps=4, resume="last")
    assert not any(p.exists() for p in stale) and not (tmp_path / ".step-00000006.tmp").exists()
    assert keep.read_text() == "mine" and _steps(tmp_path) == [2, 4]


# ------------------------------------------------------------------ SIGKILL during a checkpoint write
CHILD = r'''
import os, sys, time
import torch
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import resume_task
from torchspeed.runtime import deterministic

K = int(sys.argv[4])
real_save = torch.save


class Stalls:
    """Passes the first bytes through, then announces itself and waits to be killed mid-write."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def write(self, b):
        if self.n > 4096:
            print("mid-write", flush=True)
            time.sleep(600)
        self.n += memoryview(b).nbytes
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def save(obj, f, *a, **kw):
    if isinstance(obj, dict) and obj.get("global_step") == K:
        f = Stalls(f)
    return real_save(obj, f, *a, **kw)


torch.save = save
deterministic(True)
tr, train, val = resume_task.build(sys.argv[2])
tr.fit(train, val, epochs=3, max_steps=int(sys.argv[3]))
'''


def test_sigkill_during_a_checkpoint_write_loses_nothing(task, straight, tmp_path):
    child, d, k = tmp_path / "child.py", tmp_path / "ck", 5
    child.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(child), task.PATH, str(d), str(N), str(k)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.strip() == "mid-write":
                os.kill(proc.pid, signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "the child did not reach the write in time"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    temps = [n for n in os.listdir(d) if n.startswith(f".step-{k:08d}.pt.") and n.endswith(".tmp")]
    assert temps  # the half-written file, hidden
    assert not (d / f"step-{k:08d}.pt").exists()
    assert last_checkpoint(d) == str(d / f"step-{k - 1:08d}.pt")
    assert load_file(last_checkpoint(d))["global_step"] == k - 1  # the previous checkpoint still loads

    deterministic(True)
    try:
        seed_everything(7)
        tr, train, val = task.build(d)
        tr.fit(train, val, epochs=3, max_steps=N, resume="last")
        _assert_same(tr.module.state_dict(), straight[0])  # bit-identical to the run never killed
    finally:
        deterministic(False)
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]  # the dead process's temp file is gone


# ------------------------------------------------------------------ metrics and class outputs
def test_metrics_csv_keeps_integers_after_resume(tmp_path):
    log = tmp_path / "metrics.csv"

    def trainer():
        model = tiny_convnet(classes=2)
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                       callbacks=[Checkpoint(tmp_path / "ck", every_n_steps=1)], log_path=log, log_every_n_steps=2,
                       **FIXED)

    trainer().fit(separable_loader(64, 16), separable_loader(32, 16), epochs=2, max_steps=3)
    first = log.read_text().splitlines()[1]
    trainer().fit(separable_loader(64, 16), separable_loader(32, 16), epochs=2, resume="last")
    lines = log.read_text().splitlines()
    rows = list(csv.DictReader(lines))
    assert lines[1] == first and [r["step"] for r in rows] == ["2", "4", "4", "6", "8", "8"]
    assert all(r["epoch"].isdigit() and r["step"].isdigit() for r in rows)


FIXED = dict(precision="fp32", channels_last=False, compile=False, progress=False)


class Named(torch.utils.data.TensorDataset):
    classes = ["cat", "dog", "fox"]


def test_a_model_with_too_few_class_outputs_is_named_before_training(tmp_path, photo_folder, capsys):
    x = torch.randn(24, 3, 8, 8)
    three = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.arange(24) % 3), batch_size=12)
    for settings in (FIXED, dict(FIXED, channels_last="auto")):  # given settings, and measured ones (trials)
        model = tiny_convnet(classes=2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), **settings)
        with pytest.raises(ValueError, match=r"gives 2 output\(s\) per sample .* a label is 2.* 3 outputs"):
            tr.fit(three, epochs=1)
        _assert_same(model.state_dict(), before)
    named = torch.utils.data.DataLoader(Named(x[:12], torch.arange(12) % 2), batch_size=12)  # labels 0 and 1 only
    model = tiny_convnet(classes=2)
    with pytest.raises(ValueError, match="gives 2 output.* the data has 3 classes"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED).fit(named)
    model = tiny_convnet(classes=2)  # a loss that does not index by label (embeddings, regression) is left alone
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: out.pow(2).mean(), **FIXED).fit(three)

    for width in (2, 4):  # torchspeed train: too few outputs, or more than the data's classes
        assert main(["train", "--data", str(photo_folder), "--epochs", "1", "--out", str(tmp_path / f"w{width}"),
                     *TINY, json.dumps({"classes": width}), *FAST]) == 2
        err = _one_line(capsys)
        assert f"gives {width} output(s) per sample" in err and "the data has 3 classes" in err
        assert "Traceback" not in err and not (tmp_path / f"w{width}" / "model.pt").exists()


# ------------------------------------------------------------------ a full disk, a changed model, a refused run
def _error_lines(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("torchspeed: error:")]


def test_a_full_disk_while_a_checkpoint_is_written_is_one_line_and_the_older_checkpoints_stay(
        tmp_path, photo_folder, monkeypatch, capsys):
    """A full disk while a checkpoint is written is one line naming the file (not torch's "[enforce fail at
    inline_container.cc] unexpected pos" traceback). The disk fills during the second checkpoint."""
    import contextlib
    import errno

    real, saves = ckpt.atomic_write, []

    class Full:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            self.written += memoryview(b).nbytes
            if self.written > 1024:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def full_after_the_first(path, mode="wb"):
        with real(path, mode) as f:
            checkpoint = os.path.basename(path).startswith("step-") and path.endswith(".pt")
            saves.extend([path] if checkpoint else [])
            yield Full(f) if checkpoint and len(saves) > 1 else f

    monkeypatch.setattr(ckpt, "atomic_write", full_after_the_first)
    out = tmp_path / "run"
    argv = ["-q", "train", "--data", str(photo_folder), "--epochs", "2", "--out", str(out), *TINY, '{"classes": 3}',
            *FAST]
    assert main(argv) == 2
    (line,) = _error_lines(capsys)
    assert repr(saves[1]) in line and "No space left on device" in line and "--resume" in line, line
    assert len(saves) == 2 and load_file(saves[0])["global_step"] == 2  # the checkpoint before it is whole
    assert not os.path.exists(saves[1]) and not [n for n in os.listdir(out / "checkpoints") if n.endswith(".tmp")]
    monkeypatch.undo()  # space freed: the run continues from the checkpoint before
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 4


def test_resume_with_a_changed_model_is_one_line_naming_the_file_and_the_first_mismatch(tmp_path, photo_folder,
                                                                                         capsys):
    out = tmp_path / "run"
    argv = ["-q", "train", "--data", str(photo_folder), "--out", str(out), *FAST, *TINY]
    assert main([*argv, '{"classes": 3}', "--epochs", "1"]) == 0
    capsys.readouterr()
    assert main([*argv, '{"classes": 3, "width": 4}', "--epochs", "2", "--resume"]) == 2
    (line,) = _error_lines(capsys)
    assert "step-00000002.pt" in line and "does not fit this model" in line, line
    assert "'0.weight' is [8, 3, 3, 3] in it and [4, 3, 3, 3] in the model" in line, line


def test_a_refused_train_leaves_its_out_as_it_found_it(tmp_path, photo_folder, capsys):
    """A refused `train` leaves --out as it found it: no marker, no empty checkpoints/."""
    import pathlib

    one_class = tmp_path / "one-class" / "cat"
    one_class.mkdir(parents=True)
    shutil.copy(next(pathlib.Path(photo_folder).glob("*/*.jpg")), one_class)
    mine = tmp_path / "mine"
    mine.mkdir()
    for data, model, says in ((one_class.parent, TINY + ['{"classes": 3}'], str(one_class.parent)),
                              (photo_folder, ["--model", "no_such_model"], "no_such_model")):
        for out in (tmp_path / "new", mine):
            assert main(["-q", "train", "--data", str(data), "--epochs", "1", "--out", str(out), *model, *FAST]) == 2
            (line,) = _error_lines(capsys)
            assert says in line, line
            assert not (tmp_path / "new").exists() and os.listdir(mine) == []


def test_a_learning_rate_of_nan_or_inf_is_refused():
    from torchspeed.recipes import ClassifierOptions

    for lr in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="--lr = .*: it must be a positive, finite number"):
            ClassifierOptions(epochs=1, lr=lr)


@pytest.mark.parametrize("edit", ["no-files", "other-file-only", "outside", "absolute", "deep", "not-a-hash",
                                  "huge", "nan", "list"])
def test_a_damaged_checkpoint_record_is_never_taken_as_verified(task, tmp_path, edit):
    """A record is read as data: one that lists no file of its checkpoint (which would verify nothing),
    names a file outside it, or is malformed, deeply nested or huge makes its checkpoint incomplete:
    never listed, and `load_file` names it."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 10)
    d = tmp_path / "ck"
    tr, train, val = task.build(d, every=1)
    tr.fit(train, val, epochs=1, max_steps=2)
    two = d / "step-00000002.pt"
    record = d / "step-00000002.pt.json"
    rec = json.loads(record.read_text())
    entry = rec["files"]["step-00000002.pt"]
    text = {"no-files": lambda: json.dumps({**rec, "files": {}}),
            "other-file-only": lambda: json.dumps({**rec, "files": {"step-00000001.pt": entry}}),
            "outside": lambda: json.dumps({**rec, "files": {**rec["files"], "../outside.bin": entry}}),
            "absolute": lambda: json.dumps({**rec, "files": {**rec["files"], str(outside): entry}}),
            "deep": lambda: "[" * 100_000 + "]" * 100_000,
            "not-a-hash": lambda: json.dumps({**rec, "files": {"step-00000002.pt": {**entry, "sha256": "abc"}}}),
            "huge": lambda: json.dumps({**rec, "padding": " " * (2 << 20)}),
            "nan": lambda: json.dumps(rec).replace(f'"bytes": {entry["bytes"]}', '"bytes": NaN'),
            "list": lambda: "[]"}[edit]()
    record.write_text(text)
    assert last_checkpoint(d) == str(d / "step-00000001.pt")  # the damaged one is never listed
    with pytest.raises(ckpt.CheckpointError, match="cannot be verified") as e:
        load_file(two)
    assert repr(str(two)) in str(e.value)
