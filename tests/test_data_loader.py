"""fast_loader, DevicePrefetcher, augmentation, decoders, tune_loader: behaviour and numerics."""
import os

import numpy as np
import pytest
import torch
from helpers import fake_clock

from torchspeed import measure
from torchspeed.data import (IMAGENET_MEAN, IMAGENET_STD, DevicePrefetcher, fast_loader, pack, tune_loader)
from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop, sample_rng
from torchspeed.data import tune
from torchspeed.data.decode import available_decoders, get_decoder, jpeg_size


class IndexDataset:
    """Image i is a constant-ish array encoding i; its label is i (so batches reveal their indices)."""

    classes = []

    def __init__(self, n=40, size=(20, 24)):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, (*self.size, 3), dtype=np.uint8), i


def _epoch(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_batches_are_normalised_on_the_device_in_the_contract_format(photo_store):
    loader = fast_loader(photo_store, 8, crop=32, device="cpu", num_workers=0, decoder="simplejpeg")
    assert loader.yields_device_batches and len(loader) == 3 and loader.dataset.classes == ["class_00", "class_01", "class_02"]
    x, y = next(iter(loader))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.int64 and x.device.type == "cpu"
    lo = (0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    hi = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    per_channel = x.permute(1, 0, 2, 3).reshape(3, -1)
    assert (per_channel.min(1).values >= torch.tensor(lo, dtype=torch.float32) - 1e-5).all()
    assert (per_channel.max(1).values <= torch.tensor(hi, dtype=torch.float32) + 1e-5).all()
    x2, _ = next(iter(fast_loader(photo_store, 8, crop=32, device="cpu", num_workers=0, channels_last=False,
                                  decoder="simplejpeg")))
    assert x2.is_contiguous() and not x2.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(x2, x, atol=1e-6, rtol=1e-6)  # NCHW and NHWC uint8 paths agree
    x3, _ = next(iter(fast_loader(photo_store, 8, crop=32, device="cpu", num_workers=0, dtype=torch.bfloat16)))
    assert x3.dtype == torch.bfloat16


def test_eval_pipeline_matches_a_reference_crop(tmp_path):
    """Raw store, eval mode, crop = 0.875 * side: the output is exactly the centre crop, normalised."""
    ds = IndexDataset(6, size=(64, 64))
    pack(ds, tmp_path / "raw", format="raw", num_workers=1, progress=False)
    loader = fast_loader(str(tmp_path / "raw"), 6, train=False, crop=56, device="cpu", num_workers=0, channels_last=False)
    x, y = next(iter(loader))
    assert y.tolist() == list(range(6))
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    ref = torch.stack([torch.from_numpy(ds[i][0][4:60, 4:60]).permute(2, 0, 1) for i in range(6)]).float() / 255
    torch.testing.assert_close(x, (ref - mean) / std, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train", [True, False])
def test_every_index_exactly_once_per_epoch_with_two_workers(train):
    loader = fast_loader(IndexDataset(40), 8, train=train, crop=16, device="cpu", num_workers=2, drop_last=False)
    for _ in range(2):  # two epochs: persistent workers, new shuffle
        labels = torch.cat([y for _, y in loader]).tolist()
        assert sorted(labels) == list(range(40))
        if not train:
            assert labels == list(range(40))


def test_same_seed_same_batches_whatever_the_number_of_workers_or_threads(photo_store):
    setups = [(0, 1), (1, 1), (2, 1), (0, 2), (0, 3)]  # (num_workers, threads)
    runs = {(w, t): _epoch(fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=w, threads=t, seed=3,
                                       decoder="simplejpeg")) for w, t in setups}
    for setup in setups[1:]:
        assert len(runs[setup]) == len(runs[(0, 1)]) == 4
        for (xa, ya), (xb, yb) in zip(runs[(0, 1)], runs[setup]):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
    held = [x for x, _ in fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=0, threads=2, seed=3,
                                      decoder="simplejpeg")]  # not copied: reused buffers must not change them
    assert all(torch.equal(x, ref) for x, (ref, _) in zip(held, runs[(0, 1)]))
    assert fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=0, threads=3).threads == 3
    assert fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=1, threads=3).threads == 1  # workers decode
    other = _epoch(fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=0, seed=4, decoder="simplejpeg"))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(runs[(0, 1)], other))


