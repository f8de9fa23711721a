"""The data fix `doctor --try fast_loader` measures: a torch DataLoader reading image files (an
ImageFolder / DatasetFolder, or a Dataset of `(path, label)` samples) through the standard transforms
is swapped for `torchspeed.data.fast_loader` on the same files, crop, flip and normalisation read from
its transforms (torchvision's v1 or v2, in a Compose, nested, or held by a preset class as torchvision's
reference scripts write them). Why not only more workers: PIL's full-size JPEG decode is the cost, and on
few cores workers add no core; fast_loader decodes DCT-scaled and crops on uint8 in threads that release the GIL.

`describe` reads a DataLoader into a plain dict (in the script's process, without importing torch);
`candidates`, `code` and `numerics` (same files and labels; image statistics within tolerance, as
random crops never give equal pixels) run in the parent. The swap itself is `injection`'s.
"""
from __future__ import annotations

import inspect
import math
import os
from typing import Any

__all__ = ["EVAL_CROP_FRACTION", "candidates", "code", "describe", "keywords", "numerics", "MEAN_Z", "STD_RATIO"]

EVAL_CROP_FRACTION = 0.875  # fast_loader's evaluation crop: this share of the short side (Resize(256) + CenterCrop(224))
MEAN_Z = 4.0  # per-channel image means may differ by this many standard errors (random crops of other images)
MEAN_FLOOR = 0.05  # ... or by this much in normalised units, whichever is larger
STD_RATIO = (0.8, 1.25)  # the per-channel pixel std of the swapped loader's batches, relative to the script's
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_PIL_LOADERS = ("default_loader", "pil_loader", "accimage_loader")


# ====================================================================== child side: what the script's loader reads
def describe(loader: Any) -> dict[str, Any] | None:
    """What a DataLoader reads, when it is image files: {"dataset", "root", "samples", "supported", and
    either "reason" (why fast_loader cannot stand in) or "train", "crop", "scale", "mean", "std"}. None
    for a Dataset that is not image files (tensors, text...). Never raises: a recognition that fails is
    a reason, not a crash of the user's script."""
    try:
        return _describe(loader)
    except Exception as e:  # noqa: BLE001 - reading a user's Dataset must not cost their run
        return {"dataset": type(getattr(loader, "dataset", None)).__name__, "supported": False,
                "reason": f"its Dataset could not be read ({type(e).__name__}: {e})"}


def _describe(loader: Any) -> dict[str, Any] | None:
    ds = loader.dataset
    samples = getattr(ds, "samples", None) or getattr(ds, "imgs", None)
    if not _image_samples(samples):
        inner = getattr(ds, "dataset", None)  # torch.utils.data.Subset (random_split) of an image folder
        if inner is not None and _image_samples(getattr(inner, "samples", None)):
            return {"dataset": f"{type(ds).__name__} of {type(inner).__name__}", "supported": False,
                    "reason": "it reads a subset of the folder (random_split / Subset), fast_loader reads a whole folder"}
        return None
    first = os.path.abspath(samples[0][0])
    root = os.path.abspath(getattr(ds, "root", None) or os.path.dirname(os.path.dirname(first)))
    out: dict[str, Any] = {"dataset": type(ds).__name__, "root": root, "samples": len(samples), "supported": False}
    reason = _dataset_reason(ds)
    if reason is None:
        tf = _transforms(getattr(ds, "transform", None))
        if isinstance(tf, str):
            reason = tf
        else:
            out.update(tf)
    if reason is None and getattr(loader, "batch_size", None) is None:
        reason = "the DataLoader has no batch_size (a batch_sampler of its own)"
    if reason is None and getattr(loader, "collate_fn", None) is not None and \
            getattr(loader.collate_fn, "__name__", "") not in ("default_collate", "collate"):
        reason = f"the DataLoader has its own collate_fn ({getattr(loader.collate_fn, '__name__', 'a callable')})"
    out["supported"] = reason is None
    if reason:
        out["reason"] = reason
    return out


def _image_samples(samples: Any) -> bool:
    """A list of (path, int label) whose first path is an image file."""
    try:
        path, label = samples[0]
    except (TypeError, ValueError, IndexError, KeyError):
        return False
    return isinstance(path, (str, os.PathLike)) and isinstance(label, int) and \
        os.fspath(path).lower().endswith(IMAGE_SUFFIXES)


