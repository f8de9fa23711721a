"""Compression benchmark: structural pruning + a short fine-tune, and knowledge distillation, on CPU.

The teacher is the shared demo ResNet-18; every model is evaluated in fp32 on the 1000 held-out images.
- Pruning: 50% of every layer's channels removed (Torch-Pruning; counts rounded to multiples of 8, the
  classifier's outputs kept), then a short fine-tune through the Trainer distilling from the unpruned
  model. Latency: batch 1 at the demo input size, fp32, both models timed interleaved.
- Distillation: a half-width ResNet-18 trained from scratch for the same steps on the same batches, with
  the teacher (Hinton KD) and on the labels alone, over several seeds; `kd_gain` is the mean held-out
  accuracy gain, with its standard deviation over seeds.

Training sees whole images with random flips and translations; above MAX_TRAIN_SIDE px, too slow for a
CPU, it trains on random native-scale crops (objects as wide as at test time; a convolutional net with
global pooling applies unchanged to the whole image), then re-estimates BatchNorm statistics on whole
images. A part's first run lets the Trainer measure its settings ("auto"); its later runs reuse that
choice, so trials are paid once.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchspeed.args import progress_fn
from torchspeed.bench.rows import Row, to_json
from torchspeed.bench.suite_kit import cpu_suite_notes

TITLE = "Compression: pruning + fine-tune, knowledge distillation (CPU, at the demo model's input size)"

# (quick, full)
PRUNE_RATIO = 0.5
FINETUNE_STEPS = (80, 150)
KD_STEPS = (40, 150)
KD_SEEDS = (2, 3)
KD_MIN_STEPS = 10
MAX_TRAIN_SIDE = 96    # larger demo images are trained on crops of this side
BATCH = 64
BN_RECALIB = 512       # whole training images used to re-estimate BatchNorm statistics
TEMPERATURE, ALPHA = 4.0, 0.5


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


def _settings(setup: dict[str, Any] | None) -> dict[str, Any]:
    """Trainer settings: measured ("auto") on a part's first run, then that choice reused."""
    setup = {"precision": "auto", "channels_last": "auto"} if setup is None else setup
    return dict(compile=False, strategy=None, progress=False, device="cpu", precision=setup["precision"],
                channels_last=setup["channels_last"])


def _sgd(model: nn.Module, lr: float, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)
    # one spare step: the schedule must never be stepped past its end
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps + 1, pct_start=0.2)
    return opt, sched


