"""A batch of crops rendered from JPEG bytes in one native call (data/_crops.c), for the `turbojpeg` decoder.

Why: rendering a crop in Python takes five C calls per sample (LMDB read aside: the decode, the
resize, the flip, the CHW split, and the decoder's own setup), each one releasing the GIL and taking
it back. On a machine with few cores a loader thread that finds the GIL taken sleeps and is woken
for each of them, so a second thread added little. The native call renders the whole batch (decode
of the part each box needs, resize, flip, layout) with the GIL released once, and no Python runs per
sample.

The pixels: the decode is libturbojpeg's, the same as `TurboJpeg.decode` with a region; the resize
uses OpenCV's coordinates and kernels (INTER_LINEAR, INTER_AREA past a 2x shrink) in float where OpenCV
uses fixed point, so a pixel may differ from `augment.render`'s by one level (tests/test_native_crops.py).

The native code is compiled when torchspeed is installed (an optional extension: without a C
compiler the install goes on, and the loader renders sample by sample as before).
"""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
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
    lib.ts_crops_render.argtypes = [i, ctypes.c_char_p, vp, vp, i, i, i, ctypes.c_int64, vp, vp]
    lib.ts_crops_render.restype = i
    return lib


class NativeCrops:
    """`render(payloads, heights, widths, boxes, out, chw)`: each JPEG's box, decoded, resized to the slot
    size, flipped as its box says, written into its slot of `out`; the per-sample status (0 = rendered)."""

    def __init__(self, library: str):
        self._lib = _load(library)  # libturbojpeg's path (the one data/libturbojpeg.py loaded)

    def render(self, payloads: Sequence[Any], heights: Sequence[int], widths: Sequence[int], boxes: Sequence[Any],
               out: np.ndarray, chw: bool, max_pixels: int) -> np.ndarray:
        """`out`: a C-contiguous uint8 (n, 3, s, s) batch if `chw`, else (n, s, s, 3). `boxes`: (top, left,
        height, width, flip) per sample, in stored pixels (`heights`, `widths`). A sample whose status is
        not 0 (a size refused, data that cannot be decoded: see data/_crops.c) leaves its slot as it was."""
        n = len(payloads)
        if out.dtype != np.uint8 or not out.flags.c_contiguous or out.shape[0] < n:
            raise ValueError(f"out must be a C-contiguous uint8 batch of >= {n} slots")
        oh, ow = (out.shape[2], out.shape[3]) if chw else (out.shape[1], out.shape[2])
        data = b"".join(payloads)
        offsets = np.fromiter(itertools.accumulate((memoryview(p).nbytes for p in payloads), initial=0), np.int64,
                              n + 1)
        info = np.empty((n, 7), np.int32)
        info[:, 0], info[:, 1], info[:, 2:] = heights, widths, boxes
        status = np.zeros(n, np.int32)
        if self._lib.ts_crops_render(n, data, offsets.ctypes.data, info.ctypes.data, oh, ow, int(chw),
                                  max_pixels, out.ctypes.data, status.ctypes.data) < 0:
            raise MemoryError("libturbojpeg could not create a decompressor")
        return status


def native_crops(library: str) -> NativeCrops | None:
    """The native renderer over libturbojpeg at `library`, or None where it was not compiled or cannot load."""
    try:
        return NativeCrops(library)
    except (ImportError, OSError):
        return None
