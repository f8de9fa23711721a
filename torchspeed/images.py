"""Image-classification conventions every layer shares: the ImageFolder layout and ImageNet normalisation."""
from __future__ import annotations

import os

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS", "scan_folder"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def scan_folder(root: str, extensions: tuple[str, ...] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """ImageFolder layout: one sub-directory per class (sorted), every non-hidden file a sample.

    Returns (classes, [(path, label), ...]). pack() applies no extension filter (a stray non-image file
    is reported, on_error decides, instead of silently ignored); readers of a folder keep `extensions`
    only, as torchvision's ImageFolder does.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source folder {root!r} does not exist") if not os.path.exists(root) else \
            NotADirectoryError(f"source {root!r} is not a directory")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(f"{root!r} has no class sub-directories; expected the ImageFolder layout ROOT/CLASS/IMAGE")
    samples = []
    for label, name in enumerate(classes):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            samples += [(os.path.join(dirpath, f), label) for f in sorted(files) if not f.startswith(".")
                        and (extensions is None or f.lower().endswith(extensions))]
    if not samples:
        raise ValueError(f"{root!r} has class folders but no files in them")
    return classes, samples
