"""Compression benchmark: structural pruning + a short fine-tune, and knowledge distillation, on CPU.

The teacher is the shared demo ResNet-18 (trained on the demo photos, evaluated on 1000 held-out
images at its 224 px input size).

- Pruning: 50% of the channels of every layer removed through Torch-Pruning's dependency graph
  (channel counts rounded to multiples of 8, the classifier's outputs kept), then a short
  fine-tune through the Trainer, distilling from the unpruned model. Latency: batch 1 at 224 px,
  fp32, original and pruned timed interleaved by the harness. Accuracy: held-out top-1.
- Distillation: a half-width ResNet-18 (the same architecture with every layer's channels halved,
  randomly initialised) trained from scratch for the same steps on the same batches, once with the
  teacher (Hinton KD) and once on the labels alone, over several seeds; `kd_gain` is the mean
  held-out accuracy gain, with its standard deviation over seeds.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TITLE = "Compression: pruning + fine-tune, knowledge distillation (CPU)"

# settings: (quick, full)
PRUNE_RATIO = 0.5
FINETUNE_STEPS = (60, 240)
KD_STEPS = (60, 300)
KD_SEEDS = (2, 5)
KD_SIZE = 112          # the distillation runs train and evaluate at 112 px (4x cheaper than 224)
BATCH = 64
TEMPERATURE, ALPHA = 4.0, 0.5


class ImageTensorLoader:
    """Shuffled, augmented (flip + translate), normalised batches from uint8 NCHW images in memory.

    Same batches for every run with the same seed and epoch, so two students trained on it see
    exactly the same data.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean: tuple, std: tuple,
                 seed: int = 0, train: bool = True, channels_last: bool = True):
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std).view(1, 3, 1, 1) * 255
        self.seed, self.train, self.channels_last, self.epoch = seed, train, channels_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.images) // self.batch_size if self.train else math.ceil(len(self.images) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        n = len(self.images)
        order = torch.randperm(n, generator=gen) if self.train else torch.arange(n)
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            x = self.images[idx].float()
            if self.train:
                x = _augment(x, gen)
            x = (x - self.mean) / self.std
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, self.labels[idx]


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random horizontal flip and a random translation of up to 1/14 of the side (reflect padding)."""
    n, _, h, w = x.shape
    flip = torch.rand(n, generator=gen) < 0.5
    x = torch.where(flip.view(n, 1, 1, 1), x.flip(3), x)
    pad = max(1, h // 14)
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen).tolist()
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen).tolist()
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 NCHW resized (antialiased) to size x size, in chunks to bound memory."""
    out = [F.interpolate(images[i:i + 256].float(), size=(size, size), mode="bilinear", antialias=True,
                         align_corners=False).round_().clamp_(0, 255).to(torch.uint8)
           for i in range(0, len(images), 256)]
    return torch.cat(out)


def half_width_resnet18(num_classes: int, example: torch.Tensor) -> nn.Module:
    """ResNet-18 with every layer's channels halved (32-256 instead of 64-512), freshly initialised.

    Built by pruning an untrained ResNet-18 by 50% (the same graph surgery as the pruning part),
    then re-initialised the way torchvision initialises ResNets.
    """
    import torchvision

    from torchspeed.compress import prune

    model = prune(torchvision.models.resnet18(num_classes=num_classes), example, 0.5, importance="random",
                  measure=False).model
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            m.reset_running_stats()
        elif isinstance(m, nn.Linear):
            m.reset_parameters()
    return model


def _trainer_settings() -> dict[str, Any]:
    """Fixed settings for every run here: the train suite measures the 'auto' choices; this one must
    not spend its time budget on trials. bf16 autocast where the CPU has native bf16."""
    from torchspeed.runtime import default_precision

    return dict(precision=default_precision("cpu").name, channels_last=True, compile=False, strategy=None,
                progress=False, device="cpu")


def _sgd(model: nn.Module, lr: float, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)
    return opt, sched


