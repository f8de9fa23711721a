"""libjpeg-turbo's TurboJPEG 3 API through ctypes: DCT-scaled decoding of just the part a crop needs.

Why: a random-resized crop keeps about half of the image on average, and libjpeg-turbo can decode only
that part (`tj3SetCroppingRegion`, as DALI's CPU decoder does): rows below it are not decoded, rows
above it and the columns outside it skip the inverse DCT, upsampling and colour conversion. simplejpeg,
OpenCV and PIL do not expose it, and PyPI's bindings open a handle per image or cannot crop: hence this
module, one decompressor per thread, ctypes releasing the GIL for the whole decode.

Fast DCT, smooth upsampling (the pixels of `simplejpeg.decode_jpeg(fastdct=True, fastupsample=False)`):
the merged (fast) upsampler with cropped rows reads uninitialised memory in the bundled libjpeg-turbo 3.0
beta (wrong pixels, crashes with two threads). Smooth upsampling interpolates a cropped part's outermost
column from itself, so the part is decoded with one pixel of margin each side: every pixel a crop box
reads is then exactly the whole decode's (tests/test_region_decode.py).

The library: the `turbojpeg` wheel's bundled libjpeg-turbo 3 (the `torchspeed[turbojpeg]` extra), else a
system libturbojpeg with the version-3 API. Output sizes are computed from the header as libjpeg-turbo
computes them, and numpy allocates every buffer at that size before the library writes into it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["TurboJpeg", "CannotCrop", "library_path", "dct_factor"]

_INIT_DECOMPRESS = 1
_PARAM_SUBSAMP, _PARAM_WIDTH, _PARAM_HEIGHT, _PARAM_FASTUPSAMPLE, _PARAM_FASTDCT = 4, 5, 6, 9, 10
_PF_RGB = 0
# The column grid a crop's left edge is put on, by TJSAMP (444, 422, 420, GRAY, 440, 411, 441): the iMCU width,
# except 4:4:4 at 32, not 8: libjpeg-turbo also calls 4:4:4 a JPEG whose components share factors other than 1x1
# (all 2x1: an iMCU of 16 columns), and 32 is a multiple of every such width (a wider margin costs a few columns)
_MCU_WIDTH = (32, 16, 16, 8, 8, 32, 8)


def dct_factor(h: int, w: int, min_h: int, min_w: int) -> int:
    """Largest libjpeg scale denominator (8, 4, 2, 1) that keeps the image >= (min_h, min_w).

    Powers of two only: libjpeg-turbo has SIMD code for the 1/2, 1/4 and 1/8 IDCTs, not for
    7/8..3/8, and a 7/8 decode measured 1.7x the time of a full one (docs/data.md)."""
    for s in (8, 4, 2):
        if -(-h // s) >= min_h and -(-w // s) >= min_w:
            return s
    return 1


class CannotCrop(ValueError):
    """A JPEG libjpeg-turbo reads whole but cannot decode part of: its chroma layout is none the TurboJPEG API
    names (4:1:0, Y 2x2 with Cb 1x2 and Cr 1x1, ...), so it knows no column grid to crop on."""


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


_WHOLE = _Region(0, 0, 0, 0)  # TJUNCROPPED


def library_path() -> str:
    """Where libturbojpeg (TurboJPEG 3 API) is: the `turbojpeg` wheel's bundled copy, else the system's."""
    spec = importlib.util.find_spec("turbojpeg")
    if spec is not None and spec.origin:  # the module itself is not imported: only its bundled library is used
        found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "turbojpeg.libs", "libturbojpeg*")))
        if found:
            return found[0]
    system = ctypes.util.find_library("turbojpeg")
    if system:
        return system
    raise ImportError("libturbojpeg not found")


def _load(path: str) -> Any:
    """The library's functions, typed. Only the decode itself releases the GIL (a `CDLL` function); the
    calls of a microsecond (header, parameters) keep it (`PyDLL`): each release is a point where a
    decoding thread may have to wait for the GIL to come back, a futex sleep and wake-up that cost
    more than the call."""
    quick, slow = ctypes.PyDLL(path), ctypes.CDLL(path)
    if not hasattr(quick, "tj3Init"):
        raise ImportError(f"{path} is libturbojpeg 2 (the TurboJPEG 3 API, libjpeg-turbo >= 3.0, is needed)")
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sigs = {"tj3Init": ([i], vp), "tj3Destroy": ([vp], None), "tj3Set": ([vp, i, i], i), "tj3Get": ([vp, i], i),
            "tj3DecompressHeader": ([vp, ctypes.c_char_p, sz], i), "tj3SetScalingFactor": ([vp, _Scale], i),
            "tj3SetCroppingRegion": ([vp, _Region], i), "tj3GetErrorStr": ([vp], ctypes.c_char_p),
            "tj3Decompress8": ([vp, ctypes.c_char_p, sz, vp, i, i], i)}
    functions = {}
    for name, (args, res) in sigs.items():
        fn = getattr(slow if name == "tj3Decompress8" else quick, name)
        fn.argtypes, fn.restype = args, res
        functions[name] = fn
    return types.SimpleNamespace(**functions)


class _Handle:
    """One thread's decompressor (fast DCT, smooth upsampling), destroyed with it. Its
    scaling factor and cropping region persist from one image to the next: they are set only when they
    change (each ctypes call costs about a microsecond, a tenth of a small image's decode)."""

    def __init__(self, lib: Any):
        self.scale, self.crop = 1, (0, 0, 0, 0)
        self.lib, self.ptr = lib, lib.tj3Init(_INIT_DECOMPRESS)
        if not self.ptr:
            raise MemoryError("libturbojpeg could not create a decompressor")
        lib.tj3Set(self.ptr, _PARAM_FASTUPSAMPLE, 0)  # merged upsampling + cropped rows: see the module docstring
        lib.tj3Set(self.ptr, _PARAM_FASTDCT, 1)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.tj3Destroy(self.ptr)
            self.ptr = None


class TurboJpeg:
    """`decode(buf, min_h, min_w, region)`: RGB HWC uint8 pixels of a JPEG, DCT-scaled, whole or the part
    covering a region; one decompressor per thread."""

    def __init__(self, path: str | None = None):
        self.path = path or library_path()
        self._lib = _load(self.path)
        self._local = threading.local()

    def _handle(self) -> _Handle:
        h = getattr(self._local, "handle", None)
        if h is None:
            h = self._local.handle = _Handle(self._lib)
        return h

    def _fail(self, handle: Any, what: str) -> None:
        """Raise the library's error, after replacing this thread's decompressor: one that failed to read a
        header keeps the previous image's size for the next header it reads (libjpeg-turbo 3.0), and a
        buffer allocated at that size would be overrun."""
        msg = self._lib.tj3GetErrorStr(handle)
        self._local.handle = None  # destroyed with its last reference; the next decode makes a new one
        raise ValueError(f"libturbojpeg could not {what}: {(msg or b'unknown error').decode(errors='replace')}")

    def decode(self, buf: Any, min_h: int = 0, min_w: int = 0, region: tuple[int, int, int, int] | None = None,
               check: Callable[[int, int], str | None] | None = None) -> tuple[np.ndarray, int, int, int, int]:
        """(pixels, row0, col0, full_height, full_width): the JPEG decoded at the smallest power-of-two DCT
        scale that keeps it >= (min_h, min_w) (`dct_factor`), whole (full_height x full_width) or, with
        `region` = (top, left, height, width) in stored pixels, the part that covers the region scaled,
        with one pixel of margin each side (widened left to the iMCU column boundary libjpeg-turbo crops
        at); its first pixel is row0, col0 of the whole. `check(width, height)` returns why the stored
        size is refused (checked before anything is decoded). A warning from the library (data ending
        before its EOI marker, say) is an error; a region of a JPEG it cannot crop is CannotCrop."""
        lib, state = self._lib, self._handle()
        handle = state.ptr
        src = buf if isinstance(buf, bytes) else bytes(buf)  # a memoryview's copy costs less than its address
        if lib.tj3DecompressHeader(handle, src, len(src)) != 0:
            self._fail(handle, "read the JPEG header")
        width, height = lib.tj3Get(handle, _PARAM_WIDTH), lib.tj3Get(handle, _PARAM_HEIGHT)
        why = check(width, height) if check is not None else None
        if why:
            raise ValueError(f"the JPEG {why}")
        scale = dct_factor(height, width, min_h, min_w) if (min_h > 0 or min_w > 0) else 1
        if scale != state.scale:
            if state.crop != (0, 0, 0, 0):  # the last image's region, checked against the new scale, could fail
                lib.tj3SetCroppingRegion(handle, _WHOLE)
                state.crop = (0, 0, 0, 0)
            if lib.tj3SetScalingFactor(handle, _Scale(1, scale)) != 0:
                self._fail(handle, f"decode at 1/{scale} scale")
            state.scale = scale
        fh, fw = -(-height // scale), -(-width // scale)  # TJSCALED: ceil(size / scale)
        y0, x0, h, w = 0, 0, fh, fw
        if region is not None:  # the part the region needs, one pixel of margin each side (see the module docstring)
            top, left, rh, rw = region
            subsamp = lib.tj3Get(handle, _PARAM_SUBSAMP)
            if not 0 <= subsamp < len(_MCU_WIDTH):
                raise CannotCrop(f"libturbojpeg cannot crop a JPEG whose chroma layout it does not name (TJSAMP {subsamp})")
            mcu = -(-_MCU_WIDTH[subsamp] // scale)
            y0 = min(fh - 1, max(0, top * fh // height - 1))
            x0 = min(fw - 1, max(0, left * fw // width - 1)) // mcu * mcu
            h = min(fh, -(-(top + rh) * fh // height) + 1) - y0
            w = min(fw, -(-(left + rw) * fw // width) + 1) - x0
        crop = (0, 0, 0, 0) if (h, w) == (fh, fw) else (x0, y0, w, h)
        if crop != state.crop:
            state.crop = (-1, 0, 0, 0)  # unknown until the library accepts it
            if lib.tj3SetCroppingRegion(handle, _Region(*crop)) != 0:
                self._fail(handle, f"crop the region x {x0}, y {y0}, width {w}, height {h}")
            state.crop = crop
        out = np.empty((h, w, 3), np.uint8)
        if lib.tj3Decompress8(handle, src, len(src), out.ctypes.data, w * 3, _PF_RGB) != 0:
            self._fail(handle, "decode the JPEG data")
        return out, y0, x0, fh, fw
