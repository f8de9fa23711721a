"""This machine's ceilings: the best throughput its cores reach on the work each suite does, so each
row can say how close it comes ("% of ceiling") instead of only how much faster than plain PyTorch.

Measured (all cores, the torch thread count the suites use):
- `fp32`, `bf16`: dense GEMM GFLOP/s, the fastest of torch.mm, a 1x1 channels_last convolution (oneDNN)
  and, for fp32, ONNX Runtime's MatMul (square sizes grown until a call lasts long enough, up to 2048);
- `int8`: GOP/s of an int8 GEMM through the fastest route found here (`INT8_ROUTES`; every route kept);
- `mem_bw`: GB/s of a large tensor copy (bytes read + written);
- `decode_per_core` / `decode`: JPEG decodes per second of photos at the store's size by the fastest
  CPU decoder on one thread, and that times the cores (a data loader's decode-only ceiling);
- on a GPU also GEMM per precision, device memory and pinned host-to-device GB/s and nvjpeg batch
  decodes (`gpu_ceilings`). A row measured on a GPU is judged against these (`GPU_CEILING`), never
  against the CPU's: one without a GPU ceiling says so.

A ceiling is an upper bound, so a new measurement keeps the best of it and the cached one, cached per
machine description (CPU, cores, ISA, GPUs, torch). Only a quiet measurement becomes the machine's
ceiling: one taken while other processes held the cores (`measure.OthersLoad`) reads low and is never
cached. It judges the report it was measured for only when no quiet ceiling exists, marked busy there
(`busy_cores`: "busy ceiling" beside every share, no goal judged "met" against it), and the next run
measures again. Every timing goes through `torchspeed.measure`; this module imports torch only where
it measures, so the orchestrator can read and judge ceilings before torch is loaded.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from torchspeed.bench.rows import Row
from torchspeed.measure import busy_warning

TITLE = "Ceilings: what this machine's cores reach at best"
VERSION = 2             # 2: cached only when measured quiet (a version-1 cache may hold a busy reading)
SHORT_SIDE = 160        # the stores' image size (bench data and train suites)
DECODE_SAMPLES = 128
# which ceiling a row's precision is judged against
PRECISION_CEILING = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16", "int8": "int8"}
# a row measured on a GPU: the GPU ceiling in place of the CPU one it names (fp32 math may use TF32's
# tensor cores, its fastest route; fp16 rows name bf16, the same tensor-core rate)
GPU_CEILING = {"fp32": "gpu_tf32", "bf16": "gpu_bf16", "fp16": "gpu_fp16", "int8": "gpu_int8", "decode": "nvjpeg",
               "mem_bw": "gpu_mem_bw"}
NO_GPU_CEILING = "no GPU ceiling measured"


def cache_path(machine: dict[str, Any]) -> str:
    from torchspeed.runtime import cache_dir, machine_key

    return os.path.join(cache_dir("ceilings"), f"{machine_key(machine)}.json")


def load_cached(machine: dict[str, Any]) -> dict[str, Any] | None:
    """The cached ceilings of this machine, or None (none cached, another version, another machine, damaged,
    measured busy: never written so, or a GPU cache without a ceiling the rows are judged against; then
    measured again)."""
    from torchspeed.runtime import machine_key

    path = cache_path(machine)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("items"), dict) \
            or machine_key(data.get("machine") or {}) != machine_key(machine) or data.get("busy_cores") is not None:
        return None
    if "gpu_tf32" in data["items"] and not set(GPU_CEILING.values()) <= data["items"].keys():
        return None  # written before a GPU ceiling it now judges against (gpu_int8) was measured: measured again
    return data


def save(ceilings: dict[str, Any]) -> str:
    from torchspeed.atomic import write_json

    path = cache_path(ceilings["machine"])
    write_json(path, ceilings)
    return path


def merge(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """`new` with each ceiling raised to the cached one where that was higher (a ceiling is the best seen)."""
    if not old:
        return new
    items = dict(new["items"])
    for name, item in old.get("items", {}).items():
        cur = items.get(name)
        if cur is None or (isinstance(item.get("value"), (int, float)) and item["value"] > (cur.get("value") or 0)):
            items[name] = dict(item, kept_from=item.get("kept_from") or old.get("measured_at"))
    return dict(new, items=items)


# ---------------------------------------------------------------- measuring

def _timed(fn: Callable[[], Any], budget_s: float) -> float:
    """Seconds per call of `fn` in its fastest repeat (repeats fitted into about `budget_s`, one warm-up call):
    a ceiling is what the machine reaches at best, and other work on the cores only slows repeats down."""
    from torchspeed.measure import time_callable

    first = time_callable(fn, name="probe", warmup=1, repeats=1).median_s
    repeats = int(max(3, min(15, budget_s / max(first, 1e-6))))
    return time_callable(fn, name="ceiling", warmup=0, repeats=repeats, min_time_s=0.05).min_s


def _grow(make: Callable[[int], Callable[[], Any]], start: int = 256, stop: int = 2048,
          min_call_s: float = 0.1) -> tuple[int, Callable[[], Any]]:
    """The smallest square size (doubling from `start`) whose call lasts `min_call_s`: slow (emulated)
    routes stay cheap to measure, fast ones get a size large enough to reach their peak."""
    from torchspeed.measure import time_callable

    n = start
    while True:
        fn = make(n)
        if time_callable(fn, name=f"size {n}", warmup=1, repeats=1).median_s >= min_call_s or n >= stop:
            return n, fn
        n *= 2


def _ort_cpu(node: Any, a: Any, y_type: int, consts: list[Any]) -> Callable[[], Any]:
    """A one-node graph (`node` on the array `a`, input "a", and the initializers `consts`) in an ONNX Runtime
    CPU session on every usable core, called on `a`."""
    import onnxruntime as ort
    from onnx import helper

    from torchspeed.runtime import usable_cores

    value = helper.make_tensor_value_info
    graph = helper.make_graph([node], "gemm", [value("a", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))],
                              [value("y", y_type, list(a.shape))], consts)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = usable_cores()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, {"a": a})


def _fp32_onnxruntime(n: int) -> Callable[[], Any]:
    """ONNX Runtime's MatMul with constant weights (its MLAS kernels, which its fp32 convolutions use too)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), "w")
    return _ort_cpu(helper.make_node("MatMul", ["a", "w"], ["y"]), rng.standard_normal((n, n), dtype=np.float32),
                    TensorProto.FLOAT, [w])