def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: tuple, std: tuple) -> float:
    """Held-out top-1 in bf16 autocast where native (fast; the argmax rarely moves) else fp32."""
    from torchspeed.runtime import default_precision

    model.eval()
    loader = ImageTensorLoader(images, labels, 100, mean, std, train=False)
    bf16 = default_precision("cpu").name == "bf16"
    correct = 0
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(labels)


def _prune_part(demo: Any, quick: bool, step: Callable[[str], None]) -> dict[str, Any]:
    from torchspeed.compress import finetune, prune

    steps = FINETUNE_STEPS[0 if quick else 1]
    size = demo.input_size
    example = torch.randn(1, 3, size, size)
    teacher = demo.model
    step("pruning 50% of channels")
    t0 = time.perf_counter()
    small, report = prune(demo.model, example, PRUNE_RATIO, importance="l1", round_to=8,
                          repeats=5 if quick else 15)
    prune_s = time.perf_counter() - t0
    acc_pruned = _accuracy(small, demo.heldout_images, demo.heldout_labels, demo.mean, demo.std)
    step(f"fine-tuning the pruned model ({steps} steps, distilling from the original)")
    loader = ImageTensorLoader(demo.train_images, demo.train_labels, BATCH, demo.mean, demo.std, seed=0)
    opt, sched = _sgd(small, 0.02, steps)
    t0 = time.perf_counter()
    ft = finetune(small, loader, max_steps=steps, epochs=math.ceil(steps / len(loader)), teacher=teacher,
                  temperature=TEMPERATURE, alpha=ALPHA, optimizer=opt, scheduler=sched, **_trainer_settings())
    finetune_s = time.perf_counter() - t0
    step("evaluating the fine-tuned model")
    acc_after = _accuracy(small, demo.heldout_images, demo.heldout_labels, demo.mean, demo.std)
    acc_before = _accuracy(teacher, demo.heldout_images, demo.heldout_labels, demo.mean, demo.std)
    return {
        "report": report.to_dict(), "acc_before": acc_before, "acc_pruned_no_finetune": acc_pruned,
        "acc_after": acc_after, "finetune_steps": steps, "finetune_seconds": finetune_s, "prune_seconds": prune_s,
        "finetune_samples_per_s": ft.get("run_samples_per_s"),
    }


def _kd_part(demo: Any, quick: bool, step: Callable[[str], None]) -> dict[str, Any]:
    from torchspeed.compress import distill, finetune
    from torchspeed.runtime import seed_everything

    steps, seeds = KD_STEPS[0 if quick else 1], KD_SEEDS[0 if quick else 1]
    step(f"resizing the demo data to {KD_SIZE} px")
    train_x, held_x = _resize(demo.train_images, KD_SIZE), _resize(demo.heldout_images, KD_SIZE)
    teacher = demo.model
    teacher_acc = _accuracy(teacher, held_x, demo.heldout_labels, demo.mean, demo.std)
    example = torch.randn(1, 3, KD_SIZE, KD_SIZE)
    runs: list[dict[str, Any]] = []
    for seed in range(seeds):
        accs = {}
        for arm in ("alone", "distilled"):
            step(f"seed {seed + 1}/{seeds}: half-width student, {arm} ({steps} steps)")
            seed_everything(seed)  # same initial weights for both arms of a seed
            student = half_width_resnet18(10, example)
            loader = ImageTensorLoader(train_x, demo.train_labels, BATCH, demo.mean, demo.std, seed=seed)
            opt, sched = _sgd(student, 0.1, steps)
            epochs = math.ceil(steps / len(loader))
            t0 = time.perf_counter()
            if arm == "distilled":
                distill(teacher, student, loader, temperature=TEMPERATURE, alpha=ALPHA, epochs=epochs,
                        max_steps=steps, optimizer=opt, scheduler=sched, **_trainer_settings())
            else:
                finetune(student, loader, epochs=epochs, max_steps=steps, optimizer=opt, scheduler=sched,
                         **_trainer_settings())
            accs[arm] = _accuracy(student, held_x, demo.heldout_labels, demo.mean, demo.std)
            accs[f"{arm}_seconds"] = time.perf_counter() - t0
        accs["gain"] = accs["distilled"] - accs["alone"]
        runs.append({"seed": seed, **accs})
    gains = [r["gain"] for r in runs]
    return {
        "runs": runs, "teacher_acc": teacher_acc, "steps": steps, "seeds": seeds, "size": KD_SIZE,
        "kd_gain": statistics.mean(gains), "kd_gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
        "temperature": TEMPERATURE, "alpha": ALPHA,
        "student_params": sum(p.numel() for p in half_width_resnet18(10, example).parameters()),
    }


