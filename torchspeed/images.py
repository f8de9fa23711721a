"""Image-classification conventions every layer shares: the ImageFolder layout, ImageNet normalisation,
the one image-size guard (a decompression bomb is refused before any pixel is decoded) used by pack
and by every reader of images, and the one conversion of any PIL image to 8-bit RGB."""
from __future__ import annotations

import io
import logging
import os
import stat
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS", "MAX_IMAGE_PIXELS", "scan_folder",
           "check_image_size", "image_size_error", "open_image", "read_image_file", "rgb_image", "shown", "quoted"]

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The most pixels one image may have (about 13,400 x 13,400): PIL's own decompression-bomb error limit,
# so pack (which opens files with PIL) and folder readers (which read a JPEG's size from its header and
# decode it with libjpeg) refuse the same images. A photo needs far fewer; one over it is a bomb or a scan.
MAX_IMAGE_PIXELS = 2 * 89_478_485
_WARNED: set[tuple[str, ...]] = set()  # what scan_folder already warned about in this process


def shown(path: str) -> str:
    """`path` as text that prints anywhere: bytes of a non-UTF-8 file name shown as \\xNN."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except (TypeError, ValueError):
        return str(path)


def quoted(path: str) -> str:
    """`path` in quotes for a message, printable (see `shown`): '/data/caf\\xe9.jpg'."""
    return f"'{shown(path)}'"


def image_size_error(width: int, height: int) -> str | None:
    """Why an image whose header claims width x height is refused (no pixels, or more than
    MAX_IMAGE_PIXELS), worded to follow the image's name; None when the size is fine."""
    if width <= 0 or height <= 0:
        return f"claims a size of {width}x{height} pixels: corrupt header"
    if width * height > MAX_IMAGE_PIXELS:
        return (f"claims {width}x{height} = {width * height:,} pixels, more than the limit of {MAX_IMAGE_PIXELS:,} "
                "(a decompression bomb, or not a photo); it was not decoded")
    return None


def check_image_size(width: int, height: int, name: str) -> None:
    """Refuse an image whose header claims more than MAX_IMAGE_PIXELS pixels (or no pixels), before decoding it."""
    why = image_size_error(width, height)
    if why:
        raise ValueError(f"image {quoted(name)} {why}")


