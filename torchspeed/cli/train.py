"""`torchspeed train`: image classification end to end (fast loader, measured settings, validation,
early stopping, checkpoints). Runs unchanged under `torchrun --nproc_per_node=K -m torchspeed train ...`."""
from __future__ import annotations

import argparse
from typing import Any

from torchspeed.cli import UserError, add_json_option, add_model_options, build_model, fraction, positive_int
from torchspeed.cli.data import counts


def _on_off_auto(text: str) -> bool | str:
    v = text.lower()
    if v in ("auto", "on", "off", "true", "false"):
        return "auto" if v == "auto" else v in ("on", "true")
    raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an image classifier on an ImageFolder, a packed store or your own Dataset "
                                     "(fast, measured)")
    p.add_argument("--data", required=True, metavar="DATA",
                   help="ImageFolder (class subfolders, or train/ and val/ splits), a store from `torchspeed pack`, "
                        "or your Dataset factory package.module:factory / file.py:factory (returns a Dataset of "
                        "(image, label) with a `classes` list)")
    p.add_argument("--model", required=True, metavar="SPEC",
                   help="resnet18 (torchvision), timm:NAME, or your own package.module:factory / file.py:factory")
    add_model_options(p)
    p.add_argument("--epochs", type=positive_int, required=True, metavar="N", help="number of epochs")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"), help="default: auto (measured)")
    p.add_argument("--channels-last", default="auto", type=_on_off_auto, metavar="auto|on|off", help="auto | on | off (default auto)")
    p.add_argument("--compile", default="auto", type=_on_off_auto, metavar="auto|on|off", help="auto | on | off (default auto)")
    p.add_argument("--strategy", default="auto", choices=("auto", "ddp", "fsdp", "none"),
                   help="under torchrun: ddp (auto) or fsdp")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="per-process batch size (default 64)")
    p.add_argument("--lr", type=float, default=None, metavar="LR", help="peak learning rate of SGD+momentum, cosine schedule "
                                                          "(default 0.1 x batch/256 x processes)")
    p.add_argument("--crop", type=positive_int, default=224, metavar="N", help="training crop side (default 224)")
    p.add_argument("--val-fraction", type=fraction(), default=0.1, metavar="F",
                   help="held-out share when DATA has no val/ split (default 0.1)")
    p.add_argument("--patience", type=positive_int, default=10, metavar="N", help="early stopping patience, in validations (default 10)")
    p.add_argument("--num-workers", type=counts(0), default="auto", metavar="auto|N",
                   help="loader worker processes: auto (measured, default), a number, or a comma list of counts to measure")
    p.add_argument("--threads", type=counts(1), default="auto", metavar="auto|N",
                   help="batch-making threads when num_workers is 0: auto (measured along with --num-workers auto, "
                        "else 1; default), a number, or a comma list of counts to measure")
    p.add_argument("--max-steps", type=positive_int, default=None, metavar="N", help="stop after this many optimizer steps")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--out", default="torchspeed-train", metavar="DIR",
                   help="output directory: model.pt (the trained weights, for --weights), checkpoints/, metrics.csv, "
                        "summary.json (default ./torchspeed-train)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint that passes its check")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in --out even if it holds an earlier run's checkpoints (they are deleted)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_option(p)
    p.set_defaults(func=run)


