"""The memory planner: predicted peaks against measured ones on a ResNet, a GPT and a Hugging Face model,
the accumulation arithmetic, the budget kept over many steps, and bad budgets named in one line."""
from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from torchspeed.args import byte_size
from torchspeed.bench.gpt_model import GPT, GPTConfig, random_tokens
from torchspeed.memory import MemoryWatch, device_capacity
from torchspeed.train.checkpointing import SavedByBlock, blocks_checkpointed
from torchspeed.train.memory_plan import oom_message, plan_batch, slice_batch


def _measured_peak(model, optimizer, batch, micro, step):
    """The peak of one real step at `micro` (after a first step made the optimizer's state)."""
    part = slice_batch(batch, micro)
    step(model, optimizer, part)
    watch = MemoryWatch("cpu", held=(model, optimizer, part))
    with watch:
        step(model, optimizer, part)
    return watch.reading.peak_bytes


def _xy_step(model, optimizer, batch):
    """A loop's step, which holds the model's output through the backward (for its metrics)."""
    x, y = batch
    out = model(x, y) if isinstance(model, GPT) else model(x)
    loss = out[1] if isinstance(model, GPT) else nn.functional.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _hf_step(model, optimizer, batch):
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), (
        torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters()), random_tokens(16, cfg)


def _bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=64, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    batch = {"input_ids": torch.randint(0, 500, (16, 32)), "attention_mask": torch.ones(16, 32, dtype=torch.long),
             "labels": torch.randint(0, 3, (16,))}
    return model, torch.optim.AdamW(model.parameters()), batch


@pytest.mark.parametrize("build,step", [(_resnet, _xy_step), (_gpt, _xy_step), (_bert, _hf_step)],
                         ids=["resnet18", "gpt", "bert"])
def test_predicted_peak_within_ten_percent_of_the_measured_one(build, step):
    model, opt, batch = build()
    free = plan_batch(model, opt, batch, budget=device_capacity("cpu")[0] // 2, effective_batch=48,
                      checkpointing=False)
    # a budget that binds between the probes' sizes and the effective batch
    budget = int((free.fixed_bytes + free.per_sample_bytes * 20) / 0.9)
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=48, checkpointing=False, refresh=True)
    assert len(plan.probes) <= 3 and plan.linear
    assert plan.micro_batch * plan.accumulation == 48 and 48 % plan.micro_batch == 0
    assert plan.predicted_peak_bytes <= budget * 0.9
    measured = _measured_peak(model, opt, batch, plan.micro_batch, step)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.1 * measured
    assert plan.source == "cpu allocator (profiler)" and "probe steps" in plan.measured


def test_grows_past_the_example_batch_and_leaves_the_model_as_found():
    model, opt, batch = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_batch(model, opt, batch, budget="1GiB", effective_batch=64, checkpointing=False)
    assert (plan.micro_batch, plan.accumulation) == (64, 1)  # more than the 16 samples of the example
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_the_effective_batch_is_kept_exactly_with_a_divisor():
    model, opt, batch = _resnet()
    free = plan_batch(model, opt, batch, budget="2GiB", effective_batch=42, checkpointing=False)
    budget = int((free.fixed_bytes + free.per_sample_bytes * 9.5) / 0.9)  # 9 fit; 42's divisors below: 7, 6, 3...
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=42, checkpointing=False, refresh=True)
    assert (plan.micro_batch, plan.accumulation) == (7, 6)
    assert any("divides the effective batch 42" in n for n in plan.notes)
    micro = list(plan.micro_batches(slice_batch(batch, 42)))
    assert len(micro) == 6 and all(m[0].shape[0] == 7 for m in micro)


def test_the_chosen_micro_batch_stays_under_the_budget_for_a_thousand_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters())
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    plan = plan_batch(model, opt, batch, budget="2MB", effective_batch=64)
    part = slice_batch(batch, plan.micro_batch)
    watch = MemoryWatch("cpu", held=(model, opt, part))
    with watch:
        for _ in range(1000):
            _xy_step(model, opt, part)
    assert watch.reading.peak_bytes <= byte_size("2MB", "budget")
    assert plan.micro_batch * plan.accumulation == 64


