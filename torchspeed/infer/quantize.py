"""INT8 post-training quantization, through two runtimes' own tool chains.

- ONNX Runtime `quantize_static`: QDQ format, per-channel int8 weights, uint8 activations (the
  U8S8 form that x86 VNNI kernels run), after `quant_pre_process` (shape inference + graph
  optimisation, which folds patterns the quantizer would otherwise split). Calibration method is
  selectable: min-max, entropy or percentile.
- OpenVINO NNCF `nncf.quantize`: statistics over the calibration set, fast bias correction; NNCF
  chooses its own range estimators (min-max style), so only 'minmax' is accepted there.
- ONNX Runtime `quantize_dynamic`: int8 weights, activations quantized on the fly, for Linear /
  LSTM-heavy models (transformers) and when no calibration data is at hand. Only MatMul/Gemm/LSTM/
  Attention are quantized: dynamic ConvInteger kernels are slow on CPU.

Calibration data is an iterable of input batches (tensors) or of (input, label) pairs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from torchspeed.batches import BatchFormat, batch_size, map_tensors
from torchspeed.infer.runners import feed_names
from torchspeed.optional import optional

__all__ = ["calibration_arrays", "quantize_onnx_static", "quantize_onnx_dynamic", "quantize_openvino",
           "quiet_quantizer_logs", "CALIBRATION_METHODS"]

CALIBRATION_METHODS = ("minmax", "entropy", "percentile")


def calibration_arrays(calib_data: Iterable[Any] | None, max_samples: int | None = None,
                       batch_format: Any = None) -> list[Any]:
    """Calibration inputs as numpy arrays (labels dropped), up to `max_samples` samples in all.

    Each item of `calib_data` is an input batch (a tensor or array) or a batch that `batch_format`
    (a `torchspeed.batches.BatchFormat`; auto: `(input, label)` pairs, dict batches) splits into
    inputs and label. A model with several or named inputs gives a dict (or tuple) of arrays per batch;
    floating inputs become float32, ids and masks keep their integer type."""
    if calib_data is None:
        raise ValueError("INT8 quantization needs calibration data: pass calib_data= (an iterable of input "
                         "batches or (input, label) pairs, a few hundred representative samples)")
    fmt = BatchFormat.of(batch_format)
    out: list[Any] = []
    n = 0
    for item in calib_data:
        x = item if isinstance(item, (torch.Tensor, np.ndarray)) else fmt.split(item)[0]
        x = map_tensors(_array, tuple(x) if isinstance(x, list) else x, leaf=object)  # a list: positional inputs
        size = batch_size(map_tensors(torch.as_tensor, x, leaf=np.ndarray))
        if max_samples is not None and n + size > max_samples:
            size = max_samples - n
            x = map_tensors(lambda a, k=size: a[:k], x, leaf=np.ndarray)
        if size:
            out.append(x)
            n += size
        if max_samples is not None and n >= max_samples:
            break
    if not out:
        raise ValueError("the calibration data is empty: pass at least one batch of representative inputs")
    return out


def _array(x: Any) -> np.ndarray:
    """One input as a contiguous numpy array, floating ones as float32."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        x = (x.float() if x.is_floating_point() else x).numpy()
    a = np.asarray(x)
    return np.ascontiguousarray(a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a)


log = logging.getLogger(__name__)


class _DropThirdPartyNotices(logging.Filter):
    """Drops records below ERROR that code under `package` logged straight on the root logger."""

    def __init__(self, package: str):
        super().__init__()
        self.marker = os.sep + package + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or self.marker not in record.pathname


@contextlib.contextmanager
def quiet_quantizer_logs() -> Iterator[None]:
    """Keep the quantizers' notices out of the user's console while they run, and change nothing for good.

    ONNX Runtime's quantizer logs per-tensor notices (e.g. per-channel axis on LayerNorm weights,
    which it then quantizes per-tensor) with `logging.warning(...)`, on the root logger: a filter on
    the root logger drops those records below ERROR (nobody else's) for the duration, and the root
    logger's level is left alone. `logging.warning` would also install a console handler on the root
    logger for good (`basicConfig`) when it has none: a NullHandler stands in meanwhile. NNCF's own
    logger is set to ERROR meanwhile. Every level, filter and handler is restored on exit.
    """
    root = logging.getLogger()
    nncf_logger = logging.getLogger("nncf")
    nncf_level = nncf_logger.level
    drop = _DropThirdPartyNotices("onnxruntime")
    stand_in = logging.NullHandler() if not root.handlers else None
    root.addFilter(drop)
    if stand_in is not None:
        root.addHandler(stand_in)
    nncf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        nncf_logger.setLevel(nncf_level)
        if stand_in is not None:
            root.removeHandler(stand_in)
        root.removeFilter(drop)


