"""The shared trained demo model: a ResNet-18 trained on the demo photos, built once and cached.

Accuracy checks (INT8, pruning, distillation) need a model that has learnt something, or a lossy
variant's "drop" means nothing. No weights may be downloaded, so one is trained here, on the demo
data, with a plain bf16-autocast + channels_last loop, and cached under
`torchspeed.runtime.cache_dir("models")`. The cache key is the demo data's name (its version and
settings) plus a hash of this file (the recipe), so a changed recipe or data set builds afresh.

Resolution: training a ResNet-18 at 224x224 takes far longer than the ~3 minutes allowed on 2 CPU
cores (and random native-scale crops of 224 images, tried first, did not learn in that budget), so
the demo task is downsampled: whole images at INPUT_SIZE x INPUT_SIZE, where the classes (object hue)
are still clear. Exported models have fixed spatial sizes, so accuracy is judged at INPUT_SIZE, and
the inference benchmark times the same variants separately at 224x224 (see bench/suites/infer.py).
Training precision: fp32, because on this CPU (AVX-512 bf16 dot products, no AMX) bf16 autocast
training measured ~1.8x slower than fp32, and channels_last slower too.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from torchspeed.atomic import write_json
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD
from torchspeed.runtime import cache_dir, seed_everything, usable_cores

__all__ = ["DemoModel", "load_demo_model", "IMAGENET_MEAN", "IMAGENET_STD"]


N_IMAGES = 4000        # demo_folder(4000): image i has label i % 10
N_TRAIN = 3000         # the rest (1000) is the held-out split
INPUT_SIZE = 48        # trained and evaluated at this square size: ~22x fewer pixels than 224
EPOCHS = 12
PAD = 4                # random translation by up to PAD pixels
BATCH_SIZE = 32
PEAK_LR, WEIGHT_DECAY, LABEL_SMOOTHING = 0.05, 5e-4, 0.1
SEED = 0


@dataclass
class DemoModel:
    """The trained model, its data split (uint8 NCHW in memory) and its held-out accuracy."""

    model: torch.nn.Module
    train_images: torch.Tensor
    train_labels: torch.Tensor
    heldout_images: torch.Tensor
    heldout_labels: torch.Tensor
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    accuracy: float
    info: dict[str, Any] = field(default_factory=dict)

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW -> float32 NCHW normalised with the model's mean/std."""
        return _normalise(images, self.mean, self.std)

    def batches(self, split: str = "heldout", batch_size: int = 64, limit: int | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(float normalised NCHW, int64 labels) batches of a split, in a fixed order."""
        images, labels = self._split(split)
        n = len(images) if limit is None else min(int(limit), len(images))
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for i in range(0, n, batch_size):
            j = min(i + batch_size, n)
            yield self.normalise(images[i:j]), labels[i:j]

    def evaluate(self, run: Callable[[torch.Tensor], Any], split: str = "heldout", batch_size: int = 64,
                 limit: int | None = None) -> float:
        """Top-1 accuracy of `run(batch) -> logits` (tensor or ndarray) on a split."""
        correct = total = 0
        with torch.inference_mode():
            for x, y in self.batches(split, batch_size, limit):
                out = run(x)
                out = torch.from_numpy(np.asarray(out)) if not isinstance(out, torch.Tensor) else out
                correct += int((out.float().argmax(1) == y).sum())
                total += len(y)
        return correct / max(total, 1)

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "heldout":
            return self.heldout_images, self.heldout_labels
        if split == "train":
            return self.train_images, self.train_labels
        raise ValueError(f"split must be 'heldout' or 'train', got {split!r}")


def _normalise(images: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (images.float().div_(255.0) - m) / s


def _recipe_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def _build_model() -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _load_image(path: str, size: int) -> np.ndarray:
    """Decode, resize the short side to `size`, centre-crop a square: fixed work done once."""
    from PIL import Image

    with Image.open(path) as im:
        im.draft("RGB", (2 * size, 2 * size))  # JPEG DCT scaling: decode at >= 2x the target, much faster
        im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()


def _load_images(root: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo folder as (uint8 NCHW, int64 labels), ordered by image index (label = index % 10)."""
    files: list[tuple[int, int, str]] = []
    for label, cls in enumerate(sorted(os.listdir(root))):
        for name in os.listdir(os.path.join(root, cls)):
            files.append((int(name.split("_")[1].split(".")[0]), label, os.path.join(root, cls, name)))
    files.sort()
    # PIL releases the GIL while decoding and resizing, so threads use every core.
    with ThreadPoolExecutor(max(1, usable_cores())) as pool:
        arrays = list(pool.map(lambda f: _load_image(f[2], size), files, chunksize=32))
    return torch.from_numpy(np.stack(arrays)), torch.tensor([f[1] for f in files], dtype=torch.int64)


def _augment(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random flip and translation (reflect-pad, crop). No colour jitter: hue is the label."""
    n, _, h, w = images.shape
    padded = F.pad(images.float(), (PAD, PAD, PAD, PAD), mode="reflect")
    ys = torch.randint(0, 2 * PAD + 1, (n,), generator=gen).tolist()
    xs = torch.randint(0, 2 * PAD + 1, (n,), generator=gen).tolist()
    flip = (torch.rand(n, generator=gen) < 0.5).tolist()
    crops = [padded[i, :, y:y + h, x:x + w] for i, (y, x) in enumerate(zip(ys, xs))]
    return torch.stack([c.flip(2) if f else c for c, f in zip(crops, flip)])


def _train(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, log: Callable[[str], None]
           ) -> list[dict[str, float]]:
    """Plain loop: SGD + nesterov, one-cycle LR, label smoothing, fp32, flip + translation."""
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=PEAK_LR, momentum=0.9, nesterov=True)
    steps_per_epoch = math.ceil(len(images) / BATCH_SIZE)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=PEAK_LR, total_steps=steps_per_epoch * EPOCHS, pct_start=0.25)
    history = []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(images), generator=gen)
        t0, loss_sum, correct = time.perf_counter(), 0.0, 0
        for i in range(0, len(images), BATCH_SIZE):
            idx = order[i:i + BATCH_SIZE]
            x = _normalise(_augment(images[idx], gen), IMAGENET_MEAN, IMAGENET_STD)
            y = labels[idx]
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=LABEL_SMOOTHING)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(y)
            correct += int((out.detach().argmax(1) == y).sum())
        row = {"epoch": epoch + 1, "train_loss": loss_sum / len(images), "train_acc": correct / len(images),
               "seconds": time.perf_counter() - t0}
        history.append(row)
        log(f"epoch {epoch + 1}/{EPOCHS} at {INPUT_SIZE}px: loss {row['train_loss']:.3f}, "
            f"train acc {row['train_acc']:.3f} ({row['seconds']:.0f} s)")
    return history


@contextlib.contextmanager
def _build_lock(path: str) -> Iterator[None]:
    """Serialise builds across processes (tests and benchmarks may ask at once): one trains, others wait."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(final: str, data_root: str, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, usable_cores()))
    log(f"decoding {N_IMAGES} demo images at {INPUT_SIZE}px")
    images, labels = _load_images(data_root, INPUT_SIZE)
    log(f"decoded in {time.perf_counter() - t0:.0f} s")
    if len(images) != N_IMAGES:
        raise ValueError(f"the demo folder {data_root!r} holds {len(images)} images, expected {N_IMAGES}; delete it to regenerate")
    seed_everything(SEED)
    model = _build_model()
    history = _train(model, images[:N_TRAIN], labels[:N_TRAIN], log)
    model = model.to(memory_format=torch.contiguous_format).eval()
    demo = DemoModel(model, images[:N_TRAIN], labels[:N_TRAIN], images[N_TRAIN:], labels[N_TRAIN:], INPUT_SIZE,
                     IMAGENET_MEAN, IMAGENET_STD, accuracy=0.0)
    log("evaluating the fp32 model on the held-out split")
    accuracy = demo.evaluate(model)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(final), prefix=".build-")
    try:
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(tmp, "weights.pt"))
        torch.save({"images": images, "labels": labels}, os.path.join(tmp, "data.pt"))
        write_json(os.path.join(tmp, "meta.json"), {
            "architecture": "torchvision resnet18, 10 classes", "accuracy": accuracy, "input_size": INPUT_SIZE,
            "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "n_train": N_TRAIN, "n_heldout": N_IMAGES - N_TRAIN,
            "data": os.path.basename(data_root), "recipe": _recipe_hash(), "build_seconds": time.perf_counter() - t0,
            "threads": torch.get_num_threads(), "history": history,
        })
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"demo model built: held-out accuracy {accuracy:.3f} ({time.perf_counter() - t0:.0f} s)")


