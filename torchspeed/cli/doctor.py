"""Doctor commands: `doctor` (an unchanged training script, phases measured) and `lint` (a model)."""
from __future__ import annotations

import argparse

from torchspeed.cli import add_json_option, add_model_options, build_model, int_tuple, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="profile an unchanged training script: where each step's time goes, and the ranked fixes",
        description="Run `python your_train.py ARGS` with torch instrumented from outside (DataLoader, forward, "
                    "backward, optimizer step, copies, host syncs), then print the time per phase, the verdict "
                    "(data-, compute- or overhead-bound), where a step's memory goes (its peak by part, phase "
                    "and module) and the fixes ranked by expected gain. With --try, "
                    "each fix is then measured on the same unchanged script (baseline re-measured between "
                    "fixes, losses compared) and printed with the code that keeps it. Exits with the "
                    "script's own status.",
        usage="torchspeed doctor [--steps N] [--try [FIX,...]] [--out DIR] [--json PATH] [--trace] [--cprofile] "
              "[--no-memory] [--timeout S] -- python your_train.py ARGS")
    p.add_argument("--steps", type=positive_int, metavar="N", help="stop the script cleanly after N training (optimizer) steps")
    p.add_argument("--out", metavar="DIR", help="write doctor.json and doctor.md (and the trace) to DIR")
    add_json_option(p)
    p.add_argument("--trace", action="store_true",
                   help="also record a torch.profiler trace of a few steps (Chrome / Perfetto JSON)")
    p.add_argument("--cprofile", action="store_true", help="also list the Python hot spots (cProfile; slows the run)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="do not measure where a step's memory goes (by default the second step is measured for it "
                        "and left out of the time figures)")
    p.add_argument("--timeout", type=positive_int, metavar="S",
                   help="interrupt the script after S seconds (it still writes its report); per run under --try")
    p.add_argument("--try", dest="try_fixes", nargs="?", const="auto", metavar="FIX,...",
                   help="measure the fixes on the script itself, --steps steps per run (default 8): every fix the "
                        "findings call for, or the listed ones: workers, fast_loader (a DataLoader of image files "
                        "swapped for ts.data.fast_loader on the same files), persistent_workers, pin_memory, bf16, "
                        "fp16, channels_last, cudnn_benchmark, fused_optimizer, inference_mode, threads, compile "
                        "(compile only when listed); waits up to 5 s for a quiet machine first")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python your_train.py ARGS")
    p.set_defaults(func=run_doctor)

    q = sub.add_parser("lint", help="per-layer FLOPs, memory access and time of a model, and the design rules it breaks")
    q.add_argument("model", metavar="MODEL",
                   help="resnet18 (torchvision), timm:NAME, or your own package.module:factory / file.py:factory")
    add_model_options(q)
    q.add_argument("--input-shape", type=int_tuple, metavar="N,C,H,W",
                   help="example input shape (default: the model's own, else 1,3,224,224; for a model that reads "
                        "tokens, N,T token ids, default 1 x up to 128)")
    q.add_argument("--num-classes", type=positive_int, metavar="N", help="classifier width (default: the model's)")
    q.add_argument("--loss", choices=("ce", "nll", "none"), default="ce",
                   help="loss the output feeds, for the activation/loss pairing check (default ce)")
    q.add_argument("--device", default="cpu", metavar="DEVICE", help="device to trace on: cpu, cuda, cuda:1 ... (default cpu)")
    q.add_argument("--top", type=positive_int, default=12, metavar="N", help="layers to list (default 12)")
    q.add_argument("--threads", type=positive_int, metavar="N", help="intra-op threads while timing (default: torch's)")
    add_json_option(q)
    q.set_defaults(func=run_lint)


def run_doctor(args: argparse.Namespace) -> int:
    from torchspeed.doctor.launch import run_doctor as _run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("doctor needs the script to run after `--`: torchspeed doctor -- python your_train.py ARGS")
    try_fixes = None
    if args.try_fixes is not None:
        from torchspeed.args import as_list

        try_fixes = True if args.try_fixes == "auto" else as_list(args.try_fixes, name="--try")
    status, payload = _run(command, steps=args.steps, out=args.out, json_path=args.json, trace=args.trace,
                           cprofile=args.cprofile, timeout=args.timeout, try_fixes=try_fixes, memory=args.memory)
    if payload.get("status") == "timeout":
        return 124  # as timeout(1)
    return status


def run_lint(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from torchspeed.batches import random_input
    from torchspeed.doctor.linting import lint
    from torchspeed.doctor.output import print_lint
    from torchspeed.doctor.transformer_lint import token_input
    from torchspeed.models import default_input_shape

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.model, args, num_classes=args.num_classes)
    device = torch.device(args.device)
    model = model.to(device)
    x = token_input(model, args.input_shape, device)  # token ids for a model that reads them, else None
    if x is None:
        x = random_input(tuple(args.input_shape or default_input_shape(model) or (1, 3, 224, 224)), device,
                         name="--input-shape")
    shape = tuple(x.shape)
    loss = {"ce": nn.CrossEntropyLoss(), "nll": nn.NLLLoss(), "none": None}[args.loss]
    try:
        result = lint(model, x, loss_fn=loss)
    except (RuntimeError, MemoryError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{args.model} does not run on input shape {shape}: {first} "
                         "(set --input-shape)") from None
    print_lint(result, top=args.top)
    if args.json:
        from torchspeed.atomic import write_json

        write_json(args.json, result.to_dict())
    return 0
