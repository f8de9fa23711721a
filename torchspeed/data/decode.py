"""JPEG decoders: JPEG bytes to RGB HWC uint8 pixels, DCT-downscaled when asked for at least (min_h,
min_w) (libjpeg decodes at 1/2, 1/4 or 1/8 size, a fraction of the cost of a full decode). Workers get
the decoder by name (one instance per process), so all of them decode to the same pixels.

On the CPU: simplejpeg (accurate and fast-DCT variants), turbojpeg (data/libturbojpeg.py; its
`decode_region` decodes only the part a crop needs), OpenCV, PIL, torchvision.io. On a CUDA device:
nvjpeg, batched, an image it cannot read decoded on the CPU instead (`decode_jpeg_batch_cuda`), on the
decoding thread's own stream (`decoding_stream`). Which is fastest here: data/decoder_choice.py.
"""
from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchspeed.images import image_size_error, rgb_image
from torchspeed.data.libturbojpeg import CannotCrop, TurboJpeg, dct_factor
from torchspeed.data.native_crops import native_crops
from torchspeed.optional import optional
from torchspeed.runtime import process_as_found

log = logging.getLogger(__name__)

__all__ = ["Decoder", "DECODERS", "GPU_DECODERS", "dct_factor", "available_decoders", "get_decoder", "jpeg_size",
           "jpeg_info", "jpeg_sampling", "turbojpeg_reads", "check_jpeg_size", "decode_jpeg_batch_cuda",
           "jpeg_is_complete", "decoding_stream", "indexed_cuda", "DECODING"]


class _Decoding(threading.local):
    """What this thread is decoding, for the one message that needs it and has no other way to know: the
    DEBUG line of a whole-image fallback (`Decoder.decode`). The loader sets `image` (a callable returning the
    sample's name, called only for that line) before each decode; None: "a JPEG"."""

    image: Callable[[], str] | None = None


DECODING = _Decoding()


class Decoder:
    """A named JPEG decoder: `decode(buf, min_h, min_w) -> RGB HWC uint8` (min sizes 0 = full size).

    `decode` reads the size from the JPEG's header first and refuses one over the pixel limit before
    any decoder allocates its pixels, whatever the data came from; subclasses implement `_decode`."""

    name = "base"
    crops: Any = None  # a NativeCrops when whole batches of crops can be rendered in one native call
    # built on libjpeg-turbo's TurboJPEG API, which cannot read every chroma layout libjpeg can (see
    # `turbojpeg_reads`): such an image is decoded whole by PIL instead (`whole_by_pil`)
    turbojpeg_api = False

    def decode(self, buf: Any, min_h: int = 0, min_w: int = 0) -> np.ndarray:
        check_jpeg_size(buf)
        try:
            return self._decode(buf, min_h, min_w)
        except Exception as e:
            return self.whole_by_pil(buf, min_h, min_w, e)

    def whole_by_pil(self, buf: Any, min_h: int, min_w: int, error: Exception) -> np.ndarray:
        """After this decoder failed with `error`: the image decoded whole by PIL (DCT-scaled alike) when its
        chroma layout is one the TurboJPEG API may not read (4:1:0, Y 2x2 / Cb 1x2 / Cr 1x1, ...: libjpeg itself,
        which PIL uses, reads them; see `turbojpeg_reads`), named in a DEBUG line; else `error` is raised."""
        sampling = jpeg_sampling(buf) if self.turbojpeg_api else None
        if sampling is None or turbojpeg_reads(sampling):
            raise error
        layout = ", ".join(f"{c} {h}x{v}" for c, (h, v) in zip(("Y", "Cb", "Cr", "K"), sampling))
        log.debug("%s: its chroma layout (%s) is one the TurboJPEG API cannot read (%s); decoded whole by PIL",
                  DECODING.image() if DECODING.image is not None else "a JPEG", layout, error)
        return get_decoder("pil").decode(buf, min_h, min_w)

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        raise NotImplementedError

    def decode_region(self, buf: Any, min_h: int, min_w: int,
                      region: tuple[int, int, int, int]) -> tuple[np.ndarray, int, int, int, int]:
        """(pixels, row0, col0, full_height, full_width): pixels covering `region` = (top, left, height,
        width) in stored pixels, of the image decoded as `decode(buf, min_h, min_w)` would decode it
        (full_height x full_width), starting at its row0, col0. Here: the whole image."""
        img = self.decode(buf, min_h, min_w)
        return img, 0, 0, img.shape[0], img.shape[1]

    def __repr__(self) -> str:
        return f"<Decoder {self.name}>"