@contextlib.contextmanager
def _temporaries_in(directory: str | None) -> Iterator[None]:
    """Python's temporary files go into `directory` while inside (None: left as they are).

    ONNX Runtime's quantizer makes temporary copies of the model in the system's temp dir, where a run
    killed meanwhile leaves them for ever; `optimize` points them into its own scratch dir, which the
    next run removes once this process is gone."""
    if directory is None:
        yield
        return
    previous = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        yield
    finally:
        tempfile.tempdir = previous


def _ort_quant() -> Any:
    return optional("onnxruntime.quantization", "infer", "ONNX Runtime quantization")


def quantize_onnx_static(onnx_path: str, out_path: str, calib_data: Iterable[Any] | None, method: str = "minmax",
                         per_channel: bool = True, max_samples: int | None = 256, batch_format: Any = None,
                         input_names: list[str] | None = None, temp_dir: str | None = None) -> str:
    """Static INT8 (QDQ) quantization of an ONNX model with ONNX Runtime; returns `out_path`.
    `batch_format` says which part of a calibration batch is the input (see `calibration_arrays`).
    `input_names`: the model's input names when the caller has read them already (else an ONNX
    Runtime session on the model reads them). `temp_dir`: where its and ONNX Runtime's temporary files
    go (default: the system's)."""
    q = _ort_quant()
    methods = {"minmax": q.CalibrationMethod.MinMax, "entropy": q.CalibrationMethod.Entropy,
               "percentile": q.CalibrationMethod.Percentile}
    if method not in methods:
        raise ValueError(f"calibration method must be one of {', '.join(methods)}, got {method!r}")
    arrays = calibration_arrays(calib_data, max_samples, batch_format)
    if input_names is None:
        ort = optional("onnxruntime", "infer", "ONNX Runtime quantization")
        input_names = [i.name for i in ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"]).get_inputs()]

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(arrays)

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self.it, None)
            return None if x is None else feed_names(x, input_names)

        def rewind(self) -> None:
            self.it = iter(arrays)

    with _temporaries_in(temp_dir), tempfile.TemporaryDirectory() as tmp:
        pre = os.path.join(tmp, "pre.onnx")
        q.shape_inference.quant_pre_process(onnx_path, pre, skip_symbolic_shape=False)
        extra = {"ActivationSymmetric": False, "WeightSymmetric": True}
        if method == "percentile":
            extra["CalibPercentile"] = 99.99
        with quiet_quantizer_logs():
            q.quantize_static(pre, out_path, Reader(), quant_format=q.QuantFormat.QDQ, per_channel=per_channel,
                              activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                              calibrate_method=methods[method], extra_options=extra)
    return out_path


def quantize_onnx_dynamic(onnx_path: str, out_path: str, per_channel: bool = True, temp_dir: str | None = None) -> str:
    """Dynamic INT8 quantization (weights int8, activations on the fly) of MatMul/Gemm/LSTM/Attention.
    `temp_dir`: where its and ONNX Runtime's temporary files go (default: the system's)."""
    q = _ort_quant()
    with _temporaries_in(temp_dir), tempfile.TemporaryDirectory() as tmp:
        pre = os.path.join(tmp, "pre.onnx")
        q.shape_inference.quant_pre_process(onnx_path, pre, skip_symbolic_shape=False)
        with quiet_quantizer_logs():
            q.quantize_dynamic(pre, out_path, weight_type=q.QuantType.QInt8, per_channel=per_channel,
                               op_types_to_quantize=["MatMul", "Gemm", "LSTM", "Attention"])
    return out_path


def quantize_openvino(model_path: str, calib_data: Iterable[Any] | None, method: str = "minmax",
                      max_samples: int | None = 256, batch_format: Any = None) -> Any:
    """Static INT8 quantization of an ONNX (or OpenVINO IR) model with NNCF; returns an `openvino.Model`."""
    if method != "minmax":
        raise ValueError(f"NNCF picks its own range estimators; calibration method {method!r} is only "
                         "available through ONNX Runtime (use 'minmax' here)")
    nncf, ov = optional("nncf", "openvino", "OpenVINO INT8"), optional("openvino", "openvino", "OpenVINO INT8")
    arrays = calibration_arrays(calib_data, max_samples, batch_format)
    model = ov.Core().read_model(model_path)
    with quiet_quantizer_logs():
        # subset_size counts Dataset items, i.e. batches
        return nncf.quantize(model, nncf.Dataset(arrays), subset_size=len(arrays), fast_bias_correction=True,
                             preset=nncf.QuantizationPreset.PERFORMANCE)
