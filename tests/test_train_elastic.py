"""Training that survives lost machines, under real torchrun launches on the CPU (gloo), each bounded:

- an elastic restart (`--max-restarts=1`) after one rank is SIGKILLed mid-epoch forms its process group
  again and ends bit-identical to an uninterrupted run (deterministic mode), with the steps redone and
  the time from the kill to training again recorded;
- two torchrun agents meeting through a c10d rendezvous ("two nodes") end bit-identical to two local
  ranks;
- a checkpoint written by 2 ranks resumes in 1 process and one written by 1 process under 2 ranks
  (DDP: the full state; FSDP2: resharded through torch.distributed.checkpoint);
- a rank that hangs is timed out (TORCHSPEED_DIST_TIMEOUT) and the restart ends identical; a node that
  never joins fails torchrun's rendezvous within its join timeout;
- the store exchange that gives every launch attempt keys of its own, and the process-group timeout.

The script every launch runs is tests/elastic_train.py."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchspeed.train import data_order, distributed

SCRIPT = os.path.join(os.path.dirname(__file__), "elastic_train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU and gloo, whatever the machine
LIMIT = 180  # seconds any one launch may take before the test fails it (a hang is never the outcome)


def _launch(out, *args, torchrun=("--standalone", "--nproc_per_node=2"), wait=True, env=None, ok=True):
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, SCRIPT, str(out), *args] if torchrun \
        else [sys.executable, SCRIPT, str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**ENV, **(env or {})})
    return _finish(proc, ok) if wait else proc


def _finish(proc, ok=True):
    try:
        out, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the launch hung (killed after {LIMIT} s): {out[-3000:]}")
    assert (proc.returncode == 0) == ok, out[-4000:]
    return out


def _events(out):
    with open(os.path.join(out, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two local ranks, never interrupted: the reference every other launch must equal."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _launch(out)
    return _weights(out)


def restart_figures(out):
    """(steps redone, seconds from the kill to training again) of a run killed once and restarted."""
    ev = _events(out)
    kill = next(e for e in ev if e["what"] == "kill")
    start = min((e for e in ev if e["what"] == "start" and e["attempt"] == 1), key=lambda e: e["t"])
    return kill["step"] - start["step"], start["t"] - kill["t"]


def test_elastic_restart_after_sigkill_ends_identical(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    log = _launch(out, "--kill", "step:5", torchrun=("--standalone", "--nproc_per_node=2", "--max-restarts=1"))
    run = json.loads((out / "ck" / "run.json").read_text())
    assert f"continuing the run in {out / 'ck'} (run {run['run_id']}) from its newest checkpoint (torchrun restart 1 " \
           f"of job {run['torchrun_job']})" in log
    ev = _events(out)
    assert [e["step"] for e in ev if e["what"] == "kill"] == [5]
    assert sorted(e["rank"] for e in ev if e["what"] == "start" and e["attempt"] == 1) == [0, 1]
    assert {e["step"] for e in ev if e["what"] == "start" and e["attempt"] == 1} == {4}  # the checkpoint of step 4
    assert {e["step"] for e in ev if e["what"] == "done"} == {16}
    _assert_same(_weights(out), uninterrupted)
    redone, seconds = restart_figures(out)
    assert redone == 1 and seconds > 0
    print(f"killed at step 5: {redone} step(s) redone, {seconds:.1f} s from the kill to training again")


def test_elastic_restart_after_sigkill_during_a_checkpoint_write(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    _launch(out, "--kill", "write:6", torchrun=("--standalone", "--nproc_per_node=2", "--max-restarts=1"))
    ev = _events(out)
    assert {e["step"] for e in ev if e["what"] == "start" and e["attempt"] == 1} == {4}  # step 6 never completed
    _assert_same(_weights(out), uninterrupted)
    assert not [n for n in os.listdir(out / "ck") if n.endswith(".tmp")]  # the torn write was cleaned up
    redone, seconds = restart_figures(out)
    print(f"killed writing the checkpoint of step 6: {redone} step(s) redone, {seconds:.1f} s from the kill to "
          "training again")


def test_a_rank_that_hangs_is_timed_out_and_the_restart_ends_identical(uninterrupted, tmp_path):
    out = tmp_path / "hung"
    log = _launch(out, "--kill", "hang:5", torchrun=("--standalone", "--nproc_per_node=2", "--max-restarts=1"),
                  env={"TORCHSPEED_DIST_TIMEOUT": "5"})
    assert "Timed out" in log or "timed out" in log  # the collective's timeout, named in rank 0's error
    assert {e["step"] for e in _events(out) if e["what"] == "start" and e["attempt"] == 1} == {4}
    _assert_same(_weights(out), uninterrupted)


def test_a_node_that_never_joins_fails_the_rendezvous_within_its_timeout(tmp_path):
    node = ("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--rdzv-id=alone", "--rdzv-conf=join_timeout=5")
    t0 = time.monotonic()
    log = _launch(tmp_path / "alone", torchrun=node, ok=False)
    assert "RendezvousTimeoutError" in log and time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "alone" / "ck")  # no worker started, nothing written


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(30, 34))
def test_kill_one_rank_at_a_random_step(uninterrupted, tmp_path, seed):
    import random

    step = random.Random(seed).randint(1, 15)  # 9, 1 (before the first checkpoint), 2, 10
    out = tmp_path / "killed"
    _launch(out, "--kill", f"step:{step}", torchrun=("--standalone", "--nproc_per_node=2", "--max-restarts=1"))
    _assert_same(_weights(out), uninterrupted)
    redone, seconds = restart_figures(out)
    print(f"killed at step {step}: {redone} step(s) redone, {seconds:.1f} s from the kill to training again")
    assert 1 <= redone <= 2  # killed before its step's checkpoint (every 2 steps): back to the one before


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_equal_two_local_ranks(uninterrupted, tmp_path):
    out = tmp_path / "nodes"
    node = ("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--rdzv-id=two-nodes", "--rdzv-conf=join_timeout=60")
    agents = [_launch(out, torchrun=node, wait=False) for _ in range(2)]
    for a in agents:
        _finish(a)
    ev = _events(out)
    assert sorted(e["rank"] for e in ev if e["what"] == "done") == [0, 1]
    _assert_same(_weights(out), uninterrupted)


def test_a_checkpoint_resumes_with_another_number_of_ranks(tmp_path):
    # 2 ranks -> 1 process: the epoch-end checkpoint of step 8 holds the full state (DDP)
    a = tmp_path / "two_then_one"
    _launch(a, "--max-steps", "8")
    _launch(a, torchrun=())
    ev = _events(a)
    assert [(e["world"], e["step"]) for e in ev if e["what"] == "start"] == [(2, 0), (2, 0), (1, 8)]
    assert [e["step"] for e in ev if e["what"] == "done" and e["world"] == 1] == [8 + 16]  # 16 batches of 8 alone
    # 1 process -> 2 ranks
    b = tmp_path / "one_then_two"
    _launch(b, "--max-steps", "16", torchrun=())
    _launch(b)
    ev = _events(b)
    assert [(e["world"], e["step"]) for e in ev if e["what"] == "start"] == [(1, 0), (2, 16), (2, 16)]
    assert {e["step"] for e in ev if e["what"] == "done" and e["world"] == 2} == {16 + 8}


# the DataLoader's run (17 s of torchrun launches) in the slow suite; FastLoader's, the harder case, in every run
@pytest.mark.parametrize("loader", [pytest.param("DataLoader", marks=pytest.mark.slow), "FastLoader"])
def test_an_epoch_begun_by_2_ranks_is_continued_by_1_then_2_reading_each_sample_once(tmp_path, loader):
    out, fast = tmp_path / "mid_epoch", ["--fast"] if loader == "FastLoader" else []
    _launch(out, "--max-steps", "5", *fast)  # 2 ranks: 5 of the 8 batches of epoch 1 each (80 of 128 samples)
    _launch(out, "--max-steps", "8", *fast, torchrun=())  # 1 process: 3 batches of what is left
    _launch(out, *fast)  # 2 ranks again: the epoch's last 24 samples, then epoch 2 as usual
    ev = _events(out)
    assert [(e["world"], e["step"]) for e in ev if e["what"] == "start"] == [(2, 0), (2, 0), (1, 5), (2, 8), (2, 8)]
    first = [i for e in ev if e["what"] == "samples" and e["epoch"] == 0 for i in e["indices"]]
    assert sorted(first) == list(range(128))  # every sample of the epoch once, across the three launches
    second = [i for e in ev if e["what"] == "samples" and e["epoch"] == 1 for i in e["indices"]]
    assert sorted(second) == list(range(128))
    assert {e["step"] for e in ev if e["what"] == "done"} >= {5, 8, 10 + 8}


@pytest.mark.slow  # 21 s of torchrun launches; DDP's resume with another number of ranks runs in every run
def test_an_fsdp_checkpoint_is_resharded_for_another_number_of_ranks(tmp_path):
    out = tmp_path / "fsdp"
    _launch(out, "--strategy", "fsdp", "--max-steps", "8")  # epoch 1 of 2, sharded over 2 ranks
    assert os.path.isfile(out / "ck" / "step-00000008" / ".metadata")
    _launch(out, "--epochs", "1", torchrun=())  # 1 process reads both shards (nothing is left to train)
    alone = _weights(out)
    _launch(out, "--strategy", "fsdp", "--epochs", "1")  # 2 ranks again: the same weights, resharded
    _assert_same(_weights(out), alone)
    _launch(out, "--strategy", "fsdp")  # and training goes on from them
    ev = _events(out)
    assert [(e["world"], e["step"]) for e in ev if e["what"] == "start"][2:] == [(1, 8), (2, 8), (2, 8), (2, 8), (2, 8)]
    assert [e["step"] for e in ev if e["what"] == "done"][-1] == 16
    assert any(not torch.equal(v, alone[k]) for k, v in _weights(out).items())


# ------------------------------------------------------------------ the epoch's samples over another world
@pytest.mark.parametrize("n,k,m,batches,drop", [(10, 3, 2, 1, False), (128, 2, 3, 5, False), (11, 2, 4, 2, True),
                                                (9, 1, 2, 2, False)])
def test_the_rest_of_an_epoch_is_split_so_each_unread_sample_is_read_once(n, k, m, batches, drop):
    from torch.utils.data import DistributedSampler

    order = {"n": n, "seed": 5, "shuffle": True, "epoch": 2, "world_size": k, "batch_size": 2,
             "sampler_drop_last": drop}
    read, in_epoch = set(), set()
    for r in range(k):  # what K ranks read in `batches` batches of 2, as DistributedSampler gave it to them
        s = DistributedSampler(range(n), num_replicas=k, rank=r, shuffle=True, seed=5, drop_last=drop)
        s.set_epoch(2)
        read |= set(list(s)[:batches * 2])
        in_epoch |= set(s)
    shares = [data_order.remaining_share(order, k * batches * 2, m, r) for r in range(m)]
    assert len({len(p) for p in shares}) == 1  # as many samples on every rank: none waits at the epoch's end
    together = [i for p in shares for i in p]
    assert set(together) == in_epoch - read  # every unread sample, none read before
    assert len(together) - len(set(together)) < m  # at most the padding is read twice
    assert data_order.remaining_share(order, n, m, 0) == []


# ------------------------------------------------------------------ the store exchange, the timeout
def _agree(port, world, ranks):
    """Ranks as threads, each with its own client of the store (as each process has)."""
    got, errors = {}, []

    def run(r):
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False)
            got[r] = distributed.attempt_generation(store, r, world, timedelta(seconds=20))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return got


def test_each_launch_attempt_forms_its_group_on_keys_of_its_own():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = _agree(server.port, 3, range(3))
    assert len(set(first.values())) == 1
    # a restart: the dead attempt's questions are still in the store, and rank 2 asks before rank 0 is back
    server.set("torchspeed/ask/1", "stale-nonce")
    second = _agree(server.port, 3, [2, 1, 0])
    assert len(set(second.values())) == 1 and set(second.values()) != set(first.values())


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not join .* s \(TORCHSPEED_DIST_TIMEOUT\)"):
        distributed.attempt_generation(server, 0, 2, timedelta(seconds=1))
    assert time.monotonic() - t0 < 10


def test_process_group_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHSPEED_DIST_TIMEOUT", raising=False)
    assert distributed.timeout() == timedelta(seconds=600)
    monkeypatch.setenv("TORCHSPEED_DIST_TIMEOUT", "45")
    assert distributed.timeout() == timedelta(seconds=45)
    for bad in ("0", "soon"):
        monkeypatch.setenv("TORCHSPEED_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="TORCHSPEED_DIST_TIMEOUT"):
            distributed.timeout()
