"""Embedded demo data: a deterministic ImageFolder of photo-like JPEGs.

Nothing may be downloaded at run time, yet the pipeline must be measured on images that cost what
real photographs cost to decode: smooth shading, sharp edges, texture and sensor noise make a 500x375
JPEG at quality 90 weigh 40-60 KB like a real photo (flat colours decode several times faster, pure
noise several times slower). Each image holds a few objects whose hue is drawn around the class's hue,
plus distractors of any hue, so the classes are learnable but not trivially: a small CNN reaches
roughly 70-90% held-out accuracy, leaving room for lossy transformations (quantization, pruning) to
show a loss when there is one.
"""
from __future__ import annotations

import colorsys
import io
import logging
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from torchspeed.atomic import atomic_write, build_directory
from torchspeed.runtime import cache_dir

__all__ = ["make_photo_folder", "demo_folder", "class_name"]

log = logging.getLogger(__name__)

HUE_JITTER = 0.05  # std of an object's hue around its class hue (classes are 1/n_classes apart)


def class_name(label: int) -> str:
    return f"class_{label:02d}"


def _smooth_field(rng: np.random.Generator, w: int, h: int, cells: tuple[int, int], channels: int) -> np.ndarray:
    """Random values on a coarse grid, upsampled bicubically: smooth shading like out-of-focus light."""
    grid = rng.random((cells[1], cells[0], channels)).astype(np.float32)
    planes = [np.asarray(Image.fromarray(grid[..., c], mode="F").resize((w, h), Image.BICUBIC)) for c in range(channels)]
    return np.stack(planes, axis=-1)


def _render(index: int, n_classes: int, seed: int, size: tuple[int, int]) -> tuple[int, Image.Image]:
    w, h = size
    label = index % n_classes
    rng = np.random.default_rng([seed, index])
    # Background: smooth colour field plus mid-frequency texture (foliage, fabric, walls).
    img = 40 + 170 * _smooth_field(rng, w, h, (int(rng.integers(3, 7)), int(rng.integers(3, 6))), 3)
    img += 45 * (_smooth_field(rng, w, h, (w // 12, h // 12), 1) - 0.5)
    for k in range(int(rng.integers(3, 6)) + int(rng.integers(1, 3))):
        is_distractor = k >= 3 and rng.random() < 0.5
        hue = rng.random() if is_distractor else (label / n_classes + rng.normal(0, HUE_JITTER)) % 1.0
        rgb = 255 * np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.45, 0.95), rng.uniform(0.45, 0.95)), np.float32)
        r = rng.uniform(0.08, 0.22) * min(w, h)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        # Work inside the object's bounding box only (cheap), in box coordinates.
        x0, y0 = max(0, int(cx - r) - 4), max(0, int(cy - r) - 4)
        x1, y1 = min(w, int(cx + r) + 5), min(h, int(cy + r) + 5)
        if x1 - x0 < 2 or y1 - y0 < 2:
            continue
        cx, cy = cx - x0, cy - y0
        canvas = Image.new("L", (x1 - x0, y1 - y0))
        draw = ImageDraw.Draw(canvas)
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse((cx - r, cy - r * rng.uniform(0.5, 1.0), cx + r, cy + r * rng.uniform(0.5, 1.0)), fill=255)
        elif kind == 1:
            draw.rectangle((cx - r, cy - r * rng.uniform(0.4, 1.0), cx + r, cy + r), fill=255)
        else:
            angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 7))))
            draw.polygon([(cx + r * np.cos(a), cy + r * np.sin(a)) for a in angles], fill=255)
        mask = np.asarray(canvas.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2))), np.float32)[..., None] / 255
        # Object surface: its colour, shaded, with an oriented grating (stripes, weave, bark).
        theta, freq = rng.uniform(0, np.pi), rng.uniform(0.05, 0.35)
        yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
        grating = np.sin(freq * (xx * np.cos(theta) + yy * np.sin(theta)) + rng.uniform(0, 6.3))
        surface = rgb * (0.75 + 0.25 * rng.uniform(0.2, 1.0) * grating[..., None])
        box = img[y0:y1, x0:x1]
        box += (surface - box) * mask
    img *= rng.uniform(0.9, 1.1, size=3).astype(np.float32)  # white balance / exposure
    img += rng.uniform(4.0, 7.0) * rng.standard_normal(img.shape, dtype=np.float32)  # sensor noise
    return label, Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _photo_path(root: str, index: int, n_classes: int) -> str:
    return os.path.join(root, class_name(index % n_classes), f"img_{index:06d}.jpg")


def _write_range(root: str, indices: Sequence[int], n_classes: int, seed: int, size: tuple[int, int], quality: int,
                 atomic: bool = True) -> list[str]:
    """Write images `indices`; `atomic`: each through atomic_write (into a folder that may be in use),
    else plainly (into a build directory that is renamed into place only when whole)."""
    for i in indices:
        label, im = _render(i, n_classes, seed, size)
        path = os.path.join(root, class_name(label), f"img_{i:06d}.jpg")
        if atomic:
            with atomic_write(path) as f:
                im.save(f, format="JPEG", quality=quality)
        else:
            im.save(path, format="JPEG", quality=quality)
    return []