@pytest.mark.parametrize("workers,threads", [(1, 1), (0, 2)])
def test_state_dict_resumes_at_the_next_unseen_batch(photo_store, workers, threads):
    make = lambda: fast_loader(photo_store, 4, crop=24, device="cpu", num_workers=workers, threads=threads,  # noqa: E731
                               seed=7, decoder="simplejpeg")
    reference = make()
    epoch0 = _epoch(reference)
    epoch1 = _epoch(reference)
    assert reference.state_dict() == {"epoch": 2, "batches_done": 0, "seed": 7}
    assert not torch.equal(epoch0[0][0], epoch1[0][0])  # a new epoch reshuffles and re-augments

    first = make()
    it = iter(first)
    seen = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert state == {"epoch": 0, "batches_done": 2, "seed": 7}
    del it
    again = next(iter(first))  # an abandoned pass does not count: epoch 0 starts again at its first batch
    assert torch.equal(again[0], epoch0[0][0]) and first.state_dict()["batches_done"] == 1
    resumed = make()
    resumed.load_state_dict(state)
    rest = _epoch(resumed)
    assert len(seen) + len(rest) == len(epoch0) == 6
    for (xa, ya), (xb, yb) in zip(seen + rest, epoch0):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert resumed.state_dict()["epoch"] == 1
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_epoch(resumed), epoch1))
    with pytest.raises(ValueError, match="seed"):
        make().load_state_dict({"epoch": 0, "batches_done": 1, "seed": 8})


def test_distributed_shards_are_disjoint_and_complete():
    shards = []
    for rank in (0, 1):
        loader = fast_loader(IndexDataset(40), 5, crop=16, device="cpu", num_workers=0, num_replicas=2, rank=rank)
        loader.set_epoch(3)
        assert len(loader) == 4
        shards.append(torch.cat([y for _, y in loader]).tolist())
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(40))


@pytest.mark.parametrize("rank", [0, 1])
def test_dataloader_attributes_are_the_values_the_loader_uses(rank):
    data = IndexDataset(41)
    loader = fast_loader(data, 5, crop=16, device="cpu", num_workers=1, drop_last=True, num_replicas=2, rank=rank)
    assert loader.batch_size == 5 and loader.drop_last is True and loader.num_workers == 1
    assert loader.dataset.dataset is data  # the source wrapping the user's Dataset, as before
    assert (loader.sampler.num_replicas, loader.sampler.rank, loader.sampler.shuffle) == (2, rank, True)
    assert len(loader) == 21 // 5 and all(len(y) == 5 for _, y in loader)  # 21 samples per rank, last 1 dropped
    kept = fast_loader(data, 5, train=False, crop=16, device="cpu", num_workers=0, threads=2)
    assert (kept.batch_size, kept.drop_last, kept.num_workers, kept.sampler.shuffle) == (5, False, 0, False)
    with pytest.raises(AttributeError):
        kept.batch_size = 7  # read-only: the loader's batches could not follow a new value


def test_an_initialised_process_group_is_used(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        loader = fast_loader(IndexDataset(10), 5, crop=16, device="cpu", num_workers=0)
        assert loader.batch_sampler.num_replicas == 1 and loader.batch_sampler.rank == 0
        assert sorted(torch.cat([y for _, y in loader]).tolist()) == list(range(10))
    finally:
        dist.destroy_process_group()


def test_prefetcher_equals_reference_normalisation():
    torch.manual_seed(0)
    batches = [(torch.randint(0, 256, (4, 3, 10, 12), dtype=torch.uint8), torch.arange(4)) for _ in range(3)]
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    pf = DevicePrefetcher(batches, "cpu", mean, std, channels_last=True)
    assert len(pf) == 3
    for _ in range(2):  # re-iterable
        out = list(pf)
        assert len(out) == 3
        for (x, y), (raw, labels) in zip(out, batches):
            ref = (raw.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
            torch.testing.assert_close(x, ref, atol=1e-6, rtol=1e-6)
            assert x.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, labels)
    nhwc = [(b.permute(0, 2, 3, 1).contiguous(), y) for b, y in batches]
    x, _ = next(iter(DevicePrefetcher(nhwc, "cpu", mean, std, channels_last=False, layout="NHWC")))
    torch.testing.assert_close(x, list(pf)[0][0].contiguous(), atol=1e-6, rtol=1e-6)
    assert x.is_contiguous()


def test_prefetcher_passes_loader_errors_and_stops_early():
    def broken():
        yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2)
        raise RuntimeError("worker exploded")

    class Loader:
        def __iter__(self):
            return broken()

    it = iter(DevicePrefetcher(Loader(), "cpu"))
    next(it)
    with pytest.raises(RuntimeError, match="worker exploded"):
        next(it)
    endless = DevicePrefetcher(((torch.zeros(1, 3, 2, 2, dtype=torch.uint8),) for _ in iter(int, 1)), "cpu")
    it = iter(endless)
    next(it)
    it.close()  # leaving early stops the background thread
    assert not any(t.name == "torchspeed-prefetch" and t.is_alive() for t in __import__("threading").enumerate())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_prefetcher_on_cuda_matches_cpu():
    batches = [(torch.randint(0, 256, (4, 3, 10, 12), dtype=torch.uint8), torch.arange(4)) for _ in range(3)]
    cpu = list(DevicePrefetcher(batches, "cpu"))
    gpu = list(DevicePrefetcher(batches, "cuda"))
    for (a, _), (b, yb) in zip(cpu, gpu):
        assert b.is_cuda and yb.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=1e-6, rtol=1e-6)


