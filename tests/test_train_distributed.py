"""torchrun on CPU (gloo): DDP matches a one-process run with the same global batch, and resumes
bit-exactly with each rank's own generators; FSDP2 evaluates before training, trains, checkpoints
(sharded, through torch.distributed.checkpoint) and resumes. One launch, forced onto the CPU (no
GPU is visible to it, device='cpu'), a bounded timeout. Device selection under torchrun
(`distributed.cuda_index`) is tested as a function."""
import json
import math
import os

import pytest
import torch
from helpers import cpu_torchrun
from torch import nn

from torchspeed.train import Trainer, distributed

SCRIPT = r'''
import json, os, sys
import torch
from torch import nn
import torch.distributed as dist
from torchspeed.runtime import seed_everything
from torchspeed.train import Checkpoint, EarlyStopping, Trainer, last_checkpoint

out = sys.argv[1]
rank = int(os.environ["RANK"])


def net():
    torch.manual_seed(0)  # same initial weights on every rank (no BatchNorm: its statistics are per rank)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 36, 4), nn.ReLU(), nn.Linear(4, 3))


def data(n=64, batch=8):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def trainer(model, strategy, ckdir=None):
    cbs = [EarlyStopping(patience=5)] + ([Checkpoint(ckdir, every_n_steps=2)] if ckdir else [])
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.functional.cross_entropy,
                   precision="fp32", channels_last=False, compile=False, strategy=strategy, callbacks=cbs,
                   progress=False, device="cpu")


def dropout_net():
    torch.manual_seed(0)  # same initial weights on every rank ...
    m = nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    torch.manual_seed(100 + rank)  # ... and each rank's own dropout masks
    return m


def full_state(tr):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(tr.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# 1. DDP (strategy "auto" under torchrun), checkpoints written by rank 0
seed_everything(0)
tr = trainer(net(), "auto", os.path.join(out, "ddp_ck"))
res = tr.fit(data(), data(), epochs=2)
assert tr.report.strategy == "ddp", tr.report
if rank == 0:
    torch.save({k: v.detach().clone() for k, v in tr.module.state_dict().items()}, os.path.join(out, "ddp.pt"))
with open(os.path.join(out, f"ddp_metrics_{rank}.json"), "w") as f:
    json.dump({"val_loss": res["val_loss"], "val_acc": res["val_acc"], "last": last_checkpoint(os.path.join(out, "ddp_ck"))}, f)

# 2. DDP with per-rank dropout: stopped mid-epoch, resumed in a fresh Trainer == straight, bit for bit
seed_everything(0)
tr = trainer(dropout_net(), "auto")
tr.fit(data(), epochs=2)
straight = {k: v.detach().clone() for k, v in tr.module.state_dict().items()}
ck = os.path.join(out, "ddp_drop_ck")
seed_everything(0)
trainer(dropout_net(), "auto", ck).fit(data(), epochs=2, max_steps=3)
seed_everything(0)
tr = trainer(dropout_net(), "auto", ck)
tr.fit(data(), epochs=2, resume="last")
for k, v in tr.module.state_dict().items():
    assert torch.equal(v, straight[k]), (rank, k)

# 3. FSDP2: evaluated before training (no_grad, not inference_mode), straight, then checkpointed and
# stopped mid-epoch, then resumed in a fresh Trainer
seed_everything(0)
tr = trainer(net(), "fsdp")
before = tr.evaluate(data())
tr.fit(data(), data(), epochs=2)
assert tr.report.strategy == "fsdp", tr.report
straight = full_state(tr)
ck = os.path.join(out, "fsdp_ck")
seed_everything(0)
trainer(net(), "fsdp", ck).fit(data(), data(), epochs=2, max_steps=5)
seed_everything(0)
tr = trainer(net(), "fsdp", ck)
res = tr.fit(data(), data(), epochs=2, resume="last")
resumed = full_state(tr)
if rank == 0:
    torch.save({"straight": straight, "resumed": resumed, "step": res["step"], "before": before["val_loss"]},
               os.path.join(out, "fsdp.pt"))
dist.destroy_process_group()
print("done", rank)
'''


def _net():
    """The torchrun script's `net()`, built here for the one-process reference run (the same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 36, 4), nn.ReLU(), nn.Linear(4, 3))


def _data(n=64, batch=16):
    """The script's `data()` at the global batch (2 ranks x 8): three classes of random labels."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def test_torchrun_ddp_and_fsdp_on_cpu(tmp_path):
    cpu_torchrun(SCRIPT, tmp_path, name="dist_train.py", timeout=300)  # CPU and gloo, whatever the machine

    # DDP with 2 x 8 per rank == one process with batch 16 (gradients averaged over the same 16 samples)
    model = _net()
    ref = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.functional.cross_entropy,
                  precision="fp32", channels_last=False, compile=False, progress=False)
    ref_res = ref.fit(_data(), _data(), epochs=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ddp[k], v, rtol=1e-4, atol=1e-5)
    m0, m1 = (json.loads((tmp_path / f"ddp_metrics_{r}.json").read_text()) for r in (0, 1))
    assert m0 == m1  # metrics all-reduced: every rank reports the same figures
    assert m0["val_loss"] == pytest.approx(ref_res["val_loss"], rel=1e-4)
    assert m0["last"].endswith("step-00000008.pt")

    # FSDP: sharded checkpoint directories, and the resumed run equals the straight one
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert fsdp["step"] == 8 and math.isfinite(fsdp["before"])
    for k, v in fsdp["straight"].items():
        torch.testing.assert_close(fsdp["resumed"][k], v, rtol=1e-5, atol=1e-6)
    moved = sum((fsdp["straight"][k] - v).abs().sum().item() for k, v in _net().state_dict().items())
    assert moved > 0.01  # it trained
    cks = sorted(p for p in os.listdir(tmp_path / "fsdp_ck") if p.startswith("step-"))
    assert cks and all(os.path.isfile(tmp_path / "fsdp_ck" / c / ".metadata") for c in cks)