def _torch_mm(dtype_name: str) -> Callable[[int], Callable[[], Any]]:
    def make(n: int) -> Callable[[], Any]:
        import torch

        from torchspeed.runtime import precision_dtype

        dtype = precision_dtype(dtype_name)
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        return lambda: torch.mm(a, b)
    return make


def _torch_conv1x1(dtype_name: str) -> Callable[[int], Callable[[], Any]]:
    """An n x n x n GEMM as a 1x1 convolution in channels_last: oneDNN's convolution kernels, which torch's
    CPU convolutions use (on some CPUs well above what torch.mm's BLAS reaches)."""
    def make(n: int) -> Callable[[], Any]:
        import torch

        from torchspeed.runtime import precision_dtype

        dtype = precision_dtype(dtype_name)
        hw = max(1, n // 32)
        x = torch.randn(1, n, 32, hw).to(dtype).contiguous(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(n, n, 1, bias=False).to(dtype).to(memory_format=torch.channels_last).eval()

        def run() -> Any:
            with torch.no_grad():
                return conv(x)
        return run
    return make


def _fastest_route(routes: dict[str, Callable[[int], Callable[[], Any]]], budget_s: float, unit: str,
                   label: str) -> dict[str, Any]:
    """The fastest of several routes to the same GEMM; every route's figure (or why it failed) in `routes`."""
    out: dict[str, Any] = {}
    for name, make in routes.items():
        try:
            n, fn = _grow(make)
            out[name] = {"value": 2 * n**3 / _timed(fn, budget_s / len(routes)) / 1e9, "size": n}
        except Exception as e:  # noqa: BLE001 - a route missing here is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    ok = {k: v for k, v in out.items() if "value" in v}
    if not ok:
        return {"value": None, "unit": unit, "routes": out, "what": f"no {label} GEMM route worked here"}
    best = max(ok, key=lambda k: ok[k]["value"])
    return {"value": ok[best]["value"], "unit": unit, "route": best, "routes": out,
            "what": f"{label} GEMM {ok[best]['size']}^2 through {best} (fastest of {len(ok)} routes)"}


def gemm_gflops(dtype_name: str, budget_s: float = 1.5) -> dict[str, Any]:
    routes = {"torch.mm": _torch_mm(dtype_name), "oneDNN 1x1 convolution (NHWC)": _torch_conv1x1(dtype_name)}
    if dtype_name == "fp32":
        routes["onnxruntime MatMul"] = _fp32_onnxruntime
    return _fastest_route(routes, budget_s, "GFLOP/s", dtype_name)


def _int8_torch(n: int) -> Callable[[], Any]:
    import torch

    a = torch.randint(-128, 127, (n, n), dtype=torch.int8)
    b = torch.randint(-128, 127, (n, n), dtype=torch.int8)
    return lambda: torch._int_mm(a, b)


def _int8_onnxruntime(n: int) -> Callable[[], Any]:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).integers(-128, 127, (n, n), dtype=np.int8)
    return _ort_cpu(helper.make_node("MatMulInteger", ["a", "w"], ["y"]),
                    np.random.default_rng(1).integers(0, 255, (n, n), dtype=np.uint8), TensorProto.INT32,
                    [numpy_helper.from_array(w, "w")])


def _int8_onnxruntime_qlinear(n: int) -> Callable[[], Any]:
    """QLinearMatMul (uint8 x int8 -> uint8, constant weights): the kernel ORT runs for quantized models."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(rng.integers(-128, 127, (n, n), dtype=np.int8), "w")] + [
        numpy_helper.from_array(np.array(v, dtype=dt), name) for name, v, dt in (
            ("a_scale", 0.01, np.float32), ("a_zero", 128, np.uint8), ("w_scale", 0.01, np.float32),
            ("w_zero", 0, np.int8), ("y_scale", 1.0, np.float32), ("y_zero", 128, np.uint8))]
    node = helper.make_node("QLinearMatMul", ["a", "a_scale", "a_zero", "w", "w_scale", "w_zero", "y_scale", "y_zero"],
                            ["y"])
    return _ort_cpu(node, rng.integers(0, 255, (n, n), dtype=np.uint8), TensorProto.UINT8, consts)


def _int8_openvino(n: int, conv: bool = False) -> Callable[[], Any]:
    """A MatMul (or, `conv`, a 1x1 convolution, the kernel quantized CNNs run) between FakeQuantize'd
    operands: OpenVINO's low-precision pass runs it as an int8 GEMM."""
    import numpy as np

    from torchspeed.optional import optional
    from torchspeed.runtime import usable_cores

    ov = optional("openvino", "openvino", "the OpenVINO int8 ceiling")  # no telemetry sent
    ops = optional("openvino.opset13", "openvino", "the OpenVINO int8 ceiling")

    rng = np.random.default_rng(0)
    shape = [1, n, 32, max(1, n // 32)] if conv else [n, n]
    x = ops.parameter(shape, np.float32, name="x")

    def fq(node: Any, lo: float, hi: float, levels: int) -> Any:
        c = lambda v: ops.constant(np.array(v, dtype=np.float32))  # noqa: E731
        return ops.fake_quantize(node, c(lo), c(hi), c(lo), c(hi), levels)

    w = ops.constant(rng.uniform(-1, 1, (n, n, 1, 1) if conv else (n, n)).astype(np.float32))
    xq, wq = fq(x, 0.0, 2.55, 256), fq(w, -1.27, 1.27, 255)
    y = ops.convolution(xq, wq, [1, 1], [0, 0], [0, 0], [1, 1]) if conv else ops.matmul(xq, wq, False, True)
    model = ov.Model([y], [x], "int8_gemm")
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": usable_cores(),
                                                      "PERFORMANCE_HINT": "LATENCY"})
    req = compiled.create_infer_request()
    a = rng.uniform(0, 2.55, shape).astype(np.float32)
    return lambda: req.infer({0: a})


INT8_ROUTES = {"torch._int_mm": _int8_torch, "onnxruntime MatMulInteger": _int8_onnxruntime,
               "onnxruntime QLinearMatMul": _int8_onnxruntime_qlinear, "openvino FakeQuantize MatMul": _int8_openvino,
               "openvino FakeQuantize 1x1 convolution": lambda n: _int8_openvino(n, conv=True)}


def int8_gops(budget_s: float = 3.0) -> dict[str, Any]:
    """The fastest int8 GEMM route here; every route's GOP/s (or why it failed) in `routes`."""
    return _fastest_route(INT8_ROUTES, budget_s, "GOP/s", "int8")


def memory_bandwidth(budget_s: float = 1.0, mib: int = 256) -> dict[str, Any]:
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    s = _timed(lambda: dst.copy_(src), budget_s)
    return {"value": 2 * src.numel() * 4 / s / 1e9, "unit": "GB/s", "route": "tensor copy",
            "what": f"copy of {mib} MiB (read + write), {torch.get_num_threads()} threads"}


def decode_samples(n: int = DECODE_SAMPLES, short_side: int = SHORT_SIDE) -> list[bytes]:
    """JPEG bytes of the first `n` demo photos resized to `short_side` (q90): the stores' images."""
    import io

    from PIL import Image

    from torchspeed.data.demo import demo_folder
    from torchspeed.data.packer import load_image_file
    from torchspeed.images import scan_folder

    _, samples = scan_folder(demo_folder(4000))
    out = []
    for path, _ in sorted(samples, key=lambda s: os.path.basename(s[0]))[:n]:
        buf = io.BytesIO()
        Image.fromarray(load_image_file(path, short_side)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode_rate(samples: list[bytes], budget_s: float = 2.0) -> dict[str, Any]:
    """Full decodes per second on one thread by the fastest CPU decoder; `decode` = that x the cores."""
    from torchspeed.data.decode import jpeg_size
    from torchspeed.data.decoder_choice import measure_decoders
    from torchspeed.runtime import usable_cores

    table = measure_decoders(samples, repeats=max(3, int(budget_s)))
    rows = [r for r in table if isinstance(r.get("us_per_image"), (int, float)) and r["us_per_image"] > 0]
    best = min(rows, key=lambda r: r["us_per_image"])
    per_core = 1e6 / best["us_per_image"]
    h, w = jpeg_size(samples[0])
    return {"value": per_core, "unit": "img/s", "route": best["decoder"],
            "what": f"JPEG {w}x{h} q90 full decode, {best['decoder']} (fastest of {len(rows)}), one thread",
            "cores": usable_cores(), "decoders": {r["decoder"]: 1e6 / r["us_per_image"] for r in rows}}


def gpu_ceilings() -> dict[str, dict[str, Any]]:
    """GEMM per precision (fp32 IEEE, TF32, fp16, bf16; int8 through torch._int_mm, int32 accumulation),
    device memory bandwidth, pinned host-to-device copy and nvjpeg batch decode on the current CUDA device,
    each timed synchronised on the device. One that fails here is "not measured", the others stand."""
    import torch

    from torchspeed.measure import time_callable

    out: dict[str, dict[str, Any]] = {}
    dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(dev)
    saved = torch.get_float32_matmul_precision()
    try:
        for name, dtype, precision in (("gpu_fp32", torch.float32, "highest"), ("gpu_tf32", torch.float32, "high"),
                                       ("gpu_fp16", torch.float16, None), ("gpu_bf16", torch.bfloat16, None)):
            if precision:
                torch.set_float32_matmul_precision(precision)
            n = 8192
            a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
            t = time_callable(lambda: torch.mm(a, b), warmup=3, repeats=10, device=dev)
            out[name] = {"value": 2 * n**3 / t.median_s / 1e9, "unit": "GFLOP/s", "route": "torch.mm",
                         "what": f"torch.mm {name[4:]} {n}^2 on {gpu}"}
    finally:
        torch.set_float32_matmul_precision(saved)
    try:
        n = 8192  # _int_mm: int8 operands on the tensor cores, sizes multiples of 8
        a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=dev)
        b = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=dev)
        t = time_callable(lambda: torch._int_mm(a, b), warmup=3, repeats=10, device=dev)
        out["gpu_int8"] = {"value": 2 * n**3 / t.median_s / 1e9, "unit": "GOP/s", "route": "torch._int_mm",
                           "what": f"torch._int_mm int8 {n}^2 (int32 accumulation) on {gpu}"}
    except Exception as e:  # noqa: BLE001 - a torch build without the int8 GEMM on this GPU
        out["gpu_int8"] = {"value": None, "unit": "GOP/s", "what": f"not measured: {type(e).__name__}: {e}"}
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_callable(lambda: dst.copy_(src), warmup=3, repeats=10, device=dev)
    out["gpu_mem_bw"] = {"value": 2 * src.numel() / t.median_s / 1e9, "unit": "GB/s", "route": "copy",
                         "what": f"512 MiB device-to-device copy on {gpu} (bytes read + written)"}
    host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    t = time_callable(lambda: host.to(dev, non_blocking=True), warmup=2, repeats=10, device=dev)
    out["h2d"] = {"value": host.numel() / t.median_s / 1e9, "unit": "GB/s", "route": "pinned copy",
                  "what": "256 MiB pinned host-to-device copy"}
    try:
        from torchspeed.data.decode import decode_jpeg_batch_cuda

        samples = decode_samples(64)
        t = time_callable(lambda: decode_jpeg_batch_cuda(samples, dev, fallback=None), warmup=2, repeats=10,
                          device=dev)
        out["nvjpeg"] = {"value": len(samples) / t.median_s, "unit": "img/s", "route": "nvjpeg",
                         "what": f"batched nvjpeg decode of {len(samples)} photos at short side {SHORT_SIDE}"}
    except Exception as e:  # noqa: BLE001
        out["nvjpeg"] = {"value": None, "unit": "img/s", "what": f"nvjpeg not measured: {e}"}
    return out


