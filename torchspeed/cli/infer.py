"""`torchspeed optimize`: find the fastest verified inference variant of a model on this machine."""
from __future__ import annotations

import argparse
import os
from typing import Any

from torchspeed.cli import UserError, add_json_option, int_tuple, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="build, verify and time inference variants (fusion, bf16, INT8, ONNX Runtime, "
                                        "OpenVINO); save the fastest that keeps accuracy")
    p.add_argument("model", metavar="MODEL",
                   help="a torchvision/timm architecture name (resnet18, timm:vit_tiny_patch16_224), 'demo' (the trained "
                        "demo ResNet-18), a saved torchspeed torch artifact directory, or a state-dict file with --arch")
    p.add_argument("--arch", help="architecture of a state-dict MODEL file (e.g. resnet18)")
    p.add_argument("--num-classes", type=positive_int, help="number of classes for a model built by name")
    p.add_argument("--input-shape", type=int_tuple, default=None, metavar="N,C,H,W",
                   help="example input shape (default 1,3,224,224; the demo model's own size for 'demo')")
    p.add_argument("--calib", metavar="DATA", help="ImageFolder of calibration images for INT8 ('demo' for the demo split)")
    p.add_argument("--eval", metavar="DATA", help="labelled ImageFolder to guard accuracy on ('demo' for the held-out split)")
    p.add_argument("--max-drop", type=float, default=0.01, help="largest accepted top-1 drop vs fp32 (default 0.01)")
    p.add_argument("--calib-samples", type=positive_int, default=256, help="calibration images used (default 256)")
    p.add_argument("--eval-samples", type=positive_int, default=1000, help="evaluation images used (default 1000)")
    p.add_argument("--batch-sizes", type=int_tuple, default=(1, 8), help="batch sizes to time (default 1,8)")
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    p.add_argument("--backends", default="auto", help="comma list of torch,torch.compile,onnxruntime,openvino,tensorrt")
    p.add_argument("--precisions", default="auto", help="comma list of fp32,bf16,fp16,int8")
    p.add_argument("--out", metavar="DIR", help="save the best variant here (model file + manifest.json)")
    add_json_option(p)
    p.set_defaults(func=run)


def _image_files(root: str) -> list[tuple[str, int]]:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"data directory {root!r} does not exist (expected an ImageFolder: DIR/CLASS/IMAGE)")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    exts = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
    files = [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
             for f in sorted(os.listdir(os.path.join(root, c))) if f.lower().endswith(exts)]
    if not files:
        raise ValueError(f"no images found in {root!r}: expected an ImageFolder (DIR/CLASS/IMAGE.jpg)")
    return files


