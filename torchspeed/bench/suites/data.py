"""Data suite: images/s from JPEG files to model-ready batches, plain torchvision vs torchspeed.

One concept, one file: every row times the same work on the same photos, interleaved with the others;
its contenders and peers are set up here so that what each row measures is read in one place. From the
demo photos (500x375 JPEG q90) each yields per batch 64 RandomResizedCrop 128 + flip images, float32 NCHW
(contiguous) normalised, and int64 labels. Each figure is the median of 3 passes, the passes of all
contenders interleaved (round-robin) so that background load hits them alike, each as long as the budget
leaves (0.5-5 s). Peers (DALI, LitData) run on the photos resized offline, at their best thread/worker
count; every row is set against the decode-only ceiling. The full report adds the raw-pixel, full-size and
folder variants, the resized torchvision loader, scale rows (4k and 50k photos) and the formats users keep
photos in (WebDataset shards, a Hugging Face dataset), each read by torchspeed and by its own usual loader.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from torchspeed.args import progress_fn
from torchspeed.bench.budget import Budget
from torchspeed.bench.rows import ContenderRow, Row, to_json
from torchspeed.loader_contract import release_workers

TITLE = "Data loading: images/s into the model (64 x RandomResizedCrop 128 + flip, float32 NCHW normalised)"

BATCH, CROP, SHORT_SIDE = 64, 128, 160
SHARDS = 64  # WebDataset shards of the photos: more than the workers any machine here runs


def _resize_files(job: tuple[list[tuple[str, str]], int]) -> None:
    from PIL import Image

    from torchspeed.data.packer import load_image_file

    pairs, short_side = job
    for src, dst in pairs:
        Image.fromarray(load_image_file(src, short_side)).save(dst, quality=90)


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


def torchvision_folder(folder: str) -> Any:
    """The baseline: torchvision's ImageFolder with the transforms every row matches (the train suite's too)."""
    from torchvision import datasets

    return datasets.ImageFolder(folder, _Transform().tf)


def _check_output(name: str, batch: Any) -> None:
    """Like for like: every contender must yield the baseline's format."""
    import torch

    x, y = batch
    if tuple(x.shape) != (BATCH, 3, CROP, CROP) or x.dtype != torch.float32 or not x.is_contiguous() \
            or y.dtype != torch.int64 or not -3.0 < float(x.mean()) < 3.0:
        raise RuntimeError(f"{name} yields {tuple(x.shape)} {x.dtype} (contiguous={x.is_contiguous()}), "
                           f"not the benchmark's float32 NCHW batch")


def _best(label: str, make: Callable[[int], Any], counts: list[int], seconds: float,
          say: Callable[[str], Any]) -> tuple[int, Any, dict[int, float]]:
    """The thread/worker count of a peer that delivers most images/s (each tried for `seconds`)."""
    from torchspeed.measure import time_iterable

    rates: dict[int, float] = {}
    loaders: dict[int, Any] = {}
    for n in counts:
        say(f"{label}: trying {n}")
        loader = make(n)
        t = time_iterable(lambda: loader, name=f"{label}={n}", warmup_items=1, passes=1, min_pass_s=seconds,
                          unit="img")
        rates[n], loaders[n] = t.rates[0], loader
    best = max(rates, key=rates.__getitem__)
    for n, loader in loaders.items():
        if n != best:
            release_workers(loader)
    return best, loaders[best], rates


