"""fast_loader(): a store, a folder or a Dataset -> normalised batches on the device, measured fast.

The path of one batch, and what each step buys (figures: `torchspeed bench data`):
  sampler (main)   yields [(epoch, index), ...]: the epoch travels with the indices, so persistent
                   workers need no message to know it, and skipping batches for a resume is free;
  maker            per sample: crop box drawn from the header size -> DCT-scaled decode of just
                   enough pixels -> one cv2.resize of the box region written straight into its slot
                   of a uint8 batch (no per-sample tensors, no collate copy, one intra-op thread);
                   the batch is NCHW, or NHWC when the output is channels_last, so that the float
                   conversion is one contiguous pass. The makers are either threads of the main
                   process (`num_workers=0`, data/threads.py: no shared memory, no pickling, reused
                   buffers) or worker processes (the batch allocated in shared memory);
  conversion       uint8 -> float, /255 and mean/std as one multiply-add per batch, into a reused
                   buffer: by each thread on a CPU, else by the DevicePrefetcher a batch ahead (on
                   CUDA on a side stream, on a CPU in a thread).
"""
from __future__ import annotations

import logging
import math
import os
import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from torchspeed.data.augment import (RandomResizedCropFlip, ResizeCenterCrop, needed_size, render, render_tensor,
                                     sample_rng)
from torchspeed.data.decode import (GPU_DECODERS, CropWork, choose_decoder, decode_jpeg_batch_cuda,
                                     decoding_stream, get_decoder)
from torchspeed.data.hfdatasets import is_hf_dataset
from torchspeed.data.prefetch import BufferPool, DevicePrefetcher
from torchspeed.data.shards import looks_like_shards
from torchspeed.data.sources import (DatasetSource, as_source, is_dataset_spec, sample_name, source_identity,
                                     spec_for_tuning)
from torchspeed.data.store import PackedDataset
from torchspeed.data.threads import ThreadedBatches
from torchspeed.data.tune import (TuneResult, as_counts, candidate_counts, dataloader_factory, measure_settings,
                                  recall_settings, remember_settings, worker_error)
from torchspeed import images as image_rules
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD
from torchspeed.runtime import default_mp_context, resolve_device, usable_cores

__all__ = ["fast_loader", "tune_loader", "LoaderOptions", "FastLoader", "AugmentedDataset", "EpochBatchSampler",
           "world"]

log = logging.getLogger(__name__)


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
        """Sample `index` (its record `rec`, its crop `box`) decoded, cropped and resized into `out`; its label."""
        if rec.kind == "jpeg":
            h, w = rec.height, rec.width
            min_h, min_w = needed_size(h, w, box, self.size)  # just enough pixels: a DCT-scaled decode
            try:  # a decoder that crops decodes only the part the box needs (its origin and the full size with it)
                img, r0, c0, fh, fw = self._decoder.decode_region(
                    rec.payload, min_h, min_w, (box.top, box.left, box.height, box.width))
            except Exception as e:  # truncated or corrupt JPEG data: the error names the file (or record)
                raise ValueError(f"cannot decode {sample_name(self.source, index)}: {type(e).__name__}: {e}") from None
            render(img, box, out, None, fh / h, fw / w, chw=self.layout == "NCHW", origin=(r0, c0), full=(fh, fw))
        else:
            img = rec.payload
            render(img, box, out, None, img.shape[0] / rec.height, img.shape[1] / rec.width, chw=self.layout == "NCHW")
        return rec.label

    @property
    def _decoder(self) -> Any:
        return get_decoder(self.decoder)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        shape = (3, self.size, self.size) if self.layout == "NCHW" else (self.size, self.size, 3)
        out = np.empty(shape, np.uint8)
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
        skip = self.on_error == "skip"
        kept, records = self._records(keys)
        boxes = self.transform.boxes([r.height for r in records], [r.width for r in records], self.seed,
                                     [k[0] for k in kept], [k[1] for k in kept])
        crops = self._decoder.crops
        if crops is not None and images.flags.c_contiguous and all(r.kind == "jpeg" for r in records):
            return self._render_native(crops, kept, records, boxes, images, normalize)
        pixels = images if normalize is None else np.empty(self.batch_shape(len(kept)), np.uint8)
        labels: list[int] = []
        for (_, index), rec, box in zip(kept, records, boxes):
            try:
                labels.append(self._render(index, rec, box, pixels[len(labels)]))
            except ValueError as e:
                if not skip:
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
            for slot, j in enumerate(kept):
                (epoch, index), rec = keys[j], records[j]
                img = decoded[j] if j in decoded else torch.from_numpy(
                    np.require(rec.payload, np.uint8, ["C", "W"])).permute(2, 0, 1).to(self.device)  # raw: read-only
                box = self.transform.box(rec.height, rec.width, sample_rng(self.seed, epoch, index))
                render_tensor(img, box, images[slot], chw=self.layout == "NCHW")
        return images, torch.tensor([records[j].label for j in kept], dtype=torch.int64)

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


