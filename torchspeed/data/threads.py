"""ThreadedBatches: batches made by threads of this process, in order, a few ahead.

Why: on a machine with few cores, worker processes cost more than their decoding: each batch goes
through shared memory (a new segment, its pages faulted in twice), pickling and a socket, most of a
core with two cores. The heavy steps of a torchspeed batch (JPEG decoding, cv2 resize, the float
conversion) run in C with the GIL released, so threads decode side by side with no copies at all;
`fast_loader(num_workers="auto")` measures the two and keeps whichever is faster here.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchspeed.runtime import helper_work, start_helper_threads

__all__ = ["ThreadedBatches", "consumer_cuda_device", "put_unless_stopped"]


def consumer_cuda_device() -> int | None:
    """The calling thread's CUDA device, for helper threads to take: None where CUDA is not initialised
    (nothing is made on a GPU then, and asking would initialise it).

    Why: the current CUDA device belongs to a thread. torchrun's ranks call `torch.cuda.set_device`
    in their main thread; a thread started after that still begins on GPU 0, so a bare "cuda" in it
    (nvjpeg's output, a stream, a crop buffer) would put every rank's batches on GPU 0."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def put_unless_stopped(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put `item` on the bounded queue `q`, waiting for room until `stop` is set; False if it was."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


class ThreadedBatches:
    """Iterable of `make_batch(keys)` for each `keys` of `batch_sampler`, computed by `threads` threads.

    Thread i makes batches i, i + threads, ...; each keeps at most `ahead` finished batches, and the
    batches come out in the sampler's order. Re-iterable (one pass of the sampler per iteration, the
    threads are started per pass and stop when it ends or is left early); `len()` is the sampler's.
    An exception in a thread is raised in the consumer. Each thread runs torch ops on one core, on the
    consumer's CUDA device (`consumer_cuda_device`): under torchrun each rank's threads work on its GPU.
    """

    AHEAD = 2  # default finished batches kept per thread

    def __init__(self, make_batch: Callable[[Any], Any], batch_sampler: Iterable[Any], threads: int,
                 ahead: int = AHEAD):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.make_batch, self.batch_sampler, self.threads, self.ahead = make_batch, batch_sampler, threads, max(1, ahead)

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        jobs = list(self.batch_sampler)  # this pass's keys (a few hundred small lists)
        k = min(self.threads, max(1, len(jobs)))
        outputs: list[queue.Queue] = [queue.Queue(maxsize=self.ahead) for _ in range(k)]
        stop = threading.Event()
        device = consumer_cuda_device()  # read here, in the consumer's thread, at the pass's first batch

        def work(i: int) -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # this thread's own setting: the consumer's is left as it is
                for b in range(i, len(jobs), k):
                    if stop.is_set():
                        return
                    with helper_work:  # no fork while a batch is being made (see runtime.helper_work)
                        batch = self.make_batch(jobs[b])
                    if not put_unless_stopped(outputs[i], (True, batch), stop):
                        return
            except BaseException as e:  # handed to the consumer, raised there
                put_unless_stopped(outputs[i], (False, e), stop)

        threads = start_helper_threads(work, k, "torchspeed-decode")
        try:
            for b in range(len(jobs)):
                ok, item = outputs[b % k].get()
                if not ok:
                    raise item
                yield item
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