def run(quick: bool, step: Callable[[str], None]) -> dict[str, Any]:
    from torchspeed.bench.demo_model import load_demo_model

    step("loading the demo model (built once, a few minutes)")
    demo = load_demo_model(log=step)
    t0 = time.perf_counter()
    p = _prune_part(demo, quick, step)
    kd = _kd_part(demo, quick, step)
    r = p["report"]
    speedup = r["latency_before_ms"] / r["latency_after_ms"]
    drop = p["acc_before"] - p["acc_after"]
    alone = [x["alone"] for x in kd["runs"]]
    dist = [x["distilled"] for x in kd["runs"]]
    rows = [
        {"technique": "ResNet-18 (demo model), fp32, batch 1", "median": r["latency_before_ms"], "min": None,
         "max": None, "unit": "ms", "ratio": 1.0, "cumulative": 1.0, "metric_drop": 0.0,
         "what": f"the unpruned teacher, {p['acc_before']:.3f} held-out top-1"},
        {"technique": f"pruned {PRUNE_RATIO:.0%} channels + {p['finetune_steps']}-step fine-tune",
         "median": r["latency_after_ms"], "min": None, "max": None, "unit": "ms", "ratio": speedup,
         "cumulative": speedup, "metric_drop": drop,
         "what": f"Torch-Pruning L1, round_to 8; params {r['params_before'] / 1e6:.1f}M -> {r['params_after'] / 1e6:.1f}M, "
                 f"MACs {r['macs_before'] / 1e9:.2f}G -> {r['macs_after'] / 1e9:.2f}G; "
                 f"{p['acc_pruned_no_finetune']:.3f} before fine-tuning"},
        {"technique": "half-width student, labels only", "median": statistics.median(alone), "min": min(alone),
         "max": max(alone), "unit": "top-1", "ratio": None, "cumulative": None,
         "metric_drop": kd["teacher_acc"] - statistics.mean(alone),
         "what": f"{kd['seeds']} seeds x {kd['steps']} steps at {kd['size']} px"},
        {"technique": f"half-width student, distilled (T={TEMPERATURE:g}, alpha={ALPHA:g})",
         "median": statistics.median(dist), "min": min(dist), "max": max(dist), "unit": "top-1", "ratio": None,
         "cumulative": None, "metric_drop": kd["teacher_acc"] - statistics.mean(dist),
         "what": f"same steps and batches, with the teacher; gain {kd['kd_gain']:+.3f} +- {kd['kd_gain_std']:.3f}"},
    ]
    notes = [
        f"pruning: latency batch 1 at {demo.input_size} px fp32, median of interleaved repeats; speed-up x{speedup:.2f}, "
        f"held-out top-1 {p['acc_before']:.3f} -> {p['acc_after']:.3f} (drop {drop:+.3f}); "
        f"fine-tune {p['finetune_seconds']:.0f} s",
        f"distillation: kd_gain {kd['kd_gain']:+.3f} +- {kd['kd_gain_std']:.3f} over {kd['seeds']} seeds "
        f"(teacher {kd['teacher_acc']:.3f} at {kd['size']} px); metric drop column = teacher minus student",
    ]
    return {
        "prune_speedup": speedup, "prune_metric_drop": drop, "kd_gain": kd["kd_gain"], "kd_gain_std": kd["kd_gain_std"],
        "prune": p, "kd": kd, "rows": rows, "notes": notes, "suite_seconds": time.perf_counter() - t0,
    }
