"""fast_loader on data where users keep it (WebDataset tar shards, Hugging Face datasets, LitData): the
store's promises hold for each format. Every sample's label is its own index, so a sample is known by it."""
from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from torchspeed.data import fast_loader
from torchspeed.data.sources import as_source
from torchspeed.images import scan_folder

SHARD_SIZES = (3, 9, 5, 7)  # uneven on purpose: 24 samples


def photo_bytes(folder) -> list[bytes]:
    """The folder's JPEG files in its scan order (the order the formats below keep)."""
    _, samples = scan_folder(str(folder))
    out = []
    for path, _ in samples:
        with open(path, "rb") as f:
            out.append(f.read())
    return out


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder, out, sizes=SHARD_SIZES, label_ext="cls", image_ext="jpg") -> str:
    """The photos as WebDataset shards `out/train-{0000..K}.tar` (KEY.jpg + KEY.cls, label = index)."""
    os.makedirs(out, exist_ok=True)
    images, i = photo_bytes(folder), 0
    assert sum(sizes) == len(images)
    for s, n in enumerate(sizes):
        with tarfile.open(os.path.join(out, f"train-{s:04d}.tar"), "w") as tar:
            for _ in range(n):
                add_member(tar, f"sample{i:05d}.{image_ext}", images[i])
                add_member(tar, f"sample{i:05d}.{label_ext}", str(i).encode())
                i += 1
    return os.path.join(str(out), f"train-{{0000..{len(sizes) - 1:04d}}}.tar")


def hf_dataset(folder, labels=None, image="image", label="label"):
    datasets = pytest.importorskip("datasets")
    images = photo_bytes(folder)
    labels = list(range(len(images))) if labels is None else labels
    features = datasets.Features({image: datasets.Image(), label: datasets.Value("int64")})
    return datasets.Dataset.from_dict({image: [{"bytes": b, "path": None} for b in images], label: labels},
                                      features=features)


def write_hf(folder, out, **kw) -> str:
    hf_dataset(folder, **kw).save_to_disk(str(out))
    return str(out)


def write_litdata(folder, out, chunk_size=7) -> str:
    writer_mod = pytest.importorskip("litdata.streaming.writer")
    os.makedirs(out, exist_ok=True)
    writer = writer_mod.BinaryWriter(str(out), chunk_size=chunk_size)
    for i, data in enumerate(photo_bytes(folder)):
        writer[i] = {"image": data, "label": i}
    writer.done()
    writer.merge(1)
    return str(out)


FORMATS = ("tar", "hf_folder", "hf_dataset", "litdata")


@pytest.fixture(scope="module")
def formats(photo_folder, tmp_path_factory):
    """Each format holding the 24 photos of `photo_folder`, built once (read only)."""
    root = tmp_path_factory.mktemp("formats")
    built = {}

    def get(kind):
        if kind not in built:
            if kind == "tar":
                built[kind] = write_shards(photo_folder, root / "shards")
            elif kind == "hf_folder":
                built[kind] = write_hf(photo_folder, root / "hf")
            elif kind == "hf_dataset":
                built[kind] = hf_dataset(photo_folder)
            else:
                built[kind] = write_litdata(photo_folder, root / "lit")
        return built[kind]

    return get


def loader(data, **kw):
    base = dict(batch_size=5, crop=16, device="cpu", decoder="simplejpeg", num_workers=0, threads=1, seed=3)
    return fast_loader(data, **{**base, **kw})


@pytest.mark.parametrize("kind", FORMATS)
def test_count_and_classes_known_before_any_image_is_read(formats, kind):
    source = as_source(formats(kind))
    assert len(source) == 24 and source.targets == list(range(24))
    assert len(source.classes) == 24


@pytest.mark.parametrize("kind", FORMATS)
def test_pixels_are_the_folders_pixels(formats, photo_folder, kind):
    """Same JPEG bytes, same decoder, same crop: the batches equal those of the ImageFolder itself."""
    got = [x for x, _ in loader(formats(kind), train=False)]
    want = [x for x, _ in loader(str(photo_folder), train=False)]
    labels = [v for _, y in loader(formats(kind), train=False) for v in y.tolist()]
    assert labels == list(range(24))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("replicas,workers", [(1, 0), (2, 2), (3, 0)])
def test_every_sample_once_per_epoch_across_ranks_and_workers(formats, kind, replicas, workers):
    epochs = []
    for epoch in range(2):
        seen = []
        for rank in range(replicas):
            ld = loader(formats(kind), num_replicas=replicas, rank=rank, num_workers=workers, drop_last=False,
                        persistent_workers=False)
            ld.set_epoch(epoch)
            seen += [v for _, y in ld for v in y.tolist()]
        assert sorted(seen) == list(range(24)), (epoch, seen)
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # shuffled again each epoch


@pytest.mark.parametrize("kind", FORMATS)
def test_mid_epoch_resume_is_exact(formats, kind):
    reference = loader(formats(kind), threads=2)
    epoch0 = [(x.clone(), y.clone()) for x, y in reference]
    first = loader(formats(kind), threads=2)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = loader(formats(kind), threads=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(epoch0) - 2
    for (x, y), (xr, yr) in zip(epoch0[2:], rest, strict=True):
        assert torch.equal(x, xr) and torch.equal(y, yr)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_source_travels_to_a_spawned_worker(formats, kind):
    """What a spawned worker process receives: the same records, the files opened again there."""
    source = as_source(formats(kind))
    copy = pickle.loads(pickle.dumps(source))
    for i in (0, 13, 23):
        a, b = source.record(i), copy.record(i)
        assert bytes(a.payload) == bytes(b.payload) and a.label == b.label == i


def test_spawned_workers_read_tar_shards_and_arrow(formats):
    for kind in ("tar", "hf_folder"):
        ld = loader(formats(kind), num_workers=2, multiprocessing_context="spawn", persistent_workers=False,
                    drop_last=False)
        assert sorted(v for _, y in ld for v in y.tolist()) == list(range(24))


def test_tar_epoch_order_reads_each_shard_in_one_run_without_a_buffer(formats):
    shards = as_source(formats("tar"))
    shards.shuffle_buffer = 0
    first = np.concatenate([[0], np.cumsum(SHARD_SIZES)])
    orders = []
    for epoch in range(3):
        order, pos, visited = shards.epoch_order(epoch, 0, True).tolist(), 0, []
        while pos < len(order):
            s = int(np.searchsorted(first, order[pos], side="right")) - 1
            assert order[pos:pos + SHARD_SIZES[s]] == list(range(first[s], first[s + 1]))
            pos, visited = pos + SHARD_SIZES[s], visited + [s]
        assert sorted(visited) == list(range(len(SHARD_SIZES)))
        orders.append(visited)
    assert len({tuple(o) for o in orders}) > 1  # the shard order changes with the epoch
    assert shards.epoch_order(0, 0, False).tolist() == list(range(24))


def test_tar_local_shuffle_moves_a_sample_at_most_buffer_places(formats):
    shards = as_source(formats("tar"))
    shards.shuffle_buffer = 4
    rng = np.random.default_rng([0, 1])  # what epoch_order draws for seed 0, epoch 1: the shard order first
    shard_order = rng.permutation(len(SHARD_SIZES))
    first = np.concatenate([[0], np.cumsum(SHARD_SIZES)])
    stream = [i for s in shard_order for i in range(first[s], first[s + 1])]
    order = shards.epoch_order(1, 0, True).tolist()
    for place, sample in enumerate(order):
        assert abs(place - stream.index(sample)) <= 4
