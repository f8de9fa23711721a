"""`torchspeed optimize`: find the fastest verified inference variant of a model on this machine."""
from __future__ import annotations

import argparse
import math
from typing import Any

from torchspeed.cli import UserError, add_json_option, add_model_options, fraction, int_tuple, positive_int

CALIB_BATCH, EVAL_BATCH = 32, 50


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="build, verify and time inference variants (fusion, bf16, INT8, ONNX Runtime, "
                                        "OpenVINO); save the fastest that keeps accuracy")
    p.add_argument("model", metavar="MODEL",
                   help="a model spec (resnet18, timm:vit_tiny_patch16_224, package.module:factory, "
                        "path/to/file.py:factory; weights with --weights), 'demo' (the trained demo ResNet-18), "
                        "a torch artifact directory saved by optimize, or an .onnx file (then the ONNX Runtime "
                        "and OpenVINO variants compete against it)")
    add_model_options(p)
    p.add_argument("--num-classes", type=positive_int, metavar="N",
                   help="classifier width of a torchvision/timm model built by name (default: the model's)")
    p.add_argument("--input-shape", type=int_tuple, default=None, metavar="N,C,H,W",
                   help="example input shape (default 1,3,224,224, or the model's own; the demo model's size for 'demo'; "
                        "an .onnx file's from its graph, this filling its dynamic dimensions)")
    p.add_argument("--calib", metavar="DATA",
                   help="calibration images for INT8: an ImageFolder, a packed store or your Dataset factory "
                        "(package.module:factory, file.py:factory); 'demo' for the demo split")
    p.add_argument("--eval", metavar="DATA",
                   help="labelled data to guard top-1 accuracy on: an ImageFolder, a packed store or your Dataset "
                        "factory; 'demo' for the held-out split")
    p.add_argument("--max-metric-drop", type=fraction(low_inclusive=True), default=0.01, metavar="DROP",
                   help="largest accepted top-1 drop vs eager fp32 (an .onnx file: vs ONNX Runtime fp32 on it; default 0.01)")
    p.add_argument("--max-calib-samples", type=positive_int, default=256, metavar="N",
                   help="calibration images used (default 256)")
    p.add_argument("--max-eval-samples", type=positive_int, default=1000, metavar="N",
                   help="evaluation images used (default 1000)")
    p.add_argument("--batch-sizes", type=int_tuple, default=(1, 8), metavar="N,N",
                   help="batch sizes to time (default 1,8)")
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency",
                   help="latency: best = lowest p50 at the first batch size (default); throughput: highest "
                        "throughput at the largest")
    p.add_argument("--runtimes", default="auto", metavar="A,B",
                   help="comma list of torch,torch.compile,onnxruntime,onnxruntime-cuda,openvino,tensorrt (default auto)")
    p.add_argument("--precisions", default="auto", metavar="A,B", help="comma list of fp32,bf16,fp16,int8 (default auto)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the candidates run: cpu (default), cuda[:N] (GPU precisions and ONNX Runtime's CUDA / "
                        "TensorRT providers, timed on the GPU), or auto (a GPU when there is one)")
    p.add_argument("--out", metavar="DIR",
                   help="save the best variant here (model file + manifest.json); a new folder, or one optimize wrote")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the artifact an earlier optimize saved in --out (never other files there)")
    p.add_argument("--refresh", action="store_true",
                   help="search and time every variant again instead of checking the winner remembered from an "
                        "earlier run on this machine")
    add_json_option(p)
    p.set_defaults(func=run)


def _image_batches(root: str, n: int, shape: tuple[int, ...], batch_size: int) -> list[Any]:
    """Up to n (images, labels) batches spread over every class, resized and centre-cropped to the
    input size, ImageNet-normalised: torchspeed.data's evaluation pipeline, on the CPU."""
    from torchspeed.data.loader import fast_loader
    from torchspeed.data.sources import evenly_spread

    h, w = shape[-2:]
    if h != w:
        raise UserError(f"--calib/--eval crop images square: use an --input-shape with H == W, got {h}x{w}")
    loader = fast_loader(evenly_spread(root, n), batch_size, train=False, crop=h, device="cpu", channels_last=False,
                         num_workers=0, threads=1)
    return [(x.contiguous(), y) for x, y in loader]