def measure(progress: Callable[[str], Any] | None = None, budget_s: float = 12.0) -> dict[str, Any]:
    """Measure every ceiling now (about `budget_s` seconds on a CPU, plus building the decode samples), with
    the cores other processes used meanwhile (`others_cores`)."""
    import torch

    from torchspeed.measure import OthersLoad
    from torchspeed.runtime import describe, usable_cores

    others_load = OthersLoad()
    say = progress or (lambda s: None)
    torch.set_num_threads(usable_cores())
    items: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for name, fn in (("fp32", lambda: gemm_gflops("fp32", budget_s * 0.15)),
                     ("bf16", lambda: gemm_gflops("bf16", budget_s * 0.1)),
                     ("int8", lambda: int8_gops(budget_s * 0.3)),
                     ("mem_bw", lambda: memory_bandwidth(budget_s * 0.1))):
        say(f"ceiling: {name}")
        try:
            items[name] = fn()
        except Exception as e:  # noqa: BLE001 - one ceiling missing must not lose the others
            items[name] = {"value": None, "what": f"not measured: {type(e).__name__}: {e}"}
    say("ceiling: JPEG decode per core")
    try:
        dec = decode_rate(decode_samples(), budget_s * 0.2)
        items["decode_per_core"] = dec
        items["decode"] = {"value": dec["value"] * dec["cores"], "unit": "img/s", "route": dec["route"],
                           "what": f"decode-only ceiling: {dec['value']:,.0f} img/s per core x {dec['cores']} cores"}
    except Exception as e:  # noqa: BLE001
        items["decode"] = {"value": None, "what": f"not measured: {type(e).__name__}: {e}"}
    if torch.cuda.is_available():
        say("ceiling: GPU")
        items.update(gpu_ceilings())
    f, b = items.get("fp32", {}).get("value"), items.get("bf16", {}).get("value")
    if f and b and b < f:  # bf16 slower than fp32: emulated, say so
        items["bf16"]["emulated"] = True
        items["bf16"]["what"] += f" (emulated: {b / f:.3g}x fp32)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    others = others_load.cores()
    return {"version": VERSION, "machine": describe(), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_avg_1min": load, "others_cores": round(others, 2) if others is not None else None,
            "seconds": round(time.perf_counter() - t0, 1), "items": items}