class SimpleJpegDecoder(Decoder):
    turbojpeg_api = True

    def __init__(self, fast: bool = False):
        self._sj = optional("simplejpeg", "data", "the simplejpeg decoder")
        self.fast = fast
        self.name = "simplejpeg-fast" if fast else "simplejpeg"

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        # min_factor=2: a scale between 1/2 and 1 (7/8..5/8, no SIMD in libjpeg-turbo) decodes at full size instead
        return self._sj.decode_jpeg(buf, colorspace="RGB", fastdct=self.fast, fastupsample=self.fast,
                                    min_height=min_h, min_width=min_w, min_factor=2)


class OpenCVDecoder(Decoder):
    name = "opencv"

    def __init__(self) -> None:
        self._cv2 = cv2 = optional("cv2", "data", "the opencv decoder")
        self._flags = {1: cv2.IMREAD_COLOR_RGB, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                       8: cv2.IMREAD_REDUCED_COLOR_8}

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        cv2 = self._cv2
        s = dct_factor(*jpeg_size(buf), min_h, min_w) if (min_h > 0 or min_w > 0) else 1
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), self._flags[s])
        if img is None:
            raise ValueError("OpenCV could not decode the JPEG data")
        return img if s == 1 else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)  # reduced modes decode to BGR


class PILDecoder(Decoder):
    name = "pil"

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        im = Image.open(io.BytesIO(buf))
        if min_h > 0 or min_w > 0:
            im.draft("RGB", (max(min_w, 1), max(min_h, 1)))  # DCT scaling to >= the requested size
        return np.asarray(rgb_image(im))


class TorchvisionDecoder(Decoder):
    name = "torchvision"

    def __init__(self) -> None:
        tvio = _torchvision_io()
        self._decode_jpeg, self._mode = tvio.decode_jpeg, tvio.ImageReadMode.RGB

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:  # no DCT scaling exposed
        data = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs in favour of torchcodec
            warnings.simplefilter("ignore", DeprecationWarning)
            img = self._decode_jpeg(data, mode=self._mode)
        return np.ascontiguousarray(img.permute(1, 2, 0).numpy())


class TurboJpegDecoder(Decoder):
    """libjpeg-turbo through its TurboJPEG 3 API (data/libturbojpeg.py): fast DCT, smooth upsampling, one
    handle per thread, and `decode_region`, which decodes only the part of the image a crop needs."""

    name = "turbojpeg"
    turbojpeg_api = True

    def __init__(self) -> None:
        self._tj = TurboJpeg()
        self.crops = native_crops(self._tj.path)  # None where torchspeed's native part was not compiled

    def decode(self, buf: Any, min_h: int = 0, min_w: int = 0) -> np.ndarray:
        try:
            return self._tj.decode(buf, min_h, min_w, check=image_size_error)[0]
        except ValueError as e:
            return self.whole_by_pil(buf, min_h, min_w, e)

    def decode_region(self, buf: Any, min_h: int, min_w: int,
                      region: tuple[int, int, int, int]) -> tuple[np.ndarray, int, int, int, int]:
        try:
            return self._tj.decode(buf, min_h, min_w, region, check=image_size_error)
        except CannotCrop as e:  # a chroma layout it reads whole only: the whole image, named at DEBUG
            log.debug("%s: %s; decoded whole", DECODING.image() if DECODING.image is not None else "a JPEG", e)
            img = self.decode(buf, min_h, min_w)
        except ValueError as e:
            img = self.whole_by_pil(buf, min_h, min_w, e)
        return img, 0, 0, img.shape[0], img.shape[1]


