"""fast_loader(): a store, a folder or a Dataset -> normalised batches on the device, measured fast.

Built in stages, the keywords travelling as one `LoaderOptions`: the source opened (data/sources.py),
the device and the decoder settled (data/decoder_choice.py), the batches planned (the epoch sampler,
data/sampler.py; each batch's crops rendered into one uint8 batch, data/rendering.py, by threads of
this process, data/threads.py, or by worker processes; the conversion to normalised floats once per
batch, data/prefetch.py), the counts measured (data/tune.py) and the loader built (data/fastloader.py).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchspeed import ranks
from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop, sample_rng
from torchspeed.data.decode import GPU_DECODERS, get_decoder
from torchspeed.data.decoder_choice import CropWork, choose_decoder
from torchspeed.data.fastloader import FastLoader
from torchspeed.data.prefetch import DevicePrefetcher
from torchspeed.data.rendering import AugmentedDataset, normalised_batches
from torchspeed.data.sampler import EpochBatchSampler
from torchspeed.data.sources import as_source, sample_name, source_identity, source_name
from torchspeed.data.threads import ThreadedBatches
from torchspeed.data.tune import TuneResult, as_counts, candidate_counts, measure_settings, remembered_settings
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD
from torchspeed.optional import optional
from torchspeed.runtime import default_mp_context, resolve_device, usable_cores

__all__ = ["fast_loader", "LoaderOptions", "FastLoader", "with_decoder"]

log = logging.getLogger(__name__)


def _batch_identity(batch: Any) -> Any:
    return batch  # __getitems__ already returns the collated batch


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # workers must not compete with the model for the cores
    with contextlib.suppress(ImportError):
        optional("cv2", "data", "resizing crops").setNumThreads(1)


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
    """The whole fast input pipeline in one call; inside, the keywords travel as one `LoaderOptions`.

    `data`: a packed store, an ImageFolder path, WebDataset tar shards (a brace pattern such as
    "train-{000000..000127}.tar", a list of .tar paths or a directory of them), a Hugging Face
    `datasets.Dataset` or `save_to_disk` folder with an Image column, a LitData optimized directory
    (data/litformat.py says which layouts), a Dataset factory spec (`package.module:factory` or
    `path/file.py:factory`, called with no arguments), or a map-style Dataset. Encoded image bytes go
    to the decoder as a store's do (no PIL, no unpacking); `image_column`/`label_column` name the image
    and label members or columns when the detected ones are not right. `on_error="skip"` leaves a
    sample that cannot be read or decoded out of its batch (a warning names it) instead of raising.
    `train=True`: RandomResizedCrop(crop, scale) + horizontal flip, shuffled, drop_last; `train=False`:
    resize to crop/0.875 + centre crop, in order, every sample kept. `num_workers=0` makes the batches
    in `threads` threads of this process (the decoders release the GIL; no shared memory, no pickling),
    `num_workers>0` in worker processes of one thread each. `num_workers="auto"` measures both briefly
    (1..cores+1 threads, then 1..cores+1 worker processes, see `tune_loader`) and keeps the fastest;
    `threads="auto"` is then measured too, else it means 1; a list of counts (or a comma string) is what
    gets measured, e.g. `num_workers=[0, 1], threads=[1, 2]`. The measurement times the loader alone: a
    training loop whose model needs the cores may want fewer. `decoder="auto"` measures the JPEG
    decoders once; on a CUDA device (without worker processes) nvjpeg competes too, decoding whole
    batches on the GPU where each crop is resized (`decoder="nvjpeg"` asks for it, with `num_workers=0`;
    an image it cannot read is decoded on the CPU with a warning naming it). Each measured choice is
    logged at INFO on "torchspeed.data.*" (`progress`: True for stderr, or a callable taking a message)
    and remembered on this machine for the same data, batch, crop, device and candidates: the next call
    decides at once ("fast_loader: remembered from <date> (<figure>)") unless `refresh=True` (see
    `torchspeed.remembered`; a measurement taken on a busy machine is not kept). Distributed: each rank
    reads a disjoint shard of each epoch's shuffle, by `num_replicas`/`rank` when given, else by the
    process group, else by WORLD_SIZE/RANK (torchrun's: a loader built before `init_process_group`
    shards too); an uneven split is padded by wrapping around, as DistributedSampler does, so every rank
    runs the same number of steps. Tar shards are split in contiguous blocks of their epoch order
    (data/shards.py), so each rank reads mostly its own shards.
    """
    keywords = locals()  # every field of LoaderOptions is one of these keywords (a test holds them equal)
    return _build_loader(data, batch_size, LoaderOptions(**{f.name: keywords[f.name] for f in fields(LoaderOptions)}))


def _build_loader(data: Any, batch_size: int, options: LoaderOptions) -> FastLoader:
    """fast_loader's stages: check the arguments, open the source, settle the device and the decoder,
    plan the batches, then build the loader with the counts given or measured."""
    options = _with_counts(batch_size, options)
    source = as_source(data, in_memory=options.in_memory, image_column=options.image_column,
                       label_column=options.label_column, on_error=options.on_error)
    if len(source) == 0:
        left_out = getattr(source, "left_out", 0)  # samples left out under on_error="skip" (tar shards)
        raise ValueError(f"the dataset is empty: no samples in {source_name(source)}"
                         + (f" ({left_out} left out: see the warnings)" if left_out else ""))
    options = _with_device(options)
    options, decoder_table = with_decoder(source, options)
    augmented, sampler = _dataset_and_sampler(source, batch_size, options)
    build = _loader_factory(augmented, sampler, options, decoder_table)
    nw = options.num_workers  # measured when "auto" or a list (at num_workers=0, a list of threads too)
    if not (nw == "auto" or isinstance(nw, list) or (nw == 0 and isinstance(options.threads, list))):
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


def _with_device(options: LoaderOptions) -> LoaderOptions:
    """The device resolved (CUDA only where it exists) and pin_memory decided by it when "auto"."""
    device = resolve_device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(options.device)!r} asked for CUDA, which is not available here; "
                         "use device='cpu' or 'auto'")
    pin_memory = device.type == "cuda" if options.pin_memory == "auto" else bool(options.pin_memory)
    return replace(options, device=device, pin_memory=pin_memory)


def with_decoder(source: Any, options: LoaderOptions) -> tuple[LoaderOptions, list]:
    """The decoder named, or measured on samples of the source ("auto"); with the measurement's table
    (public: `tune_loader` chooses the decoder of the pipeline it times this way too).

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


