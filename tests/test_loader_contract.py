"""FastLoader keeps the loader contract (torchspeed/loader_contract.py): it is an instance of each
protocol and does what each docstring says, on a real loader over a tiny generated Dataset whose
labels are the sample indices (so a batch shows which samples it holds)."""
import json

import numpy as np
import pytest
import torch

from torchspeed.data import FastLoader, fast_loader
from torchspeed.loader_contract import (DeviceBatches, EpochOrder, EpochOrdered, Recountable, Resumable,
                                        conforms, release_workers, yields_device_batches)


class IndexDataset:
    """Sample i: a small random image; its label is i."""

    classes = []

    def __init__(self, n=22):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.random.default_rng(i).integers(0, 256, (12, 10, 3), dtype=np.uint8), i


def _loader(n=22, batch_size=4, **kw) -> FastLoader:
    kw = {"crop": 8, "device": "cpu", "num_workers": 0, "threads": 1, "seed": 3, **kw}
    return fast_loader(IndexDataset(n), batch_size, **kw)


def _pass(loader):
    return [(x.clone(), y.tolist()) for x, y in loader]


def _labels(batches):
    return [y for _, y in batches]


def test_a_fast_loader_is_an_instance_of_each_protocol():
    loader = _loader()
    for protocol in (DeviceBatches, Resumable, Recountable, EpochOrdered):
        assert isinstance(loader, protocol) and conforms(loader, protocol), protocol.__name__
        assert conforms(Forwarding(loader), protocol), protocol.__name__  # isinstance misses it from 3.12 on
        assert not conforms([torch.zeros(2)], protocol), protocol.__name__
    assert conforms(loader.sampler, EpochOrder) and loader.sampler.order is None
    assert yields_device_batches(loader) and yields_device_batches(Forwarding(loader))
    assert not yields_device_batches([torch.zeros(2)])


class Forwarding:
    """A wrapper that forwards its loader's attributes (as accelerate's DeviceLoader and a rank's
    strided share do)."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.__dict__["loader"], name)


def test_device_batches_arrive_normalised_on_the_device():
    x, y = next(iter(_loader()))
    assert x.device == torch.device("cpu") and x.dtype == torch.float32 and x.shape == (4, 3, 8, 8)
    assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
    assert x.min() < 0  # normalised by the mean and std, not 0..1 pixels


def test_state_dict_round_trip_gives_the_same_next_batches():
    first = _loader()
    first.set_epoch(2)
    it = iter(first)
    seen = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert json.loads(json.dumps(state)) == state and state["epoch"] == 2 and state["batches_done"] == 2
    rest = [(x.clone(), y.tolist()) for x, y in it]
    second = _loader()
    second.load_state_dict(state)
    resumed = _pass(second)
    assert _labels(resumed) == _labels(rest) and len(resumed) == len(first) - 2
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, rest))  # the same crops too
    assert second.state_dict()["epoch"] == 3 and len(seen) == 2  # the pass ended the epoch


def test_set_epoch_starts_that_epoch_from_its_first_batch():
    walked = _loader()
    _pass(walked)
    second_epoch = _labels(_pass(walked))
    jumped = _loader()
    jumped.set_epoch(1)
    assert _labels(_pass(jumped)) == second_epoch
    assert second_epoch != _labels(_pass(_loader()))  # each epoch its own shuffle


@pytest.mark.parametrize("num_workers,threads", [(0, 2), (1, 1)])
def test_with_counts_keeps_data_order_and_position(num_workers, threads):
    loader = _loader()
    loader.load_state_dict({"epoch": 1, "batches_done": 2, "seed": 3})
    other = loader.with_counts(num_workers, threads)
    assert isinstance(other, FastLoader) and other.num_workers == num_workers
    assert other.threads == (threads if num_workers == 0 else 1)
    assert other.identity() == loader.identity() and other.state_dict() == loader.state_dict()
    try:
        assert _labels(_pass(other)) == _labels(_pass(loader))
    finally:
        release_workers(other)  # persistent workers (with_counts keeps them) stopped now
    assert other.dataloader._iterator is None


def test_continue_epoch_reads_exactly_the_share_from_batch_first():
    loader = _loader(train=False)  # 22 samples, batches of 4: 6 batches
    share = [21, 3, 17, 8, 0, 5, 11, 2, 9, 14]  # what is left for this rank: batches 3..5 (the last one short)
    loader.continue_epoch(4, 3, share)
    assert loader.state_dict() == {"epoch": 4, "batches_done": 3, "seed": 3}
    assert sum(_labels(_pass(loader)), []) == share
    assert loader.state_dict()["epoch"] == 5
    assert sum(_labels(_pass(loader)), []) == list(range(22))  # once: the next pass is a whole epoch


def test_identity_is_json_and_stable():
    identity = _loader().identity()
    assert json.loads(json.dumps(identity)) == identity
    assert _loader().identity() == identity  # the same data and settings: the same key
    assert _loader(batch_size=2).identity() != identity
    assert _loader(n=23).identity() != identity
