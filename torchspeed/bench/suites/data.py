"""Data suite: images/s from JPEG files to model-ready batches, plain torchvision vs torchspeed.

Every contender yields the same thing per batch: 64 images, RandomResizedCrop to 128x128 + random
horizontal flip, float32 NCHW (contiguous) normalised with ImageNet mean/std, plus int64 labels.
Contenders run one after another in this process on the same demo photos (500x375 JPEG q90);
each figure is the median of 3 passes of >= 5 s (1 s with --quick), epochs repeated as needed,
the passes of all contenders interleaved (round-robin) so that background load hits them alike.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

TITLE = "Data loading: images/s into the model (64 x RandomResizedCrop 128 + flip, float32 NCHW normalised)"

BATCH, CROP, SHORT_SIDE = 64, 128, 160


def _subset_folder(src: str, n: int) -> str:
    """A cached ImageFolder of symlinks to the first `n` images of `src` (for --quick)."""
    from torchspeed.atomic import build_directory
    from torchspeed.images import scan_folder
    from torchspeed.runtime import cache_dir

    def build(tmp: str) -> None:
        classes, samples = scan_folder(src)
        for c in classes:
            os.makedirs(os.path.join(tmp, c))
        for path, label in sorted(samples, key=lambda s: os.path.basename(s[0]))[:n]:
            os.symlink(path, os.path.join(tmp, classes[label], os.path.basename(path)))

    return build_directory(os.path.join(cache_dir("bench-data"), f"{os.path.basename(src)}-first{n}"), build)


def _resize_files(job: tuple[list[tuple[str, str]], int]) -> None:
    from PIL import Image

    from torchspeed.data.packer import _load_file

    pairs, short_side = job
    for src, dst in pairs:
        Image.fromarray(_load_file(src, short_side)).save(dst, quality=90)


def _resized_folder(src: str, short_side: int) -> str:
    """A cached copy of the ImageFolder `src` with every image resized to `short_side` (JPEG q90)."""
    from torchspeed.atomic import build_directory
    from torchspeed.images import scan_folder
    from torchspeed.runtime import cache_dir, usable_cores

    def build(tmp: str) -> None:
        classes, samples = scan_folder(src)
        for c in classes:
            os.makedirs(os.path.join(tmp, c))
        pairs = [(p, os.path.join(tmp, classes[y], os.path.basename(p))) for p, y in samples]
        jobs = [(pairs[i:i + 64], short_side) for i in range(0, len(pairs), 64)]
        with ProcessPoolExecutor(usable_cores()) as pool:
            list(pool.map(_resize_files, jobs))

    return build_directory(os.path.join(cache_dir("bench-data"), f"{os.path.basename(src)}-short{short_side}"), build)


def _cached_store(src: str, name: str, **pack_kwargs: Any) -> str:
    from torchspeed.data import pack
    from torchspeed.runtime import cache_dir

    path = os.path.join(cache_dir("bench-data"), f"{os.path.basename(src)}-{name}")
    if not os.path.isdir(path):
        pack(src, path, progress=False, **pack_kwargs)
    return path


def _torchvision(folder: str) -> Any:
    from torchvision import datasets
    from torchvision import transforms as T

    from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

    tf = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return datasets.ImageFolder(folder, tf)


def _check_output(name: str, batch: Any) -> None:
    """Like for like: every contender must yield the baseline's format."""
    import torch

    x, y = batch
    if tuple(x.shape) != (BATCH, 3, CROP, CROP) or x.dtype != torch.float32 or not x.is_contiguous() \
            or y.dtype != torch.int64 or not -3.0 < float(x.mean()) < 3.0:
        raise RuntimeError(f"{name} yields {tuple(x.shape)} {x.dtype} (contiguous={x.is_contiguous()}), "
                           f"not the benchmark's float32 NCHW batch")


