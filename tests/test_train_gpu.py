"""Training on a CUDA GPU (`make test-gpu`, i.e. `pytest -m gpu`, which fails without a usable CUDA
device): the fp16 path (GradScaler with clipping, an overflow skipped then stepped, accumulation, the
scheduler, an injected inf, fused vs unfused optimizers, checkpoint/resume bit-exact with the same
scale), bf16 and torch.compile against fp32 eager, no host sync between reading points, TF32 and
cudnn.benchmark measured, and torchrun: NCCL with 2+ GPUs, a clear error on every rank (no hang)
when more processes than GPUs are launched. conftest.py puts back the backend flags a test sets."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from helpers import separable_loader
from torch import nn

from torchspeed.train import Callback, Checkpoint, Trainer, accelerate

pytestmark = pytest.mark.gpu  # without a usable CUDA device the GPU suite fails (conftest.py), never skips

FP16 = dict(precision="fp16", channels_last=False, compile=False, progress=False, device="cuda")


def _mlp(seed=0, dropout=0.0):
    """A two-layer MLP on 4x4 images (not the shared convnet): matmuls only, so fp16 and its GradScaler
    are what is exercised, with dropout to test the CUDA generator's restore."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 2))


def _data(n=128, batch=16):
    return separable_loader(n, batch, size=4, device="cuda")


def _grad_norm(model, x, y):
    """The fp32 gradient norm of one cross-entropy step on a copy of `model`."""
    ref = copy.deepcopy(model).float()
    nn.functional.cross_entropy(ref(x), y).backward()
    return torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()


def test_fp16_clipping_applies_to_the_unscaled_gradients():
    model = _mlp().cuda()
    x, y = next(iter(_data()))
    max_norm = _grad_norm(model, x, y) / 10  # below the true norm: the step must be clipped
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = accelerate(model, opt, precision="fp16", channels_last=False, compile=False, device="cuda")
    assert acc.scaler is not None and acc.scaler.get_scale() == 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    with acc.autocast():  # a realistic loss: its gradients times the initial scale 2^16 stay within fp16
        loss = nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    assert acc.step(opt, max_grad_norm=max_norm) is True  # step 1 is taken, not skipped for an overflow
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    # lr 1: the step is the clipped gradient; clipping the scaled gradients would give max_norm / 2^16
    assert delta.norm().item() == pytest.approx(max_norm, rel=1e-2)


def test_fp16_overflow_skips_the_step_and_the_next_one_steps():
    model = _mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate(model, opt, precision="fp16", channels_last=False, compile=False, device="cuda")
    x, y = next(iter(_data()))
    scale0 = acc.scaler.get_scale()
    before = [p.detach().clone() for p in model.parameters()]
    with acc.autocast():  # x 1e4 x 2^16: the fp16 logit gradients overflow
        loss = nn.functional.cross_entropy(model(x), y) * 1e4
    acc.backward(loss)
    assert acc.step(opt) is False
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # skipped: nothing changed
    assert acc.scaler.get_scale() == scale0 * 0.5  # backed off once
    with acc.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    assert acc.step(opt) is True
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("setting", [{"precision": "bf16"}, {"compile": True}])
def test_bf16_and_compile_train_like_fp32_eager(setting):
    """The same 8 steps in fp32 eager and with bf16 autocast / torch.compile: the weights stay close."""
    results = []
    for options in ({}, setting):
        model = _mlp(6)
        kw = {**FP16, "precision": "fp32", **options}
        tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **kw)
        res = tr.fit(_data(), epochs=1)
        assert res["step"] == 8 and res.get("skipped_steps", 0) == 0
        if options.get("compile"):
            assert tr.report.compile is True
        results.append([p.detach().float().clone() for p in tr.module.parameters()])
    tol = dict(rtol=5e-2, atol=5e-3) if setting.get("precision") == "bf16" else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol)


