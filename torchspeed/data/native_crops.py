"""A batch of crops rendered from JPEG bytes in one native call (data/_crops.c), for the `turbojpeg` decoder.

Why: a crop rendered in Python takes five C calls per sample (the decode, the resize, the flip, the CHW
split, the decoder's setup), each releasing the GIL and taking it back; on few cores a loader thread
that finds the GIL taken sleeps and is woken for each, so a second thread added little. The native call
renders the whole batch with the GIL released once, and no Python runs per sample.

The pixels: the decode is `TurboJpeg.decode`'s with a region; the resize uses OpenCV's coordinates and
kernels (INTER_LINEAR, INTER_AREA past a 2x shrink) in its own integer arithmetic, so a pixel may differ
from `augment.render`'s by one level (tests/test_native_crops.py). A sample it does not render (data that does
not decode, a box that is empty or leaves its image, a stored size that is not the JPEG's, a chroma layout it
cannot crop, a box shrunk past 2x on one axis and grown on the other, where OpenCV's own rules differ by
version) has a non-zero status: the loader renders it again in Python, which names it or renders it. Compiled at install as an optional
extension: without a C compiler the install goes on and the loader renders sample by sample.
"""
from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["NativeCrops", "native_crops"]


def _load(library: str) -> Any:
    spec = importlib.util.find_spec("torchspeed.data._crops")
    if spec is None or not spec.origin:
        raise ImportError("torchspeed's native crop renderer was not compiled (no C compiler when it was installed)")
    lib = ctypes.CDLL(spec.origin)  # CDLL: the GIL is released for the whole call
    lib.ts_crops_load.argtypes, lib.ts_crops_load.restype = [ctypes.c_char_p], ctypes.c_int
    if lib.ts_crops_load(library.encode()) != 0:
        raise ImportError(f"torchspeed's native crop renderer cannot use {library}")
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.ts_crops_render.argtypes = [i, vp, vp, vp, i, i, i, ctypes.c_int64, vp, vp, vp, vp, vp]
    lib.ts_crops_render.restype = i
    return lib


class NativeCrops:
    """`render(payloads, heights, widths, boxes, out, chw)`: each JPEG's box, decoded, resized to the slot
    size, flipped as its box says, written into its slot of `out`; the per-sample status (0 = rendered)."""

    def __init__(self, library: str):
        self._lib = _load(library)  # libturbojpeg's path (the one data/libturbojpeg.py loaded)
        self._local = threading.local()

    def _gathered(self, payloads: Sequence[Any]) -> tuple[int, np.ndarray]:
        """The batch's JPEGs copied end to end into this thread's buffer (reused: a fresh one per batch
        would fault its pages in each time): its address and the offsets of each."""
        views = [m if m.format == "B" else m.cast("B") for m in map(memoryview, payloads)]
        sizes = [m.nbytes for m in views]
        offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        total = int(offsets[-1])
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < total:
            buf = self._local.buf = np.empty(total + total // 4 + 1, np.uint8)
            self._local.view = memoryview(buf)
        view = self._local.view
        for m, a, b in zip(views, offsets[:-1].tolist(), offsets[1:].tolist()):
            view[a:b] = m
        return buf.ctypes.data, offsets

    def render(self, payloads: Sequence[Any], heights: Sequence[int], widths: Sequence[int], boxes: Sequence[Any],
               out: np.ndarray, chw: bool, max_pixels: int,
               normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> np.ndarray:
        """`out`: a C-contiguous (n, 3, s, s) batch if `chw`, else (n, s, s, 3): uint8, or float32 with
        `normalize` = (scale, shift) per channel, each pixel then written as `x * scale + shift` (x the uint8
        value, in float32: the pixels `prefetch.normalize_batch` makes of the uint8 batch). `boxes`: (top,
        left, height, width, flip) per sample, in stored pixels (`heights`, `widths`). A sample whose status
        is not 0 (an empty box or one outside its image, a JPEG whose size is not the stored one, a size refused,
        data that cannot be decoded: see data/_crops.c) leaves its slot as it was."""
        n = len(payloads)
        dtype = np.float32 if normalize is not None else np.uint8
        if out.dtype != dtype or not out.flags.c_contiguous or out.ndim != 4 or out.shape[0] < n:
            raise ValueError(f"out must be a C-contiguous {np.dtype(dtype).name} batch of >= {n} slots")
        oh, ow = (out.shape[2], out.shape[3]) if chw else (out.shape[1], out.shape[2])
        if oh < 1 or ow < 1 or out.shape[1 if chw else 3] != 3:
            raise ValueError(f"out must hold RGB slots of at least one pixel, got shape {out.shape}")
        info = np.empty((n, 7), np.int32)
        try:  # a box that is empty or leaves its image is refused per sample by the native call (its status)
            info[:, 0], info[:, 1], info[:, 2:] = heights, widths, boxes
        except (OverflowError, ValueError, TypeError) as e:
            raise ValueError(f"sizes and boxes must be n int32 values and n (top, left, height, width, flip) ({e})") from None
        data, offsets = self._gathered(payloads)
        status = np.zeros(n, np.int32)
        if normalize is not None:
            scale, shift = (np.ascontiguousarray(v, np.float32) for v in normalize)
            floats, scale_p, shift_p, out_p = out.ctypes.data, scale.ctypes.data, shift.ctypes.data, None
        else:
            floats, scale_p, shift_p, out_p = None, None, None, out.ctypes.data
        failed = self._lib.ts_crops_render(n, data, offsets.ctypes.data, info.ctypes.data, oh, ow, int(chw),
                                           max_pixels, out_p, floats, scale_p, shift_p, status.ctypes.data)
        if failed == -1:
            raise MemoryError("libturbojpeg could not create a decompressor")
        if failed < 0:
            raise ValueError(f"the native renderer refused the call (status {failed})")
        return status


def native_crops(library: str) -> NativeCrops | None:
    """The native renderer over libturbojpeg at `library`, or None where it was not compiled or cannot load."""
    try:
        return NativeCrops(library)
    except (ImportError, OSError):
        return None
