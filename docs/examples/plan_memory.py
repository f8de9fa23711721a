"""The memory planner's prediction against the peak a real training step then reaches (docs/train.md,
"Memory"). For a ResNet-18 (224x224 images, SGD with momentum) and the GPT of the benchmark suite
(torchspeed.bench.gpt_model, AdamW), each under a budget:

    python docs/examples/plan_memory.py
    python docs/examples/plan_memory.py --device cuda --resnet-budget 6GiB --gpt-budget 4GiB

plans the micro-batch and accumulation (`ts.train.plan_batch`, activation checkpointing left out so the
figures are the plain plan's), then runs one training step at the micro-batch chosen (as a loop and the
Trainer run it: the model's output held until the backward is done), after one that made the optimizer's
state, and reads its peak from the same allocator the planner read (CUDA's, or on a CPU
torch's CPU allocator through the profiler). Memory is not disturbed by other processes: the figures do
not need a quiet machine.
"""
import argparse

import torch
import torchvision
from torch import nn

import torchspeed as ts
from torchspeed.bench.gpt_model import GPT, GPTConfig, random_tokens
from torchspeed.memory import MemoryWatch, format_bytes
from torchspeed.train.memory_plan import slice_batch


def resnet(device):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(16, 3, 224, 224), torch.randint(0, 1000, (16,)))

    def step(part):
        x, y = (t.to(device) for t in part)
        logits = model(x)
        nn.functional.cross_entropy(logits, y).backward()  # the logits held through the backward, as a loop does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, batch, step


def gpt(device):
    torch.manual_seed(0)
    cfg = GPTConfig()  # the GPT suite's: 4 layers of width 256, 128 tokens, 8192 words
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch = random_tokens(16, cfg)

    def step(part):
        x, y = (t.to(device) for t in part)
        logits, loss = model(x, y)
        loss.backward()  # the logits held through the backward, as a loop does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, batch, step


def measured_peak(model, optimizer, batch, micro, step, device):
    """The peak of one training step at `micro` samples, after a first step made the optimizer's state."""
    part = slice_batch(batch, micro)
    step(part)
    watch = MemoryWatch(device, held=(model, optimizer, part))
    with watch:
        step(part)
    return watch.reading


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--resnet-budget", default="3GiB")
    p.add_argument("--gpt-budget", default="1GiB")
    p.add_argument("--effective-batch", type=int, default=256)
    a = p.parse_args()
    rows = []
    for name, build, budget in (("ResNet-18, 224x224, SGD", resnet, a.resnet_budget),
                                ("GPT (4 x 256, 128 tokens), AdamW", gpt, a.gpt_budget)):
        model, optimizer, batch, step = build(a.device)
        plan = ts.train.plan_batch(model, optimizer, batch, budget=budget, effective_batch=a.effective_batch,
                                   device=a.device, checkpointing=False, refresh=True)
        reading = measured_peak(model, optimizer, batch, plan.micro_batch, step, a.device)
        error = (plan.predicted_peak_bytes - reading.peak_bytes) / reading.peak_bytes
        rows.append((name, budget, f"{plan.micro_batch} x {plan.accumulation}", format_bytes(plan.predicted_peak_bytes),
                     format_bytes(reading.peak_bytes), f"{error:+.1%}", plan.measured))
    print("| model | budget | micro-batch x accumulation | predicted peak | measured peak | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r[:6]) + " |")
    for r in rows:
        print(f"{r[0]}: measured {r[6]}")


if __name__ == "__main__":
    main()
