"""The data area on a CUDA device: prefetcher stream safety, nvjpeg against simplejpeg (`make test-gpu`).

The prefetcher converts batch k+1 on a side stream while the main stream still works on batch k.
Each stream is stalled on purpose in turn (torch.cuda._sleep): the main stream, with the allocator
kept busy, so a missing record_stream shows as wrong checksums; the side stream, so a main stream that
does not wait for it (a missing wait_stream) reads a batch still being written. A hidden host sync
raises under torch.cuda.set_sync_debug_mode("error") (set after the first batch, whose constants are
copied once). nvjpeg falling back to the CPU decoder is an error here unless the test expects it: a
test where every image fell back would otherwise pass without nvjpeg having decoded anything.
"""
import io
import warnings

import numpy as np
import pytest
import torch

from torchspeed.data import DevicePrefetcher, fast_loader, normalize_batch
from torchspeed.data.decode import decode_jpeg_batch_cuda, get_decoder
from torchspeed.data.decoder_choice import measure_decoders, psnr
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

pytestmark = [pytest.mark.gpu,  # without a usable CUDA device the GPU suite fails (conftest.py), never skips
              pytest.mark.filterwarnings("error:nvjpeg could not decode:RuntimeWarning")]

STALL = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds, far longer than one conversion


def _batches(n=10, size=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (16, 3, size, size), dtype=torch.uint8, generator=g), torch.arange(16) + 16 * i)
            for i in range(n)]


def _expected(batches):
    return [float(normalize_batch(x, IMAGENET_MEAN, IMAGENET_STD).double().sum()) for x, _ in batches]


