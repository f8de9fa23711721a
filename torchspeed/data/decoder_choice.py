"""Choosing a decoder: each available one timed doing what the loader asks of it (its crops of samples
of the data), the fastest kept and remembered for that data on this machine (kind "decoder")."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from torchspeed import remembered
from torchspeed.args import as_list, progress_fn
from torchspeed.data.augment import needed_size, render, render_tensor
from torchspeed.data.decode import GPU_DECODERS, Decoder, available_decoders, get_decoder
from torchspeed.images import MAX_IMAGE_PIXELS
from torchspeed.measure import busy_warning, compare
from torchspeed.runtime import usable_cores

__all__ = ["CropWork", "copied_to", "measure_decoders", "choose_decoder", "psnr"]

log = logging.getLogger(__name__)


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
        """Samples `part` rendered in the decoder's one native call (`Decoder.crops`), as a loader thread does: a
        sample the call cannot render (a chroma layout it does not crop, say) rendered again the Python way."""
        out = np.empty((len(part), 3, self.size, self.size), np.uint8)
        status = dec.crops.render([samples[i] for i in part], [self.heights[i] for i in part],
                                  [self.widths[i] for i in part], [self.boxes[i] for i in part], out, True,
                                  max_pixels=MAX_IMAGE_PIXELS)
        for j in np.flatnonzero(status).tolist():
            out[j] = self.render_one(dec, samples[part[j]], part[j])
        return out

    def render_on_device(self, images: Sequence[Any], device: Any) -> Any:
        """The crops of images already on the device (CHW uint8, nvjpeg's) resized into one uint8 batch
        there, as the loader's GPU path does (`augment.render_tensor`)."""
        out = torch.empty((len(images), 3, self.size, self.size), dtype=torch.uint8, device=device)
        for i, img in enumerate(images):
            render_tensor(img, self.boxes[i], out[i])
        return out


def copied_to(device: Any, pixels: Sequence[np.ndarray]) -> list[Any]:
    """Host pixels (batches of crops, or whole images) on `device`, as a loader hands them over: pinned,
    then copied (the timing's end waits for the copies)."""
    return [torch.from_numpy(np.require(a, np.uint8, ["C", "W"])).pin_memory().to(device, non_blocking=True)
            for a in pixels]


def measure_decoders(samples: Sequence[Any], decoders: Sequence[str] | str | None = None, min_size: int = 0,
                     repeats: int = 7, progress: bool | Callable[[str], None] = False,
                     device: Any = None, cpu_threads: int | None = None,
                     crops: CropWork | None = None) -> list[dict[str, Any]]:
    """Time each decoder decoding `samples` (JPEG bytes): median of `repeats`, per image.

    `crops` (`CropWork`): each CPU decoder is then timed doing what the loader asks of it, the crop
    rendered into its slot of a uint8 batch: by its native batch call where it has one (`Decoder.crops`),
    else its `decode_region` (only the part a cropping decoder needs; the whole image at the box's DCT
    scale for the others) and the resize. `decoders`: a list or a comma string (default: every available
    one; nvjpeg only for a CUDA `device`, decoding the samples as one batch, as `fast_loader` uses it).
    With nvjpeg competing for a loader (`crops` given) every contender ends with the same batch on the
    device, so the race is fair: nvjpeg decodes the same samples and crops and resizes there
    (`CropWork.render_on_device`), the CPU decoders' crops are pinned and copied there (`copied_to`), and
    each timing waits for the device.
    They run interleaved (measure.compare), so background load hits them alike. Each row also gives the
    PSNR against the accurate simplejpeg (or PIL) decode (100 dB: identical pixels) and the `threads` the
    CPU decoders ran on: `cpu_threads` (default 1; when nvjpeg competes, the usable cores, as a loader's
    threads or workers would decode: the whole GPU against one core is not a fair race). Rows timed while
    other processes took the cores carry a `busy_warning` (`choose_decoder` then does not remember its
    choice). `progress`: True (stderr) or a callable taking a message.
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
        cpu_threads = usable_cores() if any(n in GPU_DECODERS for n in names) else 1
    threads = max(1, min(int(cpu_threads), len(samples)))
    rows: dict[str, dict[str, Any]] = {}
    contenders = {}
    with ThreadPoolExecutor(threads, thread_name_prefix="torchspeed-decode") if threads > 1 \
            else contextlib.nullcontext() as pool:
        each = pool.map if pool is not None else map  # libjpeg-turbo, PIL and OpenCV decode without the GIL
        for name in names:
            dec = get_decoder(name)
            batched = getattr(dec, "batched", False)
            if batched:
                def whole(dec: Any = dec) -> list[Any]:
                    return dec.decode_batch(samples)

                def run(whole: Any = whole) -> Any:
                    return whole() if crops is None else crops.render_on_device(whole(), device)
            else:
                def whole(dec: Any = dec) -> list[Any]:
                    return [dec.decode(b, min_size, min_size) for b in samples]

                def one(b: Any, i: int, dec: Any = dec) -> Any:
                    return dec.decode(b, min_size, min_size) if crops is None else crops.render_one(dec, b, i)

                def on_host(one: Any = one, dec: Any = dec) -> list[Any]:
                    if crops is not None and dec.crops is not None:  # the loader's one call per batch (per thread)
                        parts = np.array_split(np.arange(len(samples)), threads)
                        return list(each(lambda part: crops.render_native(dec, samples, part), parts))
                    return list(each(one, samples, range(len(samples))))

                def run(on_host: Any = on_host) -> list[Any]:  # a loader's race with nvjpeg: the batch ends on the device
                    return copied_to(device, on_host()) if on_gpu and crops is not None else on_host()
            try:
                out = whole()  # also a check that it reads them (and the pixels for the PSNR)
                out = [t.permute(1, 2, 0).cpu().numpy() for t in out] if batched else out
                if crops is not None:
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
    """The fastest available decoder on `samples` (logged at INFO), with the measurement's table. With a
    CUDA `device`, nvjpeg competes too; `crops`: what a loader makes of each sample (`measure_decoders`).

    With `parts` (what identifies the data, JSON-able) the choice is remembered on this machine (kind
    "decoder", keyed also by the decoders available and the device): the next call recalls it ("decoder:
    remembered from <date> (<figure>)") unless `refresh`; one no longer available, or damaged, is
    measured again."""
    on_gpu = device is not None and str(device).startswith("cuda")
    names = [n for n, why in available_decoders().items() if why is None and (on_gpu or n not in GPU_DECODERS)]
    key = None if parts is None else {**parts, "decoders": names, "min_size": min_size, "crops": crops is not None,
                                      "device": str(device) if on_gpu else "cpu"}

    def recalled(memory: remembered.Memory) -> tuple[str, list[dict[str, Any]]] | None:
        decoder, table = memory.decision.get("decoder"), memory.decision.get("table", [])
        if decoder not in names or not isinstance(table, list) or not all(isinstance(r, dict) and "us_per_image" in r
                                                                          for r in table):
            return None  # no longer available here, or damaged: measured again
        progress_fn(progress)(f"decoder: {decoder}, {memory.describe()}")
        return str(decoder), table

    def measured() -> tuple[str, list[dict[str, Any]]]:
        table = measure_decoders(samples, min_size=min_size, progress=progress, device=device, crops=crops)
        timed = [r for r in table if r["us_per_image"] is not None]
        if not timed:
            raise ValueError("no JPEG decoder could read the sample images: " + "; ".join(r.get("error", "") for r in table))
        chosen = min(timed, key=lambda r: r["us_per_image"])
        others = ", ".join(f"{r['decoder']} {r['us_per_image']:.0f}" for r in timed if r is not chosen)
        log.info("decoder: %s (%.0f us/image; %s) measured on %d JPEGs", chosen["decoder"], chosen["us_per_image"],
                 others or "no other decoder", len(samples))
        return chosen["decoder"], table

    def chosen_row(choice: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
        return next(r for r in choice[1] if r["decoder"] == choice[0])

    (best, table), _ = remembered.recall_or_measure(
        "decoder", key, measured, decode=recalled, refresh=refresh, what="decoder",
        encode=lambda c: ({"decoder": c[0], "table": c[1]}, f"{c[0]}, {chosen_row(c)['us_per_image']:.0f} us/image"),
        busy=lambda c: chosen_row(c).get("busy_warning"))  # a choice made on a busy machine is not kept
    return best, table


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (100: identical): how exact a decoder is."""
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * np.log10(255.0**2 / mse))  # 100 dB: identical