def run(quick: bool, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from torchspeed.args import progress_fn
    from torchspeed.measure import time_iterable
    from torchspeed.data import fast_loader, pack, tune_loader
    from torchspeed.data.demo import demo_folder
    from torchspeed.data.tune import _shutdown
    from torchspeed.runtime import usable_cores

    say = progress_fn(progress)
    cores = usable_cores()
    pass_s, tune_s = (1.0, 0.3) if quick else (5.0, 1.0)
    n_images = 1000 if quick else 4000
    say("demo photos (generated once)")
    src = demo_folder(4000)
    if quick:
        src = _subset_folder(src, n_images)
    say("resized copy of the folder (short side 160, cached)")
    resized = _resized_folder(src, SHORT_SIDE)
    say("extra stores for the comparison rows (cached)")
    raw_store = _cached_store(src, f"raw{SHORT_SIDE}", short_side=SHORT_SIDE, format="raw")
    full_store = _cached_store(src, "jpeg-full", short_side=None, format="jpeg", quality=90)

    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"images": n_images, "batch_size": BATCH, "crop": CROP, "short_side": SHORT_SIDE}
    work = tempfile.mkdtemp(prefix="torchspeed-bench-data-")
    try:
        say(f"packing {n_images} images (short side {SHORT_SIDE}, JPEG q90)")
        report = pack(src, os.path.join(work, "store"), short_side=SHORT_SIDE, format="jpeg", quality=90, progress=False)
        results["pack_s"] = round(report.seconds, 2)
        store = report.dst

        contenders: dict[str, tuple[Any, str]] = {}

        def add(name: str, loader: Any, what: str) -> None:
            _check_output(name, next(iter(loader)))
            contenders[name] = (loader, what)

        def plain(folder: str, num_workers: int) -> Any:
            return DataLoader(_torchvision(folder), BATCH, shuffle=True, drop_last=True, num_workers=num_workers,
                              persistent_workers=num_workers > 0)

        def tuned_workers(folder: str) -> int:
            say(f"tuning torchvision num_workers on {os.path.basename(folder)}")
            s = tune_loader(_torchvision(folder), BATCH, num_workers=list(range(cores + 1)), seconds=tune_s, device="cpu",
                            prefetch_factors=(2,), persistent=(True,))
            return s.num_workers

        add("baseline", plain(src, 0),
            "torchvision ImageFolder + PIL + RandomResizedCrop/flip/ToTensor/Normalize, num_workers=0")
        w_tuned = tuned_workers(src)
        add("baseline_tuned", plain(src, w_tuned), f"the same, num_workers={w_tuned} (best of 0..{cores}, measured)")
        w_resized = tuned_workers(resized)
        add("baseline_resized", plain(resized, w_resized),
            f"the same tuned loader (num_workers={w_resized}) on a folder resized offline to short side {SHORT_SIDE}")
        say("torchspeed: choosing decoder and num_workers (measured)")
        ts_loader = fast_loader(store, BATCH, crop=CROP, device="cpu", channels_last=False, num_workers="auto",
                                tune_seconds=tune_s)
        settings, decoder, decoder_table = ts_loader.settings, ts_loader.decoder, ts_loader.decoder_table
        w, threads = settings.num_workers, settings.threads
        where = (f"{threads} threads of the main process, each normalising its own batch" if w == 0 else
                 f"{w} worker processes + normalisation in the prefetch thread")
        add("torchspeed", ts_loader,
            f"packed LMDB (short side {SHORT_SIDE}, JPEG) + {decoder} + uint8 crop into the batch in {where} "
            f"(settings measured)")
        common = dict(crop=CROP, device="cpu", channels_last=False, num_workers=w, threads=threads, decoder=decoder)
        raw_mib = os.path.getsize(os.path.join(raw_store, "data.mdb")) / 2**20
        add("torchspeed_raw", fast_loader(raw_store, BATCH, **common),
            f"the same pipeline on a raw-pixel store (no decoding at all; {raw_mib:.0f} MiB)")
        add("torchspeed_no_offline_resize", fast_loader(full_store, BATCH, **common),
            "the same pipeline on a store without offline resize (500x375 JPEG, DCT-scaled decode)")
        add("torchspeed_on_folder", fast_loader(src, BATCH, **common),
            "the same pipeline reading the original JPEG files (no pack at all)")

        # Interleaved rounds (pass r of every contender, then pass r+1): a change in background load
        # spreads over all contenders instead of favouring whichever ran at a quiet moment.
        timings: dict[str, list[Any]] = {name: [] for name in contenders}
        for r in range(3):
            for name, (loader, _) in contenders.items():
                say(f"round {r + 1}/3: {name}")
                timings[name].append(time_iterable(lambda: loader, name=name, warmup_items=1, passes=1,
                                                   min_pass_s=pass_s, unit="img"))
        rates = {name: sorted(t.rates[0] for t in ts) for name, ts in timings.items()}
        for name, (loader, what) in contenders.items():
            _shutdown(loader)
            rows.append({"technique": name, "median": rates[name][1], "min": rates[name][0], "max": rates[name][-1],
                         "unit": "img/s", "ratio": None, "cumulative": None, "metric_drop": None, "what": what,
                         "headline": name == "torchspeed"})
        contenders.clear()
        median = {r["technique"]: r["median"] for r in rows}
        base, tuned, base_resized, fast = (median[k] for k in ("baseline", "baseline_tuned", "baseline_resized", "torchspeed"))
        raw, noresize, folder = (median[k] for k in ("torchspeed_raw", "torchspeed_no_offline_resize", "torchspeed_on_folder"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for r in rows:
        r["ratio"] = r["median"] / base
    results.update(
        baseline_img_s=base, baseline_tuned_img_s=tuned, baseline_resized_img_s=base_resized, torchspeed_img_s=fast,
        raw_img_s=raw, no_offline_resize_img_s=noresize, folder_img_s=folder,
        ratio_vs_tuned=fast / tuned, ratio_vs_resized=fast / base_resized, ratio_vs_baseline=fast / base,
        decoder=decoder, decoder_table=decoder_table, num_workers=w, threads=threads, baseline_tuned_workers=w_tuned,
        baseline_resized_workers=w_resized, torchspeed_tuning=[r.to_dict() for r in settings.table], rows=rows,
        notes=[f"pack of {n_images} images to the short-side-{SHORT_SIDE} JPEG store took {results['pack_s']:.1f} s (one-off)",
               f"torch {torch.__version__}; passes of >= {pass_s} s, median of 3"],
    )
    return results

