"""Checkpoints and exact resume: in process, after a real SIGKILL, and with partial writes on disk."""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from torchspeed.runtime import deterministic, seed_everything
from torchspeed.train import Checkpoint, Trainer, last_checkpoint, load_file
from torchspeed.train import checkpoint as ckpt

# The task is a file so a subprocess and this test build exactly the same run. Its data augmentation
# draws from the global torch RNG and the model has dropout, so a resume that restored the wrong RNG
# state, replayed the wrong batches or lost the optimizer/scheduler state would give other weights.
TASK = r'''
import sys, time
import torch
from torch import nn
from torchspeed.runtime import seed_everything
from torchspeed.train import Callback, Checkpoint, EarlyStopping, Trainer


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n=96):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 2, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.3 * torch.randn(2, 6, 6), self.y[i]  # augmentation from the global RNG


def build(ckdir=None, seed=0, every=1, extra=()):
    seed_everything(seed)
    model = nn.Sequential(nn.Conv2d(2, 6, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(6 * 16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    train = torch.utils.data.DataLoader(Noisy(), batch_size=12, shuffle=True,
                                        generator=torch.Generator().manual_seed(seed))
    val = torch.utils.data.DataLoader(Noisy(24), batch_size=12)
    cbs = [EarlyStopping(patience=50), *extra]
    if ckdir:
        cbs.append(Checkpoint(ckdir, every_n_steps=every, keep_last=2))
    tr = Trainer(model, opt, nn.functional.cross_entropy, precision="fp32", channels_last=False, compile=False,
                 scheduler=sched, callbacks=cbs, progress=False)
    return tr, train, val


class Announce(Callback):
    def on_step_end(self, trainer, step, metrics):
        print(f"step {step}", flush=True)
        time.sleep(0.15)


if __name__ == "__main__":
    from torchspeed.runtime import deterministic
    deterministic(True)
    tr, train, val = build(sys.argv[1], extra=[Announce()])
    tr.fit(train, val, epochs=3, max_steps=int(sys.argv[2]))
'''