def test_random_resized_crop_boxes_are_valid_and_seeded():
    t = RandomResizedCropFlip(32)
    boxes = [t.box(90, 120, sample_rng(0, 0, i)) for i in range(200)]
    assert all(0 <= b.top and b.top + b.height <= 90 and 0 <= b.left and b.left + b.width <= 120 for b in boxes)
    areas = [b.height * b.width / (90 * 120) for b in boxes]
    assert min(areas) < 0.2 and max(areas) > 0.8  # the scale range (0.08, 1) is used
    assert 0.3 < np.mean([b.flip for b in boxes]) < 0.7
    assert t.box(90, 120, sample_rng(0, 0, 5)) == boxes[5] != t.box(90, 120, sample_rng(0, 1, 5))
    draws = [sample_rng(s, e, i).random() for s in (0, 1) for e in (0, 1) for i in range(500)]
    assert len(set(draws)) == len(draws) and 0.45 < np.mean(draws) < 0.55  # distinct streams, uniform-ish
    assert all(0 <= d < 1 for d in draws)
    rng = sample_rng(3, 0, 0)
    ints = [rng.randint(2, 5) for _ in range(400)]
    assert set(ints) == {2, 3, 4, 5}  # both ends included, as random.randint
    c = ResizeCenterCrop(56).box(64, 80)
    assert (c.top, c.left, c.height, c.width, c.flip) == (4, 12, 56, 56, False)


def test_decoders_agree_and_dct_scaling_shrinks(photo_folder):
    path = os.path.join(photo_folder, "class_00", "img_000000.jpg")
    data = open(path, "rb").read()
    assert jpeg_size(data) == (72, 96)
    ref = get_decoder("pil").decode(data)
    names = [name for name, why_not in available_decoders().items() if why_not is None]
    assert {"simplejpeg", "opencv", "pil", "torchvision"} <= set(names)
    for name in names:
        img = get_decoder(name).decode(data)
        assert img.shape == ref.shape and img.dtype == np.uint8
        assert np.abs(img.astype(int) - ref.astype(int)).mean() < 3, name
        small = get_decoder(name).decode(data, 18, 24)
        if name not in ("torchvision", "nvjpeg"):  # no DCT scaling exposed there
            assert small.shape[:2] == (18, 24), name  # 1/4 scale is the largest that keeps >= 18x24
    with pytest.raises(ValueError, match="unknown decoder"):
        get_decoder("nope")


def test_folder_source_reads_jpegs_and_names_a_bad_file(photo_folder, tmp_path):
    loader = fast_loader(photo_folder, 6, crop=24, device="cpu", num_workers=0, decoder="simplejpeg")
    assert sum(len(y) for _, y in loader) == 24
    import shutil

    bad = shutil.copytree(photo_folder, tmp_path / "bad")
    open(os.path.join(bad, "class_01", "broken.jpg"), "wb").write(b"\xff\xd8 nothing")
    open(os.path.join(bad, "class_01", "README.txt"), "w").write("ignored, as ImageFolder would")
    loader = fast_loader(str(bad), 25, train=False, crop=24, device="cpu", num_workers=0, decoder="pil")
    assert len(loader.dataset) == 25
    with pytest.raises(ValueError, match="broken.jpg"):
        list(loader)


def test_auto_decoder_is_measured_once_and_reported(photo_store, photo_folder):
    loader = fast_loader(photo_store, 4, crop=24, device="cpu", num_workers=0)
    assert loader.decoder in available_decoders()
    timed = [r for r in loader.decoder_table if r["us_per_image"] is not None]
    assert timed and loader.decoder == min(timed, key=lambda r: r["us_per_image"])["decoder"]
    assert fast_loader(photo_store, 4, crop=24, device="cpu", num_workers=0).decoder == loader.decoder  # remembered
    assert fast_loader(photo_folder, 4, crop=24, device="cpu", num_workers=0).decoder_table  # measured on a folder too


