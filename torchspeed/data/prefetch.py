"""DevicePrefetcher: uint8 batches in, normalised float batches on the device out, one batch ahead.

Why: workers hand over uint8 (a quarter of float32's bytes through shared memory and over PCIe); the
conversion to float, the mean/std normalisation and the channels_last layout happen once per batch
where they are cheapest. On CUDA (Apex's data_prefetcher idea): pinned memory, non_blocking copies and
the conversion on a side stream, so the next batch moves while the current one trains; the main stream
waits on the side stream, and `record_stream` keeps the allocator from reusing memory too early. A batch
already on the GPU (nvjpeg, a GPU augmentation) is not pinned (pin_memory() on it raises); the side
stream waits for the stream that queued it. On the CPU: the same conversion in a background thread
(torch kernels release the GIL), so the next batch is ready when the training step ends.
"""
from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from torchspeed.data.threads import put_unless_stopped
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD
from torchspeed.runtime import helper_work, resolve_device, start_helper_threads

__all__ = ["BufferPool", "DevicePrefetcher", "normalize_batch", "needs_pinning", "device_tensors"]


def _affine(mean: Sequence[float], std: Sequence[float], device: torch.device, uint8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) with x_norm = x * scale + shift: ToTensor's /255 and Normalize fused into one FMA."""
    m = torch.tensor(mean, dtype=torch.float64)
    s = torch.tensor(std, dtype=torch.float64)
    if (s <= 0).any():
        raise ValueError(f"std must be positive, got {tuple(std)}")
    scale = 1.0 / (s * (255.0 if uint8 else 1.0))
    shift = -m / s
    return (scale.float().view(1, -1, 1, 1).to(device), shift.float().view(1, -1, 1, 1).to(device))


def _resolve_layout(images: torch.Tensor, layout: str) -> str:
    if layout != "auto":
        return layout
    return "NHWC" if images.shape[-1] in (1, 3, 4) and images.shape[1] not in (1, 3, 4) else "NCHW"


def _fits(out: torch.Tensor, images: torch.Tensor, layout: str, channels_last: bool, dtype: torch.dtype) -> bool:
    """Whether normalize_batch can write straight into `out` (one pass, no layout change after)."""
    if dtype != torch.float32 or out.dtype != torch.float32 or out.device != images.device:
        return False
    if layout == "NHWC":
        return (channels_last and images.is_contiguous() and out.is_contiguous(memory_format=torch.channels_last)
                and out.permute(0, 2, 3, 1).shape == images.shape)
    return not channels_last and out.is_contiguous() and out.shape == images.shape


