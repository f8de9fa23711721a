"""Image-classification conventions every layer shares: the ImageFolder layout, ImageNet normalisation,
and the one image-size guard (a decompression bomb is refused before any pixel is decoded) used by
pack and by every reader of an image folder."""
from __future__ import annotations

import io
import os
from typing import Any

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS", "MAX_IMAGE_PIXELS", "scan_folder",
           "check_image_size", "open_image", "shown", "quoted"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The most pixels one image may have (about 13,400 x 13,400): PIL's own decompression-bomb error limit,
# so pack (which opens files with PIL) and folder readers (which read a JPEG's size from its header and
# decode it with libjpeg) refuse the same images. A photo needs far fewer; one over it is a bomb or a scan.
MAX_IMAGE_PIXELS = 2 * 89_478_485


def shown(path: str) -> str:
    """`path` as text that prints anywhere: bytes of a non-UTF-8 file name shown as \\xNN."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except (TypeError, ValueError):
        return str(path)


def quoted(path: str) -> str:
    """`path` in quotes for a message, printable (see `shown`): '/data/caf\\xe9.jpg'."""
    return f"'{shown(path)}'"


def check_image_size(width: int, height: int, name: str) -> None:
    """Refuse an image whose header claims more than MAX_IMAGE_PIXELS pixels (or no pixels), before decoding it."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image {quoted(name)} claims a size of {width}x{height} pixels: corrupt header")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image {quoted(name)} claims {width}x{height} = {width * height:,} pixels, more than the "
                         f"limit of {MAX_IMAGE_PIXELS:,} (a decompression bomb, or not a photo); it was not decoded")


def open_image(source: str | os.PathLike | bytes | memoryview, name: str | None = None) -> Any:
    """A PIL image opened lazily (header only) with the size guard applied: nothing is decoded yet.

    `source` is a path or the file's bytes; `name` names it in errors (default: the path). A header
    over the pixel limit raises ValueError naming the file; so does a file PIL cannot identify.
    """
    from PIL import Image

    name = name if name is not None else os.fspath(source) if isinstance(source, (str, os.PathLike)) else "image"
    fp = os.fspath(source) if isinstance(source, (str, os.PathLike)) else io.BytesIO(source)
    try:
        im = Image.open(fp)
    except Image.DecompressionBombError as e:
        raise ValueError(f"image {quoted(name)} has more than the limit of {MAX_IMAGE_PIXELS:,} pixels (a "
                         f"decompression bomb, or not a photo: {e}); it was not decoded") from None
    except Image.UnidentifiedImageError:
        what = "an empty file" if _is_empty(source) else "not an image (no format PIL knows)"
        raise ValueError(f"cannot read image {quoted(name)}: {what}") from None
    except Exception as e:  # a corrupt or truncated header, a text-chunk bomb
        raise ValueError(f"cannot read image {quoted(name)}: {type(e).__name__}: {e}") from None
    try:
        check_image_size(*im.size, name)
    except ValueError:
        im.close()
        raise
    return im


def _is_empty(source: Any) -> bool:
    try:
        return os.path.getsize(source) == 0 if isinstance(source, (str, os.PathLike)) else len(source) == 0
    except (OSError, TypeError):
        return False


def scan_folder(root: str, extensions: tuple[str, ...] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """ImageFolder layout: one sub-directory per class (sorted), every non-hidden file a sample.

    Returns (classes, [(path, label), ...]). pack() applies no extension filter (a stray non-image file
    is reported, on_error decides, instead of silently ignored); readers of a folder keep `extensions`
    only, as torchvision's ImageFolder does. Symbolic links to directories are followed, each real
    directory once: a link loop (`cat/loop -> .`) or a second link to a directory already read adds nothing.
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
    samples = []
    for label, top in enumerate(class_dirs):
        found = []
        for dirpath, dirnames, files in os.walk(top, followlinks=True):
            keep = []
            for d in sorted(d for d in dirnames if not d.startswith(".")):
                real = os.path.realpath(os.path.join(dirpath, d))
                if real not in seen:
                    seen.add(real)
                    keep.append(d)
            dirnames[:] = keep
            found.append((dirpath, sorted(f for f in files if not f.startswith(".")
                                          and (extensions is None or f.lower().endswith(extensions)))))
        for dirpath, names in sorted(found):
            samples += [(os.path.join(dirpath, f), label) for f in names]
    if not samples:
        raise ValueError(f"{root!r} has class folders but no files in them")
    return classes, samples
