"""Memory on a GPU (`pytest -m gpu`): the planner's predicted peak against the peak CUDA's caching allocator
reads for a real step (plain and with blocks checkpointed), and doctor's breakdown read from that allocator."""
import gc

import pytest
import torch
import torchvision
from helpers import separable_loader
from torch import nn

from torchspeed.bench.gpt_model import GPT, GPTConfig, random_tokens
from torchspeed.doctor import profiling
from torchspeed.memory import CUDA_ALLOCATOR, MemoryWatch
from torchspeed.train.checkpointing import blocks_checkpointed
from torchspeed.train.memory_plan import plan_batch, slice_batch

pytestmark = pytest.mark.gpu  # without a usable CUDA device the GPU suite fails (conftest.py), never skips


def _step(model, optimizer, part):
    x, y = (t.to("cuda") for t in part)
    out = model(x, y) if isinstance(model, GPT) else model(x)
    loss = out[1] if isinstance(model, GPT) else nn.functional.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measured(model, optimizer, batch, micro, checkpointed=0):
    part = slice_batch(batch, micro)
    gc.collect()  # as the planner does before its probes: the allocator's peak counts garbage too
    with blocks_checkpointed(model, checkpointed):
        _step(model, optimizer, part)  # the optimizer's state made
        watch = MemoryWatch("cuda", held=(model, optimizer))
        with watch:
            _step(model, optimizer, part)
    assert watch.reading.source == CUDA_ALLOCATOR
    return watch.reading.peak_bytes


def _resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), (
        torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,)))


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg).cuda()
    return model, torch.optim.AdamW(model.parameters()), random_tokens(32, cfg)


@pytest.mark.parametrize("build", [_resnet, _gpt])
def test_the_plan_predicts_the_cuda_allocators_peak_within_ten_percent(build):
    model, opt, batch = build()
    free = plan_batch(model, opt, batch, budget="8GiB", effective_batch=256, device="cuda", checkpointing=False)
    budget = int((free.fixed_bytes + free.per_sample_bytes * 40) / 0.9)  # binds between the probes and 256
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=256, device="cuda", checkpointing=False,
                      refresh=True)
    assert plan.source == CUDA_ALLOCATOR and len(plan.probes) <= 3
    assert plan.micro_batch * plan.accumulation == 256
    measured = _measured(model, opt, batch, plan.micro_batch)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.1 * measured and measured <= budget, (
        plan.predicted_peak_bytes, measured, budget, plan.probes)


def test_a_checkpointed_plan_on_cuda_stays_under_its_budget():
    model, opt, batch = _gpt()
    free = plan_batch(model, opt, batch, budget="8GiB", effective_batch=256, device="cuda", checkpointing=False)
    budget = int((free.fixed_bytes + free.per_sample_bytes * 24) / 0.9)
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=256, device="cuda", checkpointing=True,
                      refresh=True)
    assert len(plan.probes) <= 3 and sum(r.decision == "kept" for r in plan.table) == 1, (plan.probes, plan.notes)
    measured = _measured(model, opt, batch, plan.micro_batch, plan.checkpointed)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.1 * measured and measured <= budget * 0.9


def test_doctor_reads_where_a_steps_memory_goes_from_the_cuda_allocator():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 256), nn.ReLU(), nn.Linear(256, 2)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    r = profiling.profile(model, separable_loader(64, 16, size=4), opt, nn.CrossEntropyLoss(), steps=2, warmup=1)
    m = r.to_dict()["memory"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m["source"] == CUDA_ALLOCATOR and sum(m["parts"].values()) == m["peak_bytes"]
    assert m["parts"]["parameters"] == params and m["parts"]["optimizer_state"] >= 2 * params


def test_trial_steps_keep_their_copy_of_the_state_off_the_gpu():
    from torchspeed.train.step_timer import trial_state_kept

    model, opt, batch = _resnet()
    _step(model, opt, batch)  # momentum to keep
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    before = torch.cuda.memory_allocated()
    with trial_state_kept(model, opt):
        inside = torch.cuda.memory_allocated()  # a copy on the GPU would count in every probe measured here
        _step(model, opt, batch)
    assert inside - before < weights / 10
    for p, m in zip(model.parameters(), momentum):
        assert p.is_cuda and opt.state[p]["momentum_buffer"].is_cuda
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