def _train(model: nn.Module, demo: Any, steps: int, lr: float, seed: int, teacher: nn.Module | None,
           setup: dict[str, Any] | None) -> dict[str, Any]:
    """`steps` SGD steps on crops (distilled from `teacher` if given), BatchNorm re-estimated on whole
    images, then held-out top-1 (fp32, whole 224 px images)."""
    from torchspeed.compress import finetune, recalibrate_bn

    crop = MAX_TRAIN_SIDE if demo.input_size > MAX_TRAIN_SIDE else None
    loader = demo.train_loader(BATCH, crop=crop, pad=0 if crop else max(1, demo.input_size // 12), seed=seed)
    opt, sched = _sgd(model, lr, steps)
    t0 = time.perf_counter()
    metrics = finetune(model, loader, max_steps=steps, epochs=math.ceil(steps / len(loader)), teacher=teacher,
                       temperature=TEMPERATURE, alpha=ALPHA, optimizer=opt, scheduler=sched, **_settings(setup))
    train_s = time.perf_counter() - t0
    if crop:  # whole images have other BatchNorm statistics than crops (the borders)
        recalibrate_bn(model, demo.batches("train", BATCH, limit=BN_RECALIB))
    model.eval()
    accuracy = demo.evaluate(model)
    return {"accuracy": accuracy, "train_seconds": train_s, "seconds": time.perf_counter() - t0,
            "setup": metrics.get("setup"), "train_samples_per_s": metrics.get("run_samples_per_s")}


def _batched_speedup(original: nn.Module, pruned: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    """Throughput-style latency of a whole batch, fp32, the two models interleaved."""
    from torchspeed.measure import compare
    from torchspeed.compress.cost import inference_fn

    original.eval()
    pruned.eval()
    c = compare({"original": inference_fn(original, x), "pruned": inference_fn(pruned, x)}, repeats=repeats,
                warmup=2, items=len(x), unit="img")
    return {"batch": len(x), "original_ms": c["original"].median_s * 1e3, "pruned_ms": c["pruned"].median_s * 1e3,
            "speedup": c.speedup("pruned"), "others_cores": c.others_cores}


def _prune_part(demo: Any, quick: bool, say: Callable[[str], Any]) -> dict[str, Any]:
    from torchspeed.compress import prune

    steps = FINETUNE_STEPS[0 if quick else 1]
    size = demo.input_size
    say(f"pruning {PRUNE_RATIO:.0%} of channels, timing both models")
    t0 = time.perf_counter()
    pruned = prune(demo.model, torch.randn(1, 3, size, size), PRUNE_RATIO, importance="l1", round_to=8,
                   repeats=10 if quick else 30)
    small = pruned.model
    prune_s = time.perf_counter() - t0
    say(f"timing both models at batch {BATCH}")
    batched = _batched_speedup(demo.model, small, torch.randn(BATCH, 3, size, size), repeats=5 if quick else 15)
    say("held-out accuracy of the pruned model before fine-tuning")
    acc_pruned = demo.evaluate(small)
    say(f"fine-tuning the pruned model ({steps} steps, distilled from the original)")
    ft = _train(small, demo, steps, lr=0.02, seed=0, teacher=demo.model, setup=None)
    return {
        "report": pruned.to_dict(), "batched": batched, "acc_before": demo.accuracy, "acc_pruned_no_finetune": acc_pruned,
        "acc_after": ft["accuracy"], "finetune_steps": steps, "finetune": ft, "prune_seconds": prune_s,
    }


def _kd_part(demo: Any, quick: bool, say: Callable[[str], Any], seconds: float | None = None,
             step_s: float | None = None) -> dict[str, Any]:
    """With `seconds` and a measured `step_s` (the fine-tune's), the steps per run are what fits the
    seconds (all seeds and both arms), at most KD_STEPS and at least KD_MIN_STEPS."""
    from torchspeed.runtime import seed_everything

    steps, seeds = KD_STEPS[0 if quick else 1], KD_SEEDS[0 if quick else 1]
    if seconds is not None and step_s:
        fit = int(seconds / (2 * seeds * step_s * 1.3))  # 1.3: evaluation and setup around the steps
        steps = min(steps, max(KD_MIN_STEPS, fit))
    example = torch.randn(1, 3, demo.input_size, demo.input_size)
    runs: list[dict[str, Any]] = []
    setup = None
    for seed in range(seeds):
        row: dict[str, Any] = {"seed": seed}
        for arm in ("alone", "distilled"):
            say(f"seed {seed + 1}/{seeds}: half-width student, {arm} ({steps} steps)")
            seed_everything(seed)  # the same initial weights for both arms of a seed
            student = half_width_resnet18(10, example)
            r = _train(student, demo, steps, lr=0.1, seed=seed, teacher=demo.model if arm == "distilled" else None,
                       setup=setup)
            setup = setup or r["setup"]
            row[arm], row[f"{arm}_seconds"] = r["accuracy"], r["seconds"]
        row["gain"] = row["distilled"] - row["alone"]
        runs.append(row)
    gains = [r["gain"] for r in runs]
    n_classes = int(demo.train_labels.max()) + 1
    return {"learned": students_learned(runs, n_classes), "runs": runs, "teacher_acc": demo.accuracy,
            "steps": steps, "seeds": seeds, "size": demo.input_size, "kd_gain": statistics.mean(gains),
            "kd_gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0, "temperature": TEMPERATURE,
            "alpha": ALPHA, "setup": setup,
            "student_params": sum(p.numel() for p in half_width_resnet18(10, example).parameters())}


def students_learned(runs: list[dict[str, Any]], n_classes: int, margin: float = 0.05) -> bool:
    """Whether any student got clear of chance (1 / n_classes + margin): a gain between two students that
    both guess says nothing about distillation (the quick report's few steps can leave them there)."""
    return max(max(r["alone"], r["distilled"]) for r in runs) > 1.0 / n_classes + margin


def run(quick: bool, progress: bool | Callable[[str], Any] = False, budget_s: float | None = None) -> dict[str, Any]:
    from torchspeed.bench.budget import Budget
    from torchspeed.bench.demo_model import load_demo_model

    say = progress_fn(progress)
    budget = Budget.of("compress", quick, budget_s)
    say("loading the demo model (built once, a few minutes)")
    demo = load_demo_model(progress=say)
    t0 = time.perf_counter()
    p = _prune_part(demo, quick, say)
    ft = p["finetune"]
    kd = _kd_part(demo, quick, say, seconds=budget.left(), step_s=ft["train_seconds"] / max(p["finetune_steps"], 1))
    r = p["report"]
    speedup = r["latency_before_ms"] / r["latency_after_ms"]
    drop = p["acc_before"] - p["acc_after"]
    return {
        "prune_speedup": speedup, "prune_metric_drop": drop, "prune_speedup_batched": p["batched"]["speedup"],
        "kd_gain": kd["kd_gain"] if kd["learned"] else None,
        "kd_gain_std": kd["kd_gain_std"] if kd["learned"] else None,
        "prune": p, "kd": kd, "rows": to_json(_rows(p, kd, speedup, drop)),
        "notes": _notes(demo.input_size, p, kd, speedup, drop) + cpu_suite_notes(), "suite_seconds": time.perf_counter() - t0,
    }


def _rows(p: dict[str, Any], kd: dict[str, Any], speedup: float, drop: float) -> list[Row]:
    """The teacher, the pruned model at batch 1 and at a whole batch, and the two students."""
    r = p["report"]
    alone = [x["alone"] for x in kd["runs"]]
    dist = [x["distilled"] for x in kd["runs"]]
    gain = f"gain {kd['kd_gain']:+.3f} +- {kd['kd_gain_std']:.3f}" if kd["learned"] else "both students at chance level"
    return [
        Row(technique="ResNet-18 (demo model), fp32, batch 1", median=r["latency_before_ms"], unit="ms", ratio=1.0,
            cumulative=1.0, metric_drop=0.0, what=f"the unpruned teacher, {p['acc_before']:.3f} held-out top-1"),
        Row(technique=f"pruned {PRUNE_RATIO:.0%} channels + {p['finetune_steps']}-step fine-tune",
            median=r["latency_after_ms"], unit="ms", ratio=speedup, cumulative=speedup, metric_drop=drop,
            headline=True,
            what=f"Torch-Pruning L1, round_to 8; params {r['params_before'] / 1e6:.1f}M -> "
                 f"{r['params_after'] / 1e6:.1f}M, MACs {r['macs_before'] / 1e9:.2f}G -> {r['macs_after'] / 1e9:.2f}G; "
                 f"{p['acc_pruned_no_finetune']:.3f} top-1 before fine-tuning"),
        Row(technique=f"  same, batch {p['batched']['batch']}", median=p["batched"]["pruned_ms"], unit="ms",
            ratio=p["batched"]["speedup"], metric_drop=drop, others_cores=p["batched"].get("others_cores"),
            what=f"a whole batch, fp32: {p['batched']['original_ms']:.1f} ms unpruned"),
        Row(technique="half-width student, labels only", median=statistics.median(alone), min=min(alone),
            max=max(alone), unit="top-1", metric_drop=kd["teacher_acc"] - statistics.mean(alone),
            what=f"{kd['seeds']} seeds x {kd['steps']} steps of {BATCH} images, trained from scratch"),
        Row(technique=f"half-width student, distilled (T={TEMPERATURE:g}, alpha={ALPHA:g})",
            median=statistics.median(dist), min=min(dist), max=max(dist), unit="top-1",
            metric_drop=kd["teacher_acc"] - statistics.mean(dist),
            what=f"same steps and batches, with the teacher; {gain}"),
    ]


def _notes(size: int, p: dict[str, Any], kd: dict[str, Any], speedup: float, drop: float) -> list[str]:
    alone_and_dist = [x["alone"] for x in kd["runs"]] + [x["distilled"] for x in kd["runs"]]
    return [
        f"pruning: latency at batch 1, {size} px, fp32, median of interleaved repeats: x{speedup:.2f}; "
        f"held-out top-1 {p['acc_before']:.3f} -> {p['acc_after']:.3f} (drop {drop:+.3f}) after a "
        f"{p['finetune']['train_seconds']:.0f} s fine-tune",
        f"distillation: kd_gain {kd['kd_gain']:+.3f} +- {kd['kd_gain_std']:.3f} (std over {kd['seeds']} seeds); "
        f"metric drop column of the student rows = teacher top-1 minus student top-1" if kd["learned"] else
        f"distillation: no figure from this run: every student stayed at chance level after {kd['steps']} steps "
        f"(top-1 <= {max(alone_and_dist):.3f}), so their difference is noise; `torchspeed bench compress` trains "
        "longer",
    ]