def demo_model_dir(log: Callable[[str], None] | None = None) -> str:
    """The cache directory of the built demo model (building it first if needed)."""
    from torchspeed.data.demo import demo_folder

    log = log or (lambda s: None)
    data_root = demo_folder(N_IMAGES)
    key = f"resnet18-{os.path.basename(data_root)}-{_recipe_hash()}"
    root = cache_dir("models")
    final = os.path.join(root, f"demo-{key}")
    if not os.path.isfile(os.path.join(final, "meta.json")):
        with _build_lock(os.path.join(root, f".demo-{key}.lock")):
            if not os.path.isfile(os.path.join(final, "meta.json")):
                _build(final, data_root, log)
    return final


def load_demo_model(log: Callable[[str], None] | None = None) -> DemoModel:
    """The trained demo ResNet-18 with its data split; built on first call (a few minutes), then cached.

    `model` is a fresh fp32 copy in eval mode on every call, so callers may modify it freely.
    """
    path = demo_model_dir(log)
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    model = _build_model()
    model.load_state_dict(torch.load(os.path.join(path, "weights.pt"), weights_only=True, map_location="cpu"))
    data = torch.load(os.path.join(path, "data.pt"), weights_only=True, map_location="cpu", mmap=True)
    images, labels = data["images"], data["labels"]
    n = meta["n_train"]
    return DemoModel(
        model=model.eval(), train_images=images[:n], train_labels=labels[:n], heldout_images=images[n:],
        heldout_labels=labels[n:], input_size=int(meta["input_size"]), mean=tuple(meta["mean"]),
        std=tuple(meta["std"]), accuracy=float(meta["accuracy"]), info=meta,
    )


if __name__ == "__main__":  # python -m torchspeed.bench.demo_model: build (if needed) and describe
    d = load_demo_model(log=lambda s: print(s, flush=True))
    print(f"held-out accuracy {d.accuracy:.3f} at {d.input_size}px; built in {d.info['build_seconds']:.0f} s")
