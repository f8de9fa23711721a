"""The turbojpeg decoder's region decode: the pixels of a whole decode, under threads, through the loader.

A decoder that decodes only the part of an image a crop needs must give the loader exactly the batch a
whole decode gives (every scale and chroma subsampling, two threads side by side), and bad data is refused
as the other decoders refuse it.
"""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from torchspeed.data import decode as decode_mod
from torchspeed.data import decoder_choice
from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop, needed_size, sample_rng
from torchspeed.data.decode import Decoder, available_decoders, get_decoder
from torchspeed.data.decoder_choice import measure_decoders

pytestmark = pytest.mark.skipif(available_decoders().get("turbojpeg") is not None,
                                reason="libturbojpeg 3 not available here")


def _jpeg(w: int, h: int, subsampling: int | None, seed: int = 0, mode: str = "RGB") -> bytes:
    """A photo-like JPEG (smooth gradients + noise, so every column differs) at the given chroma subsampling."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 3) % 256], -1)
    img = np.clip(img + rng.normal(0, 20, img.shape), 0, 255).astype(np.uint8)
    im = Image.fromarray(img).convert(mode)
    buf = io.BytesIO()
    kwargs = {} if subsampling is None else {"subsampling": subsampling}
    im.save(buf, format="JPEG", quality=90, **kwargs)
    return buf.getvalue()


CASES = [(213, 160, 2, "RGB"), (173, 131, 0, "RGB"), (211, 97, 1, "RGB"), (150, 120, None, "L"), (500, 375, 2, "RGB")]


def _regions(rng, h: int, w: int, n: int):
    for _ in range(n):
        top, left = int(rng.integers(0, h)), int(rng.integers(0, w))
        yield top, left, int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1))


def _inner(part, row0, col0, fh, fw):
    """The part without its outermost row/column where that is not the image's edge: the margin whose
    smooth upsampling sees no neighbour (a crop box never reads it)."""
    top = 1 if row0 > 0 else 0
    left = 1 if col0 > 0 else 0
    bottom = part.shape[0] - (1 if row0 + part.shape[0] < fh else 0)
    right = part.shape[1] - (1 if col0 + part.shape[1] < fw else 0)
    return (slice(top, bottom), slice(left, right)), (slice(row0 + top, row0 + bottom), slice(col0 + left, col0 + right))


@pytest.mark.parametrize("w,h,subsampling,mode", CASES)
def test_a_region_gives_the_pixels_of_a_whole_decode(w, h, subsampling, mode):
    dec = get_decoder("turbojpeg")
    buf = _jpeg(w, h, subsampling, mode=mode)
    rng = np.random.default_rng(1)
    for min_size in (0, h // 2 + 1, h // 4, h // 8):  # scales 1, 1 (just too big for 1/2), 1/4 or so, 1/8
        whole = dec.decode(buf, min_size, min_size)
        assert whole.shape[2] == 3
        for top, left, rh, rw in _regions(rng, h, w, 25):
            img, row0, col0, fh, fw = dec.decode_region(buf, min_size, min_size, (top, left, rh, rw))
            assert (fh, fw) == whole.shape[:2]
            mine, theirs = _inner(img, row0, col0, fh, fw)
            np.testing.assert_array_equal(img[mine], whole[theirs])
            # what a crop box reads lies inside the exact part
            t, l = top * fh // h, left * fw // w
            assert theirs[0].start <= t and theirs[1].start <= l
            assert theirs[0].stop >= min(fh, -(-(top + rh) * fh // h)) and theirs[1].stop >= min(fw, -(-(left + rw) * fw // w))


def test_turbojpeg_decodes_as_simplejpeg_with_fast_dct_and_smooth_upsampling():
    """Same library, same settings: the pixels must be simplejpeg's (a reference decoder)."""
    simplejpeg = pytest.importorskip("simplejpeg")
    for w, h, subsampling, mode in CASES:
        buf = _jpeg(w, h, subsampling, mode=mode)
        for min_size in (0, h // 4):
            ref = simplejpeg.decode_jpeg(buf, colorspace="RGB", fastdct=True, fastupsample=False,
                                         min_height=min_size, min_width=min_size, min_factor=2)
            np.testing.assert_array_equal(get_decoder("turbojpeg").decode(buf, min_size, min_size), ref)


def test_regions_are_exact_under_two_threads():
    """Each thread its own decompressor; many crops at every scale, side by side, each checked exactly."""
    dec = get_decoder("turbojpeg")
    images = [_jpeg(213, 160, 2, seed=s) for s in range(6)] + [_jpeg(173, 131, 1, seed=9)]
    wholes = {(i, m): dec.decode(b, m, m) for i, b in enumerate(images) for m in (0, 60, 30, 12)}
    failures: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400):
                i = int(rng.integers(0, len(images)))
                m = (0, 60, 30, 12)[int(rng.integers(0, 4))]
                h, w = (160, 213) if i < 6 else (131, 173)
                region = next(_regions(rng, h, w, 1))
                img, row0, col0, fh, fw = dec.decode_region(images[i], m, m, region)
                mine, theirs = _inner(img, row0, col0, fh, fw)
                if not np.array_equal(img[mine], wholes[(i, m)][theirs]):
                    failures.append(f"image {i} min {m} region {region}")
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]


