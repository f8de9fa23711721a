"""JPEG decoders, and a one-off measurement that picks the fastest on this machine.

Every decoder decodes to an RGB HWC uint8 array and can use DCT-domain downscaling: asked for an
image of at least (min_h, min_w), libjpeg skips the high-frequency coefficients and decodes at 1/2,
1/4 or 1/8 size, which costs a fraction of a full decode followed by a resize. The choice is made
once, in the parent process, and passed to the workers by name, so every worker decodes to the
same pixels (decoders differ in IDCT and chroma upsampling, hence in the last bit).

Decoders: simplejpeg (libjpeg-turbo, accurate and fast-DCT variants), turbojpeg (libjpeg-turbo 3 through
data/libturbojpeg.py, fast DCT with smooth upsampling; its `decode_region` decodes only the part of the
image a crop needs), OpenCV, PIL, torchvision.io on the CPU, and nvjpeg
(`decode_jpeg(device="cuda")`, batched) where CUDA exists: a candidate only for a loader on a CUDA
device, timed decoding a whole batch there against the CPU decoders on as many threads as the loader
would give them; one image it cannot read (or whose data ends before its EOI marker) is decoded on the
CPU instead (see `decode_jpeg_batch_cuda`). Decoding threads work on CUDA streams of their own
(`decoding_stream`), not on the default stream the training step uses.
"""
from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from torchspeed import remembered
from torchspeed.args import as_list, progress_fn
from torchspeed.images import check_image_size, image_size_error, open_image, rgb_image
from torchspeed.data.augment import needed_size, render
from torchspeed.data.libturbojpeg import TurboJpeg, dct_factor
from torchspeed.data.native_crops import native_crops
from torchspeed.measure import busy_warning, compare
from torchspeed.runtime import process_as_found

log = logging.getLogger(__name__)


class Record(NamedTuple):
    """One stored sample before decoding: `kind` is 'jpeg', 'raw' or 'array' (already decoded).

    A NamedTuple (one is made per sample read): half the cost of a frozen dataclass, with the GIL held."""

    kind: str
    payload: Any  # bytes-like for jpeg/raw, HWC uint8 ndarray for array
    height: int
    width: int
    label: int


__all__ = ["Record", "CropWork", "Decoder", "DECODERS", "GPU_DECODERS", "dct_factor", "available_decoders", "get_decoder",
           "measure_decoders", "choose_decoder", "decode_record", "to_hwc_uint8", "integer_label", "UnsupportedSample",
           "jpeg_size", "jpeg_info", "check_jpeg_size", "encoded_record", "decode_jpeg_batch_cuda", "psnr",
           "jpeg_is_complete", "decoding_stream"]


class Decoder:
    """A named JPEG decoder: `decode(buf, min_h, min_w) -> RGB HWC uint8` (min sizes 0 = full size).

    `decode` reads the size from the JPEG's header first and refuses one over the pixel limit before
    any decoder allocates its pixels, whatever the data came from; subclasses implement `_decode`."""

    name = "base"
    crops: Any = None  # a NativeCrops when whole batches of crops can be rendered in one native call

    def decode(self, buf: Any, min_h: int = 0, min_w: int = 0) -> np.ndarray:
        check_jpeg_size(buf)
        return self._decode(buf, min_h, min_w)

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
    def __init__(self, fast: bool = False):
        import simplejpeg

        self._sj = simplejpeg
        self.fast = fast
        self.name = "simplejpeg-fast" if fast else "simplejpeg"

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        # min_factor=2: a scale between 1/2 and 1 (7/8..5/8, no SIMD in libjpeg-turbo) decodes at full size instead
        return self._sj.decode_jpeg(buf, colorspace="RGB", fastdct=self.fast, fastupsample=self.fast,
                                    min_height=min_h, min_width=min_w, min_factor=2)


class OpenCVDecoder(Decoder):
    name = "opencv"

    def __init__(self) -> None:
        import cv2

        self._cv2 = cv2
        self._flags = {1: cv2.IMREAD_COLOR_RGB, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                       8: cv2.IMREAD_REDUCED_COLOR_8}

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        cv2 = self._cv2
        s = 1
        if min_h > 0 or min_w > 0:
            h, w = jpeg_size(buf)
            s = dct_factor(h, w, min_h, min_w)
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), self._flags[s])
        if img is None:
            raise ValueError("OpenCV could not decode the JPEG data")
        return img if s == 1 else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)  # reduced modes decode to BGR