def normalize_batch(images: torch.Tensor, mean: Sequence[float] | None, std: Sequence[float] | None,
                    channels_last: bool = True, dtype: torch.dtype | None = None, layout: str = "auto",
                    _affine_cache: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (or float) NHWC/NCHW images -> float NCHW, `(x/255 - mean)/std`, on the images' device.

    uint8 input is scaled by 1/255 first (as ToTensor does); float input is only normalised. The
    result has `dtype` (default float32) and the channels_last memory format if asked (its shape is
    NCHW either way). `out`: a float32 tensor of the result's shape and memory format to write into
    (reusing a buffer spares the page faults of fresh memory); used when the layouts allow it
    (NHWC in, channels_last out; NCHW in, contiguous out; float32), ignored otherwise.
    """
    if images.dim() != 4:
        raise ValueError(f"expected a 4-D image batch, got shape {tuple(images.shape)}")
    layout = _resolve_layout(images, layout)
    dtype = dtype or torch.float32
    uint8 = images.dtype == torch.uint8
    if mean is None or std is None:
        mean, std = None, None
    cache = _affine_cache if _affine_cache is not None else {}
    # Convert in the input's own memory order (one contiguous pass: on a CPU ~5-10x faster than a
    # strided uint8 NHWC -> float NCHW conversion), then change the layout once if asked.
    if out is not None and not _fits(out, images, layout, channels_last, dtype):
        out = None  # layouts that need another pass anyway: allocate as usual
    if layout == "NHWC" and images.is_contiguous():
        n, h, w, c = images.shape
        out = out.permute(0, 2, 3, 1) if out is not None else torch.empty((n, h, w, c), dtype=torch.float32,
                                                                           device=images.device)
        out.copy_(images)
        if mean is not None:
            # per-channel FMA over rows of w*c values (scale tiled w times): a long contiguous
            # broadcast that vectorises, unlike a broadcast over a last dimension of 3
            key = ("rows", images.device, uint8, tuple(mean), tuple(std), w)
            if key not in cache:
                scale, shift = _affine(mean, std, images.device, uint8)
                cache[key] = (scale.view(-1).repeat(w), shift.view(-1).repeat(w))
            scale_row, shift_row = cache[key]
            out.view(n * h, w * c).mul_(scale_row).add_(shift_row)
        elif uint8:
            out.mul_(1.0 / 255)
        out = out.permute(0, 3, 1, 2)  # NCHW shape, channels_last memory
    else:
        x = images.permute(0, 3, 1, 2) if layout == "NHWC" else images
        fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
            else torch.contiguous_format
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device, memory_format=fmt)
        out.copy_(x)
        if mean is not None:
            key = (images.device, uint8, tuple(mean), tuple(std))
            if key not in cache:
                cache[key] = _affine(mean, std, images.device, uint8)
            scale, shift = cache[key]
            out.mul_(scale).add_(shift)
        elif uint8:
            out.mul_(1.0 / 255)
    out = out.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return out if dtype == torch.float32 else out.to(dtype)


def needs_pinning(t: Any) -> bool:
    """Whether a batch element is copied through pinned memory: CPU tensors not pinned yet. A tensor
    already on a GPU is not (pin_memory() on it raises), nor is anything that is not a tensor."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_pinned()


def device_tensors(batch: Any) -> list[torch.Tensor]:
    """The CUDA tensors of a batch (a tensor, or a tuple/list of elements): those whose stream matters."""
    items = batch if isinstance(batch, (tuple, list)) else (batch,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.device.type == "cuda"]


class BufferPool:
    """Float batch buffers, reused once nothing but the pool refers to them.

    Why: a fresh 64 x 3 x 128 x 128 float batch is 3000 new pages, each faulted in on its first write;
    on a VM that is most of the cost of the conversion. The pool keeps only storages and hands out a new
    tensor on one each time, so every holder of a batch (a view, an autograd graph that saved it) counts
    as a reference: a buffer is reused only when nobody else has it, never overwriting a batch in use.
    """

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._storages: list[Any] = []
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it, no reuse
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], channels_last: bool) -> torch.Tensor:
        """A float32 CPU tensor of `shape` (NCHW), channels_last or contiguous, free to overwrite. Threads may
        share a pool: a buffer is handed to one of them only (its tensor made under the lock)."""
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        nbytes = 4 * math.prod(shape)
        with self._lock:
            if self._use_count is not None:
                for storage in self._storages:
                    if storage.nbytes() == nbytes and self._use_count(storage._cdata) == 1:
                        stride = torch.empty(shape, device="meta", memory_format=fmt).stride()
                        return torch.empty(0, dtype=torch.float32).set_(storage, 0, tuple(shape), stride)
            out = torch.empty(tuple(shape), dtype=torch.float32, memory_format=fmt)
            if self._use_count is not None and len(self._storages) < self.capacity:
                self._storages.append(out.untyped_storage())
            return out


