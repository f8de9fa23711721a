"""ThreadedBatches, helper threads' torch thread counts, and the store read from many threads at once."""
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from helpers import fake_clock

from torchspeed import measure
from torchspeed.data import DevicePrefetcher, tune, tune_loader
from torchspeed.data.prefetch import BufferPool
from torchspeed.data.store import PackedDataset
from torchspeed.data.threads import ThreadedBatches


def _alive(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_batches_come_out_in_sampler_order_whatever_each_one_costs():
    sampler = [[i, i + 100] for i in range(23)]

    def make(keys):
        time.sleep(0.004 * (keys[0] % 3))  # uneven costs: later batches often finish first
        return keys[0]

    batches = ThreadedBatches(make, sampler, threads=3)
    assert len(batches) == 23
    for _ in range(2):  # re-iterable
        assert list(batches) == list(range(23))
    assert not _alive("torchspeed-decode")  # the threads end with the pass


def test_an_error_in_a_thread_is_raised_and_leaving_early_stops_the_threads():
    def make(keys):
        if keys == 5:
            raise ValueError("record 5 is corrupt")
        return keys

    it = iter(ThreadedBatches(make, list(range(10)), threads=2))
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="record 5"):
        next(it)
    endless = iter(ThreadedBatches(lambda k: k, list(range(10_000)), threads=2, ahead=1))
    next(endless)
    endless.close()
    assert not _alive("torchspeed-decode")
    with pytest.raises(ValueError, match="threads"):
        ThreadedBatches(lambda k: k, [], threads=0)


def test_helper_threads_leave_the_main_threads_torch_thread_count_alone():
    # A fresh process whose main thread has run no torch op yet: the case where a plain
    # torch.set_num_threads(1) in a helper would leave the model on one core.
    code = """
import threading, torch
from torchspeed.runtime import start_helper_threads
seen = []
if HELPERS:
    for t in start_helper_threads(lambda i: seen.append(torch.get_num_threads()), 2, "probe"):
        t.join()
later = []
t = threading.Thread(target=lambda: later.append(torch.get_num_threads())); t.start(); t.join()
print(seen, torch.get_num_threads(), later[0])
"""

    def run(helpers):
        out = subprocess.run([sys.executable, "-c", f"HELPERS = {helpers}\n{code}"], capture_output=True, text=True,
                             check=True).stdout
        seen, counts = out.split("]")
        return seen.strip("[ "), counts.split()

    seen, counts = run(True)
    assert seen == "1, 1"  # the helpers run on one core each
    assert counts == run(False)[1]  # the main thread and threads started later keep the default