def test_fp16_accumulation_scheduler_and_an_injected_inf():
    big, small = _mlp(1), _mlp(1)
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.1), nn.functional.cross_entropy, **FP16).fit(
        _data(64, 32), epochs=1)
    Trainer(small, torch.optim.SGD(small.parameters(), lr=0.1), nn.functional.cross_entropy, grad_accum_steps=2,
            **FP16).fit(_data(64, 16), epochs=1)
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)  # fp16 rounding differs, the steps do not

    class InjectInf(Callback):  # an inf in one gradient, before the optimizer step of step 3
        def on_step_end(self, trainer, step, metrics):
            if step == 2:
                p = next(trainer.module.parameters())
                p.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("inf"))
                                if trainer.global_step == 2 else g)

    model = _mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tr = Trainer(model, opt, nn.functional.cross_entropy, scheduler=sched, callbacks=[InjectInf()], **FP16)
    scale0 = tr.prepare(_data()).scaler.get_scale()
    res = tr.fit(_data(), epochs=1)
    assert res["skipped_steps"] >= 1 and res["step"] == 8
    assert sched.last_epoch == res["step"] - res["skipped_steps"]  # the scheduler steps only on taken steps
    assert tr.acc.scaler.get_scale() < scale0  # lowered at the skipped step(s), never grown in 8 steps
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_fp16_fused_and_unfused_optimizers_agree(opt_cls):
    results = []
    for fused in (False, True):
        model = _mlp(3)
        opt = opt_cls(model.parameters(), lr=1e-2)
        tr = Trainer(model, opt, nn.functional.cross_entropy, accelerate_kwargs={"fused_optimizer": fused}, **FP16)
        res = tr.fit(_data(), epochs=2)
        assert (tr.report.optimizer == "fused") == fused
        results.append(([p.detach().clone() for p in model.parameters()], res["skipped_steps"],
                        tr.acc.scaler.get_scale()))
    (a, skipped_a, scale_a), (b, skipped_b, scale_b) = results
    assert skipped_a == skipped_b and scale_a == scale_b
    # Adam divides by the gradient's running size, so a rounding difference in a near-zero gradient can move
    # a weight by a fraction of the step: agreement within a tenth of one step (lr) there, tighter for SGD
    atol = 1e-3 if opt_cls is torch.optim.AdamW else 1e-5
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=atol)


def test_fp16_checkpoint_resume_is_bit_exact_with_the_same_scale(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # put back after the test

    def trainer(ck=None):
        model = _mlp(4, dropout=0.2)  # dropout: the CUDA generator must be restored too
        cbs = [Checkpoint(ck, every_n_steps=3)] if ck else []
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.functional.cross_entropy,
                       callbacks=cbs, **FP16)

    torch.manual_seed(0)
    straight = trainer()
    straight.fit(_data(), epochs=2)
    torch.manual_seed(0)
    trainer(tmp_path / "ck").fit(_data(), epochs=2, max_steps=5)
    torch.manual_seed(123)  # whatever the generators are now, resume restores them
    resumed = trainer(tmp_path / "ck")
    resumed.fit(_data(), epochs=2, resume="last")
    for a, b in zip(straight.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)
    assert straight.acc.scaler.get_scale() == resumed.acc.scaler.get_scale()
    assert straight.skipped_steps == resumed.skipped_steps


def test_no_host_sync_between_reading_points():
    class Watch(Callback):
        def on_step_end(self, trainer, step, metrics):
            # from the end of step 1 to the end of step 6: any sync raises
            torch.cuda.set_sync_debug_mode("error" if 1 <= step < 6 else 0)

    model = _mlp(5)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                 callbacks=[Watch()], log_every_n_steps=1000, precision="fp32", channels_last=False, compile=False,
                 progress=False, device="cuda")
    try:
        assert tr.fit(_data(), epochs=1)["step"] == 8
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_tf32_and_cudnn_benchmark_are_measured_on_this_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10))
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    try:
        acc = accelerate(model, None, precision="fp32", channels_last=False, compile=False, device="cuda",
                         example_batch=(x, y), loss_fn=nn.functional.cross_entropy)
        rows = {(r.setting, r.value): r for r in acc.report.candidates}
        if torch.cuda.get_device_capability()[0] >= 8:
            assert rows[("tf32", "True")].step_s > 0 and isinstance(acc.report.tf32, bool)
            assert torch.get_float32_matmul_precision() == ("high" if acc.report.tf32 else "highest")
        assert rows[("cudnn_benchmark", "True")].step_s > 0
        assert torch.backends.cudnn.benchmark is acc.report.cudnn_benchmark
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.benchmark = saved[1]


NCCL_SCRIPT = r'''
import os, sys
import torch
from torch import nn
import torch.distributed as dist
from torchspeed.runtime import seed_everything
from torchspeed.train import Checkpoint, Trainer

out = sys.argv[1]
rank = int(os.environ["RANK"])


def net(dropout=0.0):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))
    torch.manual_seed(100 + rank)
    return m


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 4, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(model, strategy, precision, ck=None):
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.functional.cross_entropy,
                   precision=precision, channels_last=False, compile=False, strategy=strategy, progress=False,
                   callbacks=[Checkpoint(ck, every_n_steps=2)] if ck else [])


# DDP on NCCL, per-rank CUDA dropout: resumed == straight, bit for bit
seed_everything(0)
tr = trainer(net(0.3), "auto", "fp32")
tr.fit(data(), epochs=2)
assert tr.report.strategy == "ddp" and tr.device == torch.device("cuda", int(os.environ["LOCAL_RANK"]))
straight = [p.detach().clone() for p in tr.module.parameters()]
ck = os.path.join(out, "ck")
seed_everything(0)
trainer(net(0.3), "auto", "fp32", ck).fit(data(), epochs=2, max_steps=3)
seed_everything(0)
tr = trainer(net(0.3), "auto", "fp32", ck)
tr.fit(data(), epochs=2, resume="last")
assert all(torch.equal(a, b) for a, b in zip(straight, tr.module.parameters())), rank

# FSDP2 in bf16 (MixedPrecisionPolicy), evaluated before training
seed_everything(0)
tr = trainer(net(), "fsdp", "bf16")
before = tr.evaluate(data())["val_loss"]
res = tr.fit(data(), data(), epochs=2)
assert "MixedPrecisionPolicy" in str(tr.report), tr.report
assert res["val_loss"] < before, (before, res)
dist.destroy_process_group()
print("ok", rank)
'''