def _foreign_files(root: str, indices: Sequence[int], n_classes: int, seed: int, size: tuple[int, int],
                   quality: int) -> list[str]:
    """Which files at the names of images `indices` are not exactly the image that would be written there
    (another photo, a link, a FIFO: anything but a regular file with the same bytes)."""
    foreign = []
    for i in indices:
        path = _photo_path(root, i, n_classes)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            foreign.append(path)
            continue
        buf = io.BytesIO()
        _render(i, n_classes, seed, size)[1].save(buf, format="JPEG", quality=quality)
        with open(path, "rb") as f:
            if f.read() != buf.getvalue():
                foreign.append(path)
    return foreign


def _in_chunks(work: Callable[..., list[str]], root: str, indices: Sequence[int], num_workers: int,
               *args: object) -> list[str]:
    """`work(root, chunk, *args)` over `indices` in chunks of 64, in `num_workers` processes; the lists joined."""
    if num_workers <= 1 or len(indices) < 64:
        return work(root, indices, *args)
    chunks = [indices[s:s + 64] for s in range(0, len(indices), 64)]
    with ProcessPoolExecutor(num_workers) as pool:
        return [x for f in [pool.submit(work, root, c, *args) for c in chunks] for x in f.result()]


def _fill(root: str, n_images: int, n_classes: int, seed: int, size: tuple[int, int], quality: int,
          num_workers: int | None, atomic: bool) -> None:
    """Write the images into `root`. Into an existing folder (`atomic`) a name already taken is never
    replaced: the same image already there is kept; anything else there refuses the whole call, naming
    it, before any image is written."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        if not atomic:
            os.chmod(root, 0o777 & ~umask)  # a build directory (mkdtemp) is 0700; the folder gets the usual mode
        for c in range(n_classes):
            os.makedirs(os.path.join(root, class_name(c)), exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the demo folder {root!r}: {e.strerror}") from None
    num_workers = num_workers or min(os.cpu_count() or 1, 8)
    indices = list(range(n_images))
    if atomic:
        there = [i for i in indices if os.path.lexists(_photo_path(root, i, n_classes))]
        foreign = sorted(_in_chunks(_foreign_files, root, there, num_workers, n_classes, seed, size, quality))
        if foreign:
            more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
            raise FileExistsError(f"demo folder {root!r} already holds {foreign[0]!r}{more}, which is not the demo "
                                  "image of that name: it is never replaced; choose another folder or move it "
                                  "(nothing was written)")
        if there:
            log.info("demo folder %s: kept the %d images already there, wrote %d", root, len(there),
                     n_images - len(there))
        taken = set(there)
        indices = [i for i in indices if i not in taken]
    _in_chunks(_write_range, root, indices, num_workers, n_classes, seed, size, quality, atomic)


def make_photo_folder(
    root: str | os.PathLike,
    n_images: int,
    n_classes: int = 10,
    seed: int = 0,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    num_workers: int | None = None,
) -> str:
    """Write `n_images` photo-like JPEGs as an ImageFolder (`root/class_XX/img_NNNNNN.jpg`).

    Deterministic for (index, seed, size): the same call writes the same bytes. `size` is (width,
    height). Images are spread evenly over the classes (image i has label i % n_classes).
    `num_workers` processes write them (default: cores, at most 8; the bytes do not depend on it).
    Nothing half-written is ever left under a final name: a new `root` is built beside it and renamed
    into place when whole; into an existing `root` each image is written atomically, and only where its
    name is free: the same image already there is kept, any other file of that name refuses the call
    (FileExistsError naming it) before anything is written. Returns `root`.
    """
    if not isinstance(n_images, int) or n_images < 1:
        raise ValueError(f"n_images must be a positive integer, got {n_images!r}")
    if not isinstance(n_classes, int) or not 2 <= n_classes <= n_images:
        raise ValueError(f"n_classes must be an integer between 2 and n_images ({n_images}), got {n_classes!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality}")
    root = os.fspath(root)
    if os.path.isdir(root):
        _fill(root, n_images, n_classes, seed, size, quality, num_workers, atomic=True)
        return root
    if os.path.lexists(root):
        raise OSError(f"cannot create the demo folder {root!r}: it exists and is not a directory")
    try:
        build_directory(root, lambda tmp: _fill(tmp, n_images, n_classes, seed, size, quality, num_workers,
                                                atomic=False))
    except OSError as e:
        if "demo folder" in str(e):
            raise
        raise OSError(f"cannot create the demo folder {root!r}: {e.strerror or e}") from None
    return root


def demo_folder(n_images: int = 2000, n_classes: int = 10, seed: int = 0, size: tuple[int, int] = (500, 375)) -> str:
    """The cached demo ImageFolder for these settings, generated once (atomically) into the cache."""
    return build_directory(demo_folder_path(n_images, n_classes, seed, size),
                           lambda tmp: _fill(tmp, n_images, n_classes, seed, size, 90, None, atomic=False))


def demo_folder_path(n_images: int = 2000, n_classes: int = 10, seed: int = 0, size: tuple[int, int] = (500, 375)) -> str:
    """Where `demo_folder` keeps the demo ImageFolder for these settings (generated or not yet)."""
    return os.path.join(cache_dir("data"), f"photos-v2-n{n_images}-c{n_classes}-s{seed}-{size[0]}x{size[1]}")