def _batch_identity(batch: Any) -> Any:
    return batch  # __getitems__ already returns the collated batch


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # workers must not compete with the model for the cores
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass


class EpochBatchSampler:
    """Batches of (epoch, index) for epoch `epoch`, skipping the first `start` batches.

    The order is DistributedSampler's (a permutation seeded by seed + epoch, sharded by rank), also
    for a single process (num_replicas=1), so one code path covers both. Every rank computes the same
    permutation for the same epoch and takes every `num_replicas`-th index from its `rank`, so the
    shards of one epoch are disjoint. When the sample count does not divide evenly, the permutation
    is padded by wrapping around to its first samples (DistributedSampler(drop_last=False)): every
    rank then has the same number of samples, hence of batches, whatever the batch size, and no
    sample is left out of an epoch (a few are seen twice). `num_replicas`/`rank` not given are read
    from the process group when one is initialised, else from WORLD_SIZE/RANK (see `world`), each
    time they are needed, so a loader built before `init_process_group` follows it.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int,
                 num_replicas: int | None = 1, rank: int | None = 0,
                 order: Callable[[int, int, bool], Sequence[int]] | None = None):
        self.n, self.batch_size, self.shuffle, self.drop_last, self.seed = n, batch_size, shuffle, drop_last, seed
        self.order = order  # a source's own epoch order (tar shards: shard order + local shuffle), or None
        self._num_replicas, self._rank = num_replicas, rank
        self.epoch, self.start = 0, 0
        # for one pass: this rank's samples of an epoch that another number of ranks began, read from
        # batch `start` on (set by the Trainer when it resumes such an epoch)
        self.rest: list[int] | None = None
        world(num_replicas, rank)  # a bad explicit value or environment fails now, naming it

    @property
    def num_replicas(self) -> int:
        return world(self._num_replicas, self._rank)[0]

    @property
    def rank(self) -> int:
        return world(self._num_replicas, self._rank)[1]

    def _indices(self) -> list[int]:
        replicas, rank = world(self._num_replicas, self._rank)
        if self.order is not None:  # the source's order, padded as DistributedSampler pads, in contiguous
            per = self.per_replica()  # blocks: each rank reads mostly its own shards
            idx = np.resize(np.asarray(self.order(self.epoch, self.seed, self.shuffle), dtype=np.int64), per * replicas)
            return idx[rank * per:(rank + 1) * per].tolist()
        s = DistributedSampler(range(self.n), num_replicas=replicas, rank=rank,  # type: ignore[arg-type]
                               shuffle=self.shuffle, seed=self.seed, drop_last=False)
        s.set_epoch(self.epoch)
        return list(s)

    def per_replica(self) -> int:
        return math.ceil(self.n / self.num_replicas)

    def __len__(self) -> int:
        m = self.per_replica()
        return m // self.batch_size if self.drop_last else math.ceil(m / self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        idx, rest, self.rest = self._indices(), self.rest, None
        if rest is not None:
            idx = idx[:self.start * self.batch_size] + rest
        for b in range(self.start, len(self)):
            yield [(self.epoch, i) for i in idx[b * self.batch_size:(b + 1) * self.batch_size]]


class FastLoader:
    """Iterable of `(images, labels)` already on the device: images normalised float NCHW
    (channels_last memory if asked), labels int64.

    Re-iterable: each complete pass advances the epoch (new shuffle); a pass left early is not
    counted (the next pass starts that epoch again from its first batch). A loader given
    `load_state_dict(state)` starts its next pass at the next batch unseen when `state` was taken.
    """

    yields_device_batches = True  # the Trainer duck-types on this: batches need no .to(device)

    def __init__(self, dataset: AugmentedDataset, sampler: EpochBatchSampler, dataloader: DataLoader,
                 prefetcher: DevicePrefetcher, settings: TuneResult | None = None, decoder_table: list | None = None,
                 threads: int = 1):
        self._augmented, self.batch_sampler, self.dataloader, self.prefetcher = dataset, sampler, dataloader, prefetcher
        self.threads = threads if dataloader.num_workers == 0 else 1
        self._batches = prefetcher if dataloader.num_workers else self._threaded(threads)
        self.settings = settings  # the measurement, when num_workers or threads were tuned
        self.decoder_table = decoder_table or []  # the decoder measurement, when one was made
        self.epoch = 0
        self.batches_done = 0  # batches of this epoch yielded so far (what state_dict reports)
        self._resume_at = 0  # where the next pass starts: set by load_state_dict, used once
        self._build: Callable[..., FastLoader] | None = None  # set by fast_loader (see with_counts)

    def _threaded(self, threads: int) -> Any:
        """No worker processes: `threads` threads of this process make the batches (see data/threads.py).

        On a CPU each thread also normalises its batch (with the native renderer, as it renders), into
        buffers reused from one batch and one pass to the next (no fresh pages per batch); on CUDA the
        prefetcher copies and normalises on its side stream.
        """
        augmented, prefetcher = self._augmented, self.prefetcher
        if prefetcher.device.type == "cuda":
            return DevicePrefetcher(ThreadedBatches(augmented.__getitems__, self.batch_sampler, threads),
                                    prefetcher.device, prefetcher.mean, prefetcher.std, prefetcher.channels_last,
                                    prefetcher.dtype, prefetcher.layout)
        # shared by the threads and kept across passes (the threads are new each pass): a uint8 batch and a
        # float output from fresh memory would fault every page in again each epoch
        outputs = BufferPool(capacity=threads * (ThreadedBatches.AHEAD + 2) + 2)
        spare_images: queue.SimpleQueue = queue.SimpleQueue()
        # with the native renderer, each thread writes the normalised floats itself (no uint8 batch, no conversion)
        native = augmented.decoder not in GPU_DECODERS and augmented._decoder.crops is not None
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
                spare = np.empty(augmented.batch_shape(self.batch_sampler.batch_size), np.uint8)
            try:
                images = spare[:len(keys)]
                labels = augmented.render_batch(keys, images)
                batch = (torch.from_numpy(images[:len(labels)]), labels)
                # the result never aliases `images`, which is free again for the next batch
                return prefetcher.convert(batch, out=prefetcher.output_buffer(outputs, batch))
            finally:
                spare_images.put(spare)

        return ThreadedBatches(make_batch, self.batch_sampler, threads)

    @property
    def dataset(self) -> Any:
        """The underlying record source (PackedDataset, FolderSource, TarShards, ArrowImages or your Dataset's
        wrapper): `len` and `.classes`."""
        return self._augmented.source

    @property
    def batch_size(self) -> int:
        """Samples per batch (DataLoader's attribute, for code written for one)."""
        return self.batch_sampler.batch_size

    @property
    def sampler(self) -> EpochBatchSampler:
        """What orders this rank's samples: its `num_replicas`, `rank`, `shuffle` and `epoch`."""
        return self.batch_sampler

    @property
    def drop_last(self) -> bool:
        """Whether a last batch smaller than `batch_size` is left out."""
        return self.batch_sampler.drop_last

    @property
    def num_workers(self) -> int:
        """Worker processes really used (0: `threads` of this process make the batches)."""
        return self.dataloader.num_workers

    @property
    def decoder(self) -> str:
        return self._augmented.decoder

    @property
    def device(self) -> torch.device:
        return self.prefetcher.device

    @property
    def seed(self) -> int:
        return self._augmented.seed

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def identity(self) -> dict[str, Any]:
        """What this loader's batches depend on, JSON-able: the data (its files' sizes and times, or a
        Dataset's class and length), batch, crop, augmentation, decoder and device: the key under which a
        choice measured with it (e.g. `train.choose_counts`) is remembered."""
        aug = self._augmented
        return {"data": source_identity(aug.source), "batch_size": self.batch_size, "crop": aug.size,
                "transform": repr(aug.transform), "layout": aug.layout, "decoder": aug.decoder,
                "device": str(self.device), "drop_last": self.drop_last}

    def with_counts(self, num_workers: int, threads: int = 1) -> FastLoader:
        """This loader (same data, crop, decoder, order, epoch and position) with its batches made by
        `num_workers` worker processes, or at 0 by `threads` threads of this process.

        Why: the counts `fast_loader` measures are the fastest for the loader alone; a training step
        needs cores too, and whoever knows the step (`train.choose_loader_with_step`) times the less
        parallel settings with it. The two loaders share their sampler: use one of them at a time."""
        if not isinstance(num_workers, int) or num_workers < 0 or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"with_counts needs num_workers >= 0 and threads >= 1, got {num_workers!r}, {threads!r}")
        build = self._build
        if build is None:
            raise ValueError("this FastLoader was not built by fast_loader(); it cannot be rebuilt with other counts")
        dl = self.dataloader
        other = build(num_workers, dl.prefetch_factor or 2, dl.persistent_workers if dl.num_workers else True,
                      dl.pin_memory, threads)
        other.settings, other.decoder_table = self.settings, self.decoder_table
        other.epoch, other.batches_done, other._resume_at = self.epoch, self.batches_done, self._resume_at
        return other

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (its shuffle and augmentation); keeps a loaded resume point if it is the current one."""
        if epoch != self.epoch:
            self.epoch, self.batches_done, self._resume_at = int(epoch), 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "batches_done": int(self.batches_done), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        try:
            epoch, done, seed = int(state["epoch"]), int(state["batches_done"]), int(state["seed"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a FastLoader state (need epoch, batches_done, seed): {state!r}") from None
        if seed != self.seed:
            raise ValueError(f"the state was taken with seed {seed} but this loader has seed {self.seed}; "
                             f"build the loader with seed={seed} to resume exactly")
        if not 0 <= done <= len(self):
            raise ValueError(f"batches_done {done} is outside 0..{len(self)} for this loader")
        self.epoch, self.batches_done, self._resume_at = epoch, done, done

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._resume_at = self._resume_at, 0  # a loaded resume point is used once
        if start >= len(self):  # the state was taken at the very end of an epoch
            self.epoch, start = self.epoch + 1, 0
        self.batches_done = start
        self.batch_sampler.epoch, self.batch_sampler.start = self.epoch, start
        try:
            for batch in self._batches:
                self.batches_done += 1
                if len(batch[1]) == 0:  # on_error="skip" left out every sample: nothing to train on
                    log.warning("a whole batch was left out (every sample of it could not be read)")
                    continue
                yield batch
        except ValueError as e:  # a bad sample in a worker process: its one-line message, not the worker's traceback
            one_line = worker_error(e)
            if one_line is e:
                raise
            raise one_line from None
        self.epoch, self.batches_done = self.epoch + 1, 0

    def __repr__(self) -> str:
        return (f"FastLoader({self.dataset!r}, batch_size={self.batch_sampler.batch_size}, crop={self._augmented.size}, "
                f"decoder={self.decoder}, num_workers={self.dataloader.num_workers}, threads={self.threads}, "
                f"device={self.device})")


def _jpeg_samples(source: Any, k: int = 16) -> list[tuple[int, Any]]:
    """Up to `k` (index, record) spread over the source, each record's payload JPEG bytes (none when the
    source holds no JPEGs)."""
    n = len(source)
    out = []
    for i in range(0, n, max(1, n // k)):
        rec = source.record(i)
        if rec.kind != "jpeg":
            return []
        out.append((i, rec._replace(payload=bytes(rec.payload))))
        if len(out) >= k:
            break
    return out


def _measured_decoder(source: Any, samples: list[tuple[int, Any]], options: LoaderOptions,
                      device: torch.device | None = None) -> tuple[str, list]:
    """choose_decoder on the samples, each decoder timed rendering the loader's crops of them (the first
    epoch's boxes; nvjpeg competing for a CUDA `device`), remembered for this data (see
    `source_identity`) and crop; when they cannot be decoded, the error names the sample that fails."""
    transform = _transform(options)
    crops = CropWork([rec.height for _, rec in samples], [rec.width for _, rec in samples],
                     [transform.box(rec.height, rec.width, sample_rng(options.seed, 0, index)) for index, rec in samples],
                     options.crop)
    parts = {"data": source_identity(source), "crop": options.crop, "train": options.train, "scale": list(options.scale)}
    try:
        return choose_decoder([rec.payload for _, rec in samples], parts=parts, progress=options.progress, device=device,
                              refresh=options.refresh, crops=crops)
    except Exception as e:
        for index, rec in samples:
            try:
                get_decoder("pil").decode(rec.payload)
            except Exception as bad:
                raise ValueError(f"cannot decode {sample_name(source, index)}: {type(bad).__name__}: {bad}") from None
        raise e


def world(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(num_replicas, rank) a loader shards by: each explicit argument wins; else an initialised
    torch.distributed process group; else torchrun's WORLD_SIZE/RANK environment variables (a loader
    built before `init_process_group` still shards); else (1, 0)."""
    if num_replicas is None or rank is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            found = torch.distributed.get_world_size(), torch.distributed.get_rank()
        else:
            try:
                found = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
            except ValueError:
                raise ValueError(f"the environment variables WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} and "
                                 f"RANK={os.environ.get('RANK')!r} must be integers (torchrun sets them); or pass "
                                 f"num_replicas= and rank=") from None
        num_replicas = found[0] if num_replicas is None else num_replicas
        rank = found[1] if rank is None else rank
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas (or WORLD_SIZE) must be a positive integer, got {num_replicas!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank (or RANK) must be in 0..{num_replicas - 1} for {num_replicas} replicas, got {rank!r}")
    return num_replicas, rank


@dataclass(frozen=True)
class LoaderOptions:
    """fast_loader's keywords as one value, each field named as its keyword (see `fast_loader`).

    The stages that build a loader, and its tuning, are handed this one value; a stage that settles
    an "auto" (the device, the decoder, pin_memory) hands on a copy with the choice in the same
    field. `fast_loader(data, batch_size, **options.keywords())` builds a loader from one, and
    `dataclasses.replace(options, train=False)` derives the evaluation loader's.
    """

    train: bool = True
    crop: int = 224
    device: str | torch.device = "auto"
    mean: Sequence[float] | None = IMAGENET_MEAN
    std: Sequence[float] | None = IMAGENET_STD
    channels_last: bool = True
    dtype: torch.dtype | None = None
    num_workers: int | str | Sequence[int] = "auto"
    seed: int = 0
    drop_last: bool | None = None
    decoder: str = "auto"
    in_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    pin_memory: bool | str = "auto"
    scale: tuple[float, float] = (0.08, 1.0)
    num_replicas: int | None = None
    rank: int | None = None
    tune_seconds: float = 0.4
    multiprocessing_context: Any = None
    threads: int | str | Sequence[int] = "auto"
    progress: bool | Callable[[str], None] = False
    refresh: bool = False
    image_column: str | None = None
    label_column: str | None = None
    on_error: str = "fail"

    def keywords(self) -> dict[str, Any]:
        """The fields as fast_loader's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fast_loader(
    data: Any,
    batch_size: int,
    *,
    train: bool = True,
    crop: int = 224,
    device: str | torch.device = "auto",
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
    channels_last: bool = True,
    dtype: torch.dtype | None = None,
    num_workers: int | str | Sequence[int] = "auto",
    seed: int = 0,
    drop_last: bool | None = None,
    decoder: str = "auto",
    in_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool | None = None,
    pin_memory: bool | str = "auto",
    scale: tuple[float, float] = (0.08, 1.0),
    num_replicas: int | None = None,
    rank: int | None = None,
    tune_seconds: float = 0.4,
    multiprocessing_context: Any = None,
    threads: int | str | Sequence[int] = "auto",
    progress: bool | Callable[[str], None] = False,
    refresh: bool = False,
    image_column: str | None = None,
    label_column: str | None = None,
    on_error: str = "fail",
) -> FastLoader:
    """The whole fast input pipeline in one call (see the module docstring for what each step buys).

    `data`: a packed store, an ImageFolder path, WebDataset tar shards (a brace pattern such as
    "train-{000000..000127}.tar", a list of .tar paths or a directory of them), a Hugging Face
    `datasets.Dataset` or `save_to_disk` folder with an Image column, a LitData optimized directory
    (data/litformat.py says which layouts), a Dataset factory spec (`package.module:factory` or
    `path/file.py:factory`, called with no arguments), or a map-style Dataset. The shards' and
    datasets' encoded image bytes go to the decoder as a store's do (no PIL, no unpacking);
    `image_column`/`label_column` name the image and label members or columns when the detected ones
    are not right. `on_error="skip"` leaves a sample that cannot be read or decoded out of its batch
    (the batch is that much smaller; a warning names its file, record, or shard and key) instead of
    raising ("fail"). `train=True`:
    RandomResizedCrop(crop, scale) + horizontal flip, shuffled, drop_last; `train=False`: resize to
    crop/0.875 + centre crop, in order, every sample kept. `num_workers=0` makes the batches in
    `threads` threads of this process (the decoders release the GIL; no shared memory, no pickling),
    `num_workers>0` in worker processes of one thread each. `num_workers="auto"` measures both
    briefly (1..cores+1 threads, then 1..cores+1 worker processes, see `tune_loader`) and keeps the
    fastest; `threads="auto"` is then measured too, else it means 1. A list of counts (or a comma
    string) instead of "auto" is what gets measured, e.g. `num_workers=[0, 1], threads=[1, 2]`: the
    measurement times the loader alone, so a training loop whose model needs the cores may want
    fewer. `decoder="auto"` measures the JPEG decoders once in this process; on a CUDA device (and
    without worker processes) nvjpeg competes too, decoding whole batches on the GPU where each crop
    is resized (`decoder="nvjpeg"` asks for it; an image it cannot read is decoded on the CPU with a
    warning naming the file; batches are then made by threads, `num_workers=0`). Each measured choice
    is logged at INFO on "torchspeed.data.*"; `progress` (True: stderr, or a callable taking a
    message) reports the measuring as it goes. What was measured (the decoder, the counts) is
    remembered on this machine for the same data (a store's or folder's files, a Dataset's class and
    length), batch, crop, device and candidates: the next call, in this process or the next, decides
    at once and logs "fast_loader: remembered from <date> (<figure>)"; `refresh=True` measures again
    (see `torchspeed.remembered`; a measurement taken on a busy machine is not kept). Distributed:
    each rank reads a disjoint shard of each epoch's shuffle, sharded by `num_replicas`/`rank` when
    given, else by the initialised process group, else by the WORLD_SIZE/RANK environment variables
    (torchrun's, so a loader built before `init_process_group` shards too). As DistributedSampler does, an uneven split is padded by
    wrapping around to the first samples, so every rank runs the same number of steps; tar shards are
    split in contiguous blocks of their epoch order (data/shards.py: shard order + a local shuffle of
    `TarShards.shuffle_buffer` places), so each rank reads mostly its own shards. Inside, the
    keywords travel as one `LoaderOptions`.
    """
    options = LoaderOptions(
        train=train, crop=crop, device=device, mean=mean, std=std, channels_last=channels_last, dtype=dtype,
        num_workers=num_workers, seed=seed, drop_last=drop_last, decoder=decoder, in_memory=in_memory,
        prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, pin_memory=pin_memory, scale=scale,
        num_replicas=num_replicas, rank=rank, tune_seconds=tune_seconds,
        multiprocessing_context=multiprocessing_context, threads=threads, progress=progress, refresh=refresh,
        image_column=image_column, label_column=label_column, on_error=on_error)
    return _build_loader(data, batch_size, options)


def _build_loader(data: Any, batch_size: int, options: LoaderOptions) -> FastLoader:
    """fast_loader's stages: check the arguments, open the source, settle the device and the decoder,
    plan the batches, then build the loader with the counts given or measured."""
    options = _with_counts(batch_size, options)
    source = as_source(data, in_memory=options.in_memory, image_column=options.image_column,
                       label_column=options.label_column, on_error=options.on_error)
    if len(source) == 0:
        raise ValueError("the dataset is empty")
    options = _with_device(options)
    options, decoder_table = _with_decoder(source, options)
    augmented, sampler = _dataset_and_sampler(source, batch_size, options)
    build = _loader_factory(augmented, sampler, options, decoder_table)
    if not _measures_counts(options):
        return build(options.num_workers, options.prefetch_factor or 2,
                     True if options.persistent_workers is None else options.persistent_workers, options.pin_memory,
                     options.threads if isinstance(options.threads, int) else 1)
    settings = _tuned(source, batch_size, options, build)
    loader = build(settings.num_workers, settings.prefetch_factor, settings.persistent_workers, options.pin_memory,
                   settings.threads)
    loader.settings = settings
    return loader


def _with_counts(batch_size: int, options: LoaderOptions) -> LoaderOptions:
    """The sizes checked; num_workers and threads as "auto", a count or a sorted list of candidates."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(options.crop, int) or options.crop < 1:
        raise ValueError(f"crop must be a positive integer, got {options.crop!r}")
    if options.on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got {options.on_error!r}")
    return replace(options, num_workers=as_counts(options.num_workers, "num_workers", 0),
                   threads=as_counts(options.threads, "threads", 1))


def _measures_counts(options: LoaderOptions) -> bool:
    """Whether num_workers (or, at num_workers=0, threads) is measured rather than used as given (`_with_counts`
    has made each "auto", a count or a list)."""
    return (options.num_workers == "auto" or isinstance(options.num_workers, list)
            or (options.num_workers == 0 and isinstance(options.threads, list)))


def _with_device(options: LoaderOptions) -> LoaderOptions:
    """The device resolved (CUDA only where it exists) and pin_memory decided by it when "auto"."""
    device = resolve_device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(options.device)!r} asked for CUDA, which is not available here; "
                         "use device='cpu' or 'auto'")
    pin_memory = device.type == "cuda" if options.pin_memory == "auto" else bool(options.pin_memory)
    return replace(options, device=device, pin_memory=pin_memory)


