"""Batch rendering, what a worker process or a loader thread runs: a batch's keys (epoch, index) -> its
records, crop boxes drawn together, DCT-scaled decodes of just enough pixels, each box resized straight
into its slot of one uint8 batch (no per-sample tensors, no collate copy; with the native renderer one
call per batch, or normalised floats at once; with a GPU decoder all of it on the device)."""
from __future__ import annotations

import logging
import math
import queue
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from torchspeed import images as image_rules
from torchspeed.data.augment import needed_size, render, render_tensor, sample_rng
from torchspeed.data.decode import DECODING, GPU_DECODERS, decode_jpeg_batch_cuda, decoding_stream, get_decoder, jpeg_size
from torchspeed.data.prefetch import BufferPool, DevicePrefetcher
from torchspeed.data.sources import sample_name
from torchspeed.data.threads import ThreadedBatches

__all__ = ["AugmentedDataset", "normalised_batches"]

log = logging.getLogger(__name__)


def decoded_as_stored(height: int, width: int, decoded_h: int, decoded_w: int) -> bool:
    """Whether a decode of decoded_h x decoded_w pixels is of an image of the stored height x width, at a
    DCT scale of 1, 1/2, 1/4 or 1/8 (libjpeg's sizes: rounded up)."""
    return any(-(-height // s) == decoded_h and -(-width // s) == decoded_w for s in (1, 2, 4, 8))


class AugmentedDataset(Dataset):
    """What the DataLoader's workers run: keys (epoch, index) -> a whole uint8 NHWC batch + labels."""

    def __init__(self, source: Any, transform: Any, decoder: str, seed: int, layout: str = "NCHW",
                 device: Any = None, on_error: str = "fail"):
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
        self.source, self.transform, self.decoder, self.seed, self.layout = source, transform, decoder, seed, layout
        self.on_error = on_error  # "skip": a sample that cannot be read or decoded is left out of its batch
        self.size = transform.size
        self.device = device  # where a GPU decoder (nvjpeg) decodes and crops: the batch is made there

    def __len__(self) -> int:
        return len(self.source)

    def _render(self, index: int, rec: Any, box: Any, out: np.ndarray) -> int:
        """Sample `index` (its record `rec`, its crop `box`) decoded, cropped and resized into `out`; its label.
        Whatever fails on the way (the decode, a stored size that is not the JPEG's, the resize) is one
        ValueError naming the sample: the per-sample error handling (on_error) covers all of it."""
        try:
            if rec.kind == "jpeg":
                h, w = rec.height, rec.width
                min_h, min_w = needed_size(h, w, box, self.size)  # just enough pixels: a DCT-scaled decode
                DECODING.image = lambda: sample_name(self.source, index)  # for a fallback's DEBUG line
                # a decoder that crops decodes only the part the box needs (its origin and the full size with it)
                img, r0, c0, fh, fw = self._decoder.decode_region(
                    rec.payload, min_h, min_w, (box.top, box.left, box.height, box.width))
                DECODING.image = None
                if not decoded_as_stored(h, w, fh, fw):
                    raise ValueError(f"its JPEG is {'x'.join(map(str, jpeg_size(rec.payload)))} pixels, but the record "
                                     f"says {h}x{w}")
                render(img, box, out, None, fh / h, fw / w, chw=self.layout == "NCHW", origin=(r0, c0), full=(fh, fw))
            else:
                img = rec.payload
                render(img, box, out, None, img.shape[0] / rec.height, img.shape[1] / rec.width,
                       chw=self.layout == "NCHW")
        except Exception as e:  # truncated or corrupt JPEG data, a damaged record: the error names the file (or record)
            DECODING.image = None
            raise ValueError(f"cannot decode {sample_name(self.source, index)}: {type(e).__name__}: {e}") from None
        return rec.label

    @property
    def _decoder(self) -> Any:
        return get_decoder(self.decoder)

    @property
    def crops(self) -> Any:
        """The decoder's renderer of whole batches in one native call (`Decoder.crops`), or None."""
        return self._decoder.crops

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        out = np.empty(self.batch_shape(1)[1:], np.uint8)
        rec = self.source.record(index)
        box = self.transform.box(rec.height, rec.width, sample_rng(self.seed, epoch, index))
        return torch.from_numpy(out), self._render(index, rec, box, out)

    def batch_shape(self, n: int) -> tuple[int, int, int, int]:
        s = self.size
        return (n, 3, s, s) if self.layout == "NCHW" else (n, s, s, 3)

    def _records(self, keys: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[Any]]:
        """The keys whose records could be read and those records; with on_error="skip" a record that cannot
        be read is left out (a warning names it), else its error is raised."""
        kept, records = [], []
        for key in keys:
            try:
                records.append(self.source.record(key[1]))
                kept.append(key)
            except ValueError as e:  # the message names the sample (its file, record, or shard and key)
                if self.on_error != "skip":
                    raise
                log.warning("left out of the batch: %s", e)
        return kept, records

    def render_batch(self, keys: Sequence[tuple[int, int]], images: np.ndarray,
                     normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> torch.Tensor:
        """Fill `images` (uint8, `batch_shape(len(keys))`) sample by sample; return the int64 labels. The
        records are read first and the batch's crop boxes drawn together (`transform.boxes`); with the
        native renderer (data/native_crops.py) the whole batch is one call. With `normalize` = (scale,
        shift) per channel, `images` is float32 and each pixel is written as `x * scale + shift`. With
        on_error="skip" a bad sample is left out (a warning names it): the first len(labels) images are
        the batch."""
        kept, records = self._records(keys)
        boxes = self.transform.boxes([r.height for r in records], [r.width for r in records], self.seed,
                                     [k[0] for k in kept], [k[1] for k in kept])
        crops = self.crops
        if crops is not None and images.flags.c_contiguous and all(r.kind == "jpeg" for r in records):
            return self._render_native(crops, kept, records, boxes, images, normalize)
        pixels = images if normalize is None else np.empty(self.batch_shape(len(kept)), np.uint8)
        labels: list[int] = []
        for (_, index), rec, box in zip(kept, records, boxes):
            try:
                labels.append(self._render(index, rec, box, pixels[len(labels)]))
            except ValueError as e:
                if self.on_error != "skip":
                    raise
                log.warning("left out of the batch: %s", e)
        if normalize is not None:
            self._normalize(pixels[:len(labels)], images[:len(labels)], normalize)
        return torch.tensor(labels, dtype=torch.int64)

    def _normalize(self, pixels: np.ndarray, out: np.ndarray, normalize: tuple[Sequence[float], Sequence[float]]) -> None:
        """out = float32(pixels) * scale + shift per channel: a multiply, then an add, as the prefetcher's
        (`prefetch.normalize_batch`: NHWC as rows of w * 3 values, the scale tiled along them)."""
        x = torch.from_numpy(out).copy_(torch.from_numpy(pixels))
        scale, shift = (torch.tensor(v, dtype=torch.float32) for v in normalize)
        if self.layout == "NHWC":
            n, h, w, c = x.shape
            x.view(n * h, w * c).mul_(scale.repeat(w)).add_(shift.repeat(w))
        else:
            x.mul_(scale.view(1, -1, 1, 1)).add_(shift.view(1, -1, 1, 1))

    def _render_native(self, crops: Any, keys: Sequence[tuple[int, int]], records: Sequence[Any],
                       boxes: Sequence[Any], images: np.ndarray,
                       normalize: tuple[Sequence[float], Sequence[float]] | None) -> torch.Tensor:
        """`render_batch` in one native call (data/native_crops.py). A sample it could not render is
        rendered again in Python, whose error names it (or which renders it after all)."""
        status = crops.render([r.payload for r in records], [r.height for r in records], [r.width for r in records],
                              boxes, images, chw=self.layout == "NCHW", max_pixels=image_rules.MAX_IMAGE_PIXELS,
                              normalize=normalize)
        labels = [r.label for r in records]
        kept = np.ones(len(records), bool)
        for j in np.flatnonzero(status).tolist():
            try:
                if normalize is None:
                    self._render(keys[j][1], records[j], boxes[j], images[j])
                else:
                    pixels = np.empty(self.batch_shape(1), np.uint8)
                    self._render(keys[j][1], records[j], boxes[j], pixels[0])
                    self._normalize(pixels, images[j:j + 1], normalize)
            except ValueError as e:
                if self.on_error != "skip":
                    raise
                log.warning("left out of the batch: %s", e)
                kept[j] = False
        if not kept.all():
            rows = np.flatnonzero(kept)
            images[:len(rows)] = images[rows]
            labels = [labels[j] for j in rows.tolist()]
        return torch.tensor(labels, dtype=torch.int64)

    def device_batch(self, keys: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch made on `self.device` by a GPU decoder: the JPEGs of the batch decoded together
        (nvjpeg; an image it cannot read is decoded on the CPU, with a warning naming it), each box
        cropped and resized there (`render_tensor`); labels stay on the host (the prefetcher moves them)."""
        keys, records = self._records(keys)
        jpegs = [j for j, rec in enumerate(records) if rec.kind == "jpeg"]

        def name(i: int) -> str:  # built only for an image nvjpeg cannot read (the fallback's warning)
            return sample_name(self.source, keys[jpegs[i]][1])

        with decoding_stream(self.device):  # this thread's own stream, finished before the batch is handed on
            decoded = dict(zip(jpegs, decode_jpeg_batch_cuda([records[j].payload for j in jpegs], self.device,
                                                             names=name, skip_bad=self.on_error == "skip")
                               if jpegs else []))
            kept = [j for j in range(len(keys)) if decoded.get(j, True) is not None]  # skip: None = left out
            images = torch.empty(self.batch_shape(len(kept)), dtype=torch.uint8, device=self.device)
            rendered = []
            for j in kept:
                (epoch, index), rec = keys[j], records[j]
                try:  # the crop and resize inside the per-sample error handling too
                    img = decoded[j] if j in decoded else torch.from_numpy(
                        np.require(rec.payload, np.uint8, ["C", "W"])).permute(2, 0, 1).to(self.device)  # raw: read-only
                    if j in decoded and tuple(img.shape[1:]) != (rec.height, rec.width):
                        raise ValueError(f"its JPEG is {img.shape[1]}x{img.shape[2]} pixels, but the record says "
                                         f"{rec.height}x{rec.width}")
                    box = self.transform.box(rec.height, rec.width, sample_rng(self.seed, epoch, index))
                    render_tensor(img, box, images[len(rendered)], chw=self.layout == "NCHW")
                    rendered.append(j)
                except Exception as e:
                    error = ValueError(f"cannot decode {sample_name(self.source, index)}: {type(e).__name__}: {e}")
                    if self.on_error != "skip":
                        raise error from None
                    log.warning("left out of the batch: %s", error)
        return images[:len(rendered)], torch.tensor([records[j].label for j in rendered], dtype=torch.int64)

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The collated batch: uint8 NCHW (or NHWC) images filled in place sample by sample, int64 labels."""
        if self.decoder in GPU_DECODERS:
            return self.device_batch(keys)
        shape = self.batch_shape(len(keys))
        if get_worker_info() is not None:  # straight into shared memory: no copy when sent to the main process
            images = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(math.prod(shape))).view(shape)
        else:
            images = torch.empty(shape, dtype=torch.uint8)
        labels = self.render_batch(keys, images.numpy())
        return (images if len(labels) == len(keys) else images[:len(labels)]), labels


def normalised_batches(augmented: AugmentedDataset, batch_sampler: Any, threads: int,
                       prefetcher: DevicePrefetcher) -> ThreadedBatches:
    """A CPU loader's batches made by `threads` threads of this process, each also normalising its batch
    as `prefetcher.convert` does (the native renderer as it renders), into buffers kept across passes:
    a uint8 batch and a float output from fresh memory would fault every page in again each epoch."""
    outputs = BufferPool(capacity=threads * (ThreadedBatches.AHEAD + 2) + 2)
    spare_images: queue.SimpleQueue = queue.SimpleQueue()
    native = augmented.decoder not in GPU_DECODERS and augmented.crops is not None
    affine = prefetcher.uint8_affine(augmented.layout) if native and len(prefetcher.mean or "rgb") == 3 else None

    def make_batch(keys: Sequence[tuple[int, int]]) -> Any:
        if affine is not None:  # rendered normalised, straight into the float batch
            s = augmented.size
            out = outputs.take((len(keys), 3, s, s), prefetcher.channels_last)
            labels = augmented.render_batch(keys, (out.permute(0, 2, 3, 1) if prefetcher.channels_last else out)
                                            .numpy(), normalize=affine)
            return out[:len(labels)], labels
        try:
            spare = spare_images.get_nowait()
        except queue.Empty:
            spare = np.empty(augmented.batch_shape(batch_sampler.batch_size), np.uint8)
        try:
            images = spare[:len(keys)]
            labels = augmented.render_batch(keys, images)
            batch = (torch.from_numpy(images[:len(labels)]), labels)
            # the result never aliases `images`, which is free again for the next batch
            return prefetcher.convert(batch, out=prefetcher.output_buffer(outputs, batch))
        finally:
            spare_images.put(spare)

    return ThreadedBatches(make_batch, batch_sampler, threads)
