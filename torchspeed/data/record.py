"""The sample record every source hands the loader, and how an image and a label become one: JPEG
bytes stay encoded until a decoder crops them, anything else is RGB HWC uint8 pixels; labels are ints."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from torchspeed.data.decode import Decoder, get_decoder, jpeg_info
from torchspeed.images import check_image_size, image_size_error, open_image, rgb_image

__all__ = ["Record", "UnsupportedSample", "encoded_record", "decode_record", "to_hwc_uint8", "integer_label"]


class Record(NamedTuple):
    """One stored sample before decoding: `kind` is 'jpeg', 'raw' or 'array' (already decoded).

    A NamedTuple (one is made per sample read): half the cost of a frozen dataclass, with the GIL held."""

    kind: str
    payload: Any  # bytes-like for jpeg/raw, HWC uint8 ndarray for array
    height: int
    width: int
    label: int


def decode_record(rec: Record, decoder: str | Decoder = "simplejpeg", min_h: int = 0, min_w: int = 0) -> np.ndarray:
    """A record's pixels as RGB HWC uint8 (JPEG decoded, raw and arrays returned as they are)."""
    if rec.kind == "jpeg":
        dec = get_decoder(decoder) if isinstance(decoder, str) else decoder
        return dec.decode(rec.payload, min_h, min_w)
    return rec.payload


def encoded_record(data: Any, label: int, name: str) -> Record:
    """An encoded image file's bytes as a record: a JPEG stays encoded (its size read from the header and
    checked against the pixel limit before anything is decoded), other formats (PNG, ...) are decoded
    here by PIL. `name` (a path, or a member of a shard) names the image in errors."""
    if data[:2] == b"\xff\xd8":
        h, w, components = jpeg_info(data)
        check_image_size(w, h, name)
        if components in (1, 3):  # grey or YCbCr: libjpeg decodes it to RGB (CMYK goes through PIL)
            return Record("jpeg", data, h, w, label)
    with open_image(bytes(data), name) as im:
        img = to_hwc_uint8(im)
    return Record("array", img, img.shape[0], img.shape[1], label)


class UnsupportedSample(ValueError):
    """A sample the torchspeed pipeline does not take (an already-transformed float tensor, an odd shape,
    not an (image, label) pair): not a broken sample, and a plain DataLoader may still read it."""


def to_hwc_uint8(x: Any) -> np.ndarray:
    """A PIL image, HWC uint8 (or uint16) array or CHW uint8 tensor -> RGB HWC uint8 array: the decoders'
    output format, for images that arrive already decoded (a Dataset's samples, a file PIL reads).

    PIL images of any mode go through `torchspeed.images.rgb_image` (16-bit scaled, transparency over
    white) once their size passes the pixel limit; uint16 pixels are scaled by 255/65535, four channels
    composited over white the same way. What the pipeline does not take raises UnsupportedSample."""
    if isinstance(x, Image.Image):
        why = image_size_error(*x.size)
        if why:
            raise ValueError(f"the image {why}")
        return np.asarray(rgb_image(x))
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor: CHW (or HW)
        t = x.detach().cpu()
        if t.dtype.is_floating_point:
            raise UnsupportedSample("a float tensor image is ambiguous (0..1 or 0..255?); give uint8 CHW tensors or "
                                    "PIL images")
        a = t.numpy()
        a = a if a.ndim == 2 else np.moveaxis(a, 0, -1)
    else:
        a = np.asarray(x)
    if a.dtype == np.uint16:
        a = ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if a.dtype != np.uint8:
        raise UnsupportedSample(f"expected uint8 pixels, got {a.dtype}")
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise UnsupportedSample(f"expected an HWC image with 1, 3 or 4 channels, got shape {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"the image is empty ({a.shape[0]}x{a.shape[1]} pixels)")
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    if a.shape[2] == 4:  # RGBA over white, as rgb_image does for a PIL image
        alpha = a[..., 3:].astype(np.uint32)
        a = ((a[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    return np.ascontiguousarray(a)


def integer_label(y: Any) -> int:
    """A sample's label as an int: a Python or numpy integer (or a whole float such as 3.0), or such a
    one-element tensor or array. Anything else (a class name, 0.5, a one-hot vector) is a ValueError
    saying what it is."""
    if isinstance(y, (bool, np.bool_)):
        what = f"a bool ({y})"
    elif isinstance(y, (int, np.integer)):
        return int(y)
    elif isinstance(y, (float, np.floating)) and float(y).is_integer():
        return int(y)  # 3.0 from a table of labels
    elif hasattr(y, "dtype") and hasattr(y, "shape"):
        dtype = str(y.dtype).replace("torch.", "")
        if ("int" in dtype or "float" in dtype) and int(np.prod(tuple(y.shape))) == 1:
            value = y.reshape(()).item()
            if float(value).is_integer():
                return int(value)
        what = f"a {type(y).__name__} of {dtype}, shape {tuple(y.shape)}"
    elif isinstance(y, str):
        what = f"a str ({y!r})"
    else:
        what = f"a {type(y).__name__} ({str(y)[:40]})"
    raise ValueError(f"its label is {what}: labels must be integer class indices (0 for the first class, 1 for "
                     "the next...); map class names to indices in the Dataset")