def _with_decoder(source: Any, options: LoaderOptions) -> tuple[LoaderOptions, list]:
    """The decoder named, or measured on samples of the source ("auto"); with the measurement's table.

    A GPU decoder makes batches in this process: worker processes are refused, and measured counts
    become the threads at num_workers=0."""
    decoder, decoder_table, num_workers = options.decoder, [], options.num_workers
    if decoder == "auto":
        samples = _jpeg_samples(source)
        if samples:
            gpu_allowed = not (isinstance(num_workers, int) and num_workers > 0)  # worker processes decode on the CPU
            decoder, decoder_table = _measured_decoder(source, samples, options, options.device if gpu_allowed else None)
        else:
            decoder = "simplejpeg"  # nothing to decode (raw pixels or decoded arrays): any name will do
        if hasattr(source, "close"):
            source.close()  # no LMDB handle left open in the parent when the workers fork
    else:
        if decoder in GPU_DECODERS and options.device.type != "cuda":
            raise ValueError(f"decoder={decoder!r} decodes on a CUDA device, but this loader's device is "
                             f"{options.device}; use a CPU decoder (or decoder='auto')")
        get_decoder(decoder)  # a clear error now rather than in a worker
    if decoder in GPU_DECODERS:  # the batch is made on the GPU by threads of this process, never in workers
        if isinstance(num_workers, int) and num_workers > 0:
            raise ValueError(f"decoder={decoder!r} makes batches on the GPU in this process: use num_workers=0 "
                             f"(with threads=N) or num_workers='auto', not {num_workers}")
        if num_workers == "auto" or isinstance(num_workers, list):
            num_workers = [0]  # only the threads are measured
    return replace(options, decoder=decoder, num_workers=num_workers), decoder_table