def test_store_reads_from_many_threads_match_serial_reads(photo_store):
    ds = PackedDataset(photo_store)
    serial = [ds[i][0] for i in range(len(ds))]
    ds.close()
    results = {}

    def read(offset):
        for r in range(3):
            for i in range(len(ds)):
                j = (i + offset) % len(ds)
                results[(offset, r, j)] = ds[j][0]

    workers = [threading.Thread(target=read, args=(k * 7,)) for k in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(results) == 4 * 3 * len(ds)
    assert all(np.array_equal(img, serial[j]) for (_, _, j), img in results.items())


class PacedThreads:
    """A fake fast_loader factory: 2 threads beat 1 worker process, which beats 2. Its batches take their
    time on `clock` (a FakeClock: the throughput timed is exactly theirs, on a busy machine too)."""

    def __init__(self, clock):
        self.calls, self.clock = [], clock

    def __call__(self, workers, prefetch, persistent, pin, threads=1):
        self.calls.append((workers, threads))
        delay, clock = {(0, 2): 0.002, (1, 1): 0.006}.get((workers, threads), 0.012), self.clock

        class It:
            def __iter__(self):
                for _ in range(5):
                    clock.sleep(delay)
                    yield torch.zeros(4), torch.zeros(4)

        return It()


def test_tune_loader_tries_threads_in_process_then_workers_and_keeps_the_fastest(monkeypatch):
    build = PacedThreads(fake_clock(monkeypatch, measure, tune))
    s = tune_loader(build, 4, num_workers=[0, 1, 2], threads=[1, 2], tune_seconds=0.05, device="cpu", prefetch_factor=(2,),
                    persistent_workers=(True,))
    assert (s.num_workers, s.threads) == (0, 2)
    walked = [(r.num_workers, r.threads) for r in s.table if not r.final]
    assert walked == [(0, 1), (0, 2), (1, 1), (2, 1)]
    finals = [r for r in s.table if r.final]  # the two winners, measured again interleaved
    assert [(r.num_workers, r.threads) for r in finals] == [(0, 2), (1, 1)]
    assert s.throughput == finals[0].items_per_s == max(r.items_per_s for r in finals)
    assert s.best is finals[0]


def test_buffer_pool_reuses_a_buffer_only_when_nothing_refers_to_it():
    pool = BufferPool(capacity=2)
    a = pool.take((2, 3, 4, 4), channels_last=True)
    assert a.is_contiguous(memory_format=torch.channels_last) and a.shape == (2, 3, 4, 4)
    address = a.data_ptr()
    view = a[1]  # the caller keeps a view: the storage is still in use
    del a
    b = pool.take((2, 3, 4, 4), channels_last=True)
    assert b.data_ptr() != address
    del view
    c = pool.take((2, 3, 4, 4), channels_last=True)
    assert c.data_ptr() == address  # released: handed out again
    assert pool.take((2, 3, 4, 4), channels_last=False).is_contiguous()


@pytest.mark.parametrize("channels_last,layout", [(True, "NHWC"), (False, "NCHW")])
def test_cpu_prefetcher_never_overwrites_a_batch_that_is_still_held(channels_last, layout):
    torch.manual_seed(0)
    raw = [torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8) for _ in range(9)]
    batches = [(r.permute(0, 2, 3, 1).contiguous() if layout == "NHWC" else r, torch.arange(4)) for r in raw]
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    reference = [(r.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
                 for r in raw]
    pf = DevicePrefetcher(batches, "cpu", mean, std, channels_last=channels_last, layout=layout)
    held = [x for x, _ in pf]  # every batch kept: no buffer may be reused
    assert len({x.data_ptr() for x in held}) == len(held)
    for x, ref in zip(held, reference):
        torch.testing.assert_close(x, ref, atol=1e-6, rtol=1e-6)
    addresses = set()
    for i, (x, _) in enumerate(pf):  # batches dropped as we go: buffers come back, values stay right
        addresses.add(x.data_ptr())
        torch.testing.assert_close(x, reference[i], atol=1e-6, rtol=1e-6)
    assert len(addresses) < len(raw)


def test_lists_of_candidates_cap_what_is_measured(small_photo_folder):
    from torchspeed.data import fast_loader

    loader = fast_loader(small_photo_folder, 4, crop=16, device="cpu", num_workers=[0, 1], threads=[1],
                         tune_seconds=0.05)
    tried = {(r.num_workers, r.threads) for r in loader.settings.table}
    assert tried == {(0, 1), (1, 1)}  # both walks, each over its one candidate, then the final round
    assert (loader.dataloader.num_workers, loader.threads) in tried
    threads_only = fast_loader(small_photo_folder, 4, crop=16, device="cpu", num_workers=0, threads="1,2",
                               tune_seconds=0.05)  # a comma string is a list; num_workers=0 measures threads only
    assert {(r.num_workers, r.threads) for r in threads_only.settings.table} == {(0, 1), (0, 2)}
    fixed = fast_loader(small_photo_folder, 4, crop=16, device="cpu", num_workers=0, threads=2)
    assert fixed.settings is None and fixed.threads == 2  # numbers are used as given, nothing measured
    for bad in ({"num_workers": -1}, {"num_workers": [0, -1]}, {"num_workers": "some"}, {"threads": 0},
                {"threads": []}, {"threads": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fast_loader(small_photo_folder, 4, crop=16, device="cpu", **bad)