class NvjpegDecoder(Decoder):
    """nvjpeg on the GPU (torchvision.io.decode_jpeg(device="cuda")). Its place is `decode_batch`: a
    whole batch decoded at once, the pixels left on the device, which `fast_loader(decoder="nvjpeg")`
    crops and resizes there; `decode` (one image, back to the host) exists for measuring and checks."""

    name = "nvjpeg"
    batched = True  # decodes whole batches on the device (see decode_batch)

    def __init__(self, device: Any = "cuda") -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("nvjpeg needs a CUDA device (none here)")
        self.device = device

    def decode_batch(self, buffers: Sequence[Any], names: Sequence[str] | Callable[[int], str] | None = None) -> list[Any]:
        """The batch decoded by nvjpeg alone: an image it cannot read is an error, not a CPU decode, so a
        timing of nvjpeg never times the CPU decoders instead."""
        return decode_jpeg_batch_cuda(buffers, self.device, names=names, fallback=None)

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:  # full size: no DCT scaling
        return self.decode_batch([buf])[0].permute(1, 2, 0).cpu().numpy()


# name -> factory; a factory raising ImportError/OSError means "not available here"
DECODERS: dict[str, Callable[[], Decoder]] = {
    "simplejpeg": SimpleJpegDecoder,
    "simplejpeg-fast": lambda: SimpleJpegDecoder(fast=True),
    "opencv": OpenCVDecoder,
    "pil": PILDecoder,
    "torchvision": TorchvisionDecoder,
    "turbojpeg": TurboJpegDecoder,
    "nvjpeg": NvjpegDecoder,
}
GPU_DECODERS = ("nvjpeg",)  # decode on the device: candidates only for a loader whose device is CUDA
_INSTANCES: dict[str, Decoder] = {}
# what to do when a decoder does not load (the optional libraries' own errors name the extra to install)
_HINTS = {"turbojpeg": "pip install 'torchspeed[turbojpeg]' (its wheel bundles libjpeg-turbo 3; it shadows PyTurboJPEG's "
                       "module of the same name), or install libturbojpeg 3 from your system's packages",
          "nvjpeg": "use a CPU decoder, or a machine with CUDA and torch/torchvision built for it"}


def get_decoder(name: str) -> Decoder:
    """The decoder called `name` (one instance per process)."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose from {', '.join(DECODERS)} or 'auto'")
    if name not in _INSTANCES:
        try:
            with process_as_found():  # importing cv2 changes LD_LIBRARY_PATH; torchvision.io, torch's inductor env
                _INSTANCES[name] = DECODERS[name]()
        except (ImportError, OSError, RuntimeError) as e:
            hint = "" if "pip install" in str(e) else "; " + _HINTS.get(name, "pip install 'torchspeed[data]'")
            raise ImportError(f"decoder {name!r} is not available here ({e}){hint}") from None
    return _INSTANCES[name]


def available_decoders() -> dict[str, str | None]:
    """Decoder -> None when it loads on this machine, else why not (with the install hint)."""
    out: dict[str, str | None] = {}
    for name in DECODERS:
        try:
            get_decoder(name)
            out[name] = None
        except ImportError as e:
            out[name] = str(e)
    return out


def jpeg_size(buf: Any) -> tuple[int, int]:
    """(height, width) from a JPEG's SOF marker, without decoding."""
    return jpeg_info(buf)[:2]


