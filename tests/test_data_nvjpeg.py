"""nvjpeg decoding on CPU terms: the per-image fallback, the GPU batch path of fast_loader, the checks.

nvjpeg itself needs CUDA (tests/test_data_gpu.py); here torchvision's batched decode_jpeg runs on the
CPU in its place (`decode._nvjpeg` monkeypatched), failing a whole batch for one image as nvjpeg does.
"""
import io
import time

import numpy as np
import pytest
import torch

from torchspeed.data import decode, decoder_choice, fast_loader
from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop
from torchspeed.data.rendering import AugmentedDataset
from torchspeed.data.prefetch import device_tensors, needs_pinning
from torchspeed.data.sources import as_source


def _jpeg(seed, size=(40, 30)) -> bytes:
    from PIL import Image

    a = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 10), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def fake_nvjpeg(monkeypatch):
    """CUDA 'available', nvjpeg replaced by the CPU batch decode; buffers in `rejected` fail their batch."""
    real = decode._nvjpeg
    calls, rejected = [], set()

    def nvjpeg(data, device):
        calls.append(len(data))
        if any(bytes(d.numpy()) in rejected for d in data):
            raise RuntimeError("nvjpegDecodeBatched failed: NVJPEG_STATUS_BAD_JPEG")
        return real(data, "cpu")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "_nvjpeg", nvjpeg)
    return calls, rejected


def test_one_bad_image_falls_back_on_the_cpu_named_in_a_warning(fake_nvjpeg):
    calls, rejected = fake_nvjpeg
    buffers = [_jpeg(0), _jpeg(1), _jpeg(2)]
    rejected.add(buffers[1])
    with pytest.warns(RuntimeWarning, match=r"nvjpeg could not decode b\.jpg; decoded it on the CPU with simplejpeg"):
        out = decode.decode_jpeg_batch_cuda(buffers, "cpu", names=["a.jpg", "b.jpg", "c.jpg"])
    assert calls == [3, 1, 1, 1]  # the batch, then one by one to find the bad image
    assert [tuple(t.shape) for t in out] == [(3, 30, 40)] * 3 and all(t.dtype == torch.uint8 for t in out)
    reference = [torch.from_numpy(decode.get_decoder("simplejpeg").decode(b)).permute(2, 0, 1) for b in buffers]
    assert torch.equal(out[1], reference[1])  # the fallback is the CPU decode itself
    for a, b in zip(out, reference):
        assert decoder_choice.psnr(a.numpy(), b.numpy()) > 30


def test_a_batch_nvjpeg_reads_whole_is_decoded_in_one_call(fake_nvjpeg):
    calls, _ = fake_nvjpeg
    out = decode.decode_jpeg_batch_cuda([_jpeg(0), _jpeg(1)], "cpu")
    assert calls == [2] and len(out) == 2


def test_not_a_jpeg_goes_to_the_cpu_and_undecodable_data_is_named(fake_nvjpeg):
    calls, _ = fake_nvjpeg
    with pytest.warns(RuntimeWarning, match=r"mislabelled\.jpg.*with pil"):
        out = decode.decode_jpeg_batch_cuda([_jpeg(0), _png()], "cpu", names=["ok.jpg", "mislabelled.jpg"])
    assert calls == [1]  # the PNG never reaches nvjpeg
    assert tuple(out[1].shape) == (3, 10, 20) and out[1][:, 0, 0].tolist() == [10, 200, 30]
    broken = b"\xff\xd8\xff\xe0" + bytes(64)
    with pytest.raises(ValueError, match=r"cannot decode broken\.jpg: neither nvjpeg nor the CPU decoders"):
        decode.decode_jpeg_batch_cuda([_jpeg(0), broken], "cpu", names=["ok.jpg", "broken.jpg"])


def test_nvjpeg_needs_cuda_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        decode.decode_jpeg_batch_cuda([_jpeg(0)])
    assert "CUDA" in decode.available_decoders()["nvjpeg"]
    rows = decoder_choice.measure_decoders([_jpeg(0)], repeats=1)  # no CUDA device asked: nvjpeg does not compete
    assert "nvjpeg" not in [r["decoder"] for r in rows]


def test_fast_loader_refuses_nvjpeg_off_cuda_and_with_worker_processes(photo_store, monkeypatch):
    with pytest.raises(ValueError, match="decodes on a CUDA device.*device is cpu"):
        fast_loader(photo_store, 4, crop=16, device="cpu", num_workers=0, decoder="nvjpeg")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("train", [True, False])