def _transform(options: LoaderOptions) -> RandomResizedCropFlip | ResizeCenterCrop:
    return RandomResizedCropFlip(options.crop, scale=options.scale) if options.train else ResizeCenterCrop(options.crop)


def _dataset_and_sampler(source: Any, batch_size: int,
                         options: LoaderOptions) -> tuple[AugmentedDataset, EpochBatchSampler]:
    """What makes each sample (the augmentation, the decoder, the uint8 layout) and the batches of indices."""
    transform = _transform(options)
    # channels_last output: NHWC uint8 is already its memory order; else NCHW (see normalize_batch)
    augmented = AugmentedDataset(source, transform, options.decoder, options.seed,
                                 layout="NHWC" if options.channels_last else "NCHW", device=options.device,
                                 on_error=options.on_error)
    drop_last = options.train if options.drop_last is None else options.drop_last
    sampler = EpochBatchSampler(len(source), batch_size, shuffle=options.train, drop_last=drop_last, seed=options.seed,
                                num_replicas=options.num_replicas, rank=options.rank,
                                order=getattr(source, "epoch_order", None))
    if len(sampler) == 0:
        raise ValueError(f"batch_size {batch_size} is larger than this rank's {sampler.per_replica()} samples "
                         f"with drop_last=True; use a smaller batch or drop_last=False")
    return augmented, sampler


