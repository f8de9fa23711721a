"""Inference suite: every variant `optimize` builds, timed against eager fp32, with its accuracy cost.

Latency is timed at 224x224, batch 1 and 8, with the same explicit thread count for every runtime.
ResNet-18 is the trained demo model, so its lossy variants (bf16, INT8) are also judged by held-out
top-1 accuracy (the drop must stay <= 0.01). Rows carry the FLOPs per image and the ceiling of their
precision; the runtimes a user would set up by hand (OpenVINO with its LATENCY hint, ONNX Runtime
defaults) are timed interleaved with the chosen variant. The quick report times ResNet-18 only. The
demo model is trained and evaluated at its own small input size and exported models have fixed spatial
sizes, so each variant is built twice: at the demo size, where the accuracy guard judges it, and at
224, where it is timed; a variant passes only if both pass. The full report's MobileNetV3-Small and
timm's vit_tiny_patch16_224 are random initialisations (nothing is downloaded), guarded by output
agreement with fp32. INT8 calibration at 224 uses the demo images upsampled. On a GPU the model is
there: the variants are built and timed on it (runtimes that run on the CPU only step aside) and the
rows are judged against the GPU's ceilings; the hand-set peers, CPU runtimes, are timed on a CPU run only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchspeed.args import progress_fn
from torchspeed.bench.rows import LatencyRow, Row, to_json
from torchspeed.models import ModelSpec

TITLE = "Inference: latency per variant at 224x224 (ms, lower is better), ratio vs eager fp32"
SIZE = 224  # where every variant is timed

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
# rows of a model on a GPU only (on a CPU, fp16 is emulated and these providers do not apply)
GPU_ROWS = (
    ("fp16 + channels_last", "fp16 + channels_last", "fused, fp16 autocast, channels_last"),
    ("ONNX Runtime CUDA fp32", "onnxruntime-cuda fp32", "ONNX Runtime CUDA provider, fp32, IO binding"),
    ("ONNX Runtime CUDA fp16", "onnxruntime-cuda fp16", "ONNX converted to fp16, ONNX Runtime CUDA provider"),
    ("TensorRT fp16", "onnxruntime-tensorrt fp16", "ONNX Runtime TensorRT provider, fp16, engine cache"),
)


MAX_METRIC_DROP = 0.01  # the accuracy guard: top-1 lost vs eager fp32 on the held-out split


def _models(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    """The quick report times the trained ResNet-18 only; the full report adds two more shapes of model."""
    from torchspeed.models import create

    models: list[tuple[str, Any]] = [("resnet18", None)]  # the trained demo model
    if not quick:
        models += [("mobilenet_v3_small", lambda: create("torchvision:mobilenet_v3_small")),
                   ("vit_tiny", lambda: create("timm:vit_tiny_patch16_224"))]
    return models


def flops_per_image(model: Any, size: int = 224) -> float:
    """Inference FLOPs of one image (torch.utils.flop_counter; a multiply-add counts 2)."""
    import torch

    from torchspeed.compress.cost import count_macs

    return 2.0 * count_macs(model, torch.randn(1, 3, size, size))


def _ceiling_of(precision: str) -> str:
    from torchspeed.bench.ceilings import PRECISION_CEILING

    return PRECISION_CEILING.get(precision.split("-")[0].split("+")[0], "fp32")


def _hand_set_peers(name: str, model: Any, res: Any, size: int, flops: float, repeats: int,
                    say: Callable[[str], Any]) -> tuple[list[Row], list[dict[str, Any]]]:
    """The runtimes a user would set up by hand on the same model (OpenVINO with its LATENCY hint and default
    precision, ONNX Runtime defaults), timed interleaved with torchspeed's chosen variant at each batch size.
    Returns (rows, per-batch comparisons)."""
    import os
    import shutil
    import tempfile

    import torch

    from torchspeed.bench import peers
    from torchspeed.infer.export import export_onnx
    from torchspeed.measure import compare

    rows: list[Row] = []
    runners: dict[str, Any] = {}
    what = {"OpenVINO, LATENCY hint": "openvino.compile_model(ONNX, 'CPU', PERFORMANCE_HINT=LATENCY): its own "
                                      "threads and default precision (<precision>)",
            "ONNX Runtime defaults": "onnxruntime.InferenceSession(ONNX) with default SessionOptions, CPU provider"}
    tmp = tempfile.mkdtemp(prefix="torchspeed-bench-peers-")
    comparisons: list[dict[str, Any]] = []
    try:
        path = os.path.join(tmp, "model.onnx")
        say(f"{name}: hand-set runtimes (ONNX export)")
        export_onnx(model, torch.randn(1, 3, size, size), path)
        for label, make in (("OpenVINO, LATENCY hint", peers.openvino_latency),
                            ("ONNX Runtime defaults", peers.onnxruntime_defaults)):
            try:
                runners[label] = make(path)
            except Exception as e:  # noqa: BLE001 - a missing runtime is a row with the reason
                why = str(e) if isinstance(e, peers.PeerMissing) else f"failed here: {type(e).__name__}: {e}"
                for b in (1, 8):
                    rows.append(peers.skipped_row(f"{name} b{b}: peer {label}", why, "ms", batch=b))
        for b in (1, 8):
            best = res.fastest_at(b)
            if best is None or best.runner is None or not runners:
                continue
            x = torch.randn(b, 3, size, size)
            say(f"{name}: chosen {best.name} vs the hand-set runtimes at batch {b} (interleaved)")
            contenders = {f"torchspeed ({best.name})": lambda r=best.runner: r(x)}
            contenders.update({label: (lambda r=r: r(x)) for label, r in runners.items()})
            c = compare(contenders, warmup=2, repeats=repeats, min_time_s=0.05, cooldown_s=0.1)
            chosen_ms = c.timings[0].median_s * 1e3
            hand = {t.name: t.median_s * 1e3 for t in c.timings[1:]}
            fastest = min(hand, key=hand.__getitem__)
            comparisons.append({"batch": b, "chosen": best.name, "chosen_ms": chosen_ms, "hand_ms": hand,
                                "fastest_hand": fastest, "chosen_vs_fastest_hand": chosen_ms / hand[fastest]})
            for t in c.timings[1:]:
                prec = getattr(runners[t.name], "precision", "fp32")
                rows.append(Row.in_ms(f"{name} b{b}: peer {t.name}", t,
                                      what[t.name].replace("<precision>", prec) + f"; {t.median_s * 1e3 / chosen_ms:.2f}x "
                                      f"the chosen variant's time in the same interleaved run ({chosen_ms:.2f} ms)",
                                      peer=True, batch=b, flops_per_item=flops, ceiling=_ceiling_of(prec),
                                      others_cores=c.others_cores))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows, comparisons


def run(quick: bool, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    import torch

    from torchspeed.bench.demo_model import load_demo_model
    from torchspeed.runtime import usable_cores

    say = progress_fn(progress)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    say("loading the demo model (built once, a few minutes, on first use)")
    demo = load_demo_model(progress=say)
    calib_small = list(demo.batches("train", 32, limit=64 if quick else 256))
    calib = [torch.nn.functional.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
             for x, _ in calib_small]
    n_eval = 500 if quick else 1000
    runtimes = (["torch", "onnxruntime", "openvino", "tensorrt"] + ([] if quick else ["torch.compile"])
                + (["onnxruntime-cuda"] if device.type == "cuda" else []))
    rows: list[Row] = []
    results: dict[str, Any] = {}
    notes = [f"{usable_cores()} threads for every runtime; p50 of "
             f"{3 if quick else 7} interleaved repeats",
             f"ResNet-18: trained demo model, held-out top-1 {demo.accuracy:.3f} (fp32) on {n_eval} images; "
             "MobileNetV3-Small / ViT-Tiny: random init, guarded by output agreement (rel. L2 <= 0.1)"]
    if quick:
        notes.append("--quick: torch.compile skipped (about a minute of compiling per model here)")
    if device.type == "cuda":
        notes.append(f"the model on {torch.cuda.get_device_name()}: variants built and timed there; the hand-set "
                     "peers (CPU runtimes) are timed on a CPU run only")
    limits: list[dict[str, Any]] = []
    for name, make in _models(quick):
        say(f"{name}: building and verifying variants")
        model = demo.model if make is None else make()
        flops = flops_per_image(model, SIZE)
        res = _optimized(name, model, demo if make is None else None, calib, calib_small, n_eval, runtimes, quick,
                         say, results, device)
        table = ROWS[:3] + GPU_ROWS + ROWS[3:] if device.type == "cuda" else ROWS
        for b in (1, 8):
            rows += _variant_rows(name, res, b, flops, table)
            best = res.fastest_at(b)
            if b == 1 and best is not None:
                any_fast = res.fastest_at(1, passed_only=False)
                notes.append(f"{name} batch 1: chosen {best.name} p50 {best.p50_ms(1):.2f} ms; fastest of all "
                             f"{any_fast.name} {any_fast.p50_ms(1):.2f} ms "
                             f"({(best.p50_ms(1) / any_fast.p50_ms(1) - 1) * 100:+.0f}%)")
        if device.type == "cpu":
            peer_rows, comparisons = _hand_set_peers(name, model, res, SIZE, flops, 3 if quick else 7, say)
            rows += peer_rows
            results[f"{name}_hand_set"] = comparisons
            limits += [_hand_set_limit(name, cmp_) for cmp_ in comparisons]
        results[f"{name}_flops_per_image"] = flops
    return {**_summary(results, demo.accuracy, rows, notes, limits), "device": str(device)}


def _optimized(name: str, model: Any, demo: Any, calib: list[Any], calib_small: list[Any], n_eval: int,
               runtimes: list[str], quick: bool, say: Callable[[str], Any], results: dict[str, Any],
               device: Any = "cpu") -> Any:
    """`optimize` at 224 (where the variants are timed) and, for the trained demo model (`demo` given),
    again at the size it was trained at, where the accuracy guard judges them; both go into `results`.
    On `device` (a copy of the model there: optimize builds and times the variants on the model's device)."""
    import copy

    import torch

    from torchspeed.infer.search import optimize

    spec = ModelSpec("torchvision", "resnet18", {"num_classes": 10}) if demo is not None else None
    model = copy.deepcopy(model).to(device) if torch.device(device).type != "cpu" else model
    example = torch.randn(1, 3, SIZE, SIZE, device=device)
    res = optimize(model, example, calib_data=calib, max_metric_drop=MAX_METRIC_DROP, runtimes=runtimes,
                   batch_sizes=(1, 8), repeats=3 if quick else 7, spec=spec, refresh=True,  # every variant timed
                   progress=lambda s: say(f"{name} at 224: {s}"))
    if demo is not None:
        s_ = demo.input_size
        guard = optimize(model, torch.randn(1, 3, s_, s_, device=device), calib_data=calib_small,
                         eval_fn=lambda run: demo.evaluate(run, "heldout", 100, limit=n_eval),
                         max_metric_drop=MAX_METRIC_DROP, runtimes=runtimes, batch_sizes=(8,), measure=False, spec=spec,
                         progress=lambda s: say(f"{name} accuracy guard at {s_}px: {s}"))
        _merge_guard(res, guard)  # res.best (a property) now counts the guard's verdicts
        results[f"{name}_guard_{s_}px"] = guard.to_dict()
    results[name] = res.to_dict()
    return res


def _variant_rows(name: str, res: Any, b: int, flops: float, table: tuple = ROWS) -> list[Row]:
    """The table's variants at batch `b` in the order of `table` (ROWS, with GPU_ROWS for a model on a GPU;
    a skipped or failed one says why), then the one torchspeed chooses; the headline is ResNet-18's at
    batch 8."""
    rows: list[Row] = []
    base = res["eager fp32"].p50_ms(b)
    for label, variant, what in table:
        try:
            c = res[variant]
        except KeyError:
            continue
        technique = f"{name} b{b}: {label}"
        if c.status == "skipped" and label not in ("torch.compile", "ONNX Runtime INT8 dynamic"):
            rows.append(LatencyRow.of(technique, None, f"skipped: {c.reason}"))
        if c.status == "skipped" or not c.latency_ms:
            if c.status == "failed":
                rows.append(LatencyRow.of(technique, None, f"failed: {c.reason}"))
            continue
        lat = c.latency_ms[b]
        status = "" if c.passed else f" [{c.status}: {c.reason}]"
        rows.append(LatencyRow.of(technique, lat, what + status, ratio=base / lat["p50_ms"], metric_drop=c.metric_drop,
                                  output_error=c.rel_l2_error, batch=b, flops_per_item=flops,
                                  ceiling=_ceiling_of(c.precision), others_cores=getattr(res, "others_cores", None)))
    best = res.fastest_at(b)
    if best is not None:
        rows.append(LatencyRow.of(f"{name} b{b}: torchspeed best", best.latency_ms[b], f"= {best.name}",
                                  ratio=base / best.p50_ms(b), metric_drop=best.metric_drop,
                                  output_error=best.rel_l2_error, batch=b, flops_per_item=flops,
                                  ceiling=_ceiling_of(best.precision), headline=(name, b) == ("resnet18", 8),
                                  others_cores=getattr(res, "others_cores", None)))
    return rows


def _hand_set_limit(name: str, cmp_: dict[str, Any]) -> dict[str, Any]:
    """The goal: the chosen variant within 5% of the fastest hand-set runtime in the interleaved run."""
    ratio = cmp_["chosen_vs_fastest_hand"]
    return {"goal": f"{name} batch {cmp_['batch']}: the chosen variant within 5% of the fastest hand-set runtime",
            "measured": f"{cmp_['chosen']} {cmp_['chosen_ms']:.2f} ms vs {cmp_['fastest_hand']} "
                        f"{cmp_['hand_ms'][cmp_['fastest_hand']]:.2f} ms ({ratio:.2f}x its time)",
            "met": ratio <= 1.05,
            "why": "" if ratio <= 1.05 else
            "the hand-set runtime was faster in this interleaved run; optimize() timed its variants "
            "in its own run, so a difference within their spreads is noise"}


def _summary(results: dict[str, Any], accuracy: float, rows: list[Row], notes: list[str],
             limits: list[dict[str, Any]]) -> dict[str, Any]:
    """The suite's JSON: ResNet-18's eager fp32 and best passed variant at batch 8 at the top level."""
    r18 = results["resnet18"]
    cands = {c["name"]: c for c in r18["candidates"]}
    eager8 = cands["eager fp32"]["latency_ms"]["8"]["p50_ms"]
    passed8 = [c for c in r18["candidates"] if c["status"] == "ok" and "8" in c["latency_ms"]]
    best8 = min(passed8, key=lambda c: c["latency_ms"]["8"]["p50_ms"])
    best_ms = best8["latency_ms"]["8"]["p50_ms"]
    return {"eager_fp32_ms": eager8, "best_ms": best_ms, "best_variant": best8["name"], "ratio": eager8 / best_ms,
            "metric_drop": best8["metric_drop"], "accuracy_fp32": accuracy, "max_metric_drop": MAX_METRIC_DROP,
            "models": results, "rows": to_json(rows), "notes": notes, "limits": limits}


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