def _python_path(monkeypatch):
    """The loader renders sample by sample in Python (decode_region, then cv2), not in one native call
    (tests/test_native_crops.py compares the two)."""
    monkeypatch.setattr(get_decoder("turbojpeg"), "crops", None)


def _whole_decodes(monkeypatch):
    """Make the turbojpeg decoder decode whole images through the base class (the reference)."""
    dec = get_decoder("turbojpeg")
    monkeypatch.setattr(dec, "decode_region", lambda buf, mh, mw, region: Decoder.decode_region(dec, buf, mh, mw, region))


@pytest.mark.parametrize("transform", [RandomResizedCropFlip(40), RandomResizedCropFlip(64), ResizeCenterCrop(40)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_loader_batches_equal_those_of_whole_decodes(photo_store, monkeypatch, transform, layout):
    from torchspeed.data.rendering import AugmentedDataset
    from torchspeed.data.store import PackedDataset

    _python_path(monkeypatch)
    augmented = AugmentedDataset(PackedDataset(photo_store), transform, "turbojpeg", seed=3, layout=layout)
    keys = [(1, i) for i in range(len(augmented))]
    cropped = np.empty(augmented.batch_shape(len(keys)), np.uint8)
    labels = augmented.render_batch(keys, cropped)
    _whole_decodes(monkeypatch)
    whole = np.empty_like(cropped)
    assert torch.equal(augmented.render_batch(keys, whole), labels)
    np.testing.assert_array_equal(cropped, whole)


def test_fast_loader_with_turbojpeg_matches_whole_decodes(photo_store, monkeypatch):
    from torchspeed.data import fast_loader

    _python_path(monkeypatch)

    def batches():
        loader = fast_loader(photo_store, 8, crop=48, device="cpu", decoder="turbojpeg", num_workers=0, threads=2)
        return [b for b in loader]

    cropped = batches()
    _whole_decodes(monkeypatch)
    for (x, y), (x2, y2) in zip(cropped, batches(), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_bad_jpeg_data_is_an_error():
    dec = get_decoder("turbojpeg")
    good = _jpeg(96, 72, 2)
    for bad in (good[:len(good) // 2], good[:300], b"\xff\xd8" + b"\x00" * 50):
        with pytest.raises(ValueError, match="libturbojpeg could not|no frame header|corrupt header"):
            dec.decode_region(bad, 0, 0, (10, 10, 20, 20))
        with pytest.raises(ValueError, match="libturbojpeg could not|no frame header|corrupt header"):
            dec.decode(bad)


def test_a_failed_header_does_not_leave_its_size_to_the_next_image():
    """libjpeg-turbo 3.0: a decompressor that failed to read a header reports the previous image's size for
    the next header, and a buffer allocated at that size would be overrun by the decode. The decoder
    replaces it after any failure."""
    dec = get_decoder("turbojpeg")
    small, large = _jpeg(96, 72, 2), _jpeg(640, 480, 2, seed=1)
    assert dec.decode(small).shape == (72, 96, 3)
    with pytest.raises(ValueError, match="libturbojpeg could not read the JPEG header"):
        dec.decode_region(small[:200], 0, 0, (0, 0, 10, 10))
    from torchspeed.data.libturbojpeg import TurboJpeg

    np.testing.assert_array_equal(dec.decode(large), TurboJpeg().decode(large)[0])  # a fresh decompressor's pixels
    assert dec.decode_region(large, 0, 0, (0, 0, 480, 640))[0].shape == (480, 640, 3)


def test_a_header_over_the_pixel_limit_is_refused_before_decoding():
    data = bytearray(_jpeg(96, 72, 2))
    i = next(k for k in range(len(data) - 1) if data[k] == 0xFF and data[k + 1] == 0xC0)  # SOF0: P, height, width
    data[i + 5:i + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    with pytest.raises(ValueError, match="the JPEG .*pixels"):
        get_decoder("turbojpeg").decode_region(bytes(data), 0, 0, (0, 0, 10, 10))


@pytest.mark.parametrize("native", [True, False])
def test_decoders_are_timed_on_what_the_loader_asks(monkeypatch, native):
    """With the loader's crops, every CPU decoder is timed rendering them: through the native batch call where
    the decoder has one, else through decode_region with each sample's crop request and the resize."""
    from torchspeed.data.decoder_choice import CropWork

    samples = [_jpeg(213, 160, 2, seed=s) for s in range(4)]
    transform = RandomResizedCropFlip(64)
    boxes = [transform.box(160, 213, sample_rng(0, 0, i)) for i in range(len(samples))]
    regions = [(*needed_size(160, 213, box, 64), (box.top, box.left, box.height, box.width)) for box in boxes]
    dec = get_decoder("turbojpeg")
    if not native:
        monkeypatch.setattr(dec, "crops", None)
    asked: list[tuple] = []
    original = dec.decode_region
    monkeypatch.setattr(dec, "decode_region", lambda b, mh, mw, r: asked.append((mh, mw, r)) or original(b, mh, mw, r))
    rendered: list[list] = []
    if native:
        crops = dec.crops
        real_render = crops.render
        monkeypatch.setattr(crops, "render", lambda *a, **k: rendered.append(list(a[3])) or real_render(*a, **k))
    table = measure_decoders(samples, decoders=["turbojpeg", "pil"], repeats=2,
                             crops=CropWork([160] * 4, [213] * 4, boxes, 64))
    assert [r["decoder"] for r in table] == ["turbojpeg", "pil"]
    assert all(r["us_per_image"] and r["us_per_image"] > 0 for r in table)
    if native:
        assert not asked and rendered and all(r == boxes for r in rendered)
    else:
        assert asked and set(asked) == set(regions)
    assert table[0]["psnr_db"] is not None  # the accuracy is judged on whole decodes


def test_missing_library_names_the_install(monkeypatch):
    from torchspeed.data import libturbojpeg

    monkeypatch.setattr(libturbojpeg.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(libturbojpeg.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(decode_mod, "_INSTANCES", {})
    with pytest.raises(ImportError, match=r"decoder 'turbojpeg' is not available.*torchspeed\[turbojpeg\]"):
        get_decoder("turbojpeg")


def test_a_decoder_choice_timed_on_a_busy_machine_is_not_remembered(monkeypatch):
    from torchspeed.data.decoder_choice import choose_decoder

    samples = [_jpeg(64, 48, 2, seed=s) for s in range(3)]
    measured = []
    real = decoder_choice.measure_decoders
    monkeypatch.setattr(decoder_choice, "measure_decoders", lambda *a, **k: measured.append(1) or real(*a, **k))
    monkeypatch.setattr(decoder_choice, "busy_warning", lambda others_cores: "the machine was busy: a test says so")
    _, table = choose_decoder(samples, parts={"data": "busy-test"})
    assert all(r.get("busy_warning") for r in table if r["us_per_image"] is not None)
    choose_decoder(samples, parts={"data": "busy-test"})
    assert len(measured) == 2  # not remembered: measured again
    monkeypatch.setattr(decoder_choice, "busy_warning", lambda others_cores: None)
    choose_decoder(samples, parts={"data": "busy-test"})
    choose_decoder(samples, parts={"data": "busy-test"})
    assert len(measured) == 3  # the quiet choice is remembered