def _torchrun(tmp_path, nproc, env, timeout=300):
    script = tmp_path / "nccl_train.py"
    script.write_text(NCCL_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           str(tmp_path)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung (killed after {e.timeout} s): {e.stderr!r:.2000}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_torchrun_nccl_ddp_and_fsdp(tmp_path):
    proc = _torchrun(tmp_path, 2, dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ok 0" in proc.stdout and "ok 1" in proc.stdout


ONE_RANK_SCRIPT = r'''
import os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torchspeed.train.checkpoint import load_sharded, save_sharded

# torchspeed's own setup leaves a world of 1 alone: the group is made here so NCCL, DDP, FSDP2 and DCP run
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
torch.manual_seed(0)
x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
ddp = DDP(nn.Linear(8, 3).cuda())
nn.functional.cross_entropy(ddp(x), y).backward()  # one all-reduce on NCCL
assert ddp.module.weight.grad is not None


def sharded():
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).cuda()
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


model, opt = sharded()
for _ in range(3):
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
path = save_sharded(sys.argv[1], 3, model, opt, {"run_id": "one-rank", "step": 3}, is_main=True)
fresh, fresh_opt = sharded()
load_sharded(path, fresh, fresh_opt)
for a, b in zip(model.parameters(), fresh.parameters()):
    assert torch.equal(a.full_tensor(), b.full_tensor())
nn.functional.cross_entropy(fresh(x), y).backward()
fresh_opt.step()  # the optimizer state loaded too: AdamW steps from step 3 on
dist.destroy_process_group()
print("ok")
'''


def test_one_process_nccl_ddp_fsdp_and_a_distributed_checkpoint_round_trip(tmp_path):
    """What one GPU can run of the distributed path: an NCCL group, a DDP all-reduce, FSDP2 shards and
    torchspeed's DCP checkpoint saved and loaded back (the 2-rank test needs 2 GPUs)."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
           str(tmp_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung (killed after {e.timeout} s)")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


def test_more_processes_than_gpus_is_a_clear_error_on_every_rank(tmp_path):
    n = torch.cuda.device_count() + 1
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # every process sees every GPU
    proc = _torchrun(tmp_path, n, env, timeout=180)  # a hang fails the test
    assert proc.returncode != 0
    # torchrun stops the other ranks at the first failure, so one message may be all that gets said there
    assert "processes would share a GPU" in proc.stderr, proc.stderr[-4000:]
    # so each rank is started alone with the environment torchrun gives it: each refuses before the
    # process group (waiting for the others there would hang it)
    script = tmp_path / "nccl_train.py"
    for rank in range(n):
        alone = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                 "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
        one = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                             timeout=120, env=alone)
        assert one.returncode != 0 and "processes would share a GPU" in one.stderr, (rank, one.stderr[-2000:])


AT_EXIT_SCRIPT = r'''
import atexit, os, sys
import torch
import torch.distributed as dist
from torchspeed.train import distributed

out, mode = sys.argv[1], sys.argv[2]
# registered before setup's own exit handler, so it runs after it: what the interpreter's finalisation finds
atexit.register(lambda: open(os.path.join(out, f"at_exit_{mode}"), "w").write(str(dist.is_initialized())))
distributed.setup(torch.device("cuda"))
t = torch.ones(2, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
if mode == "raise":
    raise RuntimeError("a rank's error after its collectives")
'''


def test_an_nccl_group_is_destroyed_at_a_clean_exit_and_kept_on_an_error(tmp_path):
    """The exit handler of `distributed.setup` on NCCL: a finished rank destroys its group and exits 0; a rank
    ending on an error leaves it (no graceful shutdown that could wait on peers) and still exits, unhung."""
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT_SCRIPT)
    for mode, ok, left in (("return", True, "False"), ("raise", False, "True")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
               str(tmp_path), mode]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"torchrun hung at exit ({mode}; killed after {e.timeout} s)")
        assert (proc.returncode == 0) == ok, (mode, proc.stderr[-3000:])
        assert (tmp_path / f"at_exit_{mode}").read_text() == left, mode