def _loader_factory(augmented: AugmentedDataset, sampler: EpochBatchSampler, options: LoaderOptions,
                    decoder_table: list) -> Callable[..., FastLoader]:
    """`build(num_workers, prefetch_factor, persistent_workers, pin_memory, threads)` -> FastLoader: the
    factory that the tuning times and that builds the loader returned."""

    def build(num_workers: int, prefetch_factor: int | None, persistent_workers: bool, pin_memory: bool,
              threads: int = 1) -> FastLoader:
        dl = DataLoader(augmented, batch_sampler=sampler, num_workers=num_workers, collate_fn=_batch_identity,
                        pin_memory=pin_memory, worker_init_fn=_worker_init if num_workers else None,
                        prefetch_factor=prefetch_factor if num_workers else None,
                        persistent_workers=persistent_workers and num_workers > 0,
                        # an explicit context: the default one would fix the user's start method for good
                        multiprocessing_context=(options.multiprocessing_context or default_mp_context())
                        if num_workers else None)
        prefetcher = DevicePrefetcher(dl, options.device, options.mean, options.std, channels_last=options.channels_last,
                                      dtype=options.dtype, layout=augmented.layout)
        loader = FastLoader(augmented, sampler, dl, prefetcher, decoder_table=decoder_table, threads=threads)
        loader._build = build  # with_counts rebuilds the same pipeline with other counts
        return loader

    return build