def _checkpointed_peak(model, optimizer, batch, micro, checkpointed):
    with blocks_checkpointed(model, checkpointed):
        return _measured_peak(model, optimizer, batch, micro, _xy_step)


def test_checkpointing_is_measured_against_accumulation_and_remembered(caplog):
    model, opt, batch = _gpt()
    free = plan_batch(model, opt, batch, budget="1GiB", effective_batch=32, checkpointing=False)
    budget = int((free.fixed_bytes + free.per_sample_bytes * 14) / 0.9)  # 16 fits with the first block checkpointed
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=32, checkpointing=True, refresh=True)
    assert len(plan.probes) <= 3 and "configurations measured in the warm-up step of their timing" in plan.measured
    assert len(plan.table) >= 2 and sum(r.decision == "kept" for r in plan.table) == 1
    kept = next(r for r in plan.table if r.decision == "kept")
    assert (plan.micro_batch, plan.checkpointed) == (kept.micro_batch, kept.checkpointed)
    assert all(r.micro_batch * r.accumulation == 32 and r.sample_s > 0 for r in plan.table)
    measured = _checkpointed_peak(model, opt, batch, plan.micro_batch, plan.checkpointed)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.1 * measured
    assert measured <= budget
    again = plan_batch(model, opt, batch, budget=budget, effective_batch=32, checkpointing=True)
    assert again.remembered and not again.probes and again.micro_batch == plan.micro_batch


def test_a_configuration_measured_over_the_budget_is_left_out(monkeypatch):
    model, opt, batch = _gpt()
    free = plan_batch(model, opt, batch, budget="1GiB", effective_batch=32, checkpointing=False)
    budget = int((free.fixed_bytes + free.per_sample_bytes * 6) / 0.9)  # 4 fits plain, 8 only checkpointed
    counted = SavedByBlock.freed
    monkeypatch.setattr(SavedByBlock, "freed", lambda self, k: 3 * counted(self, k))  # counts three times too much
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=32, checkpointing=True, refresh=True)
    assert len(plan.probes) <= 3
    over = [r for r in plan.table if r.decision.startswith("over the budget: measured")]
    assert over and all(r.measured_peak_bytes > budget * 0.9 >= r.predicted_peak_bytes for r in over)
    kept = next(r for r in plan.table if r.decision == "kept")
    assert kept.measured_peak_bytes <= budget * 0.9 and (plan.micro_batch, plan.checkpointed) == (
        kept.micro_batch, kept.checkpointed)
    measured = _checkpointed_peak(model, opt, batch, plan.micro_batch, plan.checkpointed)
    assert measured <= budget * 0.9 and plan.micro_batch * plan.accumulation == 32


def test_a_third_probe_over_the_budget_is_a_miss_even_within_the_tolerance():
    model, opt, batch = _resnet()
    free = plan_batch(model, opt, batch, budget="1GiB", effective_batch=64, checkpointing=False)
    at = free.fixed_bytes + free.per_sample_bytes * 32  # micro-batch 32 just over the budget less its margin
    plan = plan_batch(model, opt, batch, budget=int(at * 0.99 / 0.9), effective_batch=64, checkpointing=False,
                      refresh=True)
    peak = _measured_peak(model, opt, batch, plan.micro_batch, _xy_step)
    assert peak <= plan.budget_bytes * 0.9 and plan.micro_batch * plan.accumulation == 64