def _frame_header(buf: Any) -> tuple[memoryview, int]:
    """JPEG data as a memoryview and the offset of its frame header (SOF marker); ValueError without one."""
    data = memoryview(buf)
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        raise ValueError("not JPEG data (no SOI marker)")
    i, n = 2, len(data)
    while i + 9 < n:
        if data[i] != 0xFF:
            i += 1
            continue
        marker = data[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7 or marker == 0xFF:
            i += 1 if marker == 0xFF else 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return data, i
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    raise ValueError("JPEG data has no frame header (truncated or corrupt)")


def jpeg_info(buf: Any) -> tuple[int, int, int]:
    """(height, width, colour components) from a JPEG's SOF marker, without decoding (4: CMYK or YCCK)."""
    data, i = _frame_header(buf)
    return (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8], data[i + 9]


def jpeg_sampling(buf: Any) -> tuple[tuple[int, int], ...] | None:
    """Each colour component's (horizontal, vertical) sampling factors from the JPEG's frame header, or None
    when there is no readable frame header."""
    try:
        data, i = _frame_header(buf)
    except ValueError:
        return None
    components = data[i + 9]
    if i + 10 + 3 * components > len(data):
        return None
    return tuple((data[i + 11 + 3 * c] >> 4, data[i + 11 + 3 * c] & 15) for c in range(components))


# Y's factors (Cb and Cr 1x1) of the layouts the TurboJPEG API names: 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:4:1
_TURBOJPEG_LUMA = {(1, 1), (2, 1), (2, 2), (1, 2), (4, 1), (1, 4)}


def turbojpeg_reads(sampling: Sequence[tuple[int, int]]) -> bool:
    """Whether a JPEG of these sampling factors has a layout libjpeg-turbo's TurboJPEG API names: grey, or YCbCr
    with Cb and Cr 1x1 and Y one of 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:4:1. Others are valid JPEGs that libjpeg
    itself reads, which that API refuses (some versions: "Could not determine subsampling level" for 4:1:0 or Y
    2x2 with Cb 1x2 and Cr 1x1), reads whole only, or calls 4:4:4 though its column grid is wider (all
    components 2x1: libturbojpeg.py crops 4:4:4 on a grid every such width divides)."""
    if len(sampling) == 1:
        return True
    return len(sampling) == 3 and sampling[1] == sampling[2] == (1, 1) and sampling[0] in _TURBOJPEG_LUMA


def check_jpeg_size(buf: Any) -> None:
    """Refuse JPEG data whose frame header claims more than `torchspeed.images.MAX_IMAGE_PIXELS` (or no
    pixels), before anything is decoded. Data without a readable frame header passes: the decoder then
    says what it is (PIL, which also reads other formats, applies the same limit)."""
    try:
        h, w, _ = jpeg_info(buf)
    except ValueError:
        return
    why = image_size_error(w, h)
    if why:
        raise ValueError(f"the JPEG {why}")


def _torchvision_io() -> Any:
    """torchvision.io (heavy: imported on first use), its codecs' deprecation warning silenced."""
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        return optional("torchvision.io", "pip install torchvision", "JPEG decoding with torchvision")


def indexed_cuda(device: Any) -> torch.device:
    """`device` with its index where it is a bare "cuda": this thread's current GPU (others as they are).

    Why: torchvision keeps one nvjpeg decoder per process and makes it again (a new nvjpeg handle, its
    buffers) whenever the device asked for is not the one it was made for, and "cuda" is not "cuda:0";
    with the index always given, the decoder is made once, on the GPU this thread works on."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    # no CUDA call yet in this process: no device was set, so it is GPU 0 (asking would initialise CUDA)
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)


def _nvjpeg(data: list[Any], device: Any) -> list[Any]:
    """torchvision's batched decode_jpeg (nvjpeg on a CUDA device): one failure fails the whole batch.

    torchvision holds one lock around each call (its decoder is one per process), so decoding threads
    take turns for nvjpeg itself; their crops and resizes, on their own streams, overlap. torchspeed adds
    no lock of its own."""
    tvio = _torchvision_io()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB, device=device)


def jpeg_is_complete(buf: Any) -> bool:
    """Whether JPEG data ends its last scan with the EOI marker (FF D9): what a truncated file lacks.

    Why: libjpeg (the CPU decoders) reports a file that stops early, but nvjpeg may decode one to
    garbage without an error, so the GPU path checks before decoding. In entropy-coded data an FF byte
    is always followed by 00 or a restart marker, so an FF D9 after the last start-of-scan (FF DA) can
    only be the end marker; an EOI earlier in the file (an EXIF thumbnail's) does not count, trailing
    bytes after the end marker do not matter."""
    data = buf if isinstance(buf, (bytes, bytearray)) else bytes(buf)
    sos = data.rfind(b"\xff\xda")
    return sos >= 0 and data.rfind(b"\xff\xd9") > sos


_STREAMS = threading.local()


@contextlib.contextmanager
def decoding_stream(device: Any) -> Any:
    """Run the block's CUDA work (nvjpeg, the crops and resizes) on this thread's own stream, and wait for
    it at the end: the batch handed on is finished (on a non-CUDA device the block runs as it is).

    Why: a helper thread's current stream is the default stream, which the training step uses too, so
    decoding there serialises with the step's kernels; on a stream of its own (per thread and device) it
    overlaps them, and the consumer needs no event (the thread waits for its stream, blocking only
    itself). torchvision's nvjpeg makes the current stream wait for its internal one: the decoded
    images are ordered on this one."""
    device = torch.device(device)
    if device.type != "cuda":
        yield None
        return
    streams = vars(_STREAMS).setdefault("by_device", {})  # this thread's
    index = indexed_cuda(device).index
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    with torch.cuda.stream(stream):
        yield stream
    stream.synchronize()


def decode_jpeg_batch_cuda(buffers: Sequence[Any], device: Any = "cuda",
                           names: Sequence[str] | Callable[[int], str] | None = None,
                           fallback: str | None = "simplejpeg", skip_bad: bool = False) -> list[Any]:
    """Decode many JPEGs at once on the GPU with nvjpeg (torchvision.io.decode_jpeg, batched), for
    pipelines that move decoding off a starved CPU (`fast_loader(decoder="nvjpeg")`); needs CUDA.

    Returns RGB CHW uint8 tensors on `device`, one per buffer, in order, made on the current stream
    (`decoding_stream` gives a decoding thread its own). nvjpeg fails a whole batch for one image it
    cannot read, so the images it cannot decode (or whose header is not a baseline/progressive grey or
    YCbCr JPEG, or whose data stops before its EOI marker, which nvjpeg may turn into garbage) are
    decoded on the CPU (`fallback`, then PIL, which also reads CMYK and mislabelled PNGs), with a
    RuntimeWarning naming each (`names[i]`, or `names(i)`, called only for such an image). Only an image
    no decoder reads raises a ValueError naming it (with `skip_bad`, its place is None and a warning
    names it); with `fallback=None` (measuring nvjpeg alone) any image nvjpeg does not decode does.
    """
    if not torch.cuda.is_available():
        raise ValueError("nvjpeg decoding needs a CUDA device; none is available here (use a CPU decoder)")
    device = indexed_cuda(device)
    if names is None:
        name_of: Callable[[int], str] = lambda i: f"image {i} of the batch"  # noqa: E731
    elif callable(names):
        name_of = names
    else:
        if len(names) != len(buffers):
            raise ValueError(f"got {len(names)} names for {len(buffers)} images")
        name_of = names.__getitem__
    out: list[Any] = [None] * len(buffers)
    gpu = []
    for i, buf in enumerate(buffers):
        try:
            h, w, components = jpeg_info(buf)
        except ValueError:
            continue  # not JPEG data, or no frame header: the CPU decoders say what it is
        why = image_size_error(w, h)
        if why and skip_bad:
            log.warning("left out of the batch: %s: the JPEG %s", name_of(i), why)
            out[i] = False  # refused: neither nvjpeg nor a CPU decoder may read it
            continue
        if why:
            raise ValueError(f"{name_of(i)}: the JPEG {why}")
        if components in (1, 3) and jpeg_is_complete(buf):
            gpu.append(i)
    data = {i: torch.frombuffer(bytearray(buffers[i]), dtype=torch.uint8) for i in gpu}
    try:
        for i, img in zip(gpu, _nvjpeg([data[i] for i in gpu], device) if gpu else []):
            out[i] = img
    except Exception:  # one bad image fails the batch: decode them one by one to find it
        for i in gpu:
            try:
                out[i] = _nvjpeg([data[i]], device)[0]
            except Exception:
                pass
    for i in [i for i, img in enumerate(out) if img is None]:  # (False: refused above)
        if fallback is None:
            raise ValueError(f"nvjpeg could not decode {name_of(i)} (not a complete baseline or progressive "
                             "grey/YCbCr JPEG, or data nvjpeg refuses)")
        try:
            out[i] = _decode_on_cpu(buffers[i], name_of(i), fallback).to(device)
        except ValueError as e:  # no decoder reads it: named
            if not skip_bad:
                raise
            log.warning("left out of the batch: %s", e)
    return [img if img is not False else None for img in out]


def _decode_on_cpu(buf: Any, name: str, fallback: str) -> Any:
    """One image nvjpeg could not decode, decoded on the CPU as CHW uint8 (a warning names it)."""
    errors = []
    for decoder in dict.fromkeys((fallback, "pil")):
        try:
            img = get_decoder(decoder).decode(buf)
        except Exception as e:
            errors.append(f"{decoder}: {type(e).__name__}: {e}")
            continue
        warnings.warn(f"nvjpeg could not decode {name}; decoded it on the CPU with {decoder} instead",
                      RuntimeWarning, stacklevel=3)
        return torch.from_numpy(np.require(img, np.uint8, ["C", "W"])).permute(2, 0, 1)  # PIL arrays are read-only
    raise ValueError(f"cannot decode {name}: neither nvjpeg nor the CPU decoders read it ({'; '.join(errors)})")