def _peers(resized: str, cores: int, tune_s: float, say: Callable[[str], Any], add: Callable[..., None],
           skipped: Callable[[dict[str, Any]], None], full: bool = True) -> None:
    """DALI (CPU pipeline; GPU pipeline too on a GPU) and LitData on the pre-resized photos, each at its best count
    (LitData from 1 worker in the quick report: with 0 it measured 10-20x slower, and one batch alone takes seconds)."""
    import torch

    from torchspeed.bench import peers
    from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD
    from torchspeed.runtime import cache_dir

    counts = list(range(1, cores + 1))
    dali_kinds = [("dali_cpu", "cpu")] + ([("dali_gpu", "gpu")] if torch.cuda.is_available() else [])
    for name, dev in dali_kinds:
        try:
            best, loader, rates = _best(f"{name} threads", lambda n, d=dev: peers.DaliLoader(
                resized, BATCH, CROP, n, IMAGENET_MEAN, IMAGENET_STD, device=d), counts, tune_s, say)
            tried = ", ".join(str(n) for n in rates)
            add(name, loader, f"NVIDIA DALI {dev.upper()} pipeline ({'device_id=None, ' if dev == 'cpu' else ''}"
                f"fn.decoders.image_random_crop on {'cpu' if dev == 'cpu' else 'mixed'}, resize, crop_mirror_normalize) "
                f"on the photos resized offline to short side {SHORT_SIDE}, num_threads={best}, the fastest in a short trial of {tried}",
                peer=True, check=dev == "cpu")
        except Exception as e:  # noqa: BLE001 - a peer that is missing or fails is a row with the reason
            skipped(peers.skipped_row(name, _why(e), "img/s", ceiling="decode" if dev == "cpu" else "nvjpeg"))
    try:
        say("litdata: optimize() of the resized photos (cached)")
        directory = peers.litdata_dir(resized, os.path.join(cache_dir("bench-data"),
                                                            f"{os.path.basename(resized)}-litdata"))
        best, loader, rates = _best("litdata num_workers", lambda n: peers.litdata_loader(
            directory, BATCH, CROP, n, IMAGENET_MEAN, IMAGENET_STD), list(range(0 if full else 1, cores + 1)), tune_s, say)
        tried = ", ".join(str(n) for n in rates)
        add("litdata", loader, f"LitData optimize() of the photos resized offline to short side {SHORT_SIDE} + "
            f"StreamingDataLoader, PIL + the torchvision transforms, num_workers={best}, the fastest in a short trial of {tried}",
            peer=True)
    except Exception as e:  # noqa: BLE001
        skipped(peers.skipped_row("litdata", _why(e), "img/s", ceiling="decode"))