def _load_folder(root: str, n: int, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """Up to n images spread over every class, resized + centre-cropped to shape, ImageNet-normalised."""
    import numpy as np
    import torch
    from PIL import Image

    files = _image_files(root)
    step = max(1, len(files) // n)
    files = files[::step][:n]
    h, w = shape[-2:]
    arrays = []
    for path, _ in files:
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                s = max(h / im.height, w / im.width)
                im = im.resize((max(w, round(im.width * s)), max(h, round(im.height * s))), Image.BILINEAR)
                left, top = (im.width - w) // 2, (im.height - h) // 2
                arrays.append(np.asarray(im.crop((left, top, left + w, top + h)), dtype=np.float32))
        except OSError as e:
            raise ValueError(f"cannot read image {path!r}: {e}") from None
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 255.0
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous(), torch.tensor([lab for _, lab in files])


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, tuple[int, ...]]:
    """(model, demo or None, default input shape)."""
    import torch

    from torchspeed.infer.models import create_model

    kwargs = {"num_classes": args.num_classes} if args.num_classes else {}
    if args.model == "demo":
        from torchspeed.bench.demo_model import load_demo_model

        demo = load_demo_model()
        return demo.model, demo, (1, 3, demo.input_size, demo.input_size)
    if os.path.isdir(args.model):
        from torchspeed.infer.artifact import load

        runner = load(args.model)
        if getattr(runner, "source", None) is None:
            raise UserError(f"{args.model!r} holds a {runner.backend} artifact; optimize needs a PyTorch model "
                            "(a torch artifact, a name, or a state-dict file with --arch)")
        return runner.source, None, (1, 3, 224, 224)
    if os.path.isfile(args.model):
        if not args.arch:
            raise UserError(f"{args.model!r} is a file: say which architecture its weights are for with --arch NAME")
        model = create_model(args.arch, **kwargs)
        try:
            state = torch.load(args.model, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot read weights from {args.model!r} (a torch.save'd state dict is expected): {e}") from None
        state = state.get("model", state) if isinstance(state, dict) else state
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError) as e:
            raise UserError(f"the weights in {args.model!r} do not fit {args.arch}: {str(e).splitlines()[0]}") from None
        return model, None, (1, 3, 224, 224)
    if os.sep in args.model or args.model.endswith((".pt", ".pth", ".onnx")):
        raise FileNotFoundError(f"model file {args.model!r} does not exist")
    return create_model(args.model, **kwargs), None, (1, 3, 224, 224)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from torchspeed.atomic import write_json
    from torchspeed.infer.search import optimize

    console = Console()
    if not 0 <= args.max_drop < 1:
        raise UserError(f"--max-drop must be in [0, 1), got {args.max_drop}")
    model, demo, default_shape = _load_model(args)
    shape = args.input_shape or default_shape
    if len(shape) != 4 and (args.calib or args.eval):
        raise UserError(f"--calib/--eval read images, which needs a 4-d --input-shape N,C,H,W; got {shape}")
    example = torch.randn(shape)
    calib = eval_fn = None
    if args.calib == "demo" or args.eval == "demo":
        if demo is None:
            from torchspeed.bench.demo_model import load_demo_model

            demo = load_demo_model()
        if shape[-1] != demo.input_size or shape[-2] != demo.input_size:
            raise UserError(f"the demo data is {demo.input_size}x{demo.input_size}; use --input-shape 1,3,{demo.input_size},{demo.input_size}")
    if args.calib == "demo":
        calib = list(demo.batches("train", 32, limit=args.calib_samples))
    elif args.calib:
        x, _ = _load_folder(args.calib, args.calib_samples, shape)
        calib = list(torch.split(x, 32))
    if args.eval == "demo":
        def eval_fn(run):
            return demo.evaluate(run, "heldout", 50, limit=args.eval_samples)
    elif args.eval:
        ex, ey = _load_folder(args.eval, args.eval_samples, shape)

        def eval_fn(run):
            correct = 0
            for xb, yb in zip(torch.split(ex, 50), torch.split(ey, 50)):
                out = run(xb)
                out = out if isinstance(out, torch.Tensor) else torch.as_tensor(out)
                correct += int((out.argmax(1) == yb).sum())
            return correct / len(ey)
    split = (lambda s: s if s == "auto" else [v.strip() for v in s.split(",") if v.strip()])
    with console.status("optimize: starting") as status:
        result = optimize(model, example, calib_data=calib, eval_fn=eval_fn, max_metric_drop=args.max_drop,
                          backends=split(args.backends), precisions=split(args.precisions),
                          batch_sizes=args.batch_sizes, objective=args.objective,
                          max_calib_samples=args.calib_samples, log=lambda s: status.update(f"optimize: {s}"))
    result.print(console)
    if result.best is None:
        console.print("[red]no variant passed its checks[/]")
        return 1
    b = result.batch_sizes[0]
    base = result.table[0].p50_ms(b)
    console.print(f"best: {result.best.name} ({result.best.p50_ms(b):.2f} ms at batch {b}, "
                  f"{base / result.best.p50_ms(b):.1f}x eager fp32)")
    if args.out:
        result.best.save(args.out)
        console.print(f"saved to {args.out} (run it with torchspeed.infer.load({args.out!r}))")
    if args.json:
        write_json(args.json, result.to_dict())
    return 0
