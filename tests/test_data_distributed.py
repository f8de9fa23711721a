"""Sharding a FastLoader across ranks: from arguments, the process group or torchrun's environment.

No process group is needed for the arithmetic: WORLD_SIZE/RANK are set with monkeypatch, one
loader per rank is built in this process, and the labels (= sample indices) show what each read.
"""
import numpy as np
import pytest
import torch

from torchspeed.data import fast_loader
from torchspeed.ranks import world


class IndexDataset:
    """Sample i is a small random image; its label is i, so a batch reveals its indices."""

    classes = []

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.random.default_rng(i).integers(0, 256, (12, 12, 3), dtype=np.uint8), i


def _shards(monkeypatch, n, replicas, batch_size, train, epoch):
    """What each rank reads in `epoch`, every loader built with only WORLD_SIZE/RANK to go by."""
    out = []
    for rank in range(replicas):
        monkeypatch.setenv("WORLD_SIZE", str(replicas))
        monkeypatch.setenv("RANK", str(rank))
        loader = fast_loader(IndexDataset(n), batch_size, train=train, crop=8, device="cpu", num_workers=0,
                             threads=1, decoder="simplejpeg")
        assert (loader.batch_sampler.num_replicas, loader.batch_sampler.rank) == (replicas, rank)
        loader.set_epoch(epoch)
        batches = [y.tolist() for _, y in loader]
        assert len(batches) == len(loader)
        out.append(batches)
    return out


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("n,replicas,batch_size", [(48, 3, 4), (43, 3, 4), (10, 4, 3), (3, 4, 1)])
def test_env_shards_are_disjoint_equal_and_cover_the_data(monkeypatch, n, replicas, batch_size, train):
    per_rank = -(-n // replicas)  # padded by wrapping: every rank has ceil(n / replicas) samples
    steps = per_rank // batch_size if train else -(-per_rank // batch_size)
    for epoch in (0, 1):
        shards = _shards(monkeypatch, n, replicas, batch_size, train, epoch)
        assert [len(b) for b in shards] == [steps] * replicas  # the same number of steps on every rank
        samples = [sum(b, []) for b in shards]
        if not train:  # every sample kept: the union is the data, repeated only where padded
            assert [len(s) for s in samples] == [per_rank] * replicas
            everything = sum(samples, [])
            assert set(everything) == set(range(n))
            assert len(everything) - n == per_rank * replicas - n
        if n % replicas == 0:
            for a in range(replicas):
                for b in range(a + 1, replicas):
                    assert not set(samples[a]) & set(samples[b]), (epoch, a, b)


def test_shards_follow_the_epoch_shuffle(monkeypatch):
    first, second = (_shards(monkeypatch, 48, 2, 4, True, epoch) for epoch in (0, 1))
    for shards in (first, second):
        assert not set(sum(shards[0], [])) & set(sum(shards[1], []))
        assert sorted(sum(shards[0], []) + sum(shards[1], [])) == list(range(48))
    assert first[0] != second[0]  # a new epoch is a new shuffle, still disjoint across ranks


def test_explicit_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert world() == (4, 3)
    assert world(2, 0) == (2, 0)
    assert world(num_replicas=8) == (8, 3)  # each argument on its own
    loader = fast_loader(IndexDataset(8), 2, crop=8, device="cpu", num_workers=0, threads=1, num_replicas=2, rank=1)
    assert (loader.batch_sampler.num_replicas, loader.batch_sampler.rank) == (2, 1)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert world() == (1, 0)


@pytest.mark.parametrize("env,match", [({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE"),
                                       ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
                                       ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE")])
def test_a_bad_environment_is_named(monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        fast_loader(IndexDataset(8), 2, crop=8, device="cpu", num_workers=0, threads=1)


def test_a_loader_built_before_the_process_group_follows_it(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")  # stale or foreign: the process group, once there, decides
    monkeypatch.setenv("RANK", "1")
    loader = fast_loader(IndexDataset(10), 5, train=False, crop=8, device="cpu", num_workers=0, threads=1)
    assert (loader.batch_sampler.num_replicas, loader.batch_sampler.rank) == (2, 1) and len(loader) == 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert (loader.batch_sampler.num_replicas, loader.batch_sampler.rank) == (1, 0) and len(loader) == 2
        assert sorted(torch.cat([y for _, y in loader]).tolist()) == list(range(10))
    finally:
        dist.destroy_process_group()


def test_worker_processes_read_the_same_shard_as_threads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    shards = []
    for workers in (0, 1):
        loader = fast_loader(IndexDataset(43), 4, crop=8, device="cpu", num_workers=workers, threads=1,
                             decoder="simplejpeg", persistent_workers=False)
        assert len(loader) == 3  # ceil(43 / 3) = 15 samples: 3 full batches of 4
        shards.append([y.tolist() for _, y in loader])
    assert shards[0] == shards[1] and len(shards[0]) == 3