def _format_copies(resized: str) -> tuple[str, str]:
    """The resized photos as WebDataset shards (64 tars, KEY.jpg + KEY.cls, in the folder's order) and as a
    Hugging Face dataset folder (`save_to_disk`, an Image column of the same JPEG bytes + a ClassLabel),
    each built once (cached): the same JPEG files the peers read, in each format as its own tools write it."""
    import io
    import tarfile

    from torchspeed.atomic import build_directory
    from torchspeed.bench import peers
    from torchspeed.images import scan_folder
    from torchspeed.runtime import cache_dir

    classes, samples = scan_folder(resized)
    base = os.path.join(cache_dir("bench-data"), os.path.basename(resized))

    def shards(tmp: str) -> None:
        per = -(-len(samples) // SHARDS)
        for s in range(0, len(samples), per):
            with tarfile.open(os.path.join(tmp, f"train-{s // per:06d}.tar"), "w") as tar:
                for i in range(s, min(s + per, len(samples))):
                    path, label = samples[i]
                    with open(path, "rb") as f:
                        image = f.read()
                    for ext, data in (("jpg", image), ("cls", str(label).encode())):
                        info = tarfile.TarInfo(f"{i:08d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))

    def hf(tmp: str) -> None:
        datasets = peers.require("datasets", "datasets")
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        ds = datasets.Dataset.from_dict({"image": [p for p, _ in samples], "label": [y for _, y in samples]},
                                        features=features)
        os.rmdir(tmp)
        was_off = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # its per-save bar would land in the report's console output
        try:
            ds.save_to_disk(tmp)  # embeds each file's bytes in the Arrow column
        finally:
            if not was_off:
                datasets.enable_progress_bars()

    return build_directory(f"{base}-wds", shards), build_directory(f"{base}-hf", hf)


class _Transform:
    """PIL image -> the baseline's torchvision transforms (picklable for worker processes)."""

    def __init__(self) -> None:
        from torchvision import transforms as T

        from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

        self.tf = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(),
                             T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def __call__(self, im: Any) -> Any:
        return self.tf(im.convert("RGB"))

    def hf_batch(self, batch: dict[str, list]) -> dict[str, list]:
        """datasets' `with_transform`: the batch's images transformed, labels kept."""
        return {"pixel_values": [self(im) for im in batch["image"]], "label": batch["label"]}


def _hf_collate(rows: list[dict[str, Any]]) -> tuple[Any, Any]:
    import torch

    return torch.stack([r["pixel_values"] for r in rows]), torch.tensor([r["label"] for r in rows], dtype=torch.int64)


def _webdataset_loader(shards: str, workers: int) -> Any:
    """webdataset's usual pipeline: shard shuffle, a 1000-sample buffer, PIL decode, the torchvision
    transforms per sample, batched by a DataLoader (shards split across workers by webdataset)."""
    from torch.utils.data import DataLoader

    from torchspeed.bench import peers

    wds = peers.require("webdataset", "webdataset")
    tf = _Transform()
    dataset = (wds.WebDataset(shards, shardshuffle=100, empty_check=False).shuffle(1000).decode("pil")
               .to_tuple("jpg", "cls").map_tuple(tf, int))
    return DataLoader(dataset, batch_size=BATCH, num_workers=workers, drop_last=True, persistent_workers=workers > 0)


def _hf_loader(folder: str, workers: int) -> Any:
    """`datasets`' usual pipeline: load_from_disk, with_transform (PIL decode + the torchvision
    transforms), a shuffled DataLoader."""
    from torch.utils.data import DataLoader

    from torchspeed.bench import peers

    datasets = peers.require("datasets", "datasets")
    ds = datasets.load_from_disk(folder).with_transform(_Transform().hf_batch)
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, drop_last=True,
                      collate_fn=_hf_collate, persistent_workers=workers > 0)


def _formats(resized: str, common: dict[str, Any], cores: int, tune_s: float, say: Callable[[str], Any],
             add: Callable[..., None], skipped: Callable[[Any], None]) -> None:
    """Data where users keep it (full report): torchspeed's pipeline on WebDataset shards and on a Hugging
    Face dataset of the resized photos, each beside that format's own usual loader at its best worker count."""
    from torchspeed.bench import peers
    from torchspeed.data import fast_loader

    say("WebDataset shards and a Hugging Face dataset of the resized photos (cached)")
    try:
        shard_dir, hf_dir = _format_copies(resized)
    except Exception as e:  # noqa: BLE001 - without the copies, each row says why
        for name in ("torchspeed_on_webdataset", "webdataset", "torchspeed_on_hf_dataset", "hf_datasets"):
            skipped(peers.skipped_row(name, _why(e), "img/s", ceiling="decode"))
        return
    count = len([f for f in os.listdir(shard_dir) if f.endswith(".tar")])
    pattern = os.path.join(shard_dir, f"train-{{000000..{count - 1:06d}}}.tar")  # the brace pattern both read
    add("torchspeed_on_webdataset", fast_loader(pattern, BATCH, **common),
        f"the same pipeline on the resized photos as {count} WebDataset tar shards (read as they are: tar index, "
        "shard order + 1000-place local shuffle)")
    add("torchspeed_on_hf_dataset", fast_loader(hf_dir, BATCH, **common),
        "the same pipeline on the resized photos as a Hugging Face dataset folder (save_to_disk; the Arrow "
        "column of JPEG bytes read as it is)")
    for name, make, what in (
            ("webdataset", lambda n: _webdataset_loader(pattern, n),
             "webdataset's pipeline on the same shards: WebDataset(shardshuffle) .shuffle(1000) .decode('pil') + "
             "the torchvision transforms, DataLoader"),
            ("hf_datasets", lambda n: _hf_loader(hf_dir, n),
             "datasets' load_from_disk + with_transform (PIL + the torchvision transforms) + a shuffled DataLoader "
             "on the same dataset")):
        try:
            best, loader, rates = _best(f"{name} num_workers", make, list(range(cores + 1)), tune_s, say)
            add(name, loader, f"{what}, num_workers={best}, the fastest in a short trial of "
                f"{', '.join(str(n) for n in rates)}", peer=True)
        except Exception as e:  # noqa: BLE001 - a peer that is missing or fails is a row with the reason
            skipped(peers.skipped_row(name, _why(e), "img/s", ceiling="decode"))


def _why(e: BaseException) -> str:
    from torchspeed.bench.peers import PeerMissing

    if isinstance(e, PeerMissing):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0][:200]  # StopIteration and others may carry no message
    return f"failed here: {type(e).__name__}{': ' + first if first else ''}"