def test_where_one_sample_fits_only_checkpointed_the_plan_says_so_with_its_measured_speed():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=2, n_embd=64)  # activations outweigh weights
    model, batch = GPT(cfg), random_tokens(16, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    free = plan_batch(model, opt, batch, budget="1GiB", effective_batch=16, checkpointing=False)
    one = free.fixed_bytes + free.per_sample_bytes  # the plain step of one sample
    with SavedByBlock(model, ["transformer.h.0", "transformer.h.1"]) as saved:
        _xy_step(model, opt, slice_batch(batch, 8))
    budget = int((one - saved.freed(1) / 8 / 4) / 0.9)  # one sample fits with blocks checkpointed only
    with pytest.raises(ValueError, match="too small for even one sample"):
        plan_batch(model, opt, batch, budget=budget, effective_batch=16, checkpointing=False, refresh=True)
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=16, refresh=True)
    assert plan.checkpointed > 0 and plan.micro_batch * plan.accumulation == 16 and len(plan.probes) <= 3
    assert "ms a sample measured (without, not even one sample fits)" in plan.notes[-1]
    assert _checkpointed_peak(model, opt, batch, plan.micro_batch, plan.checkpointed) <= budget


def test_where_the_count_overstates_what_checkpointing_frees_a_smaller_micro_batch_is_measured(monkeypatch):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=2, n_embd=64)
    model, batch = GPT(cfg), random_tokens(16, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    free = plan_batch(model, opt, batch, budget="1GiB", effective_batch=16, checkpointing=False)
    with SavedByBlock(model, ["transformer.h.0", "transformer.h.1"]) as saved:
        _xy_step(model, opt, slice_batch(batch, 8))
    budget = int((free.fixed_bytes + free.per_sample_bytes - saved.freed(1) / 8 / 4) / 0.9)
    counted = SavedByBlock.freed
    monkeypatch.setattr(SavedByBlock, "freed", lambda self, k: 3 * counted(self, k))
    plan = plan_batch(model, opt, batch, budget=budget, effective_batch=16, refresh=True)
    assert plan.micro_batch == 1 and plan.checkpointed >= 1 and "run to check" in " ".join(plan.notes)
    assert _checkpointed_peak(model, opt, batch, 1, plan.checkpointed) <= budget * 0.9


def test_a_budget_larger_than_the_device_is_one_line():
    model, opt, batch = _gpt()
    total, _ = device_capacity("cpu")
    with pytest.raises(ValueError, match=r"more than this cpu's RAM .*give at most"):
        plan_batch(model, opt, batch, budget=total * 2)


def test_a_budget_too_small_for_anything_names_checkpointing_and_sharding():
    model, opt, batch = _gpt()
    with pytest.raises(ValueError, match=r"too small for even one sample with all 2 repeated blocks checkpointed.*"
                                         r"torchrun --nproc_per_node"):
        plan_batch(model, opt, batch, budget="1MB")


class _Pairwise(nn.Module):
    """Memory quadratic in the batch: every sample compared with every other one."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 64)

    def forward(self, x):
        h = self.proj(x)
        return (h @ h.T).unsqueeze(-1).expand(-1, -1, 16).mean(dim=(1, 2)).unsqueeze(1).repeat(1, 2)


def test_memory_that_does_not_grow_linearly_is_said(caplog):
    model = _Pairwise()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(64, 8), torch.randint(0, 2, (64,)))
    with caplog.at_level("WARNING", logger="torchspeed"):
        plan = plan_batch(model, opt, batch, budget="4MB", effective_batch=256)
    assert not plan.linear and "does not grow linearly" in plan.notes[0]
    assert sum("does not grow linearly" in r.message for r in caplog.records) == 1
    assert plan.micro_batch * plan.accumulation == 256


@pytest.mark.parametrize("budget,match", [("8 potatoes", "give a size such as 8GiB"), (0, "positive")])
def test_bad_budget_strings(budget, match):
    model, opt, batch = _gpt()
    with pytest.raises(ValueError, match=match):
        plan_batch(model, opt, batch, budget=budget)


def test_oom_message_names_the_phase_and_the_suggestion():
    model, opt, batch = _gpt()
    plan = plan_batch(model, opt, batch, budget="1GiB", effective_batch=16, checkpointing=False)
    line = oom_message("backward", plan)
    assert line.startswith("out of memory during the backward") and f"micro-batch {plan.micro_batch}" in line
    assert "memory_budget=" in oom_message("forward", None)
