"""The shared trained demo model: a ResNet-18 trained on the demo photos, built once and cached.

Accuracy checks (INT8, pruning, distillation) need a model that has learnt something, or a lossy
variant's "drop" means nothing. No weights may be downloaded, so one is trained here, on the demo
data, with a plain fp32 loop, and cached under `torchspeed.runtime.cache_dir("models")`. The cache
key is the demo data's name (its version and settings) plus a hash of the recipe (its constants and
the code of the functions that shape the weights), so a changed recipe or data set builds afresh and
an edit elsewhere in this file does not.

`torchspeed bench` builds the photos and the model on a machine's first run before the suites, outside
their time budgets (`prepare_photos`, `prepare_model`, `ready`); the build is part of the 10 minutes
`make demo` may take on a fresh clone, so the recipe is as short as the accuracy checks allow: 4 epochs at
40 px (held-out top-1 0.607 on a 2-core EPYC; 6 epochs at 48 px reached 0.655 in 3.5 minutes on a 2-core AVX2
EPYC, 12 reached 0.695; at 32 px 4 epochs reached only 0.43).

Resolution: training a ResNet-18 at 224x224 takes far longer than the minutes allowed on 2 CPU
cores (and random native-scale crops of 224 images, tried first, did not learn in that budget), so
the demo task is downsampled: whole images at INPUT_SIZE x INPUT_SIZE, where the classes (object hue)
are still clear. Exported models have fixed spatial sizes, so accuracy is judged at INPUT_SIZE, and
the inference benchmark times the same variants separately at 224x224 (see bench/suites/infer.py).
Training precision: fp32, because on this CPU (AVX-512 bf16 dot products, no AMX) bf16 autocast
training measured ~1.8x slower than fp32, and channels_last slower too.

The demo data is held in memory as uint8 NCHW tensors; `DemoModel.batches` gives normalised batches
of a split in a fixed order, `DemoModel.train_loader` shuffled and augmented ones (the augmentation of
the recipe: random flips and translations, or random crops), and `DemoModel.evaluate` top-1 accuracy
computed by `torchspeed.metrics`.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
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
from torchspeed.args import progress_fn
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD, scan_folder
from torchspeed.metrics import correct_top1, top1_accuracy
from torchspeed.runtime import cache_dir, seed_everything, usable_cores

__all__ = ["DemoModel", "ImageTensorLoader", "load_demo_model", "demo_model_dir", "ready", "prepare_photos",
           "prepare_model", "IMAGENET_MEAN", "IMAGENET_STD"]


log = logging.getLogger(__name__)

N_IMAGES = 4000        # demo_folder(4000): image i has label i % 10
N_TRAIN = 3000         # the rest (1000) is the held-out split
INPUT_SIZE = 40        # trained and evaluated at this square size: ~31x fewer pixels than 224
EPOCHS = 4             # held-out top-1 0.607 on a 2-core EPYC (at 48 px: 0.619 in 1.4x the time; 3 epochs: 0.594)
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

    def train_loader(self, batch_size: int, crop: int | None = None, pad: int = 0, seed: int = 0
                     ) -> ImageTensorLoader:
        """Shuffled, augmented, normalised batches of the training split (see `ImageTensorLoader`)."""
        return ImageTensorLoader(self.train_images, self.train_labels, batch_size, self.mean, self.std, crop=crop,
                                 pad=pad, seed=seed)

    def evaluate(self, run: Callable[[torch.Tensor], Any], split: str = "heldout", batch_size: int = 64,
                 limit: int | None = None) -> float:
        """Top-1 accuracy of `run(batch) -> logits` (tensor or ndarray) on a split (torchspeed.metrics)."""
        return top1_accuracy(run, self.batches(split, batch_size, limit))

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "heldout":
            return self.heldout_images, self.heldout_labels
        if split == "train":
            return self.train_images, self.train_labels
        raise ValueError(f"split must be 'heldout' or 'train', got {split!r}")


class ImageTensorLoader:
    """Shuffled, augmented, normalised batches from uint8 NCHW images in memory: random horizontal
    flip, random translation by up to `pad` pixels (reflect padding), or random `crop` x `crop`
    crops. The same seed and epoch give the same batches, so the two arms of a comparison see
    exactly the same data."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean: tuple, std: tuple,
                 crop: int | None = None, pad: int = 0, seed: int = 0):
        if crop is not None and crop > min(images.shape[-2:]):
            raise ValueError(f"crop {crop} is larger than the images {tuple(images.shape[-2:])}")
        self.images, self.labels, self.batch_size, self.crop, self.pad = images, labels, batch_size, crop, pad
        self.mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std).view(1, 3, 1, 1) * 255
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.images) // self.batch_size  # drop the last partial batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.images), generator=gen)
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            x = _augment(self.images[idx], gen, self.crop, self.pad)
            yield (x.float() - self.mean) / self.std, self.labels[idx]


