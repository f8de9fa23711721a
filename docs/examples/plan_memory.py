"""The memory planner's prediction against the peak a real training step then reaches (docs/train.md,
"Memory"). For a ResNet-18 (224x224 images, SGD with momentum) and the GPT of the benchmark suite
(torchspeed.bench.gpt_model, AdamW), each under a budget:

    python docs/examples/plan_memory.py
    python docs/examples/plan_memory.py --device cuda --resnet-budget 6GiB --gpt-budget 4GiB

plans the micro-batch and accumulation (`ts.train.plan_batch`) twice, once plain and once with activation
checkpointing weighed against accumulation (`checkpointing=True`), then runs one training step of each plan
(its micro-batch, its blocks checkpointed; as a loop and the Trainer run it: the model's output held until
the backward is done), after one that made the optimizer's state, and reads its peak from the same allocator the planner read (CUDA's, or on a CPU
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


def measured_peak(model, optimizer, batch, micro, step, device, checkpointed=0):
    """The peak of one training step at `micro` samples with the first `checkpointed` blocks checkpointed,
    after a first step made the optimizer's state."""
    part = slice_batch(batch, micro)
    ts.train.checkpoint_blocks(model, checkpointed)
    step(part)
    watch = MemoryWatch(device, held=(model, optimizer, part))
    with watch:
        step(part)
    ts.train.uncheckpoint_blocks(model)
    return watch.reading.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--resnet-budget", default="3GiB")
    p.add_argument("--gpt-budget", default="1GiB")
    p.add_argument("--effective-batch", type=int, default=256)
    a = p.parse_args()
    rows, weighed = [], []
    for name, build, budget in (("ResNet-18, 224x224, SGD", resnet, a.resnet_budget),
                                ("GPT (4 x 256, 128 tokens), AdamW", gpt, a.gpt_budget)):
        model, optimizer, batch, step = build(a.device)
        for checkpointing in (False, True):
            plan = ts.train.plan_batch(model, optimizer, batch, budget=budget, effective_batch=a.effective_batch,
                                       device=a.device, checkpointing=checkpointing, refresh=True)
            peak = measured_peak(model, optimizer, batch, plan.micro_batch, step, a.device, plan.checkpointed)
            rows.append((name, budget, f"weighed: {plan.checkpointed} blocks" if checkpointing else "off",
                         f"{plan.micro_batch} x {plan.accumulation}", format_bytes(plan.predicted_peak_bytes),
                         format_bytes(peak), error(plan.predicted_peak_bytes, peak)))
            print(plan, flush=True)
            for r in plan.table:  # every configuration weighed, its prediction against its own step
                peak = measured_peak(model, optimizer, batch, r.micro_batch, step, a.device, r.checkpointed)
                weighed.append((name, f"{r.micro_batch} x {r.accumulation}", str(r.checkpointed),
                                format_bytes(r.predicted_peak_bytes), format_bytes(peak),
                                error(r.predicted_peak_bytes, peak), f"{r.sample_s * 1e3:.1f}" if r.sample_s else "-",
                                r.decision))
    print("| model | budget | checkpointing | micro-batch x accumulation | predicted peak | measured peak | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\n| model | micro-batch x accumulation | blocks checkpointed | predicted peak | measured peak | error "
          "| ms a sample | decision |")
    print("|---|---|---|---|---|---|---|---|")
    for r in weighed:
        print("| " + " | ".join(r) + " |")


def error(predicted: int, measured: int) -> str:
    return f"{(predicted - measured) / measured:+.1%}"

if __name__ == "__main__":
    main()