def _consume(prefetcher, pressure):
    """Checksums queued on the stalled main stream, read only at the end (no sync in the loop)."""
    sums, labels = [], []
    try:
        for i, (x, y) in enumerate(prefetcher):
            if i == 1:
                torch.cuda.set_sync_debug_mode("error")  # from here on, any host sync raises
            assert x.is_cuda and y.is_cuda
            torch.cuda._sleep(STALL)  # the main stream falls behind the side stream
            sums.append(x.double().sum())
            labels.append(y.clone())
            del x, y  # freed while the main stream has not read it yet: only record_stream protects it
            if pressure:  # keep the caching allocator handing blocks out again
                junk = [torch.empty(8 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
                del junk
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [float(s) for s in sums], [t.cpu() for t in labels]


@pytest.mark.parametrize("pressure", [False, True])
def test_prefetcher_is_stream_safe_with_a_stalled_main_stream(pressure):
    batches = _batches()
    sums, labels = _consume(DevicePrefetcher(batches, "cuda"), pressure)
    assert sums == pytest.approx(_expected(batches), rel=1e-5)
    assert all(torch.equal(a, y) for a, (_, y) in zip(labels, batches))


class SideStalled(DevicePrefetcher):
    """Each conversion starts with a stall queued on the side stream (convert runs under it): the batch
    is written long after the host has moved on, so only the main stream's wait_stream makes it safe."""

    def convert(self, batch, out=None):
        torch.cuda._sleep(STALL)
        return super().convert(batch, out)


def test_prefetcher_main_stream_waits_for_a_stalled_side_stream():
    batches = _batches()
    stalled = SideStalled(batches, "cuda")
    sums, labels = [], []
    for x, y in stalled:  # no stall on the main stream: it would read the batch before the side stream wrote it
        sums.append(x.double().sum())
        labels.append(y.clone())
    torch.cuda.synchronize()
    assert [float(v) for v in sums] == pytest.approx(_expected(batches), rel=1e-5)
    assert all(torch.equal(a.cpu(), y) for a, (_, y) in zip(labels, batches))


def test_prefetcher_takes_batches_made_on_the_gpu_without_pinning_and_waits_for_them():
    batches = _batches()
    on_gpu = [(x.cuda(), y.cuda()) for x, y in batches]
    torch.cuda.synchronize()

    def made_late():  # each batch is written by the main stream after a stall, as a GPU decoder would
        for x, y in on_gpu:
            torch.cuda._sleep(STALL)
            yield x.clone(), y.clone()

    class Loader:
        def __iter__(self):
            return made_late()

        def __len__(self):
            return len(on_gpu)

    sums, labels = _consume(DevicePrefetcher(Loader(), "cuda"), pressure=True)
    assert sums == pytest.approx(_expected(batches), rel=1e-5)
    assert all(torch.equal(a, y) for a, (_, y) in zip(labels, batches))


def _photo_jpegs(n=8):
    from PIL import Image

    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        base = rng.integers(0, 255, (1, 1, 3)).astype(np.float32)
        yy, xx = np.mgrid[0:120, 0:160]
        img = np.clip(base + 60 * np.sin(xx[..., None] / (7 + i)) + 40 * np.cos(yy[..., None] / 9), 0, 255)
        buf = io.BytesIO()
        Image.fromarray(img.astype(np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def test_nvjpeg_matches_simplejpeg_and_survives_a_bad_image():
    good = _photo_jpegs()
    bad = good[0][: len(good[0]) // 3]  # truncated: nvjpeg may refuse it, the CPU decoders must name it or read it
    garbage = b"\xff\xd8\xff\xe0" + bytes(100)
    buffers = good[:4] + [garbage] + good[4:]
    names = [f"img{i}.jpg" for i in range(len(buffers))]
    with pytest.raises(ValueError, match="img4.jpg"):
        decode_jpeg_batch_cuda(buffers, names=names)
    buffers[4] = bad
    with warnings.catch_warnings(record=True) as caught:  # recorded and counted, not swallowed
        warnings.simplefilter("always")
        try:
            out = decode_jpeg_batch_cuda(buffers, names=names)
        except ValueError as e:  # the truncated image is unreadable for every decoder: named
            assert "img4.jpg" in str(e)
            out = decode_jpeg_batch_cuda(good, names=names[:4] + names[5:])
            buffers = good
    fell_back = [str(w.message) for w in caught if "nvjpeg could not decode" in str(w.message)]
    # the truncated image never reaches nvjpeg (no EOI marker); every good one is decoded on the GPU
    assert all("img4.jpg" in m for m in fell_back) and len(fell_back) <= 1, fell_back
    ref = get_decoder("simplejpeg")
    for img, b in zip(out, buffers):
        if b is bad:
            continue
        assert img.is_cuda and img.dtype == torch.uint8
        assert psnr(img.permute(1, 2, 0).cpu().numpy(), ref.decode(b)) > 30


def test_nvjpeg_decodes_on_a_stream_of_its_own_thread():
    """fast_loader's decoding threads work on streams of their own (not the default stream the training
    step uses), and hand over a batch whose GPU work is finished."""
    import threading

    from torchspeed.data.decode import decoding_stream

    seen = {}

    def work(name):
        with decoding_stream("cuda"):
            seen[name] = stream = torch.cuda.current_stream()
            torch.cuda._sleep(STALL)  # GPU work still queued when the block ends
            decode_jpeg_batch_cuda(_photo_jpegs(2))
        seen[name + " ready"] = stream.query()  # finished on exit: nothing left for the consumer to wait on

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    default = torch.cuda.default_stream()
    assert seen["t0"] != default and seen["t1"] != default and seen["t0"] != seen["t1"]
    assert seen["t0 ready"] and seen["t1 ready"]


def test_nvjpeg_competes_on_cuda_and_the_loader_makes_batches_with_it(photo_store):
    rows = measure_decoders(_photo_jpegs(4), repeats=2, device="cuda")
    nv = [r for r in rows if r["decoder"] == "nvjpeg"]
    assert nv and nv[0]["us_per_image"] is not None and nv[0]["psnr_db"] > 30
    gpu = fast_loader(photo_store, 8, crop=32, device="cuda", num_workers=0, threads=2, decoder="nvjpeg")
    cpu = fast_loader(photo_store, 8, crop=32, device="cpu", num_workers=0, threads=1, decoder="simplejpeg")
    for (xg, yg), (xc, yc) in zip(gpu, cpu):
        assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(yg.cpu(), yc)
        assert torch.nn.functional.mse_loss(xg.cpu(), xc).item() < 0.05  # the same crops, resampled alike
    with pytest.raises(ValueError, match="num_workers=0"):
        fast_loader(photo_store, 8, crop=32, device="cuda", num_workers=2, decoder="nvjpeg")