def _normalise(images: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (images.float().div_(255.0) - m) / s


def _recipe_hash() -> str:
    """The recipe's constants and the code of every function that shapes the weights or the stored data."""
    constants = [N_IMAGES, N_TRAIN, INPUT_SIZE, EPOCHS, PAD, BATCH_SIZE, PEAK_LR, WEIGHT_DECAY, LABEL_SMOOTHING, SEED,
                 list(IMAGENET_MEAN), list(IMAGENET_STD)]
    try:
        code = [inspect.getsource(fn) for fn in (_build_model, _load_image, _load_images, _augment, _normalise, _train)]
    except OSError:  # no source to read (a zipped install): the module's bytecode stands for it
        code = [fn.__code__.co_code.hex() for fn in (_build_model, _load_image, _load_images, _augment, _normalise,
                                                     _train)]
    return hashlib.sha256(json.dumps([constants, code]).encode()).hexdigest()[:12]


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
    _, samples = scan_folder(root)
    files = sorted((int(os.path.basename(path).split("_")[1].split(".")[0]), label, path) for path, label in samples)
    # PIL releases the GIL while decoding and resizing, so threads use every core.
    with ThreadPoolExecutor(max(1, usable_cores())) as pool:
        arrays = list(pool.map(lambda f: _load_image(f[2], size), files, chunksize=32))
    return torch.from_numpy(np.stack(arrays)), torch.tensor([f[1] for f in files], dtype=torch.int64)


def _augment(x: torch.Tensor, gen: torch.Generator, crop: int | None = None, pad: int = 0) -> torch.Tensor:
    """Random translation by up to `pad` pixels (reflect-pad, crop back to size; float result) or a
    random `crop` x `crop` crop, then a random horizontal flip. No colour jitter: hue is the label."""
    n, _, h, w = x.shape
    if pad > 0:  # translation: reflect-pad, then crop back to the original size
        x = F.pad(x.float(), (pad, pad, pad, pad), mode="reflect")
        crop_h, crop_w = h, w
        h, w = h + 2 * pad, w + 2 * pad
    elif crop is not None:
        crop_h = crop_w = crop
    if pad > 0 or crop is not None:
        top = torch.randint(0, h - crop_h + 1, (n,), generator=gen).tolist()
        left = torch.randint(0, w - crop_w + 1, (n,), generator=gen).tolist()
        x = torch.stack([x[i, :, top[i]:top[i] + crop_h, left[i]:left[i] + crop_w] for i in range(n)])
    flip = torch.rand(n, generator=gen) < 0.5
    return torch.where(flip.view(n, 1, 1, 1), x.flip(3), x)


def _train(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, say: Callable[[str], Any]
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
            x = _normalise(_augment(images[idx], gen, pad=PAD), IMAGENET_MEAN, IMAGENET_STD)
            y = labels[idx]
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=LABEL_SMOOTHING)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(y)
            correct += correct_top1(out.detach(), y)
        row = {"epoch": epoch + 1, "train_loss": loss_sum / len(images), "train_acc": correct / len(images),
               "seconds": time.perf_counter() - t0}
        history.append(row)
        say(_epoch_line(row))
    return history


def _epoch_line(row: dict[str, float]) -> str:
    """An epoch's progress line, with the time the others will take at its pace."""
    to_go = (EPOCHS - row["epoch"]) * row["seconds"]
    return (f"epoch {row['epoch']}/{EPOCHS} at {INPUT_SIZE}px: loss {row['train_loss']:.3f}, train acc "
            f"{row['train_acc']:.3f} ({row['seconds']:.0f} s" + (f"; about {to_go:.0f} s to go)" if to_go else ")"))


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


def _build(final: str, data_root: str, say: Callable[[str], Any]) -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, usable_cores()))
    say(f"decoding {N_IMAGES} demo images at {INPUT_SIZE}px")
    images, labels = _load_images(data_root, INPUT_SIZE)
    say(f"decoded in {time.perf_counter() - t0:.0f} s")
    if len(images) != N_IMAGES:
        raise ValueError(f"the demo folder {data_root!r} holds {len(images)} images, expected {N_IMAGES}; delete it to regenerate")
    seed_everything(SEED)
    model = _build_model()
    say(f"training ResNet-18 on {N_TRAIN} images at {INPUT_SIZE}px for {EPOCHS} epochs (plain fp32 loop)")
    history = _train(model, images[:N_TRAIN], labels[:N_TRAIN], say)
    model = model.to(memory_format=torch.contiguous_format).eval()
    demo = DemoModel(model, images[:N_TRAIN], labels[:N_TRAIN], images[N_TRAIN:], labels[N_TRAIN:], INPUT_SIZE,
                     IMAGENET_MEAN, IMAGENET_STD, accuracy=0.0)
    say("evaluating the fp32 model on the held-out split")
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
    log.info("demo model built: held-out top-1 %.3f at %d px (%.0f s)", accuracy, INPUT_SIZE, time.perf_counter() - t0)
    say(f"demo model built: held-out accuracy {accuracy:.3f} ({time.perf_counter() - t0:.0f} s)")


