"""Training under a memory budget: `torchspeed train --memory-budget` plans the micro-batch and trains with
the accumulation that keeps --batch-size per optimizer step; a short last group of an epoch is averaged over
its own micro-batches; an out-of-memory error in training names its phase and the planner's suggestion;
under torchrun (2 ranks, gloo) every rank takes the smallest micro-batch."""
import json
import re

import pytest
import torch
from helpers import cpu_torchrun, separable_loader, tiny_convnet
from torch import nn

from torchspeed.cli import main
from torchspeed.train import Trainer
from torchspeed.train.memory_plan import plan_batch

FIXED = dict(precision="fp32", channels_last=False, compile=False, progress=False)

NET = '''
import torch
from torch import nn


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 3))
'''

CLI = ["--crop", "32", "--num-workers", "0", "--threads", "1", "--precision", "fp32", "--channels-last", "off",
       "--compile", "off", "--no-progress"]


def _budget_for(micro: float, batch: int) -> int:
    """A budget whose usable part (90%) lies at `micro` samples on the line the planner measures for the
    net of NET at the recipe's shapes (32x32 crops, 3 classes, SGD with momentum)."""
    namespace: dict = {}
    exec(NET, namespace)
    model = namespace["net"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5)
    example = (torch.randn(batch, 3, 32, 32), torch.randint(0, 3, (batch,)))
    free = plan_batch(model, opt, example, budget="1GiB", effective_batch=batch,
                      loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1))
    return int((free.fixed_bytes + free.per_sample_bytes * micro) / 0.9)


def test_cli_memory_budget_trains_micro_batches_with_the_effective_batch_kept(photo_folder, tmp_path, capsys):
    (tmp_path / "netfile.py").write_text(NET)
    budget = _budget_for(3, 8)  # micro-batch 2 fits, 4 does not: 2 x 4 accumulation = 8
    out = tmp_path / "run"
    assert main(["train", "--data", str(photo_folder), "--model", f"{tmp_path / 'netfile.py'}:net", "--epochs", "1",
                 "--batch-size", "8", "--memory-budget", str(budget), "--out", str(out), *CLI]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "memory plan: micro-batch 2 x 4 accumulation = 8" in printed
    assert "exactly --batch-size 8 samples per process" in printed and "probe steps" in printed
    s = json.loads((out / "summary.json").read_text())
    plan = s["memory_plan"]
    assert (plan["micro_batch"], plan["accumulation"], plan["effective_batch"]) == (2, 4, 8)
    assert plan["budget_bytes"] == budget and plan["predicted_peak_bytes"] <= 0.9 * budget
    assert s["batch_size"] == 8  # per process: the effective batch
    # 22 training images: 11 micro-batches of 2 (drop_last), in groups of 4: 3 optimizer steps
    assert s["step"] == 3


def test_cli_bad_memory_budgets_are_one_line(photo_folder, tmp_path, capsys):
    base = ["train", "--data", str(photo_folder), "--model", "resnet18", "--epochs", "1", *CLI]
    with pytest.raises(SystemExit):
        main([*base, "--memory-budget", "8 potatoes", "--out", str(tmp_path / "a")])
    assert "--memory-budget = '8 potatoes': give a size such as 8GiB" in capsys.readouterr().err
    assert main([*base, "--memory-budget", "1000TB", "--out", str(tmp_path / "c")]) == 2  # over the RAM
    err = capsys.readouterr().err
    assert "is more than this cpu's RAM" in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "c").exists()  # refused before its first step: OUT left as found
    assert main([*base, "--memory-budget", "1KB", "--out", str(tmp_path / "d")]) == 2
    assert "too small for even one sample" in " ".join(capsys.readouterr().err.split())