def _tuned(source: Any, batch_size: int, options: LoaderOptions, build: Callable[..., FastLoader]) -> TuneResult:
    """The counts (and prefetch_factor, persistent_workers when not given) measured, or remembered from
    an earlier measurement of the same data, batch, crop, decoder, device and candidates on this machine."""
    worker_counts, thread_counts = candidate_counts(options.num_workers, options.threads)
    prefetch = [options.prefetch_factor] if options.prefetch_factor else [2, 4]
    persistent = [options.persistent_workers] if options.persistent_workers is not None else [True]
    parts = {"entry": "fast_loader", "data": source_identity(source), "batch_size": batch_size, "crop": options.crop,
             "train": options.train, "scale": list(options.scale), "device": options.device.type,
             "channels_last": options.channels_last, "dtype": str(options.dtype), "normalised": options.mean is not None,
             "decoder": options.decoder, "in_memory": options.in_memory, "world": world(options.num_replicas, options.rank)[0],
             "cores": usable_cores(), "num_workers": worker_counts, "threads": thread_counts,
             "prefetch_factor": prefetch, "persistent_workers": persistent, "pin_memory": [bool(options.pin_memory)]}
    settings = recall_settings("fast_loader", parts, options.refresh, options.progress)
    if settings is None:
        settings = measure_settings(
            build, num_workers=worker_counts, threads=thread_counts, prefetch_factor=prefetch,
            persistent_workers=persistent, pin_memory=[bool(options.pin_memory)], tune_seconds=options.tune_seconds,
            device=options.device, progress=options.progress)
        log.info("fast_loader: %s (%.0f img/s), tuned in %.1f s on %d images (%d settings timed)",
                 settings.describe(), settings.throughput, settings.tuning_s, len(source), len(settings.table))
        remember_settings("fast_loader", parts, settings)
    return settings