class DevicePrefetcher:
    """Wrap a loader of `(images, labels, ...)` batches: yields them normalised on `device`, one ahead.

    `len()` is the loader's; iterating again starts a new pass over the loader (re-iterable per
    epoch). Extra batch elements (labels, ...) are moved to the device unchanged. On the CPU the
    conversion thread uses `cpu_threads` intra-op threads (that thread only), so it does not
    compete with the training step for every core.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device = "auto", mean: Sequence[float] | None = IMAGENET_MEAN,
                 std: Sequence[float] | None = IMAGENET_STD, channels_last: bool = True, dtype: torch.dtype | None = None,
                 layout: str = "auto", depth: int = 2, cpu_threads: int | None = 1):
        if layout not in ("auto", "NHWC", "NCHW"):
            raise ValueError(f"layout must be 'auto', 'NHWC' or 'NCHW', got {layout!r}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        if mean is not None and len(mean) != len(std):
            raise ValueError(f"mean and std must have the same length, got {len(mean)} and {len(std)}")
        self.loader = loader
        self.device = resolve_device(device)  # a bare "cuda" is indexed at each pass (`device_now`)
        self.mean, self.std = (tuple(mean), tuple(std)) if mean is not None else (None, None)
        self.channels_last, self.dtype, self.layout = channels_last, dtype, layout
        self.depth, self.cpu_threads = max(1, depth), cpu_threads
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def device_now(self) -> torch.device:
        """`device`, a bare "cuda" read as the calling thread's current CUDA device.

        Why then and not at construction: a loader is often built before the code that picks this rank's
        GPU runs (the Trainer's `torch.cuda.set_device` under torchrun), and the current device belongs
        to a thread; read when a pass starts, in the thread that iterates, it is that rank's GPU."""
        if self.device.type == "cuda" and self.device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    def convert(self, batch: Any, out: torch.Tensor | None = None) -> Any:
        """One batch to the device, images normalised (runs on the side stream / background thread).

        `out`: a buffer for the images (see `normalize_batch`)."""
        images, *rest = batch if isinstance(batch, (tuple, list)) else (batch,)
        device = self.device_now()
        non_blocking = device.type == "cuda"
        images = images.to(device, non_blocking=non_blocking)
        images = normalize_batch(images, self.mean, self.std, self.channels_last, self.dtype, self.layout, self._cache,
                                 out=out)
        rest = [r.to(device, non_blocking=non_blocking) if isinstance(r, torch.Tensor) else r for r in rest]
        return (images, *rest) if isinstance(batch, (tuple, list)) else images

    def __iter__(self) -> Iterator[Any]:
        return self._iter_cuda() if self.device.type == "cuda" else self._iter_thread()

    def _iter_cuda(self) -> Iterator[Any]:
        device = self.device_now()  # this pass's GPU: the iterating thread's (under torchrun, its rank's)
        stream = torch.cuda.Stream(device)
        it = iter(self.loader)

        def preload() -> Any:
            try:
                batch = next(it)
            except StopIteration:
                return None
            if isinstance(batch, (tuple, list)):
                batch = [b.pin_memory() if needs_pinning(b) else b for b in batch]
            elif needs_pinning(batch):
                batch = batch.pin_memory()
            made_on_device = device_tensors(batch)
            if made_on_device:
                # a batch already on the GPU (a GPU augmentation, a user's own decoder) may still be in
                # the making on the stream that queued it: this thread's current stream or, for another
                # thread, the default one; the side stream waits for both before it reads the batch
                # (fast_loader's nvjpeg threads hand over finished batches: data.decode.decoding_stream)
                queued_on = torch.cuda.current_stream(device)
                stream.wait_stream(queued_on)
                if queued_on != torch.cuda.default_stream(device):
                    stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                for t in made_on_device:
                    t.record_stream(stream)  # its memory is not handed out again while the side stream reads it
                return self.convert(batch)

        nxt = preload()
        while nxt is not None:
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)  # the copy and conversion of `nxt` are done before use
            for t in device_tensors(nxt):
                t.record_stream(current)  # its memory is not reused while the main stream needs it
            batch, nxt = nxt, preload()
            yield batch

    def uint8_affine(self, layout: str) -> tuple[list[float], list[float]] | None:
        """(scale, shift) per channel such that `convert` makes `float32(x) * scale + shift` (a multiply, then
        an add, in float32) of a uint8 CPU batch in `layout` with no change of layout after: a maker that
        writes that itself skips the conversion. None where `convert` does more (another dtype or device,
        a change of memory layout)."""
        if self.device.type != "cpu" or self.dtype not in (None, torch.float32) or \
                (layout == "NHWC") != self.channels_last or layout not in ("NHWC", "NCHW"):
            return None
        if self.mean is None:
            scale, shift = torch.full((3,), 1.0 / 255), torch.zeros(3)
        else:
            scale, shift = _affine(self.mean, self.std, torch.device("cpu"), uint8=True)
        return scale.view(-1).tolist(), shift.view(-1).tolist()

    def output_buffer(self, pool: BufferPool, batch: Any) -> torch.Tensor | None:
        """A float buffer from `pool` for this batch's images, where `convert` can write into one (CPU, float32,
        the input already in the output's memory order); else None."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not (isinstance(images, torch.Tensor) and images.dim() == 4 and images.device.type == "cpu"
                and self.dtype in (None, torch.float32) and images.is_contiguous()):
            return None
        layout = _resolve_layout(images, self.layout)
        if (layout == "NHWC") != self.channels_last:
            return None  # the conversion changes the layout afterwards: a buffer would not be the result
        n, a, b, c = images.shape
        return pool.take((n, c, a, b) if layout == "NHWC" else (n, a, b, c), self.channels_last)

    def _iter_thread(self) -> Iterator[Any]:
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        pool = BufferPool(capacity=self.depth + 3)  # used by the producer thread only

        def produce(_: int) -> None:
            try:
                for batch in self.loader:
                    with helper_work:  # no fork while a batch is converted (see runtime.helper_work)
                        batch = self.convert(batch, out=self.output_buffer(pool, batch))
                    if not put_unless_stopped(q, ("ok", batch), stop):
                        return
                put_unless_stopped(q, ("end", None), stop)
            except BaseException as e:  # handed to the consumer, raised there
                put_unless_stopped(q, ("error", e), stop)

        # cpu_threads for this thread only: the model keeps its cores
        (thread,) = start_helper_threads(produce, 1, "torchspeed-prefetch",
                                         torch_threads=self.cpu_threads or torch.get_num_threads())
        try:
            while True:
                kind, item = q.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=30)
