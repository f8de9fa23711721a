"""`torchspeed train`: image classification end to end (fast loader, measured settings, validation,
early stopping, checkpoints), the recipe of `torchspeed.recipes`. Runs unchanged under
`torchrun --nproc_per_node=K -m torchspeed train ...`."""
from __future__ import annotations

import argparse

from torchspeed.args import byte_size
from torchspeed.cli import UserError, add_json_option, add_model_options, fraction, positive_float, positive_int
from torchspeed.cli.data import counts


def _on_off_auto(text: str) -> bool | str:
    v = text.lower()
    if v in ("auto", "on", "off", "true", "false"):
        return "auto" if v == "auto" else v in ("on", "true")
    raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")


def _memory_size(text: str) -> int:
    """argparse type: a memory size (8GiB, 500MB, a number of bytes), one line naming the flag otherwise."""
    try:
        return byte_size(text, "--memory-budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    p.add_argument("--memory-budget", type=_memory_size, default=None, metavar="SIZE",
                   help="memory a training step may use on this process's device, e.g. 8GiB or 500MB: the "
                        "micro-batch that fits is planned from measured probe steps and gradients are "
                        "accumulated so that each optimizer step still takes --batch-size samples")
    p.add_argument("--lr", type=positive_float(None), default=None, metavar="LR", help="peak learning rate of SGD+momentum, cosine schedule "
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
    p.add_argument("--max-steps", type=positive_int, default=None, metavar="N", help="stop after this many optimizer steps (a checkpoint is written where it stops)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--out", default="torchspeed-train", metavar="DIR",
                   help="output directory, new or one torchspeed wrote (a folder holding other files is refused): "
                        "model.pt (the trained weights, for --weights), checkpoints/, metrics.csv, summary.json "
                        "(default ./torchspeed-train)")
    p.add_argument("--resume", nargs="?", const="last", choices=("last", "auto"), default=False,
                   help="continue the run in --out from its newest checkpoint that passes its check (refused when "
                        "--out holds no checkpoint of its run); --resume auto: continue it when there is one, else "
                        "start it (for jobs that torchrun --max-restarts or a scheduler restarts)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in --out even if an earlier run wrote there (its checkpoints are deleted, "
                        "its files replaced; never a file torchspeed did not write)")
    p.add_argument("--refresh", action="store_true",
                   help="measure every auto setting again (loader, precision, layout, compile) instead of recalling "
                        "what an earlier run on this machine measured for the same model and data")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from torchspeed.atomic import write_json
    from torchspeed.models import parse_kwargs
    from torchspeed.recipes import ClassifierOptions, prepare_classifier

    console = Console()
    options = ClassifierOptions(
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, crop=args.crop, val_fraction=args.val_fraction,
        patience=args.patience, precision=args.precision, channels_last=args.channels_last, compile=args.compile,
        strategy=args.strategy, num_workers=args.num_workers, threads=args.threads, max_steps=args.max_steps,
        seed=args.seed, out=args.out, resume=args.resume, overwrite=args.overwrite,
        model_kwargs=parse_kwargs(args.model_kwargs), weights=args.weights, refresh=args.refresh,
        memory_budget=args.memory_budget)
    training = prepare_classifier(args.data, args.model, options, progress=not args.no_progress)
    if training.is_main:
        console.print(training.description)
        if training.memory_line:
            console.print(training.memory_line)
    try:
        result = training.fit()
    except FloatingPointError as e:  # NaN/inf loss: one clear line, not a traceback
        raise UserError(str(e)) from None
    except torch.OutOfMemoryError as e:  # the Trainer's line: the phase and the planner's suggestion
        raise UserError(str(e)) from None
    if training.is_main:
        console.print(str(result.report))
        if result.loader is not None:
            console.print(f"loader (chosen with the training step in the loop): {result.loader.describe()}")
        if result.early_stopping["reason"]:
            console.print(f"early stopping: {result.early_stopping['reason']}")
        if args.json:
            write_json(args.json, result.to_dict())
    return 0