def tune_loader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: str | int | Sequence[int] = "auto",
    threads: str | int | Sequence[int] | None = None,
    tune_seconds: float = 1.0,
    device: str | torch.device = "auto",
    prefetch_factor: Sequence[int] = (2, 4),
    persistent_workers: Sequence[bool] = (True, False),
    pin_memory: str | bool = "auto",
    collate_fn: Callable | None = None,
    crop: int = 224,
    train: bool = True,
    progress: bool | Callable[[str], None] = False,
    patience: int = 2,
    refresh: bool = False,
) -> TuneResult:
    """Measure loader throughput over settings; return the fastest with the whole table (`TuneResult`).

    `dataset`: a map-style Dataset (timed as a plain shuffled DataLoader), an ImageFolder or store
    path (timed as the torchspeed pipeline, `fast_loader` with `crop` and `train`), a Dataset factory
    spec `package.module:factory` or `path/file.py:factory` (its Dataset built once; timed as the
    torchspeed pipeline when its samples are images it can take, PIL or uint8, else as a plain
    DataLoader with the Dataset's own transforms, logged at INFO), or a factory
    `build(num_workers, prefetch_factor, persistent_workers, pin_memory[, threads]) -> iterable of batches`.
    `num_workers`: the counts tried, "auto" (0..cores+1) or a list of candidates (or a comma string
    "0,1,2"), walked upward until throughput falls (`patience` successive counts slower than the best
    so far: one noisy measurement does not end the search); the `prefetch_factor` and
    `persistent_workers` candidates are then tried at the best worker count, and pin_memory only with
    CUDA. Each configuration runs two passes of `tune_seconds` after a warm-up. `threads` (torchspeed
    pipelines, whose factory takes `threads=`; "auto" for a path): with "auto" (1..cores+1) or a list,
    num_workers=0 is tried with those threads making batches in this process before the worker
    processes, and the best of each then run again, interleaved, three passes each (rows marked
    `final`); an integer fixes the threads used at num_workers=0. The result is logged at INFO on
    "torchspeed.data.loader"; `progress` (True: stderr, or a callable taking a message) reports each
    configuration timed. Before timing it waits (at most `tune.QUIET_WAIT_S`) for other processes to
    leave the cores; `others_cores` and `busy_warning` say when they did not.

    The result is remembered on this machine for the same data (a path's files, a Dataset's class and
    length), batch, crop, device and candidates: the next call returns it at once, with `remembered`
    set ("remembered from <date> (<figure>)"), unless `refresh=True`. A loader factory has no identity
    to remember it by and is measured every time; a measurement taken on a busy machine is not kept.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if tune_seconds <= 0:
        raise ValueError(f"tune_seconds must be positive, got {tune_seconds!r}")
    dev = resolve_device(device)
    num_workers = as_counts(num_workers, "num_workers", 0)
    timed = _timed_factory(dataset, batch_size, num_workers, threads, collate_fn, crop, train, dev, progress, refresh)
    pins = [False, True] if (pin_memory == "auto" and dev.type == "cuda") else [bool(pin_memory) and pin_memory != "auto"]
    worker_counts, thread_counts = candidate_counts(
        timed.num_workers, None if timed.threads is None else as_counts(timed.threads, "threads", 1))
    parts = None if timed.identity is None else {
        "entry": "tune_loader", "data": timed.identity, "batch_size": batch_size, "crop": crop, "train": train,
        "device": dev.type, "cores": usable_cores(), "num_workers": worker_counts, "threads": thread_counts,
        "prefetch_factor": [int(p) for p in prefetch_factor], "persistent_workers": [bool(p) for p in persistent_workers],
        "pin_memory": pins, "patience": patience}
    settings = None if parts is None else recall_settings("tune_loader", parts, refresh, progress)
    if settings is None:
        settings = measure_settings(timed.build, num_workers=worker_counts, threads=thread_counts,
                                    prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                                    pin_memory=pins, tune_seconds=tune_seconds, device=dev, progress=progress,
                                    patience=patience)
        log.info("tune_loader: %s (%.0f items/s), %d settings timed in %.1f s", settings.describe(),
                 settings.throughput, len(settings.table), settings.tuning_s)
        if parts is not None:
            remember_settings("tune_loader", parts, settings)
    return settings


@dataclass
class _Timed:
    """What tune_loader times: the factory, the worker counts and threads it searches, and the data's
    identity for remembering the result (None: a factory, measured every time)."""

    build: Callable[..., Any]
    num_workers: str | int | list[int]
    threads: str | int | Sequence[int] | None
    identity: dict[str, Any] | None


def _timed_factory(dataset: Any, batch_size: int, num_workers: str | int | list[int],
                   threads: str | int | Sequence[int] | None, collate_fn: Callable | None, crop: int, train: bool,
                   device: torch.device, progress: Any, refresh: bool) -> _Timed:
    """What tune_loader times, and the threads it searches: the torchspeed pipeline for a path or a
    Dataset of images (its decoder chosen once, as fast_loader chooses it; threads "auto" unless
    given), the factory given, or a plain DataLoader (no threads)."""
    name = None
    if is_dataset_spec(dataset):  # built once, not once per setting timed
        name, dataset = dataset.strip(), spec_for_tuning(dataset)
        if not isinstance(dataset, DatasetSource):
            threads = None  # a plain DataLoader has worker processes only
    if is_hf_dataset(dataset) or looks_like_shards(dataset):  # read as records, like a path: not a plain DataLoader
        dataset = as_source(dataset)
    if isinstance(dataset, (str, os.PathLike, DatasetSource)) or hasattr(dataset, "record"):
        source = as_source(dataset)
        identity = source_identity(source)
        options, _ = _with_decoder(source, LoaderOptions(train=train, crop=crop, device=device, num_workers=num_workers,
                                                         progress=progress, refresh=refresh))
        # a store is opened by each loader timed (its LMDB handle per process); other sources are opened once
        data = dataset if isinstance(source, PackedDataset) else source

        def build(num_workers: int, prefetch_factor: int | None, persistent_workers: bool, pin_memory: bool,
                  threads: int = 1) -> FastLoader:
            return fast_loader(data, batch_size, train=train, crop=crop, device=device, num_workers=num_workers,
                               prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                               pin_memory=pin_memory, threads=threads, decoder=options.decoder)

        # the torchspeed pipeline: its threads are searched too
        return _Timed(build, options.num_workers, "auto" if threads is None else threads,
                      {**identity, "decoder": options.decoder})
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        return _Timed(dataset, num_workers, threads, None)
    identity = {"dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}", "spec": name,
                "n": len(dataset) if hasattr(dataset, "__len__") else None,
                "collate_fn": None if collate_fn is None else getattr(collate_fn, "__qualname__", type(collate_fn).__name__)}
    return _Timed(dataloader_factory(dataset, batch_size, collate_fn, name=name), num_workers, threads, identity)
