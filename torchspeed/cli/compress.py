"""Compression commands: `select` (backbones ranked by latency measured here) and `prune` (channels cut
out of your model, the speed-up measured)."""
from __future__ import annotations

import argparse

from torchspeed.cli import (add_json_option, add_model_options, build_model, fraction, int_tuple, positive_float,
                            positive_int)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "select",
        help="rank candidate backbones by inference latency measured on this machine (untrained, random weights)",
        description="Build each candidate with random weights (no training needed: speed depends on the "
                    "architecture), count its parameters and MACs, and time it at the given input shape.",
    )
    p.add_argument("--candidates", required=True, metavar="A,B,C",
                   help="comma-separated model specs: torchvision ('resnet18'), timm ('timm:efficientnet_b0') or your own "
                        "(package.module:factory, file.py:factory)")
    p.add_argument("--input-shape", required=True, type=int_tuple, metavar="N,C,H,W",
                   help="input batch shape, e.g. 1,3,224,224")
    p.add_argument("--budget-ms", type=positive_float("milliseconds"), metavar="MS", help="latency budget per batch; marks which fit")
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="batch size (replaces N of --input-shape)")
    p.add_argument("--precision", default="auto", metavar="NAME",
                   help="auto (default): time fp32 and the device's mixed precision, keep the faster; "
                        "or fp32, bf16, fp16")
    p.add_argument("--device", default="cpu", metavar="DEVICE", help="device to measure on (default cpu; 'auto' picks a GPU if present)")
    p.add_argument("--repeats", type=positive_int, default=15, metavar="N", help="timed repeats per candidate (default 15)")
    p.add_argument("--warmup", type=positive_int, default=3, metavar="N", help="untimed runs per candidate first (default 3)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="time 4-D inputs and models in channels_last memory format (default on)")
    add_json_option(p)
    p.set_defaults(func=run_select)

    q = sub.add_parser("prune", help="cut a fraction of every layer's channels out of a model and measure the speed-up",
                       description="Structural pruning (channels really removed, Torch-Pruning's dependency graph); the "
                                   "output layers are kept, so input and output shapes stay. Fine-tune the result (Python: "
                                   "ts.compress.prune(finetune=...)) before using it: pruning is lossy.")
    q.add_argument("model", metavar="MODEL",
                   help="model spec: torchvision ('resnet18'), timm ('timm:NAME') or your own (package.module:factory, "
                        "file.py:factory)")
    add_model_options(q)
    q.add_argument("--ratio", type=fraction(), required=True, metavar="R", help="fraction of channels to remove, in (0, 1)")
    q.add_argument("--input-shape", type=int_tuple, metavar="N,C,H,W",
                   help="example input shape (default: the model's own, else 1,3,224,224)")
    q.add_argument("--importance", default="l1", metavar="NAME",
                   help="how channels are ranked: l1 (default), l2, fpgm, lamp, bn_scale, random")
    q.add_argument("--steps", type=positive_int, default=1, metavar="N", help="prune in N equal steps (default 1)")
    q.add_argument("--round-to", type=positive_int, default=8, metavar="N",
                   help="keep channel counts multiples of N (default 8: vector kernels run blocks of channels)")
    q.add_argument("--out", metavar="DIR",
                   help="write the pruned model to DIR (model.pt + pruned.json; Python: ts.compress.load_pruned(DIR)); "
                        "DIR must be new or an earlier torchspeed output")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a pruned model torchspeed wrote in --out before (never any other file)")
    add_json_option(q)
    q.set_defaults(func=run_prune)


def run_prune(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchspeed.batches import random_input
    from torchspeed.compress.pruning import IMPORTANCES, PRUNED_FILES, prune, save_pruned
    from torchspeed.models import default_input_shape, spec_of

    if args.importance not in IMPORTANCES:
        raise ValueError(f"--importance {args.importance!r}: choose one of {', '.join(IMPORTANCES)}")
    if args.out:  # a bad --out costs nothing: checked before the model is built or anything measured
        from torchspeed.outputs import claim_output_dir

        claim_output_dir(args.out, "prune", overwrite=args.overwrite, replaces=PRUNED_FILES)
    model = build_model(args.model, args)
    example = random_input(tuple(args.input_shape or default_input_shape(model) or (1, 3, 224, 224)), name="--input-shape")
    console = Console()
    with console.status("pruning") as status:
        result = prune(model, example, args.ratio, importance=args.importance, steps=args.steps,
                       round_to=args.round_to, progress=status.update)
    console.print(str(result))
    if args.out:
        spec = spec_of(model)
        save_pruned(result.model, args.out, spec, result, overwrite=args.overwrite)
        how = f", spec={args.model!r}" if spec is not None and spec.runs_user_code else ""
        console.print(f"pruned model written to {args.out} (ts.compress.load_pruned({args.out!r}{how}))",
                      highlight=False, markup=False)
    if args.json:
        from torchspeed.atomic import write_json

        write_json(args.json, result.to_dict())
    return 0


def run_select(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchspeed.compress.selection import select_backbone

    console = Console()
    with console.status("measuring") as status:
        result = select_backbone(args.candidates, args.input_shape, budget_ms=args.budget_ms,
                                 batch_size=args.batch_size, precision=args.precision, device=args.device,
                                 channels_last=args.channels_last, repeats=args.repeats, warmup=args.warmup,
                                 progress=status.update)
    result.print(console)
    if args.budget_ms is not None:
        fit = [c.name for c in result.fitting]
        console.print(f"within {args.budget_ms:g} ms: {', '.join(fit) if fit else 'none'}")
    if args.json:
        from torchspeed.atomic import write_json

        write_json(args.json, result.to_dict())
    return 0