def _jpeg_samples(source: Any, k: int = 16) -> list[tuple[int, Any]]:
    """Up to `k` (index, record) spread over the source, each record's payload JPEG bytes (none when the
    source holds no JPEGs)."""
    out = []
    for i in range(0, len(source), max(1, len(source) // k))[:k]:
        rec = source.record(i)
        if rec.kind != "jpeg":
            return []
        out.append((i, rec._replace(payload=bytes(rec.payload))))
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
        for index, rec in samples:  # the sample that fails, named (PIL reads most; simplejpeg is the reference)
            for name in ("pil", "simplejpeg"):
                try:
                    get_decoder(name).decode(rec.payload)
                except ImportError:
                    continue
                except Exception as bad:
                    raise ValueError(f"cannot decode {sample_name(source, index)}: {type(bad).__name__}: {bad}") from None
        raise e


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
    factory that the tuning times, that builds the loader returned and that rebuilds it (`with_counts`)."""

    def build(num_workers: int, prefetch_factor: int | None, persistent_workers: bool, pin_memory: bool,
              threads: int = 1) -> FastLoader:
        dl = DataLoader(augmented, batch_sampler=sampler, num_workers=num_workers, collate_fn=_batch_identity,
                        pin_memory=pin_memory, worker_init_fn=_worker_init if num_workers else None,
                        prefetch_factor=prefetch_factor if num_workers else None,
                        persistent_workers=persistent_workers and num_workers > 0,
                        # an explicit context: the default one would fix the user's start method for good
                        multiprocessing_context=(options.multiprocessing_context or default_mp_context())
                        if num_workers else None)
        # no worker processes: `threads` threads of this process make the batches (data/threads.py); on a
        # CPU each also normalises its own, on CUDA the prefetcher does on its side stream
        on_cuda = options.device.type == "cuda"
        made = ThreadedBatches(augmented.__getitems__, sampler, threads) if on_cuda and not num_workers else dl
        prefetcher = DevicePrefetcher(made, options.device, options.mean, options.std,
                                      channels_last=options.channels_last, dtype=options.dtype, layout=augmented.layout)
        batches = prefetcher if num_workers or on_cuda else normalised_batches(augmented, sampler, threads, prefetcher)
        return FastLoader(augmented, sampler, dl, prefetcher, batches, threads=threads, rebuild=build,
                          decoder_table=decoder_table)

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
             "decoder": options.decoder, "in_memory": options.in_memory,
             "world": ranks.world(options.num_replicas, options.rank)[0], "cores": usable_cores(), "num_workers": worker_counts, "threads": thread_counts,
             "prefetch_factor": prefetch, "persistent_workers": persistent, "pin_memory": [bool(options.pin_memory)]}

    def measured() -> TuneResult:
        settings = measure_settings(
            build, num_workers=worker_counts, threads=thread_counts, prefetch_factor=prefetch,
            persistent_workers=persistent, pin_memory=[bool(options.pin_memory)], tune_seconds=options.tune_seconds,
            device=options.device, progress=options.progress)
        log.info("fast_loader: %s (%.0f img/s), tuned in %.1f s on %d images (%d settings timed)",
                 settings.describe(), settings.throughput, settings.tuning_s, len(source), len(settings.table))
        return settings

    return remembered_settings("fast_loader", parts, measured, options.refresh, options.progress)