def test_spawn_workers_open_their_own_store_handle(photo_store):
    loader = fast_loader(photo_store, 8, train=False, crop=24, device="cpu", num_workers=1, decoder="simplejpeg",
                         multiprocessing_context="spawn")
    serial = fast_loader(photo_store, 8, train=False, crop=24, device="cpu", num_workers=0, decoder="simplejpeg")
    for (a, ya), (b, yb) in zip(loader, serial):
        assert torch.equal(a, b) and torch.equal(ya, yb)


def test_in_memory_loader_matches_disk(photo_store):
    disk = _epoch(fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=2, decoder="simplejpeg"))
    ram = _epoch(fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=2, decoder="simplejpeg", in_memory=True))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(disk, ram))


class Paced:
    """A fake loader factory whose throughput depends on num_workers: 1 is best until 4. Its batches take
    their time on `clock` (a FakeClock: the throughput timed is exactly theirs, on a busy machine too)."""

    def __init__(self, clock):
        self.calls, self.clock = [], clock

    def __call__(self, workers, prefetch, persistent, pin):
        self.calls.append(workers)
        delay = {0: 0.02, 1: 0.004, 2: 0.03, 3: 0.03}.get(workers, 0.001)

        def batches():
            for _ in range(5):
                self.clock.sleep(delay)
                yield torch.zeros(4), torch.zeros(4)

        class It:
            def __iter__(self):
                return batches()

        return It()


def test_tune_loader_picks_the_fastest_and_stops_when_throughput_falls(monkeypatch):
    build = Paced(fake_clock(monkeypatch, measure, tune))
    s = tune_loader(build, 4, num_workers=range(6), tune_seconds=0.1, device="cpu", prefetch_factor=(2,),
                    persistent_workers=(True,))
    assert s.num_workers == 1
    assert 4 not in build.calls  # 4 would be fastest of all, but the search stopped when 2 and 3 were slower
    assert [r.num_workers for r in s.table] == [0, 1, 2, 3]
    assert s.throughput == max(r.items_per_s for r in s.table) == s.best.items_per_s
    assert s.best.num_workers == 1 and s.best.to_dict()["num_workers"] == 1
    assert s.dataloader_kwargs()["num_workers"] == 1
    assert s.to_dict()["table"][1] == s.table[1].to_dict()  # JSON-ready all the way down


def test_tune_loader_on_a_plain_dataset():
    s = tune_loader(IndexDataset(32), 8, num_workers="0,1", tune_seconds=0.05, device="cpu", prefetch_factor=(2,),
                    persistent_workers=(True,))
    assert s.num_workers in (0, 1) and len(s.table) >= 1 and s.throughput > 0
    with pytest.raises(ValueError, match="batch_size"):
        tune_loader(IndexDataset(4), 0)


def test_fast_loader_bad_arguments(photo_store, tmp_path):
    with pytest.raises(FileNotFoundError, match="no data at"):
        fast_loader(tmp_path / "missing", 4)
    with pytest.raises(ValueError, match="batch_size"):
        fast_loader(photo_store, 0)
    with pytest.raises(ValueError, match="larger than"):
        fast_loader(photo_store, 100, device="cpu", num_workers=0, decoder="pil")
    with pytest.raises(ValueError, match="rank"):
        fast_loader(photo_store, 4, device="cpu", num_workers=0, num_replicas=2, rank=2, decoder="pil")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            fast_loader(photo_store, 4, device="cuda", num_workers=0, decoder="pil")


def test_loader_options_are_fast_loaders_keywords_with_the_same_defaults():
    import dataclasses
    import inspect

    from torchspeed.data import LoaderOptions

    keywords = {name: p.default for name, p in inspect.signature(fast_loader).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == {f.name: f.default for f in dataclasses.fields(LoaderOptions)}
    options = LoaderOptions(train=False, crop=24, device="cpu", num_workers=0, threads=2, decoder="simplejpeg")
    assert options.keywords() == {**keywords, "train": False, "crop": 24, "device": "cpu", "num_workers": 0,
                                  "threads": 2, "decoder": "simplejpeg"}


def test_a_loader_built_from_options_is_the_loader_built_from_keywords(photo_store):
    from torchspeed.data import LoaderOptions

    options = LoaderOptions(train=False, crop=24, device="cpu", num_workers=0, threads=1, decoder="simplejpeg")
    from_options = _epoch(fast_loader(photo_store, 6, **options.keywords()))
    from_keywords = _epoch(fast_loader(photo_store, 6, train=False, crop=24, device="cpu", num_workers=0, threads=1,
                                       decoder="simplejpeg"))
    assert len(from_options) == len(from_keywords)
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(from_options, from_keywords))