def get(refresh: bool = False, progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """This machine's ceilings: the cached ones, or measured now when `refresh` or none is cached. A quiet
    measurement is kept (the best of it and the cache); a busy one (`busy_warning` of the cores other
    processes used meanwhile) never is: the cached ceilings stand if there are any, else it serves this
    report alone, marked with `busy_cores`, and the next run measures again."""
    from torchspeed.runtime import describe

    machine = describe()
    cached = load_cached(machine)
    if cached is not None and not refresh:
        return dict(cached, source="cache")
    new = measure(progress)
    others = new.get("others_cores")
    if busy_warning(others):
        if cached is not None:
            return dict(cached, source="cache", not_kept={
                "measured_at": new.get("measured_at"), "others_cores": others,
                "why": f"measured again while other processes used {others:.1f} cores: not kept, the cached "
                       "quiet ceilings judge this report"})
        return dict(new, source="measured", busy_cores=others)
    result = merge(new, cached)
    save(result)
    return dict(result, source="measured")


def busy_cores(ceilings: dict[str, Any] | None) -> float | None:
    """The cores other processes used while the ceilings judging a report were measured, when that made them
    a busy reading (never cached, see `get`); None for quiet or cached ceilings."""
    value = (ceilings or {}).get("busy_cores")
    return float(value) if isinstance(value, (int, float)) else None


def run(quick: bool, progress: Callable[[str], Any] | bool = False) -> dict[str, Any]:
    """The orchestrator's entry point (it runs this in its own process, like a suite): the quick report reads
    the cache, the full report measures again."""
    from torchspeed.args import progress_fn

    return get(refresh=not quick, progress=progress_fn(progress))


# ---------------------------------------------------------------- rows against their ceiling

def achieved(row: Row) -> float | None:
    """What a row achieves in its ceiling's unit: G(FL)OP/s when it counts work per item, else items/s
    (its median for a "<unit>/s" row, batch / latency for an "ms" row)."""
    m, unit = row.median, str(row.unit)
    if not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
        return None
    if unit.endswith("/s"):
        rate = float(m)
    elif unit == "ms" and isinstance(row.batch, (int, float)):
        rate = row.batch * 1e3 / m
    else:
        return None
    per_item = row.flops_per_item
    return rate * per_item / 1e9 if isinstance(per_item, (int, float)) else rate


def pct_of_ceiling(row: Row, ceilings: dict[str, Any] | None) -> float | None:
    """100 x achieved / the ceiling the row names (None when either is unknown)."""
    item = ((ceilings or {}).get("items") or {}).get(row.ceiling or "")
    value = achieved(row)
    if not item or not isinstance(item.get("value"), (int, float)) or item["value"] <= 0 or value is None:
        return None
    return 100.0 * value / item["value"]


def suite_device(result: dict[str, Any]) -> str:
    """The device a suite's rows ran on: its `device`, or the one `accelerate` reported; "cpu" when unsaid."""
    accelerate = result.get("accelerate")
    device = result.get("device") or (accelerate.get("device") if isinstance(accelerate, dict) else None)
    return str(device or "cpu")


def gpu_ceiling(ceiling: str) -> str:
    """The GPU ceiling a row measured on a GPU is judged against, in place of the CPU `ceiling` it names
    ("gpu_<name>" where the GPU has none, which is never measured: the row then says so)."""
    return ceiling if ceiling in GPU_CEILING.values() else GPU_CEILING.get(ceiling, f"gpu_{ceiling}")


def annotate(results: dict[str, Any], ceilings: dict[str, Any] | None) -> None:
    """Give every row (in the suites' JSON) that names a ceiling its `achieved` and `pct_of_ceiling`, in place.

    Rows of a suite that ran on a GPU (`suite_device`; a row's own `device` wins) are judged against the
    GPU ceilings: a GPU step against the CPU's GEMM would read far above 100%."""
    for name, result in results.items():
        if not isinstance(result, dict) or name == "ceilings":
            continue
        device = suite_device(result)
        for d in result.get("rows", []) or []:
            if isinstance(d, dict) and d.get("ceiling"):
                if str(d.get("device") or device).startswith("cuda"):
                    d["ceiling"] = gpu_ceiling(d["ceiling"])
                row = Row.from_dict(d)
                d["achieved"] = achieved(row)
                d["pct_of_ceiling"] = pct_of_ceiling(row, ceilings)


ABOVE_CEILING_NOTE = ("* above 100%: a ceiling is the fastest route timed on its reference kernel, not a hard limit, "
                      "or it was timed at a busier moment (`--refresh-ceilings` on a quiet machine)")
BUSY_MARK = ", busy ceiling"  # beside a share judged against a ceiling measured on a busy machine


def ceiling_unit(ceiling: str | None) -> str:
    """The unit a ceiling is measured in."""
    return {"decode": "img/s", "nvjpeg": "img/s", "int8": "GOP/s", "gpu_int8": "GOP/s", "mem_bw": "GB/s",
            "gpu_mem_bw": "GB/s", "h2d": "GB/s"}.get(ceiling or "", "GFLOP/s")


def ceiling_cell(row: Row, busy: bool = False) -> str:
    """A row against the ceiling of its own precision, achieved first: "bf16: 133 of 215 GFLOP/s (62%)",
    starred above 100% (the table carries `ABOVE_CEILING_NOTE` once), "busy ceiling" beside the share when
    the ceiling was a busy reading (`busy_cores`); "" for a row without one."""
    from torchspeed.tables import format_number

    p, got = row.pct_of_ceiling, row.achieved
    if not isinstance(p, (int, float)) or not isinstance(got, (int, float)) or p <= 0:
        return f"{row.ceiling}: {NO_GPU_CEILING}" if str(row.ceiling or "").startswith("gpu_") else ""
    star = "*" if p > 100 else ""
    return (f"{row.ceiling}: {format_number(got)} of {format_number(100 * got / p)} {ceiling_unit(row.ceiling)} "
            f"({p:.0f}%{star}{BUSY_MARK if busy else ''})")


def ceiling_rows(ceilings: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(ceiling, value, route, what) for the report's table."""
    from torchspeed.tables import format_number

    out = []
    for name, item in (ceilings.get("items") or {}).items():
        v = item.get("value")
        out.append((name, f"{format_number(v)} {item.get('unit', '')}".strip() if v is not None else "not measured",
                    item.get("route", ""), item.get("what", "")))
    return out