def _dataset_reason(ds: Any) -> str | None:
    """Why the Dataset's own reading would differ from fast_loader's, or None."""
    if getattr(ds, "target_transform", None) is not None:
        return "its Dataset has a target_transform (labels changed on the way)"
    image_loader = getattr(ds, "loader", None)
    if image_loader is not None and getattr(image_loader, "__name__", "") not in _PIL_LOADERS:
        return f"its Dataset opens images with its own loader ({getattr(image_loader, '__name__', 'a callable')})"
    for klass in type(ds).__mro__:
        if klass.__name__ == "DatasetFolder":
            if type(ds).__getitem__ is not klass.__getitem__:
                return f"{type(ds).__name__} overrides __getitem__ (it may do more than open, transform and label)"
            break
    return None


def _size(v: Any) -> int | None:
    """A square size: an int, or a sequence of one int or of two equal ints."""
    if isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)) and len(v) in (1, 2) and all(isinstance(x, int) for x in v) and v[0] == v[-1]:
        return int(v[0])
    return None


_PIXELS = {"PIL": "a PIL image", "uint8": "a uint8 tensor (0-255)", "float": "a float tensor scaled to [0, 1]",
           "float 0-255": "a float tensor of 0-255 values"}  # what a transform receives, as it is called in a reason
_NO_OPS = ("ToPureTensor", "Identity")  # v2's tv_tensor-to-plain-tensor step and the identity: pixels unchanged


def _name(t: Any) -> str:
    """A transform's name in a message: a function's own name ('<lambda>'), else its class."""
    return getattr(t, "__name__", type(t).__name__) if inspect.isroutine(t) else type(t).__name__


def _is_torchvision(t: Any) -> bool:
    """A torchvision transform object, v1 or v2 (not a class or an enum of those modules)."""
    return callable(t) and not isinstance(t, type) and type(t).__module__.startswith("torchvision.transforms")


def _steps_of(t: Any) -> list[Any] | None:
    """The transforms a container applies in order: a Compose (v1, v2, or any object holding a list in
    `transforms`) or an nn.Sequential; None for anything else."""
    steps = getattr(t, "transforms", None)
    if isinstance(steps, (list, tuple)):
        return list(steps)
    if type(t).__name__ == "Sequential" and type(t).__module__.startswith("torch.nn"):
        return list(t.children())
    return None


