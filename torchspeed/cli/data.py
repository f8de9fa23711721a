"""Data commands: demo-data, pack, tune-loader."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from torchspeed.cli import add_json_option, non_negative_int, positive_float, positive_int


def counts(minimum: int) -> Callable[[str], str | int | list[int]]:
    """argparse type for --num-workers / --threads: 'auto', a count, or candidate counts '0,1,2'."""

    def parse(text: str) -> str | int | list[int]:
        if text.strip() == "auto":
            return "auto"
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected auto, a number >= {minimum} or a comma list of them "
                                             f"(e.g. {minimum},{minimum + 1}), got {text!r}")
        return values[0] if len(values) == 1 and "," not in text else sorted(set(values))

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-data", help="write a photo-like JPEG ImageFolder (deterministic demo data)")
    p.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--images", type=positive_int, default=2000, metavar="N", help="number of images (default 2000)")
    p.add_argument("--classes", type=positive_int, default=10, metavar="N", help="number of classes (default 10)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--num-workers", type=positive_int, default=None, metavar="N",
                   help="writing processes (default: cores, at most 8; the images do not depend on it)")
    p.set_defaults(func=run_demo_data)

    p = sub.add_parser("pack", help="pack an ImageFolder into one LMDB store (resized/encoded once, offline)")
    p.add_argument("src", metavar="SRC", help="ImageFolder directory (SRC/CLASS/IMAGE)")
    p.add_argument("dst", metavar="DST", help="store directory to create (written atomically)")
    p.add_argument("--short-side", type=positive_int, default=None, metavar="N",
                   help="resize so the shorter side is N pixels (never upscales); default: keep the size")
    p.add_argument("--format", choices=("jpeg", "raw"), default="jpeg",
                   help="jpeg: re-encoded JPEG (compact); raw: decoded pixels (no decoding at train time, ~10x bytes)")
    p.add_argument("--quality", type=positive_int, default=90, metavar="Q", help="JPEG quality 1..100 (default 90)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                   help="an unreadable image: stop naming it (fail, default) or leave it out and report it (skip)")
    p.add_argument("--num-workers", type=positive_int, default=None, metavar="N",
                   help="encoding processes (default: cores, at most 8)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it is a torchspeed store (only once the new store is whole); "
                        "any other DST, or one equal to, inside or around SRC, is refused")
    add_json_option(p)
    p.set_defaults(func=run_pack)

    p = sub.add_parser("tune-loader", help="time the data loader over num_workers/threads/prefetch/persistent and pick "
                                           "the fastest",
                       description="Time the data loader over num_workers/threads/prefetch/persistent and pick the "
                                   "fastest. DATA is an ImageFolder directory, a packed store, WebDataset tar shards "
                                   "(a brace pattern such as 'train-{000000..000127}.tar' or a directory of .tar files), "
                                   "a Hugging Face dataset folder (save_to_disk) with an Image column, a LitData "
                                   "optimized directory, or your own Dataset as "
                                   "a factory: package.module:factory (installed or on PYTHONPATH) or path/file.py:factory, "
                                   "a function or class called with no arguments that returns a map-style Dataset of "
                                   "(image, label) or dicts with an image and a label. Images (PIL or uint8) go "
                                   "through the torchspeed pipeline; samples that are already tensors (your own "
                                   "transforms) are timed as a plain DataLoader.")
    p.add_argument("data", metavar="DATA", help="ImageFolder directory, packed store, tar shards (quote a brace "
                                                "pattern), Hugging Face dataset folder, LitData directory, or Dataset "
                                                "factory package.module:factory / path/file.py:factory")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="batch size (default 64)")
    p.add_argument("--crop", type=positive_int, default=224, metavar="N", help="training crop size (default 224)")
    p.add_argument("--num-workers", type=counts(0), default="auto", metavar="auto|N,M,...",
                   help="worker-process counts tried: auto (0..cores+1, default) or a comma list such as 0,1,2")
    p.add_argument("--threads", type=counts(1), default="auto", metavar="auto|N,M,...",
                   help="batch-making threads tried at num_workers=0: auto (1..cores+1, default), a number (fixed) "
                        "or a comma list such as 1,2")
    p.add_argument("--tune-seconds", type=positive_float("seconds"), default=1.0, metavar="S", help="length of each timed pass in seconds (default 1.0)")
    p.add_argument("--refresh", action="store_true",
                   help="measure again instead of using the settings remembered from an earlier run on this machine")
    add_json_option(p)
    p.set_defaults(func=run_tune_loader)


def run_demo_data(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from torchspeed.data.demo import make_photo_folder

    t0 = time.perf_counter()
    make_photo_folder(args.dir, args.images, n_classes=args.classes, seed=args.seed, num_workers=args.num_workers)
    Console().print(f"{args.dir}: {args.images} demo images in {args.classes} classes ({time.perf_counter() - t0:.1f} s)",
                    highlight=False)
    return 0


def run_pack(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchspeed.atomic import write_json
    from torchspeed.data.packer import pack

    if not 1 <= args.quality <= 100:
        raise ValueError(f"--quality must be in 1..100, got {args.quality}")
    result = pack(args.src, args.dst, short_side=args.short_side, format=args.format, quality=args.quality,
                  on_error=args.on_error, num_workers=args.num_workers, overwrite=args.overwrite)
    console = Console()
    console.print(str(result), highlight=False)
    for s in result.skipped:
        console.print(f"  skipped {s['path']}: {s['reason']}", highlight=False, markup=False)
    if args.json:
        write_json(args.json, result.to_dict())
    return 0


def run_tune_loader(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchspeed.atomic import write_json
    from torchspeed.data import tune_loader
    from torchspeed.data.sources import DatasetSource, is_dataset_spec, spec_for_tuning
    from torchspeed.tables import print_table

    console = Console()
    data = spec_for_tuning(args.data) if is_dataset_spec(args.data) else args.data
    pipeline = isinstance(data, (str, DatasetSource))  # else the Dataset's own samples, in a plain DataLoader
    tuned = tune_loader(data, args.batch_size, crop=args.crop, num_workers=args.num_workers,
                        threads=args.threads if pipeline else None,
                        tune_seconds=args.tune_seconds, refresh=args.refresh,
                        progress=lambda text: console.print(text, style="dim"))
    rows = [(r.num_workers, r.threads, r.prefetch_factor, r.persistent_workers, r.pin_memory,
             "final (interleaved)" if r.final else "", r.items_per_s) for r in tuned.table]
    print_table(f"tune-loader {args.data} (batch {args.batch_size}, crop {args.crop}): images/s",
                ["num_workers", "threads", "prefetch_factor", "persistent", "pin_memory", "round", "img/s"], rows,
                console)
    console.print(f"best: {'fast_loader' if pipeline else 'DataLoader'}(..., {tuned.describe()}) at "
                  f"{tuned.throughput:,.0f} img/s", highlight=False)
    if tuned.remembered:
        console.print(f"{tuned.remembered}: not measured again (--refresh measures again)", highlight=False)
    if tuned.busy_warning:
        console.print(f"note: {tuned.busy_warning}", highlight=False)
    if args.json:
        write_json(args.json, tuned.to_dict())
    return 0