def test_a_short_last_accumulation_group_is_averaged_over_its_own_micro_batches():
    # 48 samples: batches of 32 without drop_last are 32 + 16; micro-batches of 16 in groups of 2 are (16, 16) + (16)
    big = tiny_convnet(seed=1)
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED).fit(
        separable_loader(48, 32), epochs=1)
    acc = tiny_convnet(seed=1)
    res = Trainer(acc, torch.optim.SGD(acc.parameters(), lr=0.1), nn.functional.cross_entropy, grad_accum_steps=2,
                  **FIXED).fit(separable_loader(48, 16), epochs=1)
    assert res["step"] == 2
    for a, b in zip(big.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _RunsOut(nn.Module):
    """A classifier whose forward (or backward) runs out of memory from its second call on."""

    def __init__(self, where: str):
        super().__init__()
        self.net, self.where, self.calls = tiny_convnet(), where, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1 and self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = self.net(x)
        return _FailingBackward.apply(out) if self.calls > 1 and self.where == "backward" else out


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 4611686018427387904 bytes")


class _StepRunsOut(torch.optim.SGD):
    def step(self, closure=None):
        raise torch.OutOfMemoryError("out of memory")


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer step"])
def test_out_of_memory_in_training_names_the_phase_and_the_suggestion(phase):
    model = _RunsOut(phase)
    opt = (_StepRunsOut if phase == "optimizer step" else torch.optim.SGD)(model.parameters(), lr=0.1)
    tr = Trainer(model, opt, nn.functional.cross_entropy, **FIXED)
    with pytest.raises(torch.OutOfMemoryError) as e:
        tr.fit(separable_loader(64, 16), epochs=1)
    line = str(e.value)
    assert line.startswith(f"out of memory during the {phase}: give the training a memory budget")
    assert "--memory-budget 8GiB" in line and "\n" not in line
    assert e.value.__cause__ is not None  # the allocator's own message stays in the chain


def test_out_of_memory_with_a_plan_names_the_plan():
    model = _RunsOut("forward")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(iter(separable_loader(64, 16)))
    plan = plan_batch(tiny_convnet(), None, (x, y), budget="1GiB", effective_batch=16)
    tr = Trainer(model, opt, nn.functional.cross_entropy, memory_plan=plan, **FIXED)
    assert tr.memory_plan is plan
    with pytest.raises(torch.OutOfMemoryError, match=rf"during the forward: the memory plan predicted .* at "
                                                     rf"micro-batch {plan.micro_batch} \(budget 1.00 GiB\)"):
        tr.fit(separable_loader(64, 16), epochs=1)


def test_a_runtime_error_that_is_not_out_of_memory_is_left_alone():
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("shapes do not match")

    model = nn.Sequential(Broken(), nn.Linear(2, 2))
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    with pytest.raises(RuntimeError, match="^shapes do not match$"):
        tr.fit(separable_loader(64, 16), epochs=1)


SCRIPT = r'''
import json, os, sys
import torch
from torch import nn
import torch.distributed as dist
from torchspeed.train import Trainer, plan_batch

out, budgets = sys.argv[1], [int(b) for b in sys.argv[2:]]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 3))


g = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 3, (64,), generator=g)
model = net()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
# each rank its own budget: rank 1's fits fewer samples, and every rank must take its micro-batch
try:
    plan = plan_batch(model, opt, (x[:8], y[:8]), budget=budgets[rank], effective_batch=8, device="cpu")
except ValueError as e:  # a budget that fits nothing: every rank must say so, none may wait for the others
    with open(os.path.join(out, f"error_{rank}.txt"), "w") as f:
        f.write(str(e))
    dist.destroy_process_group()
    sys.exit(0)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=plan.micro_batch)
tr = Trainer(model, opt, nn.functional.cross_entropy, precision="fp32", channels_last=False, compile=False,
             strategy="ddp", device="cpu", grad_accum_steps=plan.accumulation, memory_plan=plan, progress=False)
res = tr.fit(data, epochs=1)
with open(os.path.join(out, f"plan_{rank}.json"), "w") as f:
    json.dump({"micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
               "effective_batch": plan.effective_batch, "notes": plan.notes, "step": res["step"],
               "strategy": tr.report.strategy}, f)
dist.destroy_process_group()
'''


def test_every_rank_takes_the_smallest_micro_batch_under_torchrun(tmp_path):
    roomy, tight = _budget_for(8.5, 8), _budget_for(3, 8)  # rank 0 fits 8 samples, rank 1 only 2 of the divisors
    cpu_torchrun(SCRIPT, tmp_path, roomy, tight, name="plan_ranks.py")
    r0, r1 = (json.loads((tmp_path / f"plan_{r}.json").read_text()) for r in (0, 1))
    assert (r0["micro_batch"], r0["accumulation"]) == (r1["micro_batch"], r1["accumulation"]) == (2, 4)
    assert r0["effective_batch"] == r1["effective_batch"] == 8
    assert any("every rank takes micro-batch 2" in n for n in r0["notes"])  # rank 0 alone would have taken 8
    # 64 samples a rank, DDP's sampler halves them: 16 micro-batches of 2 a rank, in groups of 4
    assert r0["strategy"] == "ddp" and r0["step"] == r1["step"] == 4


def test_a_rank_whose_budget_fits_nothing_stops_every_rank_with_one_line(tmp_path):
    """Under torchrun a rank whose budget fits nothing raises its one line, and the ranks that did plan raise
    one naming it, instead of waiting for it in the agreement on the micro-batch."""
    cpu_torchrun(SCRIPT, tmp_path, _budget_for(8.5, 8), 1000, name="plan_ranks.py")
    e0, e1 = ((tmp_path / f"error_{r}.txt").read_text() for r in (0, 1))
    assert e0.startswith("rank 1 could not plan a micro-batch") and "\n" not in e0
    assert "memory budget" in e1 and "\n" not in e1 and not (tmp_path / "plan_0.json").exists()


SHARDED = r"""
import os, sys
import torch
from torch import nn
import torch.distributed as dist
from torchspeed.train import plan_batch
from torchspeed.train.memory_plan import NothingFits

out, budget = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
# 8 x 4 MiB of weights: with their gradients and AdamW's state about 134 MB a process, 67 MB sharded over 2
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 1024), torch.randint(0, 4, (8,))
before = {k: v.clone() for k, v in model.state_dict().items()}
try:
    plan_batch(model, opt, (x, y), budget=budget, effective_batch=8, device="cpu", checkpointing=False)
    msg = "planned"
except NothingFits as e:
    msg = str(e)
same = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not opt.state
with open(os.path.join(out, f"sharded_{rank}.txt"), "w") as f:
    f.write(f"{msg}\n{same}\n")
dist.destroy_process_group()
"""


def test_where_no_rank_fits_one_sample_sharding_is_measured(tmp_path):
    """Under torchrun, when one sample fits no rank, the model sharded over the ranks (FSDP, on a copy) is
    probed and timed: every rank's one line says which micro-batch fits sharded and at what measured speed,
    and the caller's model and optimizer are left as found."""
    # one sample needs about 136 MiB unsharded, 84-88 MiB a rank sharded (FSDP's overlapped gathers peak a
    # few MiB higher on a busy machine): the budget's usable 94.4 MiB is between the two, with room for that
    cpu_torchrun(SHARDED, tmp_path, 110_000_000, name="sharded.py")
    lines = [(tmp_path / f"sharded_{r}.txt").read_text().splitlines() for r in (0, 1)]
    fits = []
    for msg, same in lines:
        assert msg.startswith("memory budget 104.9 MiB") and "too small for even one sample" in msg, msg
        found = re.search(r"measured instead: sharded over 2 ranks \(FSDP, strategy='fsdp'\) micro-batch (\d+) "
                          r"fits: [\d.]+ MiB a rank predicted from probes at 2 and 4 samples .*, [\d.]+ ms a sample "
                          r"measured$", msg)
        assert found, msg
        fits.append(int(found.group(1)))
        assert same == "True"
    assert fits[0] == fits[1] and 8 % fits[0] == 0  # every rank the same divisor of the effective batch