def test_gpu_batch_path_matches_the_cpu_pipeline(photo_store, fake_nvjpeg, layout, train):
    """The batch fast_loader(decoder="nvjpeg") makes: whole-batch decode, each box resized with torch."""
    source = as_source(photo_store)
    transform = RandomResizedCropFlip(32) if train else ResizeCenterCrop(32)
    keys = [(1, i) for i in range(0, len(source), 3)]
    gpu = AugmentedDataset(source, transform, "nvjpeg", seed=5, layout=layout, device="cpu")
    cpu = AugmentedDataset(source, transform, "simplejpeg", seed=5, layout=layout)
    (xg, yg), (xc, yc) = gpu.__getitems__(keys), cpu.__getitems__(keys)
    assert xg.shape == xc.shape and xg.dtype == torch.uint8 and torch.equal(yg, yc)
    # the same crops and flips; the pixels differ by the resampling (DCT scaling and cv2 vs torch bilinear)
    assert decoder_choice.psnr(xg.numpy(), xc.numpy()) > 30


def test_gpu_batch_path_reads_raw_records(small_photo_folder, tmp_path, fake_nvjpeg):
    from torchspeed.data import pack

    pack(small_photo_folder, tmp_path / "raw.store", format="raw", progress=False)
    source = as_source(str(tmp_path / "raw.store"))
    keys = [(0, i) for i in range(len(source))]
    xg, yg = AugmentedDataset(source, ResizeCenterCrop(16), "nvjpeg", 0, device="cpu").__getitems__(keys)
    xc, yc = AugmentedDataset(source, ResizeCenterCrop(16), "simplejpeg", 0).__getitems__(keys)
    assert fake_nvjpeg[0] == [] and torch.equal(yg, yc)  # nothing to decode
    assert decoder_choice.psnr(xg.numpy(), xc.numpy()) > 30


def test_only_host_tensors_are_pinned(monkeypatch):
    images, labels = torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.arange(2)
    assert needs_pinning(images) and needs_pinning(labels)
    assert not needs_pinning(torch.zeros(2, device="meta"))  # not on the host: pin_memory() would raise
    assert not needs_pinning("a name") and not needs_pinning(3)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert not needs_pinning(images)  # pinned already (a DataLoader with pin_memory=True)
    assert device_tensors((images, labels, "x")) == [] and device_tensors(images) == []


def test_names_are_built_only_for_an_image_that_falls_back(photo_store, fake_nvjpeg):
    calls, rejected = fake_nvjpeg
    asked = []

    def name(i):
        asked.append(i)
        return f"file{i}.jpg"

    buffers = [_jpeg(0), _jpeg(1), _jpeg(2)]
    decode.decode_jpeg_batch_cuda(buffers, "cpu", names=name)
    assert asked == []  # nvjpeg read them all: no name was needed
    rejected.add(buffers[2])
    with pytest.warns(RuntimeWarning, match=r"nvjpeg could not decode file2\.jpg"):
        decode.decode_jpeg_batch_cuda(buffers, "cpu", names=name)
    assert asked == [2]
    with pytest.raises(ValueError, match="got 2 names for 3 images"):
        decode.decode_jpeg_batch_cuda(buffers, "cpu", names=["a.jpg", "b.jpg"])
    # the loader's batch path names a falling-back image by its record in the store
    source = as_source(photo_store)
    rejected.add(bytes(source.record(3).payload))
    gpu = AugmentedDataset(source, ResizeCenterCrop(16), "nvjpeg", seed=0, device="cpu")
    with pytest.warns(RuntimeWarning, match=r"nvjpeg could not decode record 3 of store"):
        gpu.__getitems__([(0, 1), (0, 3)])