def test_cuda_device_of_each_rank():
    # torchrun, one GPU per process: LOCAL_RANK
    assert [distributed.cuda_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    # SLURM-style: each task sees only its own GPU (CUDA_VISIBLE_DEVICES set per process): cuda:0
    assert distributed.cuda_index(3, 1, 4, visible_devices="3") == 0
    assert distributed.cuda_index(3, 2, 4, visible_devices="6,7") == 1
    # two processes on a one-GPU machine: a clear error on every rank (rank 0 too, so none waits)
    for r in (0, 1):
        with pytest.raises(ValueError, match=r"2 training processes on this node.*1 CUDA device.*nproc_per_node=1"):
            distributed.cuda_index(r, 1, 2)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        distributed.cuda_index(0, 0, 1)


def test_setup_picks_the_device_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="processes would share a GPU"):
        distributed.setup(torch.device("cuda"))
    chosen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # this process was given one GPU of its own
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    _, dev = distributed.setup(torch.device("cuda"))
    assert dev == torch.device("cuda", 0) and chosen == [dev]


def test_rng_states_of_every_rank_round_trip_through_a_checkpoint(tmp_path):
    from torchspeed.runtime import rng_state, set_rng_state
    from torchspeed.safeload import load_torch_file
    from torchspeed.ranks import DistEnv
    from torchspeed.train.resume import own_rng

    torch.manual_seed(1)
    mine = {"rng": rng_state(), "epoch_start_rng": None}
    assert distributed.gather_states(mine) == [mine]  # one process: its own
    torch.manual_seed(2)
    other = {"rng": rng_state(), "epoch_start_rng": rng_state()}
    path = tmp_path / "s.pt"
    torch.save({"rng": mine["rng"], "rng_ranks": [mine, other], "epoch_start": {"rng": mine["rng"]}}, path)
    state = load_torch_file(str(path), what="checkpoint")  # weights_only: tensors and plain types
    own = own_rng(state, DistEnv(world_size=2, rank=1, local_rank=1))
    set_rng_state(own["rng"])
    a = torch.rand(3)
    torch.manual_seed(2)
    assert torch.equal(a, torch.rand(3))  # rank 1 continues with rank 1's generators, not rank 0's
    assert torch.equal(own["epoch_start"]["rng"]["torch"], other["epoch_start_rng"]["torch"])
    assert own_rng(state, DistEnv(world_size=3, rank=1, local_rank=1)) is state


def test_each_rank_finds_its_generators_in_the_one_copy_a_checkpoint_keeps():
    from torchspeed.runtime import rng_state
    from torchspeed.ranks import DistEnv
    from torchspeed.train.resume import own_rng

    torch.manual_seed(1)
    r0 = {"rng": rng_state(), "epoch_start_rng": rng_state()}
    torch.manual_seed(2)
    r1 = {"rng": rng_state(), "epoch_start_rng": rng_state()}
    state = {"rng_ranks": [r0, r1], "epoch_start": {"generator": None}}  # as state_dict() writes it now
    assert "rng" not in state
    own = own_rng(state, DistEnv(world_size=2, rank=1, local_rank=1))
    assert torch.equal(own["rng"]["torch"], r1["rng"]["torch"])
    assert torch.equal(own["epoch_start"]["rng"]["torch"], r1["epoch_start_rng"]["torch"])
    assert not torch.equal(r0["rng"]["torch"], r1["rng"]["torch"])
    end = {"rng_ranks": [r0, r1], "epoch_start": None}  # epoch end: any number of ranks takes rank 0's
    for rank in range(3):
        own = own_rng(end, DistEnv(world_size=3, rank=rank, local_rank=rank))
        assert torch.equal(own["rng"]["torch"], r0["rng"]["torch"]) and own["epoch_start"] is None


AT_EXIT = r'''
import atexit, os, sys
import torch
import torch.distributed as dist
from torchspeed.train import distributed

out = sys.argv[1]
# registered before setup's handler, so it runs after it (atexit runs last-in, first-out): what the
# interpreter's finalisation will find
atexit.register(lambda: open(os.path.join(out, f"at_exit_{os.environ['RANK']}"), "w").write(str(dist.is_initialized())))
distributed.setup(torch.device("cpu"))
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [2.0, 2.0]
'''


def test_the_process_group_setup_formed_is_destroyed_before_the_interpreter_finalises(tmp_path):
    """gloo's worker threads left to the interpreter's finalisation can abort a rank that finished its work
    (SIGABRT), which torchrun counts as a failure: the group `distributed.setup` formed is destroyed at exit."""
    cpu_torchrun(AT_EXIT, tmp_path, name="at_exit.py", timeout=120)
    assert [(tmp_path / f"at_exit_{r}").read_text() for r in (0, 1)] == ["False", "False"]


def test_a_rank_ending_on_an_error_keeps_its_group_at_exit(monkeypatch):
    """An unhandled error (the interpreter sets sys.last_value before the exit handlers run): no graceful
    shutdown that could wait on peers still in a collective."""
    import sys

    import torch.distributed as dist

    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setattr(sys, "last_value", RuntimeError("a rank's error"), raising=False)
    distributed._destroy_at_exit()
    assert destroyed == []
    monkeypatch.delattr(sys, "last_value")
    distributed._destroy_at_exit()
    assert destroyed == [True]