def _kind_of(path: str) -> str:
    """What a file that is not a regular file is, for messages."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "not a regular file")


def read_image_file(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file `path`. Opened without blocking, so a FIFO or device that took an
    image's name is refused (ValueError naming it) instead of waiting for ever for a writer."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{quoted(path)} is {_kind_of(path)}, not an image file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def open_image(source: str | os.PathLike | bytes | memoryview, name: str | None = None) -> Any:
    """A PIL image opened lazily (header only) with the size guard applied: nothing is decoded yet.

    `source` is a path (a regular file: see `read_image_file`) or the file's bytes; `name` names it in
    errors (default: the path). A header over the pixel limit raises ValueError naming the file; so
    does a file PIL cannot identify.
    """
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source) if name is None else name
        try:
            source = read_image_file(source)
        except OSError as e:
            raise ValueError(f"cannot read image {quoted(name)}: {e.strerror or e}") from None
    name = "image" if name is None else name
    try:
        im = Image.open(io.BytesIO(source))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image {quoted(name)} has more than the limit of {MAX_IMAGE_PIXELS:,} pixels (a "
                         f"decompression bomb, or not a photo: {e}); it was not decoded") from None
    except Image.UnidentifiedImageError:
        what = "an empty file" if len(source) == 0 else "not an image (no format PIL knows)"
        raise ValueError(f"cannot read image {quoted(name)}: {what}") from None
    except Exception as e:  # a corrupt or truncated header, a text-chunk bomb
        raise ValueError(f"cannot read image {quoted(name)}: {type(e).__name__}: {e}") from None
    try:
        check_image_size(*im.size, name)
    except ValueError:
        im.close()
        raise
    return im


def rgb_image(im: Any) -> Any:
    """Any PIL image as an 8-bit RGB PIL image, its values scaled rather than clipped.

    PIL's own `convert("RGB")` clips: a 16-bit grey PNG (0..65535) comes out nearly white. Here 16-bit
    modes (I;16*, and I holding 0..65535, as PIL reads 16-bit PNG, TIFF and PGM) are scaled by
    255/65535; F in 0..1 by 255, F in 0..255 kept; other I and F images are stretched from their own
    range (32-bit counts, measurements). Transparency (an alpha band, or a palette or grey image's transparent colour) is composited
    over white, as a viewer shows it on a page: the colour stored under a transparent pixel is arbitrary.
    Every other mode (CMYK, YCbCr, grey, bilevel, palette) goes through PIL's conversion.
    """
    mode = im.mode
    if mode == "RGB" and "transparency" not in im.info:
        return im
    if mode in ("I", "F") or mode.startswith("I;16"):
        return Image.fromarray(_grey8(im), "L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = (im.convert("LA") if mode == "La" else im).convert("RGBA")  # La (premultiplied) has no direct route
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


def _grey8(im: Any) -> Any:
    """A one-band image of more than 8 bits (I;16*, I, F) as uint8 values, scaled (see `rgb_image`)."""
    a = np.asarray(im).astype(np.float64)
    a[~np.isfinite(a)] = 0
    low, high = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if im.mode.startswith("I;16") or (im.mode == "I" and low >= 0 and high <= 65535):
        scale, offset = 255 / 65535, 0.0
    elif im.mode == "F" and low >= 0 and high <= 1:
        scale, offset = 255.0, 0.0
    elif im.mode == "F" and low >= 0 and high <= 255:
        scale, offset = 1.0, 0.0
    else:  # values of their own range (32-bit integers, floats): stretched to 0..255
        scale, offset = (255 / (high - low) if high > low else 0.0), low
    return np.clip(np.rint((a - offset) * scale), 0, 255).astype(np.uint8)


def scan_folder(root: str, extensions: tuple[str, ...] | None = None,
                skipped: list[tuple[str, str]] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """ImageFolder layout: one sub-directory per class (sorted), every non-hidden file a sample.

    Returns (classes, [(path, label), ...]). pack() applies no extension filter (a stray non-image file
    is reported, on_error decides, instead of silently ignored); readers of a folder keep `extensions`
    only, as torchvision's ImageFolder does. Symbolic links to directories are followed, each real
    directory once: a link loop (`cat/loop -> .`) or a second link to a directory already read adds nothing.

    What is not a regular file (a FIFO, socket, device, broken link: reading one would block or fail)
    and folders that cannot be listed are left out and named: appended to `skipped` as (path, why)
    when it is given, else in a warning on the "torchspeed" logger. A class folder without images
    stays a class (labels follow the sorted folder names, so train/ and val/ keep the same numbers;
    the class is never seen in training, which still runs), named in a warning.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source folder {root!r} does not exist") if not os.path.exists(root) else \
            NotADirectoryError(f"source {root!r} is not a directory")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(f"{root!r} has no class sub-directories; expected the ImageFolder layout ROOT/CLASS/IMAGE")
    class_dirs = [os.path.join(root, name) for name in classes]
    # the root and the class folders are read as such: a link up or from one class into another is not followed
    seen = {os.path.realpath(d) for d in [root] + class_dirs}
    left_out: list[tuple[str, str]] = []
    samples, empty = [], []
    for label, top in enumerate(class_dirs):
        found = _walk(top, seen, extensions, left_out)
        if not found:
            empty.append(classes[label])
        samples += [(path, label) for path in found]
    if not samples:
        raise ValueError(f"{root!r} has class folders but no files in them")
    if skipped is not None:
        skipped += left_out
    elif left_out:
        _warn_once(("skipped", root, *(p for p, _ in left_out)),
                   f"{root!r}: left out {len(left_out)} entr{'y' if len(left_out) == 1 else 'ies'} that cannot be read "
                   f"as images: " + "; ".join(f"{quoted(p)} is {why}" for p, why in left_out[:3])
                   + ("; ..." if len(left_out) > 3 else ""))
    if empty:
        _warn_once(("empty", root, *empty),
                   f"{root!r}: class folder{'s' if len(empty) > 1 else ''} {', '.join(map(repr, empty[:5]))}"
                   f"{', ...' if len(empty) > 5 else ''} hold{'' if len(empty) > 1 else 's'} no images: kept as "
                   "classes (labels follow the folder names) that training never sees; add images or remove the folder")
    return classes, samples


def _walk(top: str, seen: set[str], extensions: tuple[str, ...] | None, left_out: list[tuple[str, str]]) -> list[str]:
    """The files under `top` in os.walk's top-down sorted order; directory links followed once each;
    entries that are not regular files (and folders that cannot be listed) added to `left_out`."""
    found, stack = [], [top]
    while stack:
        directory = stack.pop()
        try:
            entries = sorted((e for e in os.scandir(directory) if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError as e:
            left_out.append((directory, f"a folder that cannot be listed ({e.strerror})"))
            continue
        subdirs, files = [], []
        for entry in entries:
            if entry.is_dir():  # follows links: each real directory once
                real = os.path.realpath(entry.path)
                if real not in seen:
                    seen.add(real)
                    subdirs.append(entry.path)
            elif extensions is None or entry.name.lower().endswith(extensions):
                if entry.is_file():
                    files.append(entry.path)
                else:
                    left_out.append((entry.path, _kind_of(entry.path)))
        found.append((directory, files))
        stack += reversed(subdirs)
    return [path for _, files in sorted(found) for path in files]


def _warn_once(key: tuple[str, ...], message: str) -> None:
    """A warning on the "torchspeed" logger, once per process (a folder is scanned again for each loader)."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)