def test_a_truncated_jpeg_never_reaches_nvjpeg(fake_nvjpeg):
    """nvjpeg may decode a file that stops early into garbage where libjpeg reports it: such data (no EOI
    marker after its last scan) goes to the CPU decoders, as the CPU pipeline would read it."""
    calls, _ = fake_nvjpeg
    good = _jpeg(0)
    truncated = good[: len(good) * 2 // 3]
    assert decode.jpeg_is_complete(good) and not decode.jpeg_is_complete(truncated)
    assert decode.jpeg_is_complete(good + b"\x00" * 16)  # bytes after the end marker do not matter
    # simplejpeg and PIL refuse this one: named as unreadable (a CPU decoder that reads it warns instead)
    with pytest.raises(ValueError, match=r"cannot decode cut\.jpg: neither nvjpeg nor the CPU decoders"):
        decode.decode_jpeg_batch_cuda([good, truncated], "cpu", names=["ok.jpg", "cut.jpg"])
    assert calls == [1]  # only the complete image went to nvjpeg


@pytest.fixture
def host_timing(monkeypatch):
    """measure_decoders' timing without the CUDA synchronisation (no device here)."""
    real = decoder_choice.compare
    monkeypatch.setattr(decoder_choice, "compare", lambda contenders, **kw: real(contenders, **{**kw, "device": None}))


def test_measuring_nvjpeg_never_times_the_cpu_fallback(fake_nvjpeg, host_timing):
    calls, rejected = fake_nvjpeg
    buffers = [_jpeg(0), _jpeg(1)]
    rejected.add(buffers[1])
    with pytest.raises(ValueError, match="nvjpeg could not decode image 1 of the batch"):
        decode.decode_jpeg_batch_cuda(buffers, "cpu", fallback=None)
    dec = decode.NvjpegDecoder("cpu")
    with pytest.raises(ValueError, match="nvjpeg could not decode"):
        dec.decode_batch(buffers)  # what measure_decoders times: nvjpeg alone
    rows = decoder_choice.measure_decoders(buffers, decoders="simplejpeg,nvjpeg", repeats=1, device="cuda")
    nv = {r["decoder"]: r for r in rows}["nvjpeg"]
    assert nv["us_per_image"] is None and "nvjpeg could not decode" in nv["error"]  # not a candidate


def test_cpu_decoders_race_nvjpeg_on_the_loaders_threads(fake_nvjpeg, host_timing, monkeypatch):
    """Like with like: when nvjpeg competes, the CPU decoders decode on as many threads as the loader
    would give them, not on one."""
    import threading

    threads_seen = set()
    sj = decode.get_decoder("simplejpeg")
    real = sj._decode

    def counted(buf, min_h, min_w):
        threads_seen.add(threading.get_ident())
        time.sleep(0.002)  # long enough for the pool's threads to overlap
        return real(buf, min_h, min_w)

    monkeypatch.setattr(sj, "_decode", counted)
    samples = [_jpeg(i) for i in range(8)]
    rows = decoder_choice.measure_decoders(samples, decoders="simplejpeg,nvjpeg", repeats=1, device="cuda", cpu_threads=3)
    by = {r["decoder"]: r for r in rows}
    assert by["simplejpeg"]["threads"] == 3 and by["nvjpeg"]["threads"] is None
    assert len(threads_seen - {threading.get_ident()}) > 1  # timed on the pool (the reference decode is here)
    threads_seen.clear()
    rows = decoder_choice.measure_decoders(samples, decoders="simplejpeg", repeats=1)  # no GPU in the race: one thread
    assert rows[0]["threads"] == 1 and threads_seen == {threading.get_ident()}


def test_each_decoding_thread_has_a_stream_of_its_own_finished_on_exit(monkeypatch):
    """decoding_stream, with torch's CUDA stream API faked: per thread and device a stream that is not
    the default one, made current for the block and waited for at its end."""
    import contextlib
    import threading

    log, stacks = [], {}

    class Stream:
        def __init__(self, device):
            self.device = device
            log.append(("new", threading.get_ident()))

        def synchronize(self):
            log.append(("synchronize", self))

    @contextlib.contextmanager
    def on(stream):
        current = stacks.setdefault(threading.get_ident(), [])  # torch's current stream is per thread
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    got = {}

    def work(name):
        for _ in range(2):
            with decode.decoding_stream("cuda") as s:
                assert stacks[threading.get_ident()] == [s]
                got.setdefault(name, []).append(s)
                waited = log.count(("synchronize", s))
            assert log.count(("synchronize", s)) == waited + 1  # waited for at the end of the block, not before

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0][0] is got[0][1] and got[1][0] is got[1][1] and got[0][0] is not got[1][0]
    assert sum(1 for e in log if e[0] == "new") == 2 and sum(1 for e in log if e[0] == "synchronize") == 4
    with decode.decoding_stream("cpu") as s:  # no CUDA: the block runs as it is
        assert s is None and not any(stacks.values())