def _held(t: Any) -> list[tuple[str, Any]]:
    """The attributes of a user's object that are a pipeline (a container or a torchvision transform): how
    a preset class is read, e.g. torchvision's reference ClassificationPresetTrain, whose __call__
    applies the `self.transforms = Compose([...])` it built (an nn.Module preset holds it in _modules)."""
    attrs = getattr(t, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    modules = attrs.get("_modules")
    pairs = [(k, v) for k, v in attrs.items() if k != "_modules"]
    pairs += list(modules.items()) if isinstance(modules, dict) else []
    return [(k, v) for k, v in pairs if _steps_of(v) is not None or _is_torchvision(v)]


def _pipeline(t: Any, where: str, depth: int = 0) -> list[tuple[str, Any]] | str:
    """Every transform `t` applies, in order, each with where it sits ('ClassificationPresetTrain.
    transforms[2]'): containers opened, a preset class read through the one pipeline it holds, anything
    else one step; or why the order cannot be known."""
    if depth > 8:
        return f"its transform nests containers too deep to read ({where})"
    steps = _steps_of(t)
    if steps is None and not _is_torchvision(t) and not inspect.isroutine(t):
        held = _held(t)
        if len(held) > 1:
            return (f"its transform {type(t).__name__} holds several pipelines ({', '.join(k for k, _ in held)}); "
                    "which one it applies is not known")
        if held:
            return _pipeline(held[0][1], f"{where}.{held[0][0]}", depth + 1)
    if steps is None:
        return [(where, t)]
    out: list[tuple[str, Any]] = []
    for i, step in enumerate(steps):
        inner = _pipeline(step, f"{where}[{i}]", depth + 1)
        if isinstance(inner, str):
            return inner
        out += inner
    return out


def _image_dtype(dtype: Any) -> Any:
    """The dtype a ConvertImageDtype / ToDtype gives images: v2's ToDtype also takes a dict by type."""
    if not isinstance(dtype, dict):
        return dtype
    by_name = {getattr(k, "__name__", k): v for k, v in dtype.items()}
    return next((by_name[k] for k in ("Image", "Tensor", "others") if k in by_name), None)


def _transforms(transform: Any) -> dict[str, Any] | str:
    """The fast_loader settings a torchvision pipeline (v1 or v2; a Compose, nested, or held by a preset
    class) amounts to, or why it has none: the first transform fast_loader does not apply is named with
    where it sits. Pixels are followed from the PIL image: ToTensor, or PILToTensor / ToImage then
    ConvertImageDtype(torch.float) / ToDtype(torch.float32, scale=True), must give a float tensor
    scaled to [0, 1], as fast_loader's batches are, before Normalize."""
    if transform is None:
        return "its Dataset has no transform (it yields PIL images, not tensors)"
    steps = _pipeline(transform, type(transform).__name__)
    if isinstance(steps, str):
        return steps
    seen: dict[str, Any] = {}
    pixels = "PIL"
    for where, t in steps:
        name = _name(t)
        if name == "RandomResizedCrop":
            size, ratio = _size(t.size), tuple(t.ratio)
            if size is None:
                return f"RandomResizedCrop({t.size}) is not square; fast_loader crops squares"
            if any(abs(a - b) > 1e-3 for a, b in zip(ratio, (3 / 4, 4 / 3))):
                return f"RandomResizedCrop(ratio={ratio}) is not the default (3/4, 4/3) fast_loader draws from"
            seen["rrc"], seen["scale"] = size, [float(s) for s in t.scale]
        elif name == "RandomHorizontalFlip":
            if abs(float(t.p) - 0.5) > 1e-6:
                return f"RandomHorizontalFlip(p={t.p}); fast_loader flips with p=0.5"
            seen["flip"] = True
        elif name == "Resize":
            if getattr(t, "max_size", None) is not None:
                return f"Resize(max_size={t.max_size}) caps the long side; fast_loader resizes the short side only"
            size = t.size if isinstance(t.size, int) else \
                t.size[0] if isinstance(t.size, (list, tuple)) and len(t.size) == 1 else None
            if size is None:
                return f"Resize({t.size}) squashes to a fixed shape; fast_loader resizes the short side"
            seen["resize"] = int(size)
        elif name == "CenterCrop":
            if (size := _size(t.size)) is None:
                return f"CenterCrop({t.size}) is not square; fast_loader crops squares"
            seen["center"] = size
        elif name == "ToTensor":
            pixels = "float"
        elif name in ("PILToTensor", "ToImage", "ToImageTensor"):
            pixels = "uint8" if pixels == "PIL" else pixels
        elif name in ("ConvertImageDtype", "ToDtype"):
            dtype = _image_dtype(getattr(t, "dtype", None))
            if pixels == "PIL" or dtype is None:
                continue  # v2 passes a PIL image through; a None dtype leaves images as they are
            if str(dtype) != "torch.float32":
                return f"{name}({dtype}) ({where}) makes {dtype} images; fast_loader's are float32"
            if pixels == "uint8":
                pixels = "float" if name == "ConvertImageDtype" or getattr(t, "scale", False) else "float 0-255"
        elif name == "Normalize":
            if pixels != "float":
                return f"Normalize ({where}) is given {_PIXELS[pixels]}; fast_loader normalises {_PIXELS['float']}"
            seen["mean"], seen["std"] = [float(m) for m in t.mean], [float(s) for s in t.std]
        elif name not in _NO_OPS:
            return f"its transforms include {name} ({where}), which fast_loader does not apply"
    if pixels == "float 0-255":
        return ("its images stay 0-255 floats (ToDtype without scale=True); fast_loader's are scaled to [0, 1] "
                "(ToDtype(torch.float32, scale=True))")
    if pixels != "float":
        return ("its transforms do not end in a float tensor scaled to [0, 1] (ToTensor, or PILToTensor / ToImage "
                "then ConvertImageDtype(torch.float) / ToDtype(torch.float32, scale=True))")
    norm = {"mean": seen.get("mean"), "std": seen.get("std")}
    if "rrc" in seen:
        if not seen.get("flip") or "resize" in seen or "center" in seen:
            return ("RandomResizedCrop without RandomHorizontalFlip (fast_loader's training crop always flips)"
                    if not seen.get("flip") else "RandomResizedCrop combined with Resize / CenterCrop")
        return {"train": True, "crop": seen["rrc"], "scale": seen["scale"], **norm}
    if seen.get("flip"):
        return "RandomHorizontalFlip without RandomResizedCrop; fast_loader flips only with its random crop"
    if "resize" in seen and "center" in seen:
        fraction = seen["center"] / seen["resize"]
        if abs(fraction - EVAL_CROP_FRACTION) > 0.02:
            return (f"Resize({seen['resize']}) + CenterCrop({seen['center']}) keeps {fraction:.3f} of the short side; "
                    f"fast_loader's evaluation crop keeps {EVAL_CROP_FRACTION}")
        return {"train": False, "crop": seen["center"], "scale": None, **norm}
    return "its transforms neither crop at random (RandomResizedCrop) nor resize and centre-crop"


def keywords(d: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """fast_loader's keywords for a description `d` and a tried `value` (the ones that differ from its
    defaults are what `code` prints)."""
    kw: dict[str, Any] = {"train": d["train"], "crop": d["crop"]}
    if d["train"] and d.get("scale") and tuple(d["scale"]) != (0.08, 1.0):
        kw["scale"] = tuple(d["scale"])
    kw["mean"] = tuple(d["mean"]) if d.get("mean") else None
    kw["std"] = tuple(d["std"]) if d.get("std") else None
    kw.update(device=value["device"], channels_last=False, num_workers=0, threads=value["threads"])
    return kw


# ====================================================================== parent side
def candidates(loaders: list[dict[str, Any]], cores: int, device: str) -> str | list[dict[str, Any]]:
    """The fast_loader settings to try for the training loaders' records, or why there are none.
    Decoding threads: one, and half the cores (the step's own threads keep the rest)."""
    images = [ld["images"] for ld in loaders if ld.get("images")]
    if not images:
        return "the loop's DataLoader does not read image files (fast_loader reads the JPEG / PNG files of an ImageFolder)"
    ok = [d for d in images if d.get("supported")]
    if not ok:
        return f"the loop's image Dataset ({images[0].get('dataset')}) is read differently: {images[0].get('reason')}"
    d = ok[0]
    return [{"threads": n, "device": device, "root": d["root"], "train": d["train"], "crop": d["crop"]}
            for n in sorted({1, max(1, cores // 2)})]


def code(value: dict[str, Any], loaders: list[dict[str, Any]]) -> str:
    """The lines that keep the fix: the script's DataLoader replaced by fast_loader with what was measured."""
    d = next((ld["images"] for ld in loaders if (ld.get("images") or {}).get("root") == value["root"]), None)
    bs = next((ld.get("batch_size") for ld in loaders if (ld.get("images") or {}).get("root") == value["root"]), None)
    if d is None:
        return f"loader = ts.data.fast_loader({value['root']!r}, batch_size=..., crop={value['crop']})"
    kw = keywords(d, value)
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    what = "RandomResizedCrop + RandomHorizontalFlip" if d["train"] else "Resize + CenterCrop"
    return (f"import torchspeed as ts\n"
            f"# the same files, {what} {d['crop']}, {'Normalize' if d.get('mean') else 'no Normalize'}; "
            "batches already on the device\n"
            f"loader = ts.data.fast_loader({d['root']!r}, batch_size={bs}, {args})")


def numerics(base: dict[str, Any], fixed: dict[str, Any], batches: int) -> dict[str, Any]:
    """Does the swapped loader give the same data? The same files with the same labels (checked in the
    script's process when the swap was made), and per channel, over the first `batches` batches, image
    means within MEAN_Z standard errors (or MEAN_FLOOR) of the script's and a pixel std within STD_RATIO."""
    notes = (fixed.get("fix_notes") or {}).get("fast_loader") or {}
    sb = [s for s in base.get("batch_stats") or [] if s][:batches]
    sf = [s for s in fixed.get("batch_stats") or [] if s][:batches]
    out: dict[str, Any] = {"kind": "images", "max_rel_diff": None, "same_samples": notes.get("same_samples"),
                           "tolerance": f"the same files and labels; per channel over the first {batches} batches, "
                                        f"image means within {MEAN_Z:g} standard errors (or {MEAN_FLOOR:g}) and pixel std "
                                        f"within {STD_RATIO[0]:g}-{STD_RATIO[1]:g}x of the script's loader"}
    if not notes:
        out.update(ok=False, reason="the swap was not made: no DataLoader of the described files was iterated")
        return out
    if not sb or not sf:
        out["ok"] = None if notes.get("same_samples") else False
        return out
    channels = []
    ok = bool(notes.get("same_samples"))
    for c in range(min(len(sb[0]["std"]), len(sf[0]["std"]))):
        mb, vb, nb = _moments([m[c] for s in sb for m in s["means"]])
        mf, vf, nf = _moments([m[c] for s in sf for m in s["means"]])
        se = math.sqrt(vb / nb + vf / nf)
        std_b = sum(s["std"][c] for s in sb) / len(sb)
        std_f = sum(s["std"][c] for s in sf) / len(sf)
        ratio = std_f / std_b if std_b > 0 else float("inf")
        mean_ok = abs(mb - mf) <= max(MEAN_Z * se, MEAN_FLOOR)
        std_ok = STD_RATIO[0] <= ratio <= STD_RATIO[1]
        ok = ok and mean_ok and std_ok
        channels.append({"mean": [round(mb, 4), round(mf, 4)], "mean_tolerance": round(max(MEAN_Z * se, MEAN_FLOOR), 4),
                         "std": [round(std_b, 4), round(std_f, 4)], "ok": mean_ok and std_ok})
    out.update(ok=ok, channels=channels)
    return out


def _moments(values: list[float]) -> tuple[float, float, int]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, var, n