def demo_model_dir(progress: bool | Callable[[str], Any] = False) -> str:
    """The cache directory of the built demo model (building it first if needed; `progress`: True
    prints the build's stages to stderr, a callable receives them)."""
    from torchspeed.data.demo import demo_folder

    say = progress_fn(progress)
    data_root = demo_folder(N_IMAGES)
    final = _model_dir(data_root)
    if not os.path.isfile(os.path.join(final, "meta.json")):
        with _build_lock(os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.lock")):
            if not os.path.isfile(os.path.join(final, "meta.json")):
                _build(final, data_root, say)
    return final


def _model_dir(data_root: str) -> str:
    """Where the model trained on `data_root` by this recipe is cached (built or not)."""
    return os.path.join(cache_dir("models"), f"demo-resnet18-{os.path.basename(data_root)}-{_recipe_hash()}")


def ready() -> dict[str, bool]:
    """Whether the demo photos and the demo model are already cached (nothing is built)."""
    from torchspeed.data.demo import demo_folder_path

    photos = demo_folder_path(N_IMAGES)
    return {"demo photos": os.path.isdir(photos),
            "demo model": os.path.isfile(os.path.join(_model_dir(photos), "meta.json"))}


def prepare_photos(quick: bool = True, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    """The demo photos, generated (once) now: the step `torchspeed bench` runs before the suites that read them,
    in its own process like a suite (`quick` is that calling convention's; the photos are the same)."""
    from torchspeed.data.demo import demo_folder

    t0 = time.perf_counter()
    progress_fn(progress)(f"generating {N_IMAGES} photo-like demo JPEGs (500x375, cached)")
    demo_folder(N_IMAGES)
    return {"seconds": round(time.perf_counter() - t0, 1), "images": N_IMAGES}


def prepare_model(quick: bool = True, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    """The demo model, trained (once) now: the step `torchspeed bench` runs before the suites that use it,
    outside their budgets; its held-out accuracy and how long the build took."""
    t0 = time.perf_counter()
    with open(os.path.join(demo_model_dir(progress), "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return {"seconds": round(time.perf_counter() - t0, 1), "accuracy": meta.get("accuracy"),
            "epochs": EPOCHS, "build_seconds": meta.get("build_seconds")}


def load_demo_model(progress: bool | Callable[[str], Any] = False) -> DemoModel:
    """The trained demo ResNet-18 with its data split; built on first call (a few minutes), then cached.

    `progress`: True prints the build's stages to stderr, a callable receives them.
    `model` is a fresh fp32 copy in eval mode on every call, so callers may modify it freely.
    """
    path = demo_model_dir(progress)
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
    photos = prepare_photos(progress=lambda s: print(s, flush=True))
    d = load_demo_model(progress=lambda s: print(s, flush=True))
    print(f"demo photos ready in {photos['seconds']:.0f} s; held-out accuracy {d.accuracy:.3f} at {d.input_size}px "
          f"after {len(d.info['history'])} epochs; model built in {d.info['build_seconds']:.0f} s")