def test_available_decoders_says_why_a_decoder_is_missing(monkeypatch):
    from torchspeed.data import available_decoders as public
    from torchspeed.data import decode

    found = public()
    assert isinstance(found, dict) and list(found) == list(decode.DECODERS)
    assert all(why is None or isinstance(why, str) for why in found.values())
    assert found["simplejpeg"] is None and found["pil"] is None  # installed with torchspeed[data]

    def missing():
        raise ImportError("No module named 'nothing'")

    monkeypatch.setitem(decode.DECODERS, "absent", missing)
    why = public()["absent"]
    assert "not available" in why and "pip install" in why


def test_measured_choices_are_logged_at_info(photo_store, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="torchspeed.data")
    fast_loader(photo_store, 4, crop=16, device="cpu", num_workers=[0], threads=[1, 2], tune_seconds=0.02)
    by_logger = {r.name: r.getMessage() for r in caplog.records if r.levelno == logging.INFO}
    assert by_logger["torchspeed.data.decoder_choice"].startswith("decoder: ")  # what was chosen, with its time
    assert "us/image" in by_logger["torchspeed.data.decoder_choice"]
    tuned = by_logger["torchspeed.data.loader"]
    assert tuned.startswith("fast_loader: num_workers=0, threads=") and "img/s" in tuned
    assert "tuned in" in tuned and "on 24 images" in tuned
    caplog.clear()
    tune_loader(IndexDataset(16), 8, num_workers=[0], tune_seconds=0.02, device="cpu", prefetch_factor=(2,))
    lines = [r.getMessage() for r in caplog.records if r.name == "torchspeed.data.loader_tuning"]
    assert len(lines) == 1 and lines[0].startswith("tune_loader: num_workers=0") and "items/s" in lines[0]


def test_progress_is_a_bool_or_a_callable(tmp_path, capsys):
    said = []
    tune_loader(IndexDataset(16), 8, num_workers=[0], tune_seconds=0.02, device="cpu", prefetch_factor=(2,),
                progress=said.append)
    assert said and said[0].startswith("timing num_workers=0")
    tune_loader(IndexDataset(16), 8, num_workers=[0], tune_seconds=0.02, device="cpu", prefetch_factor=(2,), progress=True,
                refresh=True)  # measured again, not remembered from the call above
    assert "timing num_workers=0" in capsys.readouterr().err
    packed = []
    pack(IndexDataset(40), tmp_path / "s", format="raw", num_workers=1, progress=packed.append)
    assert packed[-1] == "packed 40/40 samples"


def test_the_loader_decodes_at_power_of_two_dct_scales_only(photo_store, photo_folder, monkeypatch):
    """libjpeg-turbo's 7/8..5/8 scales have no SIMD code (a 7/8 decode measured 1.7x a full one): a box
    that a 7/8 or 3/4 decode would still cover is decoded at full size, a smaller one at 1/2, 1/4, 1/8."""
    from torchspeed.data import decode

    real = get_decoder("simplejpeg")
    seen = []

    class Recording(decode.Decoder):
        name = "simplejpeg"

        def decode(self, buf, min_h=0, min_w=0):
            img = real.decode(buf, min_h, min_w)
            seen.append(((min_h, min_w), img.shape[:2]))
            return img

    monkeypatch.setitem(decode._INSTANCES, "simplejpeg", Recording())
    for _ in _epoch(fast_loader(photo_store, 6, crop=24, device="cpu", num_workers=0, threads=1, seed=0,
                                decoder="simplejpeg")):
        pass
    full = (64, 85)  # the store's images
    allowed = {(0, 0): full, **{(-(-64 // s), -(-85 // s)): (-(-64 // s), -(-85 // s)) for s in (2, 4, 8)}}
    assert seen and all(allowed.get(asked) == got for asked, got in seen), seen
    assert {got for _, got in seen} == {full, (32, 43)}  # both full-size and 1/2-scale decodes happen here
    data = open(os.path.join(photo_folder, "class_00", "img_000000.jpg"), "rb").read()  # 96x72
    assert real.decode(data, 63, 84).shape[:2] == (72, 96)  # 7/8 would do: full size instead
    assert real.decode(data, 36, 48).shape[:2] == (36, 48)