class PILDecoder(Decoder):
    name = "pil"

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:
        from PIL import Image

        im = Image.open(io.BytesIO(buf))
        if min_h > 0 or min_w > 0:
            im.draft("RGB", (max(min_w, 1), max(min_h, 1)))  # DCT scaling to >= the requested size
        return np.asarray(rgb_image(im))


class TorchvisionDecoder(Decoder):
    name = "torchvision"

    def __init__(self) -> None:
        import warnings

        import torch

        with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs in favour of torchcodec
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_jpeg

        self._torch, self._decode_jpeg, self._mode = torch, decode_jpeg, ImageReadMode.RGB

    def _decode(self, buf: Any, min_h: int, min_w: int) -> np.ndarray:  # no DCT scaling exposed
        import warnings

        data = self._torch.frombuffer(bytearray(buf), dtype=self._torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            img = self._decode_jpeg(data, mode=self._mode)
        return np.ascontiguousarray(img.permute(1, 2, 0).numpy())


class TurboJpegDecoder(Decoder):
    """libjpeg-turbo through its TurboJPEG 3 API (data/libturbojpeg.py): fast DCT, smooth upsampling, one
    handle per thread, and `decode_region`, which decodes only the part of the image a crop needs."""

    name = "turbojpeg"

    def __init__(self) -> None:
        self._tj = TurboJpeg()
        self.crops = native_crops(self._tj.path)  # None where torchspeed's native part was not compiled

    def decode(self, buf: Any, min_h: int = 0, min_w: int = 0) -> np.ndarray:
        return self._tj.decode(buf, min_h, min_w, check=_size_error)[0]

    def decode_region(self, buf: Any, min_h: int, min_w: int,
                      region: tuple[int, int, int, int]) -> tuple[np.ndarray, int, int, int, int]:
        return self._tj.decode(buf, min_h, min_w, region, check=_size_error)


class NvjpegDecoder(Decoder):
    """nvjpeg on the GPU (torchvision.io.decode_jpeg(device="cuda")). Its place is `decode_batch`: a
    whole batch decoded at once, the pixels left on the device, which `fast_loader(decoder="nvjpeg")`
    crops and resizes there; `decode` (one image, back to the host) exists for measuring and checks."""

    name = "nvjpeg"
    batched = True  # decodes whole batches on the device (see decode_batch)

    def __init__(self, device: Any = "cuda") -> None:
        import torch

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


def get_decoder(name: str) -> Decoder:
    """The decoder called `name` (one instance per process)."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose from {', '.join(DECODERS)} or 'auto'")
    if name not in _INSTANCES:
        try:
            with process_as_found():  # importing cv2 changes LD_LIBRARY_PATH; torchvision.io, torch's inductor env
                _INSTANCES[name] = DECODERS[name]()
        except (ImportError, OSError, RuntimeError) as e:
            hint = {"turbojpeg": "pip install 'torchspeed[turbojpeg]' (its wheel bundles libjpeg-turbo 3; it "
                                 "shadows PyTurboJPEG's module of the same name), or install libturbojpeg 3 from "
                                 "your system's packages",
                    "nvjpeg": "use a CPU decoder, or a machine with CUDA and torch/torchvision built for it"}.get(
                name, "pip install 'torchspeed[data]'")
            raise ImportError(f"decoder {name!r} is not available here ({e}); {hint}") from None
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


class CropWork(NamedTuple):
    """What a loader makes of each sample it decodes: the crop box (`augment.Box`: top, left, height, width,
    flip, in the stored size `heights[i]` x `widths[i]`) resized to a `size` x `size` slot of a uint8
    batch. Decoders are timed doing that (`measure_decoders`), not a whole decode."""

    heights: Sequence[int]
    widths: Sequence[int]
    boxes: Sequence[Any]
    size: int

    def render_one(self, dec: Decoder, buf: Any, i: int) -> np.ndarray:
        """Sample i rendered the Python way: the decoder's `decode_region`, then the resize (`augment.render`)."""
        h, w, box = self.heights[i], self.widths[i], self.boxes[i]
        img, r0, c0, fh, fw = dec.decode_region(buf, *needed_size(h, w, box, self.size),
                                                (box.top, box.left, box.height, box.width))
        out = np.empty((3, self.size, self.size), np.uint8)
        render(img, box, out, None, fh / h, fw / w, origin=(r0, c0), full=(fh, fw))
        return out

    def render_native(self, dec: Decoder, samples: Sequence[Any], part: Sequence[int]) -> np.ndarray:
        """Samples `part` rendered in the decoder's one native call (`Decoder.crops`), as a loader thread does."""
        from torchspeed.images import MAX_IMAGE_PIXELS

        out = np.empty((len(part), 3, self.size, self.size), np.uint8)
        status = dec.crops.render([samples[i] for i in part], [self.heights[i] for i in part],
                                  [self.widths[i] for i in part], [self.boxes[i] for i in part], out, True,
                                  max_pixels=MAX_IMAGE_PIXELS)
        if status.any():
            raise ValueError(f"{int((status != 0).sum())} of the JPEGs could not be rendered")
        return out


def measure_decoders(samples: Sequence[Any], decoders: Sequence[str] | str | None = None, min_size: int = 0,
                     repeats: int = 7, progress: bool | Callable[[str], None] = False,
                     device: Any = None, cpu_threads: int | None = None,
                     crops: CropWork | None = None) -> list[dict[str, Any]]:
    """Time each decoder decoding `samples` (JPEG bytes): median of `repeats`, per image.

    `crops`: what a loader makes of each sample (`CropWork`); each CPU decoder is then timed doing what
    the loader would ask of it: the crop rendered into its slot of a uint8 batch, by the decoder's native
    batch call where it has one (`Decoder.crops`), else its `decode_region` (a decoder that crops decodes
    only that part, the others the whole image at the DCT scale the box allows) and the resize.

    `decoders`: a list or a comma string (default: every available one; the GPU decoder nvjpeg only
    when `device` is a CUDA device, timed decoding the samples as one batch on it, the way
    `fast_loader` uses it). The decoders run interleaved (measure.compare), so background load hits
    them alike. Each row also gives the PSNR against the accurate simplejpeg (or PIL) decode, so a
    faster but less exact decoder is visible as such (100 dB: identical pixels), and the `threads`
    the CPU decoders ran on: `cpu_threads` (default 1; when nvjpeg competes, this machine's usable
    cores, as a loader's threads or workers would decode: the whole GPU against one core is not a fair
    race). Rows timed while other processes took the cores carry a `busy_warning` (and `choose_decoder`
    then does not remember its choice). `progress`: True (stderr) or a callable taking a message.
    """
    if not samples:
        raise ValueError("measure_decoders needs at least one JPEG sample")
    say = progress_fn(progress)
    on_gpu = device is not None and str(device).startswith("cuda")
    names = as_list(decoders, name="decoders") if decoders is not None else \
        [n for n, why in available_decoders().items() if why is None and (on_gpu or n not in GPU_DECODERS)]
    if any(n in GPU_DECODERS for n in names) and not on_gpu:  # asked for by name: time it on the GPU
        device, on_gpu = "cuda", True
    reference_name = "simplejpeg" if "simplejpeg" in names else "pil"
    reference = [get_decoder(reference_name).decode(b, min_size, min_size) for b in samples]
    if cpu_threads is None:
        from torchspeed.runtime import usable_cores

        cpu_threads = usable_cores() if any(n in GPU_DECODERS for n in names) else 1
    threads = max(1, min(int(cpu_threads), len(samples)))
    rows: dict[str, dict[str, Any]] = {}
    contenders = {}
    with contextlib.ExitStack() as stack:
        pool = None
        if threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = stack.enter_context(ThreadPoolExecutor(threads, thread_name_prefix="torchspeed-decode"))
        for name in names:
            dec = get_decoder(name)
            batched = getattr(dec, "batched", False)
            if batched:
                def run(dec: Any = dec) -> list[Any]:
                    return dec.decode_batch(samples)

                whole = run

                def to_host(images: list[Any]) -> list[np.ndarray]:
                    return [t.permute(1, 2, 0).cpu().numpy() for t in images]
            else:
                def whole(dec: Any = dec) -> list[Any]:
                    return [dec.decode(b, min_size, min_size) for b in samples]

                def one(b: Any, i: int, dec: Any = dec) -> Any:
                    return dec.decode(b, min_size, min_size) if crops is None else crops.render_one(dec, b, i)

                def run(one: Any = one, dec: Any = dec) -> list[Any]:
                    if crops is not None and dec.crops is not None:  # the loader's one call per batch (per thread)
                        parts = np.array_split(np.arange(len(samples)), threads)
                        if pool is not None:
                            return list(pool.map(lambda part: crops.render_native(dec, samples, part), parts))
                        return [crops.render_native(dec, samples, parts[0])]
                    if pool is not None:  # libjpeg-turbo, PIL and OpenCV decode without the GIL
                        return list(pool.map(one, samples, range(len(samples))))
                    return [one(b, i) for i, b in enumerate(samples)]

                def to_host(images: list[Any]) -> list[np.ndarray]:
                    return images
            try:
                out = to_host(whole())  # also a check that it reads them (and the pixels for the PSNR)
                if crops is not None and not batched:
                    run()  # and renders their crops: a failure here only costs this decoder its candidacy
            except Exception as e:  # a decoder that cannot read these files is simply not a candidate
                rows[name] = {"decoder": name, "us_per_image": None, "psnr_db": None, "error": str(e)}
                continue
            psnrs = [psnr(a, r) for a, r in zip(out, reference) if a.shape == r.shape]
            rows[name] = {"decoder": name, "us_per_image": None, "threads": None if batched else threads,
                          "psnr_db": float(np.mean(psnrs)) if len(psnrs) == len(out) else None}
            contenders[name] = run
        if contenders:
            say(f"timing JPEG decoders {', '.join(contenders)} on {len(samples)} images, interleaved"
                + (f" (CPU decoders on {threads} threads)" if threads > 1 else ""))
            timed = compare(contenders, warmup=1, repeats=repeats, cooldown_s=0.0, device=device if on_gpu else None)
            busy = busy_warning(timed.others_cores)
            for t in timed.timings:
                rows[t.name]["us_per_image"] = t.median_s / len(samples) * 1e6
                if busy:
                    rows[t.name]["busy_warning"] = busy
    return [rows[n] for n in names]


def choose_decoder(samples: Sequence[Any], parts: Mapping[str, Any] | None = None, min_size: int = 0,
                   progress: bool | Callable[[str], None] = False, device: Any = None,
                   refresh: bool = False, crops: CropWork | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The fastest available decoder on `samples` (logged at INFO), with the measurement's table.

    With `parts` (what identifies the data, JSON-able) the choice is remembered on this machine
    (`torchspeed.remembered`, kind "decoder", keyed also by the decoders available and the device): the
    next call recalls it, logged as "decoder: remembered from <date> (<figure>)", unless `refresh`.
    With a CUDA `device`, nvjpeg competes too; `crops`: what a loader makes of each sample (see
    `measure_decoders`)."""
    on_gpu = device is not None and str(device).startswith("cuda")
    names = [n for n, why in available_decoders().items() if why is None and (on_gpu or n not in GPU_DECODERS)]
    key = None if parts is None else {**parts, "decoders": names, "min_size": min_size, "crops": crops is not None,
                                      "device": str(device) if on_gpu else "cpu"}
    memory = None if key is None or refresh else remembered.recall("decoder", key)
    if memory is not None and memory.decision.get("decoder") in names:
        log.info("decoder: %s", memory.describe())
        progress_fn(progress)(f"decoder: {memory.decision['decoder']}, {memory.describe()}")
        return str(memory.decision["decoder"]), list(memory.decision.get("table", []))
    table = measure_decoders(samples, min_size=min_size, progress=progress, device=device, crops=crops)
    timed = [r for r in table if r["us_per_image"] is not None]
    if not timed:
        raise ValueError("no JPEG decoder could read the sample images: " + "; ".join(r.get("error", "") for r in table))
    chosen = min(timed, key=lambda r: r["us_per_image"])
    best = chosen["decoder"]
    others = ", ".join(f"{r['decoder']} {r['us_per_image']:.0f}" for r in timed if r is not chosen)
    log.info("decoder: %s (%.0f us/image; %s) measured on %d JPEGs", best, chosen["us_per_image"],
             others or "no other decoder", len(samples))
    if key is not None and not chosen.get("busy_warning"):  # a choice made on a busy machine is not kept
        remembered.remember("decoder", key, {"decoder": best, "table": table},
                            f"{best}, {chosen['us_per_image']:.0f} us/image")
    return best, table


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (100: identical): how exact a decoder is."""
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * np.log10(255.0**2 / mse))  # 100 dB: identical


def jpeg_size(buf: Any) -> tuple[int, int]:
    """(height, width) from a JPEG's SOF marker, without decoding."""
    return jpeg_info(buf)[:2]


def jpeg_info(buf: Any) -> tuple[int, int, int]:
    """(height, width, colour components) from a JPEG's SOF marker, without decoding (4: CMYK or YCCK)."""
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
        length = (data[i + 2] << 8) | data[i + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8], data[i + 9]
        i += 2 + length
    raise ValueError("JPEG data has no frame header (truncated or corrupt)")


def _size_error(height: int, width: int) -> str | None:
    return image_size_error(width, height)


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

    PIL images of any mode are converted by `torchspeed.images.rgb_image` (16-bit scaled, transparency
    over white), after their size is checked against the pixel limit; uint16 pixels are scaled by
    255/65535; four channels are RGBA, composited over white the same way. What the pipeline does not
    take raises UnsupportedSample."""
    from PIL import Image

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


def _nvjpeg(data: list[Any], device: Any) -> list[Any]:
    """torchvision's batched decode_jpeg (nvjpeg on a CUDA device): one failure fails the whole batch."""
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


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
    it at the end: the batch handed on is finished.

    Why: a helper thread's current stream is the default stream, which the training step uses too;
    decoding there serialises with the step's kernels. On a stream of its own (one per thread and
    device) it overlaps them, and since the thread waits for its own stream before handing the batch
    over (it blocks only itself), the consumer needs no event to wait on. torchvision's nvjpeg decoder
    makes the current stream wait for its own internal stream, so the decoded images are ordered on
    this one. On a non-CUDA device the block runs as it is."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        yield None
        return
    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    with torch.cuda.stream(stream):
        yield stream
    stream.synchronize()


