"""Data commands: demo-data (and, as the data pipeline lands, pack and tune-loader)."""
from __future__ import annotations

import argparse

from torchspeed.cli import non_negative_int, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-data", help="write a photo-like JPEG ImageFolder (deterministic demo data)")
    p.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--images", type=positive_int, default=2000, help="number of images (default 2000)")
    p.add_argument("--classes", type=positive_int, default=10, help="number of classes (default 10)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    p.set_defaults(func=run_demo_data)


def run_demo_data(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from torchspeed.data.demo import make_photo_folder

    t0 = time.perf_counter()
    make_photo_folder(args.dir, args.images, n_classes=args.classes, seed=args.seed)
    Console().print(f"wrote {args.images} images in {args.classes} classes to {args.dir} ({time.perf_counter() - t0:.1f} s)")
    return 0