def _resolve(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the resolved model, the demo bundle or None): 'demo' here (it lives in bench, a higher layer),
    anything else through `torchspeed.infer.resolve_model`."""
    from torchspeed.infer.model_input import ResolvedModel, resolve_model

    if args.model != "demo":
        return resolve_model(args.model, weights=args.weights, model_kwargs=args.model_kwargs,
                             num_classes=args.num_classes, input_shape=args.input_shape), None
    if args.weights or args.model_kwargs:
        raise UserError(f"--weights and --model-kwargs apply to a model built from a spec, not to {args.model!r}")
    from torchspeed.bench.demo_model import load_demo_model

    demo = load_demo_model()
    return ResolvedModel(demo.model, args.input_shape or (1, 3, demo.input_size, demo.input_size)), demo


def _judging_data(args: argparse.Namespace, shape: tuple[int, ...], demo: Any) -> tuple[Any, Any]:
    """(calibration batches or None, eval_fn or None) from --calib / --eval."""
    from torchspeed.metrics import top1_accuracy

    if len(shape) != 4 and (args.calib or args.eval):
        raise UserError(f"--calib/--eval read images, which needs a 4-d --input-shape N,C,H,W; got {shape}")
    calib = eval_fn = None
    if args.calib == "demo" or args.eval == "demo":
        if demo is None:
            from torchspeed.bench.demo_model import load_demo_model

            demo = load_demo_model()
        if shape[-1] != demo.input_size or shape[-2] != demo.input_size:
            raise UserError(f"the demo data is {demo.input_size}x{demo.input_size}; use --input-shape 1,3,{demo.input_size},{demo.input_size}")
    if args.calib == "demo":
        calib = list(demo.batches("train", CALIB_BATCH, limit=args.max_calib_samples))
    elif args.calib:
        calib = [x for x, _ in _image_batches(args.calib, args.max_calib_samples, shape, CALIB_BATCH)]
    if args.eval == "demo":
        def eval_fn(run):
            return demo.evaluate(run, "heldout", EVAL_BATCH, limit=args.max_eval_samples)
    elif args.eval:
        eval_batches = _image_batches(args.eval, args.max_eval_samples, shape, EVAL_BATCH)

        def eval_fn(run):
            return top1_accuracy(run, eval_batches)
    return calib, eval_fn


def _claim_out(args: argparse.Namespace) -> Any:
    """The --out folder checked before any work (new, or an earlier optimize's with --overwrite; never a
    user's file; writable), with what a killed save left there put right first; None without --out."""
    if not args.out:
        return None
    from torchspeed.infer.runners import ARTIFACT_FILES, recover_artifact
    from torchspeed.outputs import claim_output_dir

    recover_artifact(args.out)
    return claim_output_dir(args.out, "optimize", overwrite=args.overwrite, replaces=ARTIFACT_FILES)


def _example(shape: tuple[int, ...], batch_sizes: tuple[int, ...], device: Any) -> Any:
    """A random example input of `shape` on the CPU, refused in one line naming --input-shape before any
    work when it, or optimize's largest batch of it (verification takes 8 rows, timing the largest
    --batch-sizes), would not fit in the memory free on the CPU or `device` (the memory guard lint,
    prune and select have)."""
    import torch

    from torchspeed.batches import random_input
    from torchspeed.runtime import free_memory

    rows = max(8, shape[0], *batch_sizes) if len(shape) > 1 else 1
    needed = math.prod(shape[1:] if len(shape) > 1 else shape) * rows * 4
    for where in dict.fromkeys(("cpu", str(device))):
        free = free_memory(torch.device(where))
        if free is not None and needed > free:
            raise UserError(f"--input-shape {','.join(map(str, shape))}: optimize's batches of {rows} need "
                            f"{needed / 2**30:,.1f} GiB and {where} has {free / 2**30:,.1f} GiB free: give a smaller "
                            "shape (or smaller --batch-sizes)")
    return random_input(shape, "cpu", name="--input-shape")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchspeed.atomic import write_json
    from torchspeed.infer.search import optimize
    from torchspeed.runtime import resolve_device

    console = Console()
    out = _claim_out(args)
    resolved, demo = _resolve(args)
    shape = resolved.input_shape
    try:
        device = resolve_device(args.device)
    except RuntimeError as e:
        raise UserError(f"--device {args.device!r}: {e}") from None
    example = _example(shape, args.batch_sizes, device)  # before any data is read
    calib, eval_fn = _judging_data(args, shape, demo)
    with console.status("optimize: starting") as status:
        result = optimize(resolved.model, example, calib_data=calib, eval_fn=eval_fn,
                          max_metric_drop=args.max_metric_drop, device=device, runtimes=args.runtimes,
                          precisions=args.precisions, batch_sizes=args.batch_sizes, objective=args.objective,
                          max_calib_samples=args.max_calib_samples, refresh=args.refresh,
                          progress=lambda s: status.update(f"optimize: {s}"))
    result.print(console)
    best = result.best
    if best is None:
        console.print("[red]no variant passed its checks[/]")
        return 1
    b = result.batch_sizes[0]
    base = result.table[0].p50_ms(b)
    console.print(f"best: {best.name} ({best.p50_ms(b):.2f} ms at batch {b}, {base / best.p50_ms(b):.1f}x {result.table[0].name})")
    if out is not None:
        out.record(*best.runner.saves)  # before saving: files of a save cut short are still known as optimize's
        best.save(args.out)
        console.print(f"saved to {args.out} (run it with torchspeed.infer.load({args.out!r}))")
    if args.json:
        write_json(args.json, result.to_dict())
    return 0
