"""Inference suite: every variant `optimize` builds, timed against eager fp32, with its accuracy cost.

Latency is timed at 224x224, batch 1 and 8, with the same explicit thread count for every runtime.
ResNet-18 is the trained demo model, so its lossy variants (bf16, INT8) are also judged by held-out
top-1 accuracy (the drop must stay <= 0.01). The demo model is trained and evaluated at its own small
input size (training at 224 does not fit the build budget) and exported models have fixed spatial
sizes, so each variant is built twice: at the demo size, where the accuracy guard judges it, and at
224, where it is timed; a variant counts as passed only if both pass. MobileNetV3-Small and timm's
vit_tiny_patch16_224 are random initialisations (nothing is downloaded), guarded by output
agreement with fp32. INT8 calibration at 224 uses the demo images upsampled.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

TITLE = "Inference: latency per variant at 224x224 (ms, lower is better), ratio vs eager fp32"

# bench row -> optimize variant name (the order of the table)
ROWS = (
    ("eager fp32", "eager fp32", "PyTorch eager, fp32"),
    ("fused", "fused fp32", "Conv+BN folded (FX), fp32"),
    ("bf16 + channels_last", "bf16 + channels_last", "fused, bf16 autocast, channels_last"),
    ("torch.compile", "torch.compile bf16", "inductor, freezing, bf16 + channels_last"),
    ("ONNX Runtime fp32", "onnxruntime fp32", "ONNX (dynamo exporter), ORT CPU, fp32"),
    ("ONNX Runtime INT8", "onnxruntime int8", "ORT quantize_static QDQ per-channel U8S8, min-max"),
    ("ONNX Runtime INT8 dynamic", "onnxruntime int8 dynamic", "ORT quantize_dynamic (MatMul/Gemm)"),
    ("OpenVINO fp32", "openvino fp32", "OpenVINO CPU, INFERENCE_PRECISION_HINT=f32"),
    ("OpenVINO bf16", "openvino bf16", "OpenVINO CPU, INFERENCE_PRECISION_HINT=bf16"),
    ("OpenVINO INT8", "openvino int8", "NNCF nncf.quantize (PTQ), OpenVINO CPU"),
)


def _models(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    from torchspeed.models import create

    return [
        ("resnet18", None),  # the trained demo model
        ("mobilenet_v3_small", lambda: create("torchvision:mobilenet_v3_small")),
        ("vit_tiny", lambda: create("timm:vit_tiny_patch16_224")),
    ]


def run(quick: bool, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    import torch

    from torchspeed.bench.demo_model import load_demo_model
    from torchspeed.args import progress_fn
    from torchspeed.infer.search import optimize
    from torchspeed.runtime import usable_cores

    say = progress_fn(progress)
    say("loading the demo model (built once, a few minutes, on first use)")
    demo = load_demo_model(progress=say)
    size = 224
    calib_small = list(demo.batches("train", 32, limit=64 if quick else 256))
    calib = [torch.nn.functional.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)
             for x, _ in calib_small]
    n_eval = 500 if quick else 1000
    backends = ["torch", "onnxruntime", "openvino", "tensorrt"] + ([] if quick else ["torch.compile"])
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    notes = [f"{usable_cores()} threads for every runtime; ONNX Runtime spinning off; p50 of "
             f"{3 if quick else 7} interleaved repeats",
             f"ResNet-18: trained demo model, held-out top-1 {demo.accuracy:.3f} (fp32) on {n_eval} images; "
             "MobileNetV3-Small / ViT-Tiny: random init, guarded by output agreement (rel. L2 <= 0.1)"]
    if quick:
        notes.append("--quick: torch.compile skipped (about a minute of compiling per model here)")
    for name, make in _models(quick):
        say(f"{name}: building and verifying variants")
        arch = {"source": "torchvision", "name": "resnet18", "kwargs": {"num_classes": 10}} if make is None else None
        model = demo.model if make is None else make()
        example = torch.randn(1, 3, size, size)
        res = optimize(model, example, calib_data=calib, max_metric_drop=0.01, backends=backends,
                       batch_sizes=(1, 8), repeats=3 if quick else 7, arch=arch,
                       progress=lambda s, n=name: say(f"{n} at 224: {s}"))
        if make is None:  # the accuracy guard, at the size the demo model was trained at
            s_ = demo.input_size
            guard = optimize(model, torch.randn(1, 3, s_, s_), calib_data=calib_small,
                             eval_fn=lambda run: demo.evaluate(run, "heldout", 100, limit=n_eval),
                             max_metric_drop=0.01, backends=backends, batch_sizes=(8,), measure=False, arch=arch,
                             progress=lambda s, n=name: say(f"{n} accuracy guard at {s_}px: {s}"))
            _merge_guard(res, guard)  # res.best (a property) now counts the guard's verdicts
            results[f"{name}_guard_{s_}px"] = guard.to_dict()
        results[name] = res.to_dict()
        for b in (1, 8):
            base = res["eager fp32"].p50_ms(b)
            for label, variant, what in ROWS:
                try:
                    c = res[variant]
                except KeyError:
                    continue
                if c.status == "skipped" and label not in ("torch.compile", "ONNX Runtime INT8 dynamic"):
                    rows.append(_row(f"{name} b{b}: {label}", None, None, None, None, f"skipped: {c.reason}"))
                if c.status == "skipped" or not c.latency_ms:
                    if c.status == "failed":
                        rows.append(_row(f"{name} b{b}: {label}", None, None, None, None, f"failed: {c.reason}"))
                    continue
                lat = c.latency_ms[b]
                status = "" if c.passed else f" [{c.status}: {c.reason}]"
                rows.append(_row(f"{name} b{b}: {label}", lat, base / lat["p50_ms"], c.metric_drop, c.rel_l2_error,
                                 what + status))
            best = res.fastest_at(b)
            if best is not None:
                rows.append(_row(f"{name} b{b}: torchspeed best", best.latency_ms[b], base / best.p50_ms(b),
                                 best.metric_drop, best.rel_l2_error, f"= {best.name}"))
                rows[-1]["headline"] = (name, b) == ("resnet18", 8)  # the headline figure: ResNet-18 at batch 8
            if b == 1 and best is not None:
                any_fast = res.fastest_at(1, passed_only=False)
                notes.append(f"{name} batch 1: chosen {best.name} p50 {best.p50_ms(1):.2f} ms; fastest of all "
                             f"{any_fast.name} {any_fast.p50_ms(1):.2f} ms "
                             f"({(best.p50_ms(1) / any_fast.p50_ms(1) - 1) * 100:+.0f}%)")
    r18 = results["resnet18"]
    cands = {c["name"]: c for c in r18["candidates"]}
    eager8 = cands["eager fp32"]["latency_ms"]["8"]["p50_ms"]
    passed8 = [c for c in r18["candidates"] if c["status"] == "ok" and "8" in c["latency_ms"]]
    best8 = min(passed8, key=lambda c: c["latency_ms"]["8"]["p50_ms"])
    return {
        "eager_fp32_ms": eager8,
        "best_ms": best8["latency_ms"]["8"]["p50_ms"],
        "best_variant": best8["name"],
        "ratio": eager8 / best8["latency_ms"]["8"]["p50_ms"],
        "metric_drop": best8["metric_drop"],
        "accuracy_fp32": demo.accuracy,
        "models": results,
        "rows": rows,
        "notes": notes,
    }


def _merge_guard(res: Any, guard: Any) -> None:
    """A variant passes only if it passed at both sizes; the metric comes from the guard run."""
    for c in res.table:
        try:
            g = guard[c.name]
        except KeyError:
            continue
        c.metric, c.metric_drop = g.metric, g.metric_drop
        if c.passed and g.status in ("rejected", "failed"):
            c.status, c.reason = g.status, f"at {g.input_shape[-1]}px: {g.reason}"


def _row(technique: str, lat: dict[str, float] | None, ratio: float | None, drop: float | None,
         err: float | None, what: str) -> dict[str, Any]:
    nan = math.nan
    return {
        "technique": technique,
        "median": lat["p50_ms"] if lat else nan, "min": lat["min_ms"] if lat else nan,
        "max": lat["max_ms"] if lat else nan, "p90": lat["p90_ms"] if lat else nan, "unit": "ms",
        "ratio": ratio, "cumulative": None, "metric_drop": drop, "output_error": err, "what": what,
    }