def decode_jpeg_batch_cuda(buffers: Sequence[Any], device: Any = "cuda",
                           names: Sequence[str] | Callable[[int], str] | None = None,
                           fallback: str | None = "simplejpeg", skip_bad: bool = False) -> list[Any]:
    """Decode many JPEGs at once on the GPU with nvjpeg (torchvision.io.decode_jpeg, batched).

    Returns RGB CHW uint8 tensors on `device`, one per buffer, in order, made on the current stream
    (`decoding_stream` gives a decoding thread one of its own). nvjpeg fails a whole batch for one
    image it cannot read, so one bad file does not cost the batch: the images nvjpeg cannot decode (or
    whose header is not a baseline/progressive grey or YCbCr JPEG, or whose data stops before its EOI
    marker, which nvjpeg may turn into garbage) are decoded on the CPU (`fallback`, then PIL, which
    also reads CMYK and mislabelled PNGs) and copied to the device, with a RuntimeWarning naming each
    one (`names[i]`, e.g. its file; or `names(i)`, called only for such an image, so that a batch
    without one builds no names). Only an image that no decoder can read raises a ValueError naming
    it (with `skip_bad`, its place in the result is None and a warning names it); with `fallback=None`
    (measuring nvjpeg alone) any image nvjpeg does not decode does. For
    pipelines that move decoding off a starved CPU onto the GPU (`fast_loader(decoder="nvjpeg")`);
    needs CUDA.
    """
    import torch

    if not torch.cuda.is_available():
        raise ValueError("nvjpeg decoding needs a CUDA device; none is available here (use a CPU decoder)")
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
    import warnings

    import torch

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