def _linked_folder(src: str, n: int, name: str) -> str:
    """A cached ImageFolder of `n` symlinks cycling over the photos of `src` in name order: --quick's first `n`,
    or the scale rows' larger copies (each file a distinct entry, so packing and loading do the full work per
    image; building it costs no image generation)."""
    from torchspeed.atomic import build_directory
    from torchspeed.images import scan_folder
    from torchspeed.runtime import cache_dir

    def build(tmp: str) -> None:
        classes, samples = scan_folder(src)
        for c in classes:
            os.makedirs(os.path.join(tmp, c))
        samples = sorted(samples, key=lambda s: os.path.basename(s[0]))
        for i in range(n):
            path, label = samples[i % len(samples)]
            os.symlink(path, os.path.join(tmp, classes[label], f"img_{i:07d}.jpg"))

    return build_directory(os.path.join(cache_dir("bench-data"), f"{os.path.basename(src)}-{name}{n}"), build)


def _scale(src: str, decoder: str, num_workers: int, threads: int, sizes: tuple[int, ...], window_s: float,
           say: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Pack time per 1k images, loader throughput and peak RSS as the data grows."""
    from torchspeed.data import fast_loader, pack
    from torchspeed.measure import time_iterable

    out = []
    for n in sizes:
        say(f"scale: a folder of {n:,} photos (cached)")
        folder = _linked_folder(src, n, "scale")
        work = tempfile.mkdtemp(prefix="torchspeed-bench-scale-")
        try:
            say(f"scale: packing {n:,} photos")
            rep = pack(folder, os.path.join(work, "store"), short_side=SHORT_SIDE, format="jpeg", quality=90,
                       progress=False)
            loader = fast_loader(rep.dst, BATCH, crop=CROP, device="cpu", channels_last=False, num_workers=num_workers,
                                 threads=threads, decoder=decoder)
            say(f"scale: loader on {n:,} photos")
            # three passes, the median kept: one pass of a few seconds moves with any background work
            t = time_iterable(lambda: loader, name=f"scale {n}", warmup_items=1, passes=3, min_pass_s=window_s,
                              unit="img", measure_memory=True)
            release_workers(loader)
            out.append({"images": n, "pack_s": rep.seconds, "pack_s_per_1k": 1000 * rep.seconds / n,
                        "img_s": sorted(t.rates)[1], "img_s_passes": t.rates,
                        "peak_rss_mib": (t.peak_mem_bytes or 0) / 2**20,
                        "store_mib": os.path.getsize(os.path.join(rep.dst, "data.mdb")) / 2**20})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def run(quick: bool, progress: bool | Callable[[str], Any] = False, budget_s: float | None = None,
        scale_sizes: tuple[int, ...] = (4000, 50000)) -> dict[str, Any]:
    suite = _DataSuite(quick, progress, budget_s)
    suite.prepare_photos()
    work = tempfile.mkdtemp(prefix="torchspeed-bench-data-")
    try:
        suite.pack_store(work)
        suite.add_baselines()
        suite.add_torchspeed()
        _peers(suite.resized, suite.cores, suite.tune_s, suite.say, suite.add, suite.skipped_rows.append,
               full=not quick)
        if not quick:
            _formats(suite.resized, suite.common, suite.cores, suite.tune_s, suite.say, suite.add,
                     suite.skipped_rows.append)
        suite.rows_of_rounds(suite.time_rounds())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    suite.figures()
    if not quick and scale_sizes:
        suite.scale_rows(scale_sizes)
    return suite.finish()


class _DataSuite:
    """One run of the suite: its stages share the photos, the contenders, the rows and the JSON."""

    def __init__(self, quick: bool, progress: bool | Callable[[str], Any], budget_s: float | None):
        from torchspeed.runtime import usable_cores

        self.quick = quick
        self.say = progress_fn(progress)
        self.budget = Budget.of("data", quick, budget_s)
        self.cores = usable_cores()
        self.tune_s = 0.3 if quick else 1.0
        self.n_images = 1000 if quick else 4000
        self.rows: list[Row] = []
        self.skipped_rows: list[Row] = []
        self.contenders: dict[str, tuple[Any, str, dict[str, Any]]] = {}
        self.on_gpu: set[str] = set()  # contenders whose batches arrive on a GPU: timed synchronised, nvjpeg's ceiling
        self.cpu_us: list[float] = []  # torchspeed's CPU microseconds per image, per pass
        self.others: dict[str, float] = {}  # per contender: the most cores other processes took during one pass
        self.settled = 0.0             # seconds waited for quiet before the timed passes

    def prepare_photos(self) -> None:
        """The demo photos (the quick report's first 1000), a copy resized offline for the peers, and (full
        report) the raw-pixel and full-size stores of the comparison rows."""
        from torchspeed.data.demo import demo_folder

        say, quick = self.say, self.quick
        say("demo photos (generated once)")
        self.src = demo_folder(4000)
        if quick:
            self.src = _linked_folder(self.src, self.n_images, "first")
        say("resized copy of the folder (short side 160, cached)")
        self.resized = _resized_folder(self.src, SHORT_SIDE)
        if not quick:
            say("extra stores for the comparison rows (cached)")
            self.raw_store = _cached_store(self.src, f"raw{SHORT_SIDE}", short_side=SHORT_SIDE, format="raw")
            self.full_store = _cached_store(self.src, "jpeg-full", short_side=None, format="jpeg", quality=90)
        self.results: dict[str, Any] = {"images": self.n_images, "batch_size": BATCH, "crop": CROP,
                                        "short_side": SHORT_SIDE, "budget_s": self.budget.seconds}

    def pack_store(self, work: str) -> None:
        from torchspeed.data import pack

        self.say(f"packing {self.n_images} images (short side {SHORT_SIDE}, JPEG q90)")
        packed = pack(self.src, os.path.join(work, "store"), short_side=SHORT_SIDE, format="jpeg", quality=90,
                      progress=False)
        self.results["pack_s"] = round(packed.seconds, 2)
        self.store = packed.dst

    def add(self, name: str, loader: Any, what: str, check: bool = True, **columns: Any) -> None:
        """A contender of the timed rounds (its first batch checked against the baseline's format); one whose
        batches arrive on a GPU is timed waiting for the device and judged against the nvjpeg ceiling."""
        first = next(iter(loader))
        if check:
            _check_output(name, first)
        if getattr(first[0], "is_cuda", False):
            self.on_gpu.add(name)
        self.contenders[name] = (loader, what, columns)

    def plain(self, folder: str, num_workers: int) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(torchvision_folder(folder), BATCH, shuffle=True, drop_last=True, num_workers=num_workers,
                          persistent_workers=num_workers > 0)

    def tuned_workers(self, folder: str) -> int:
        from torchspeed.data import tune_loader

        self.say(f"tuning torchvision num_workers on {os.path.basename(folder)}")
        s = tune_loader(torchvision_folder(folder), BATCH, num_workers=list(range(self.cores + 1)),
                        tune_seconds=self.tune_s, device="cpu", prefetch_factor=(2,), persistent_workers=(True,),
                        refresh=True)
        return s.num_workers

    def add_baselines(self) -> None:
        """torchvision's loader with num_workers=0, tuned, and (full report) tuned on the resized photos."""
        self.add("baseline", self.plain(self.src, 0),
                 "torchvision ImageFolder + PIL + RandomResizedCrop/flip/ToTensor/Normalize, num_workers=0")
        self.w_tuned = self.tuned_workers(self.src)
        self.add("baseline_tuned", self.plain(self.src, self.w_tuned),
                 f"the same, num_workers={self.w_tuned} (best of 0..{self.cores}, measured)")
        self.w_resized = None
        if not self.quick:
            self.w_resized = self.tuned_workers(self.resized)
            self.add("baseline_resized", self.plain(self.resized, self.w_resized),
                     f"the same tuned loader (num_workers={self.w_resized}) on a folder resized offline to short side "
                     f"{SHORT_SIDE}")

    def add_torchspeed(self) -> None:
        """fast_loader on the store with its measured settings and (full report) the same pipeline on a
        raw-pixel store, on a store without offline resize and on the original files."""
        from torchspeed.data import fast_loader
        from torchspeed.measure import wait_until_quiet

        self.say("torchspeed: choosing decoder and num_workers (measured)")
        self.settled = wait_until_quiet()  # the tuned torchvision workers finish their prefetch before the tuning windows
        ts_loader = fast_loader(self.store, BATCH, crop=CROP, device="cpu", channels_last=False, num_workers="auto",
                                tune_seconds=self.tune_s, refresh=True)  # a benchmark measures, never recalls
        self.settings, self.decoder, self.decoder_table = ts_loader.settings, ts_loader.decoder, ts_loader.decoder_table
        self.w, self.threads = w, threads = self.settings.num_workers, self.settings.threads
        where = (f"{threads} threads of the main process, each normalising its own batch" if w == 0 else
                 f"{w} worker processes + normalisation in the prefetch thread")
        self.add("torchspeed", ts_loader,
                 f"packed LMDB (short side {SHORT_SIDE}, JPEG) + {self.decoder} + uint8 crop into the batch in {where} "
                 f"(settings measured)")
        self.common = common = dict(crop=CROP, device="cpu", channels_last=False, num_workers=w, threads=threads,
                                    decoder=self.decoder)
        self.add_gpu_decode()
        if self.quick:
            return
        raw_mib = os.path.getsize(os.path.join(self.raw_store, "data.mdb")) / 2**20
        self.add("torchspeed_raw", fast_loader(self.raw_store, BATCH, **common),
                 f"the same pipeline on a raw-pixel store (no decoding at all; {raw_mib:.0f} MiB)", ceiling=None)
        self.add("torchspeed_no_offline_resize", fast_loader(self.full_store, BATCH, **common),
                 "the same pipeline on a store without offline resize (500x375 JPEG, DCT-scaled decode)")
        self.add("torchspeed_on_folder", fast_loader(self.src, BATCH, **common),
                 "the same pipeline reading the original JPEG files (no pack at all)")

    def add_gpu_decode(self) -> None:
        """On a GPU: the same store through fast_loader's GPU path (nvjpeg decoding the batch, crops and
        resizes on the device, threads measured), beside DALI's GPU pipeline; a row saying why where it fails."""
        import torch

        from torchspeed.bench import peers
        from torchspeed.data import fast_loader

        if not torch.cuda.is_available():
            return
        self.say("torchspeed on the GPU: nvjpeg, threads measured")
        try:
            loader = fast_loader(self.store, BATCH, crop=CROP, device="cuda", channels_last=False, num_workers="auto",
                                 decoder="nvjpeg", tune_seconds=self.tune_s, refresh=True)
            self.add("torchspeed_gpu", loader, f"packed LMDB (short side {SHORT_SIDE}, JPEG) + nvjpeg on "
                     f"{torch.cuda.get_device_name()} (batched decode, crop and resize on the device) in "
                     f"{loader.settings.threads} threads of the main process (measured)")
        except Exception as e:  # noqa: BLE001 - the CPU rows stand; the GPU row says what failed
            self.skipped_rows.append(peers.skipped_row("torchspeed_gpu", _why(e), "img/s", ceiling="nvjpeg"))

    def time_rounds(self) -> dict[str, list[float]]:
        """Each contender's img/s per pass, sorted: interleaved rounds (pass r of every contender, then pass
        r+1), so a change in background load spreads over all contenders instead of favouring whichever ran
        at a quiet moment. The passes share what is left of the budget (the full report keeps some for the
        scale rows)."""
        from torchspeed.measure import OthersLoad, process_tree_cpu_seconds, time_iterable, wait_until_quiet

        left = self.budget.left() * (1.0 if self.quick else 0.6)
        self.pass_s = pass_s = min(5.0, max(0.5, left / (3 * len(self.contenders) * 1.3)))
        timings: dict[str, list[Any]] = {name: [] for name in self.contenders}
        for r in range(3):
            for name, (loader, _, _) in self.contenders.items():
                self.say(f"round {r + 1}/3: {name} ({pass_s:.1f} s pass)")
                self.settled += wait_until_quiet()  # the previous contender's background prefetch is not this one's time
                cpu0, load = process_tree_cpu_seconds(), OthersLoad()
                t = time_iterable(lambda: loader, name=name, warmup_items=1, passes=1, min_pass_s=pass_s, unit="img",
                                  device="cuda" if name in self.on_gpu else None)
                cpu1, others = process_tree_cpu_seconds(), load.cores()
                if others is not None:  # the row says the most other processes took during one of its passes
                    self.others[name] = max(others, self.others.get(name, 0.0))
                if name == "torchspeed" and cpu0 is not None and cpu1 is not None:
                    # CPU time the loader's threads/workers used, warm-up item included (a small overestimate)
                    self.cpu_us.append(1e6 * (cpu1 - cpu0) / max(1.0, sum(t.items) + 1))
                timings[name].append(t)
        return {name: sorted(t.rates[0] for t in ts) for name, ts in timings.items()}

    def rows_of_rounds(self, rates: dict[str, list[float]]) -> None:
        """One row per contender (median, min and max of its passes), its loader closed; then the peers
        that did not run."""
        for name, (loader, what, columns) in self.contenders.items():
            release_workers(loader)
            columns = {"headline": name == "torchspeed", "ceiling": "nvjpeg" if name in self.on_gpu else "decode",
                       **columns}
            others = self.others.get(name)
            self.rows.append(ContenderRow(technique=name, median=rates[name][1], min=rates[name][0],
                                          max=rates[name][-1], unit="img/s", what=what,
                                          others_cores=None if others is None else round(others, 2), **columns))
        self.contenders.clear()
        self.rows.extend(self.skipped_rows)
        self.median = {r.technique: r.median for r in self.rows}
        self.base, self.tuned, self.ts = (self.median[k] for k in ("baseline", "baseline_tuned", "torchspeed"))

    def figures(self) -> None:
        """Every row's ratio to the baseline and the suite's figures and notes."""
        import torch

        base, tuned, ts, median = self.base, self.tuned, self.ts, self.median
        for r in self.rows:
            if r.median is not None:
                r.ratio = r.median / base
        results = self.results
        results.update(
            baseline_img_s=base, baseline_tuned_img_s=tuned, torchspeed_img_s=ts,
            ratio_vs_tuned=ts / tuned, ratio_vs_baseline=ts / base,
            decoder=self.decoder, decoder_table=self.decoder_table, num_workers=self.w, threads=self.threads,
            baseline_tuned_workers=self.w_tuned, torchspeed_tuning=[r.to_dict() for r in self.settings.table],
            rows=[], pass_s=round(self.pass_s, 2),
            notes=[f"pack of {self.n_images} images to the short-side-{SHORT_SIDE} JPEG store took "
                   f"{results['pack_s']:.1f} s (one-off)",
                   f"torch {torch.__version__}; passes of {self.pass_s:.1f} s (the suite's {self.budget.seconds:.0f} s "
                   "budget shared), median of 3 interleaved rounds",
                   f"{self.settled:.1f} s waited in all for the process and its workers to go quiet before each timed "
                   "pass (the previous contender's prefetch finishing)"],
        )
        if not self.quick:
            results.update(baseline_resized_img_s=median["baseline_resized"],
                           ratio_vs_resized=ts / median["baseline_resized"], raw_img_s=median["torchspeed_raw"],
                           no_offline_resize_img_s=median["torchspeed_no_offline_resize"],
                           folder_img_s=median["torchspeed_on_folder"], baseline_resized_workers=self.w_resized)
        for peer in ("dali_cpu", "dali_gpu", "litdata"):
            if median.get(peer):
                results[f"ratio_vs_{peer}"] = ts / median[peer]
        if median.get("torchspeed_gpu") and median.get("dali_gpu"):  # the GPU decode paths against each other
            results["ratio_gpu_vs_dali_gpu"] = median["torchspeed_gpu"] / median["dali_gpu"]
        for ours, theirs in (("torchspeed_on_webdataset", "webdataset"), ("torchspeed_on_hf_dataset", "hf_datasets")):
            if median.get(ours) and median.get(theirs):  # each format against its own usual loader
                results[f"ratio_{ours}_vs_{theirs}"] = median[ours] / median[theirs]

    def scale_rows(self, sizes: tuple[int, ...]) -> None:
        """torchspeed's loader on larger copies of the photos: pack time, img/s, peak RSS, store size."""
        from torchspeed.data.demo import demo_folder

        window = max(1.0, min(5.0, self.budget.left() / (12 * len(sizes))))
        self.results["scale"] = _scale(demo_folder(4000), self.decoder, self.w, self.threads, sizes, window, self.say)
        for sc in self.results["scale"]:
            self.rows.append(Row(technique=f"scale: torchspeed on {sc['images']:,} photos", median=sc["img_s"],
                                 unit="img/s", ratio=sc["img_s"] / self.base, ceiling="decode", scale=True,
                                 what=f"median of 3 passes of {window:.0f} s; pack {sc['pack_s_per_1k']:.2f} s per 1k "
                                      f"images; peak RSS {sc['peak_rss_mib']:,.0f} MiB; store "
                                      f"{sc['store_mib']:,.0f} MiB"))
            self.results["notes"].append(f"scale, {sc['images']:,} photos (the demo photos cycled): pack "
                                         f"{sc['pack_s_per_1k']:.2f} s per 1k images, store {sc['store_mib']:,.0f} MiB, "
                                         f"loader {sc['img_s']:,.0f} img/s, peak RSS {sc['peak_rss_mib']:,.0f} MiB")

    def finish(self) -> dict[str, Any]:
        """The CPU time per image, the goals against the decode ceiling and DALI, and the rows as JSON."""
        from torchspeed.bench import ceilings as ceil
        from torchspeed.runtime import describe

        results = self.results
        if self.cpu_us:
            results["torchspeed_cpu_us_per_img"] = sorted(self.cpu_us)[len(self.cpu_us) // 2]
        results["limits"] = _data_limits(self.ts, self.median, self.cores, ceil.load_cached(describe()), self.threads,
                                         self.w, results.get("torchspeed_cpu_us_per_img"))
        results["rows"] = to_json(self.rows)
        return results


def _data_limits(fast: float, median: dict[str, Any], cores: int, ceilings: dict[str, Any] | None,
                 threads: int, workers: int, cpu_us: float | None = None) -> list[dict[str, Any]]:
    """The data goals: >= 60% of the decode-only ceiling, >= 2x DALI's CPU pipeline; the per-image time
    split into decoding (the ceiling's per-core rate), the rest of the loader's CPU time (`cpu_us`: CPU
    time of the process and its workers per image, measured during the timed passes) and the core time
    no loader thread used (threads waiting on the GIL and on each other)."""
    item = ((ceilings or {}).get("items") or {}).get("decode_per_core") or {}
    per_core = item.get("value")
    lims = []
    lim: dict[str, Any] = {"goal": "data >= 60% of the decode-only ceiling (all cores)", "met": None,
                           "measured": f"{fast:,.0f} img/s"}
    if per_core:
        ceiling = per_core * cores
        used_us = 1e6 * cores / fast  # core-microseconds per delivered image
        decode_us = 1e6 / per_core
        lim.update(measured=f"{fast:,.0f} img/s = {100 * fast / ceiling:.0f}% of {ceiling:,.0f}",
                   met=fast >= 0.6 * ceiling,
                   why=f"each image costs {used_us:,.0f} core-us here ({'%d threads' % threads if workers == 0 else '%d workers' % workers}), "
                       f"of which a whole decode (the ceiling's, {item.get('route')}) is {decode_us:,.0f} us ({100 * decode_us / used_us:.0f}%); "
                       + (f"the loader used {cpu_us:,.0f} CPU-us per image in all, so {max(0.0, cpu_us - decode_us):,.0f} us "
                          f"went to reading, crop and resize, flip, normalisation and batch assembly, and "
                          f"{max(0.0, used_us - cpu_us):,.0f} us of core time per image no loader thread used (threads "
                          f"waiting on the GIL and on each other, or the cores busy elsewhere)" if cpu_us else
                          f"the other {used_us - decode_us:,.0f} us are the crop and resize, flip, conversion to "
                          f"normalised float32 and batch assembly, and any core time taken by other processes"))
    else:
        lim["why"] = "no decode ceiling measured for this machine"
    lims.append(lim)
    dali = median.get("dali_cpu")
    why = ""
    if dali and fast < 2 * dali:
        why = f"2x DALI would be {2 * dali:,.0f} img/s"
        if per_core:
            why += (f" = {100 * 2 * dali / (per_core * cores):.0f}% of the decode-only ceiling; DALI's CPU pipeline "
                    f"itself reaches {100 * dali / (per_core * cores):.0f}% of it here")
    lims.append({"goal": ">= 2x DALI's CPU pipeline on the same photos", "met": (fast >= 2 * dali) if dali else None,
                 "measured": f"{fast / dali:.2f}x ({fast:,.0f} vs {dali:,.0f} img/s)" if dali else "DALI not run",
                 "why": why})
    return lims
