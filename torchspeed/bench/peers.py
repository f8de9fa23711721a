"""Peers measured in the same run: what a user would pick instead of torchspeed, set up by hand the way
each project recommends (optional extra `peers`: nvidia-dali-cuda120, litdata).

Data: NVIDIA DALI (its CPU pipeline, `device_id=None`; its GPU pipeline with "mixed" decoding on a GPU)
and LitData (`litdata.optimize` of the photos, then `StreamingDataLoader`), both on torchspeed's
pre-resized photos, yielding the same batches, each at its best thread/worker count (measured). Infer:
OpenVINO with its recommended `PERFORMANCE_HINT: LATENCY` and default precision, and ONNX Runtime
with default session options, on the same ONNX model. A peer whose library is missing is a row with
no figure and a note saying what installs it.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from torchspeed.bench.rows import Row
from torchspeed.optional import optional

INSTALL = {"dali": "pip install nvidia-dali-cuda120 (or: pip install 'torchspeed[peers]')",
           "litdata": "pip install litdata (or: pip install 'torchspeed[peers]')",
           "openvino": "pip install openvino (or: pip install 'torchspeed[openvino]')",
           "onnxruntime": "pip install onnxruntime (or: pip install 'torchspeed[infer]')",
           "webdataset": "pip install webdataset (or: pip install 'torchspeed[peers]')",
           "datasets": "pip install datasets (or: pip install 'torchspeed[peers]')"}


class PeerMissing(ImportError):
    """The peer's library is not installed: its row is skipped with this note."""


def require(name: str, module: str) -> Any:
    """The peer's module, or PeerMissing with how to install it (its row is then skipped with that note)."""
    try:
        return optional(module, INSTALL[name], f"the {name} row")
    except ImportError as e:
        raise PeerMissing(f"{name} not installed: {e}") from None


def skipped_row(technique: str, why: str, unit: str, **columns: Any) -> Row:
    """A peer row without a figure: the report shows why."""
    return Row.skipped(technique, why, unit, peer=True, **columns)


# ---------------------------------------------------------------- data

class DaliLoader:
    """A DALI pipeline as an iterable of (float32 NCHW, int64) batches, one epoch per iteration."""

    def __init__(self, folder: str, batch: int, crop: int, threads: int, mean: Any, std: Any,
                 device: str = "cpu", seed: int = 0):
        require("dali", "nvidia.dali")
        import torch
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        gpu = device != "cpu"

        # on the GPU the caller works on (torch.cuda.set_device), not always GPU 0
        @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device() if gpu else None,
                      seed=seed, prefetch_queue_depth=2)
        def pipe() -> Any:
            jpegs, labels = fn.readers.file(file_root=folder, random_shuffle=True, name="Reader")
            images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
            images = fn.resize(images, resize_x=crop, resize_y=crop)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                              mean=[255 * m for m in mean], std=[255 * s for s in std],
                                              mirror=fn.random.coin_flip())
            return images, labels

        self.pipe = pipe()
        self.pipe.build()
        self.it = DALIGenericIterator(self.pipe, ["x", "y"], reader_name="Reader",
                                      last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
        self.threads = threads

    def __iter__(self) -> Iterator[Any]:
        started = False
        while True:  # next() on DALI's iterator: iter() on it would ask for a reset mid-epoch
            try:
                d = next(self.it)[0]
            except StopIteration:  # the epoch ended (auto_reset starts the next one)
                if started:
                    return
                started = True  # the end of the epoch a previous pass left pending: this epoch starts now
                continue
            started = True
            yield d["x"], d["y"].view(-1).long()


def litdata_dir(folder: str, out: str) -> str:
    """The photos of `folder` (an ImageFolder) written once by `litdata.optimize` (JPEG bytes kept as they are)."""
    ld = require("litdata", "litdata")
    from torchspeed.images import scan_folder

    if os.path.isfile(os.path.join(out, "index.json")):
        return out
    _, samples = scan_folder(folder)
    # litdata writes nothing into a hidden directory (atomic.build_directory's temporaries are hidden), so
    # it writes into a visible one, renamed into place when whole
    tmp = f"{out}-partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    method = multiprocessing.get_start_method()
    try:
        with _output_kept_aside():
            ld.optimize(fn=_litdata_item, inputs=list(samples), output_dir=tmp, chunk_bytes="16MB", num_workers=1)
        os.rename(tmp, out)
    finally:
        multiprocessing.set_start_method(method, force=True)  # optimize() switches the process to spawn
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _output_kept_aside:
    """stdout and stderr of this process and of the workers it starts (file descriptors 1 and 2) written to
    a temporary file: litdata.optimize prints an advert, progress bars and worker chatter into the report's
    console. On an error they are written out after all, since there they may say why."""

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(self.file.fileno(), fd)

    def __exit__(self, kind: Any, *rest: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        if kind is not None:
            self.file.seek(0)
            os.write(2, self.file.read())
        self.file.close()


def _litdata_item(sample: tuple[str, int]) -> dict[str, Any]:
    path, label = sample
    with open(path, "rb") as f:
        return {"jpeg": f.read(), "label": label}


def litdata_loader(directory: str, batch: int, crop: int, num_workers: int, mean: Any, std: Any) -> Any:
    """LitData's StreamingDataLoader over `directory`, decoding and augmenting like the torchvision baseline."""
    ld = require("litdata", "litdata")
    ds = ld.StreamingDataset(directory, shuffle=True, transform=_LitTransform(crop, mean, std))
    return ld.StreamingDataLoader(ds, batch_size=batch, num_workers=num_workers, drop_last=True)


class _LitTransform:
    """PIL decode + the baseline's torchvision transforms, for one LitData item (picklable for workers)."""

    def __init__(self, crop: int, mean: Any, std: Any):
        from torchvision import transforms as T

        self.tf = T.Compose([T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])

    def __call__(self, item: dict[str, Any]) -> Any:
        import io

        from PIL import Image

        return self.tf(Image.open(io.BytesIO(item["jpeg"])).convert("RGB")), int(item["label"])


# ---------------------------------------------------------------- infer

def openvino_latency(onnx_path: str) -> Callable[[Any], Any]:
    """OpenVINO as its documentation recommends for latency: PERFORMANCE_HINT LATENCY, default precision
    and threads (the runtime's own choices, nothing set by hand)."""
    ov = require("openvino", "openvino")
    compiled = ov.Core().compile_model(onnx_path, "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    req = compiled.create_infer_request()

    def run(x: Any) -> Any:
        return req.infer({0: x.numpy() if hasattr(x, "numpy") else x})

    hint = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()  # e.g. "<Type: 'float32'>"
    run.precision = "bf16" if "bf16" in hint or "bfloat16" in hint else "fp16" if "16" in hint else "fp32"  # type: ignore[attr-defined]
    return run


def onnxruntime_defaults(onnx_path: str) -> Callable[[Any], Any]:
    """ONNX Runtime with a default SessionOptions() on the CPU provider."""
    ort = require("onnxruntime", "onnxruntime")
    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name

    def run(x: Any) -> Any:
        return sess.run(None, {name: x.numpy() if hasattr(x, "numpy") else x})

    return run