N = 20  # optimizer steps; 8 batches per epoch, so runs cross epoch boundaries


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "resume_task.py"
    path.write_text(TASK)
    spec = importlib.util.spec_from_file_location("resume_task", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.PATH = str(path)
    return mod


@pytest.fixture(scope="module")
def straight(task):
    deterministic(True)
    try:
        tr, train, val = task.build()
        tr.fit(train, val, epochs=3, max_steps=N)
        return {k: v.clone() for k, v in tr.module.state_dict().items()}, tr.global_step
    finally:
        deterministic(False)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("k", [11, 8])  # mid-epoch, and exactly at an epoch end
def test_resume_in_process_matches_a_straight_run(task, straight, tmp_path, k):
    deterministic(True)
    try:
        tr, train, val = task.build(tmp_path, every=k)
        tr.fit(train, val, epochs=3, max_steps=k)
        assert last_checkpoint(tmp_path).endswith(f"step-{k:08d}.pt")
        seed_everything(12345)  # a new "process": its RNG state differs until the checkpoint restores it
        tr2, train2, val2 = task.build(tmp_path, seed=0)
        torch.manual_seed(999)
        out = tr2.fit(train2, val2, epochs=3, max_steps=N, resume="last")
        assert out["step"] == N
        _assert_same(tr2.module.state_dict(), straight[0])
        assert tr2.callbacks[0].checks == 2  # EarlyStopping's count came back from the checkpoint
    finally:
        deterministic(False)


def test_resume_auto_starts_a_new_run_then_continues_it_exactly(task, straight, tmp_path, caplog):
    """One script for the first attempt and every restart: resume="auto" starts when the directory holds
    no checkpoint of its run, and continues from the newest one when it does, saying which."""
    import logging

    deterministic(True)
    try:
        with caplog.at_level(logging.INFO, logger="torchspeed"):
            tr, train, val = task.build(tmp_path, every=7)
            assert tr.fit(train, val, epochs=3, max_steps=7, resume="auto")["step"] == 7
            assert "starting a new run" in caplog.text
            caplog.clear()
            seed_everything(12345)
            tr2, train2, val2 = task.build(tmp_path, seed=0)
            out = tr2.fit(train2, val2, epochs=3, max_steps=N, resume="auto")
            assert "continuing the run" in caplog.text
        assert out["step"] == N
        _assert_same(tr2.module.state_dict(), straight[0])
    finally:
        deterministic(False)


def test_checkpoints_of_older_versions_resume_exactly(task, straight, tmp_path):
    """Older versions kept rank 0's generators at the top level too (`rng`, `epoch_start["rng"]`),
    the oldest there only: both layouts still resume bit-exactly; one with no RNG state is refused."""
    deterministic(True)
    try:
        tr, train, val = task.build(tmp_path / "run", every=11)
        tr.fit(train, val, epochs=3, max_steps=11)  # mid-epoch: epoch-start generators matter too
        state = load_file(last_checkpoint(tmp_path / "run"))
        mine = state["rng_ranks"][0]
        older = {**state, "rng": mine["rng"], "epoch_start": {**state["epoch_start"], "rng": mine["epoch_start_rng"]}}
        oldest = {k: v for k, v in older.items() if k != "rng_ranks"}
        none = {k: v for k, v in state.items() if k != "rng_ranks"}
        for name, old in (("older", older), ("oldest", oldest), ("none", none)):
            path = tmp_path / f"{name}.pt"
            ckpt.save_file(path, old)
            seed_everything(12345)
            tr2, train2, val2 = task.build(seed=0)
            if name == "none":
                with pytest.raises(ValueError, match=f"{name}.pt.*holds no RNG state"):
                    tr2.fit(train2, val2, epochs=3, max_steps=N, resume=path)
                continue
            assert tr2.fit(train2, val2, epochs=3, max_steps=N, resume=path)["step"] == N
            _assert_same(tr2.module.state_dict(), straight[0])
    finally:
        deterministic(False)


def test_sigkill_then_resume_gives_identical_parameters(task, straight, tmp_path):
    proc = subprocess.Popen([sys.executable, task.PATH, str(tmp_path), str(N)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed_after = None
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= 6:
                os.kill(proc.pid, signal.SIGKILL)  # no clean-up, no atexit: as a crash
                killed_after = int(line.split()[1])
                break
            assert time.monotonic() < deadline, "the child did not reach step 6 in time"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_after is not None, proc.stderr.read()
    assert proc.returncode == -signal.SIGKILL
    found = ckpt.list_checkpoints(tmp_path)
    # Announce runs before the Checkpoint callback: the kill lands before, during or after step k's write
    assert found and killed_after - 1 <= found[-1][0] < N
    deterministic(True)
    try:
        seed_everything(7)
        tr, train, val = task.build(tmp_path)
        tr.fit(train, val, epochs=3, max_steps=N, resume="last")
        _assert_same(tr.module.state_dict(), straight[0])
    finally:
        deterministic(False)


def test_interrupted_write_is_never_last(task, tmp_path, monkeypatch):
    tr, train, val = task.build(tmp_path, every=2)
    tr.fit(train, val, epochs=1, max_steps=4)
    good = last_checkpoint(tmp_path)
    assert good.endswith("step-00000004.pt")
    state = load_file(good)  # weights_only=True: tensors and plain types only
    assert state["global_step"] == 4 and isinstance(state["rng_ranks"][0]["rng"]["numpy"]["keys"], torch.Tensor)

    real_save = torch.save

    def dies_midway(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # e.g. Ctrl-C (or a crash) during the write

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        tr.save_checkpoint(tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    # what a SIGKILL mid-write leaves: a hidden temp file; and a truncated file copied in by hand
    (tmp_path / ".step-00000006.pt.abc.tmp").write_bytes(b"PK\x03\x04 partial")
    (tmp_path / "step-00000009.pt").write_bytes(open(good, "rb").read()[:1000])
    assert last_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="corrupt, truncated"):
        load_file(tmp_path / "step-00000009.pt")


def test_keep_last_and_bad_resume_paths(task, tmp_path):
    tr, train, val = task.build(tmp_path, every=1)
    tr.fit(train, val, epochs=1, max_steps=5)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tr.fit(train, epochs=1, resume=tmp_path / "nope.pt")
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        tr.fit(train, epochs=1, resume=tmp_path / "other")
    with pytest.raises(ValueError, match="needs a Checkpoint callback"):
        Trainer(tr.module, tr.optimizer, torch.nn.functional.cross_entropy, precision="fp32", channels_last=False,
                compile=False, progress=False).fit(train, epochs=1, resume="last")


def test_fast_loader_mid_epoch_resume(tmp_path, photo_folder):
    from torch import nn

    from torchspeed.data import fast_loader

    def build(ckdir):
        seed_everything(0)
        loader = fast_loader(str(photo_folder), 8, train=True, crop=16, device="cpu", num_workers=0, seed=3)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return Trainer(model, opt, nn.functional.cross_entropy, precision="fp32", channels_last=False, compile=False,
                       callbacks=[Checkpoint(ckdir, every_n_steps=1)], progress=False), loader

    tr, loader = build(tmp_path / "a")
    tr.fit(loader, epochs=2)
    ref = tr.module.state_dict()
    tr, loader = build(tmp_path / "b")
    tr.fit(loader, epochs=2, max_steps=len(loader) + 2)  # stop mid-way through epoch 2
    tr, loader = build(tmp_path / "b")
    tr.fit(loader, epochs=2, resume="last")
    _assert_same(tr.module.state_dict(), ref)