def _full_state_dict(module: Any) -> dict[str, Any]:
    """The model's whole state dict on the CPU (gathered from every rank under FSDP)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _check_out(out: str, resume: bool, overwrite: bool) -> str:
    """Before any data is read: --out can be written, and a new run does not land on an earlier one.
    Returns the checkpoint directory."""
    import os
    import tempfile

    from torchspeed.train.checkpoint import holds_run, read_run

    if resume and overwrite:
        raise UserError("--resume continues the run in --out and --overwrite deletes it: give one of them")
    ckdir = os.path.join(out, "checkpoints")
    try:
        os.makedirs(ckdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=ckdir):  # can files be created there? (nothing is left behind)
            pass
    except OSError as e:
        raise UserError(f"--out {out!r} cannot be written: {e.strerror or e}") from None
    if not resume and not overwrite and holds_run(ckdir):
        run = read_run(ckdir)
        raise UserError(f"--out {out!r} already holds checkpoints of an earlier run{f' (run {run})' if run else ''} "
                        f"in {ckdir!r}: continue it with --resume, or start a new run there with --overwrite "
                        "(deletes those checkpoints), or give another --out")
    return ckdir


def _class_names(data: str, source: object) -> list[str]:
    """The classes of the training data: a folder's or store's; a Dataset's `classes` (torchvision's
    convention), else the distinct values of its `targets`."""
    classes = list(getattr(source, "classes", []) or [])
    if classes:
        return [str(c) for c in classes]
    dataset = getattr(getattr(source, "source", source), "dataset", None)
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return [str(c) for c in sorted({int(t) for t in targets})]
    raise UserError(f"--data {data!r}: the Dataset has no `classes` list (nor `targets`) to count the classes by; "
                    "give it a `classes` attribute with the class names, as torchvision's ImageFolder has")


def run(args: argparse.Namespace) -> int:
    import math
    import os

    import torch
    from rich.console import Console

    from torchspeed.atomic import atomic_write, write_json
    from torchspeed.data import fast_loader, train_val_split
    from torchspeed.data.sources import is_dataset_spec
    from torchspeed.runtime import resolve_device, seed_everything
    from torchspeed.train import Checkpoint, EarlyStopping, Trainer, distributed

    console = Console()
    if not os.path.exists(args.data) and not is_dataset_spec(args.data):
        raise FileNotFoundError(f"--data {args.data!r} does not exist: give an ImageFolder directory, a packed store "
                                "or a Dataset factory (package.module:factory or path/file.py:factory)")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")
    ckdir = _check_out(args.out, args.resume, args.overwrite)  # before the process group and any data
    seed_everything(args.seed)
    # The process group first, so the loaders shard themselves per rank.
    denv, device = distributed.setup(resolve_device("auto")) if args.strategy != "none" else (distributed.env(),
                                                                                             resolve_device("auto"))
    train_src, val_src = train_val_split(args.data, args.val_fraction, args.seed)
    classes = _class_names(args.data, train_src)
    if len(classes) < 2:
        raise UserError(f"{args.data!r} has {len(classes)} class(es); classification needs at least 2")
    model = build_model(args.model, args, num_classes=len(classes))  # before the loaders: a bad name fails fast
    train = fast_loader(train_src, args.batch_size, train=True, crop=args.crop, device=device,
                        num_workers=args.num_workers, threads=args.threads, seed=args.seed)
    # validation: the number given, else the main process (its batches are few)
    val = fast_loader(val_src, args.batch_size, train=False, crop=args.crop, device=device,
                      num_workers=args.num_workers if isinstance(args.num_workers, int) else 0,
                      threads=args.threads if isinstance(args.threads, int) else 1, seed=args.seed)
    lr = args.lr or 0.1 * args.batch_size * denv.world_size / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    total = args.max_steps or max(1, len(train) * args.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    stopper = EarlyStopping("val_loss", patience=args.patience)
    checkpoints = Checkpoint(ckdir, keep_last=2, overwrite=args.overwrite)
    trainer = Trainer(model, opt, torch.nn.CrossEntropyLoss(label_smoothing=0.1), precision=args.precision,
                      channels_last=args.channels_last, compile=args.compile,
                      strategy=None if args.strategy == "none" else args.strategy,
                      scheduler=sched, callbacks=[stopper, checkpoints],
                      log_path=os.path.join(args.out, "metrics.csv"), progress=not args.no_progress)
    if denv.is_main:
        console.print(f"training {args.model} on {len(train_src)} images ({len(classes)} classes), "
                      f"validating on {len(val_src)}; {denv.world_size} process(es), device {device}")
    try:
        result = trainer.fit(train, val, epochs=args.epochs, max_steps=args.max_steps,
                             resume="last" if args.resume else None)
    except FloatingPointError as e:  # NaN/inf loss: one clear line, not a traceback
        raise UserError(str(e)) from None
    data = os.path.abspath(args.data) if os.path.exists(args.data) else args.data
    summary = {"model": args.model, "data": data, "classes": classes,
               "world_size": denv.world_size, "lr": lr, "batch_size": args.batch_size, **result,
               "early_stopping": {"stopped": result["stopped_early"], "best_val_loss": stopper.best,
                                  "reason": stopper.reason},
               "accelerate": trainer.report.to_dict(), "checkpoint": checkpoints.last(), "run_id": trainer.run_id}
    weights = _full_state_dict(trainer.module)  # collective under FSDP: every rank takes part
    if denv.is_main:
        with atomic_write(os.path.join(args.out, "model.pt"), "wb") as f:
            torch.save(weights, f)
        summary["weights"] = os.path.join(args.out, "model.pt")
        console.print(str(trainer.report))
        if stopper.reason:
            console.print(f"early stopping: {stopper.reason}")
        write_json(os.path.join(args.out, "summary.json"), summary)
        if args.json:
            write_json(args.json, summary)
    return 0
