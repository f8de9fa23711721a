"""The native batch renderer (data/_crops.c): the crops the Python path renders, for whole batches at once.

Its decode is libturbojpeg's region decode and its resize follows OpenCV's coordinates in integer
arithmetic, so each pixel must be within one level of `augment.render` on the same decode (every
chroma subsampling, DCT scale, shrink past 2x, flip and layout); a sample it cannot render is rendered
again in Python, whose error names it, and `on_error="skip"` leaves it out with the rest intact.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop, needed_size, render, sample_rng
from torchspeed.data.decode import available_decoders, get_decoder

pytestmark = pytest.mark.skipif(available_decoders().get("turbojpeg") is not None,
                                reason="libturbojpeg 3 not available here")


def _crops():
    crops = get_decoder("turbojpeg").crops
    if crops is None:
        pytest.fail("torchspeed.data._crops was not compiled: `make install` builds it (a C compiler is needed)")
    return crops


def _jpeg(w: int, h: int, subsampling: int | None, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 3) % 256], -1)
    img = np.clip(img + rng.normal(0, 20, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(buf, format="JPEG", quality=90,
                                             **({} if subsampling is None else {"subsampling": subsampling}))
    return buf.getvalue()


def _python_render(payload, h, w, box, out, chw):
    """The Python path for one sample (what `AugmentedDataset._render` does with the turbojpeg decoder)."""
    size = out.shape[1]
    dec = get_decoder("turbojpeg")
    min_h, min_w = needed_size(h, w, box, size)
    img, r0, c0, fh, fw = dec.decode_region(payload, min_h, min_w, (box.top, box.left, box.height, box.width))
    render(img, box, out, None, fh / h, fw / w, chw=chw, origin=(r0, c0), full=(fh, fw))


# 4:2:0, 4:4:4, 4:2:2, grey; sizes where crops upscale, shrink within 2x, past 2x and at 1/2 .. 1/8 DCT scales
IMAGES = [(213, 160, 2, "RGB"), (173, 131, 0, "RGB"), (211, 97, 1, "RGB"), (150, 120, None, "L"), (900, 640, 2, "RGB")]


@pytest.mark.parametrize("size", [16, 40, 128])
@pytest.mark.parametrize("chw", [True, False])
def test_native_crops_are_those_of_the_python_path(size, chw):
    crops = _crops()
    payloads, heights, widths = [], [], []
    for k, (w, h, subsampling, mode) in enumerate(IMAGES):
        for seed in range(6):
            payloads.append(_jpeg(w, h, subsampling, seed=10 * k + seed, mode=mode))
            heights.append(h)
            widths.append(w)
    n = len(payloads)
    boxes = RandomResizedCropFlip(size, scale=(0.02, 1.0)).boxes(heights, widths, 7, [0] * n, list(range(n)))
    boxes += ResizeCenterCrop(size).boxes(heights, widths)
    payloads, heights, widths = payloads * 2, heights * 2, widths * 2
    assert any(b.flip for b in boxes) and not all(b.flip for b in boxes)
    shape = (len(boxes), 3, size, size) if chw else (len(boxes), size, size, 3)
    native = np.zeros(shape, np.uint8)
    status = crops.render(payloads, heights, widths, boxes, native, chw, max_pixels=10**9)
    assert not status.any()
    reference = np.zeros_like(native)
    for i, box in enumerate(boxes):
        _python_render(payloads[i], heights[i], widths[i], box, reference[i], chw)
    diff = np.abs(native.astype(np.int16) - reference)
    assert diff.max() <= 1, f"{int((diff > 1).sum())} pixels differ by more than one level"
    assert diff.mean() < 0.2


def test_the_decoder_decodes_exactly_after_a_native_batch():
    """The native call sets the decompressor's scale and region itself: the Python decode that follows must
    not trust what it remembers having set."""
    from torchspeed.data.libturbojpeg import TurboJpeg

    crops, dec = _crops(), get_decoder("turbojpeg")
    big, small = _jpeg(640, 480, 2, seed=1), _jpeg(96, 72, 2, seed=2)
    fresh = TurboJpeg()  # its own decompressor, never touched by native code
    region = (10, 10, 30, 30)
    dec.decode_region(small, 0, 0, region)  # this thread's handle now remembers scale 1 and a region
    box = RandomResizedCropFlip(16).box(480, 640, sample_rng(0, 0, 0))
    crops.render([big], [480], [640], [box], np.zeros((1, 3, 16, 16), np.uint8), True, max_pixels=10**9)
    for got, want in zip(dec.decode_region(small, 0, 0, region), fresh.decode(small, 0, 0, region)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dec.decode(small), fresh.decode(small)[0])


def _augmented(photo_store, on_error="fail", layout="NCHW"):
    from torchspeed.data.rendering import AugmentedDataset
    from torchspeed.data.store import PackedDataset

    return AugmentedDataset(PackedDataset(photo_store), RandomResizedCropFlip(40), "turbojpeg", seed=3,
                            layout=layout, on_error=on_error)


def _python_path(monkeypatch):
    monkeypatch.setattr(get_decoder("turbojpeg"), "crops", None)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_loader_batches_native_against_python(photo_store, monkeypatch, layout):
    _crops()
    augmented = _augmented(photo_store, layout=layout)
    keys = [(1, i) for i in range(len(augmented))]
    native = np.zeros(augmented.batch_shape(len(keys)), np.uint8)
    labels = augmented.render_batch(keys, native)
    _python_path(monkeypatch)
    python = np.zeros_like(native)
    assert torch.equal(augmented.render_batch(keys, python), labels)
    assert np.abs(native.astype(np.int16) - python).max() <= 1


class _Corrupted:
    """A store whose record `bad` has its JPEG data cut short."""

    def __init__(self, source, bad):
        self.source, self.bad = source, bad

    def __len__(self):
        return len(self.source)

    def record(self, index):
        rec = self.source.record(index)
        if index == self.bad:
            rec = rec._replace(payload=bytes(rec.payload)[:200])
        return rec

    def name(self, index):
        return f"record {index} of the test store"


def test_a_sample_the_native_call_cannot_render_is_named_or_skipped(photo_store, monkeypatch, caplog):
    _crops()
    keys = [(0, i) for i in range(6)]
    clean = _augmented(photo_store)
    expected = np.zeros(clean.batch_shape(6), np.uint8)
    expected_labels = clean.render_batch(keys, expected)

    failing = _augmented(photo_store)
    failing.source = _Corrupted(failing.source, bad=2)
    monkeypatch.setattr("torchspeed.data.rendering.sample_name", lambda source, index: source.name(index))
    with pytest.raises(ValueError, match="cannot decode record 2 of the test store"):
        failing.render_batch(keys, np.zeros(failing.batch_shape(6), np.uint8))

    skipping = _augmented(photo_store, on_error="skip")
    skipping.source = _Corrupted(skipping.source, bad=2)
    images = np.zeros(skipping.batch_shape(6), np.uint8)
    labels = skipping.render_batch(keys, images)
    kept = [0, 1, 3, 4, 5]
    assert labels.tolist() == expected_labels[kept].tolist()
    np.testing.assert_array_equal(images[:5], expected[kept])
    assert "record 2 of the test store" in caplog.text


def test_a_size_over_the_pixel_limit_is_refused_as_in_python(photo_store, monkeypatch):
    from torchspeed import images

    _crops()
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)
    augmented = _augmented(photo_store)
    with pytest.raises(ValueError, match="more than the limit of 100"):
        augmented.render_batch([(0, 0), (0, 1)], np.zeros(augmented.batch_shape(2), np.uint8))


@pytest.mark.parametrize("chw", [True, False])
def test_normalised_output_is_the_uint8_output_normalised(chw):
    crops = _crops()
    payloads = [_jpeg(213, 160, 2, seed=s) for s in range(8)] + [_jpeg(150, 120, None, seed=9, mode="L")]
    n = len(payloads)
    boxes = RandomResizedCropFlip(48).boxes([160] * 8 + [120], [213] * 8 + [150], 1, [0] * n, list(range(n)))
    heights, widths = [160] * 8 + [120], [213] * 8 + [150]
    shape = (n, 3, 48, 48) if chw else (n, 48, 48, 3)
    pixels = np.zeros(shape, np.uint8)
    crops.render(payloads, heights, widths, boxes, pixels, chw, max_pixels=10**9)
    scale, shift = [0.017, 0.0175, 0.0174], [-2.1, -2.03, -1.8]
    floats = np.zeros(shape, np.float32)
    status = crops.render(payloads, heights, widths, boxes, floats, chw, max_pixels=10**9, normalize=(scale, shift))
    assert not status.any()
    bcast = (3, 1, 1) if chw else (3,)
    expected = pixels.astype(np.float32) * np.float32(scale).reshape(bcast) + np.float32(shift).reshape(bcast)
    np.testing.assert_array_equal(floats, expected)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("normalized", [True, False])
def test_the_loader_normalising_while_rendering_gives_the_prefetchers_batches(photo_store, monkeypatch, channels_last,
                                                                              normalized):
    """On a CPU the loader's threads write normalised floats straight from the native call; the batches must
    be those of rendering uint8 and converting them with the prefetcher, bit for bit."""
    from torchspeed.data import fast_loader
    from torchspeed.data.prefetch import DevicePrefetcher

    _crops()
    stats = {} if normalized else {"mean": None, "std": None}

    def batches():
        loader = fast_loader(photo_store, 8, crop=40, device="cpu", decoder="turbojpeg", num_workers=0, threads=2,
                             channels_last=channels_last, **stats)
        return [b for b in loader]

    fused = batches()
    monkeypatch.setattr(DevicePrefetcher, "uint8_affine", lambda self, layout: None)
    converted = batches()
    assert len(fused) == len(converted) == 3
    for (x, y), (x2, y2) in zip(fused, converted):
        assert x.dtype == x2.dtype == torch.float32 and x.shape == x2.shape
        assert x.is_contiguous(memory_format=torch.channels_last) == channels_last == \
            x2.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_bad_sample_left_out_of_a_normalised_batch(photo_store, caplog):
    _crops()
    keys = [(0, i) for i in range(6)]
    scale, shift = [0.02, 0.02, 0.02], [-1.0, -1.0, -1.0]
    clean = _augmented(photo_store)
    expected = np.zeros(clean.batch_shape(6), np.float32)
    expected_labels = clean.render_batch(keys, expected, normalize=(scale, shift))
    skipping = _augmented(photo_store, on_error="skip")
    skipping.source = _Corrupted(skipping.source, bad=4)
    images = np.zeros(skipping.batch_shape(6), np.float32)
    labels = skipping.render_batch(keys, images, normalize=(scale, shift))
    kept = [0, 1, 2, 3, 5]
    assert labels.tolist() == expected_labels[kept].tolist()
    np.testing.assert_array_equal(images[:5], expected[kept])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_normalising_without_the_native_call_is_the_prefetchers(photo_store, monkeypatch, layout):
    """Where the native call does not apply (records of raw pixels, a sample rendered again in Python) the
    normalised batch is still the prefetcher's conversion of the uint8 one."""
    from torchspeed.data.prefetch import DevicePrefetcher

    _python_path(monkeypatch)
    augmented = _augmented(photo_store, layout=layout)
    keys = [(2, i) for i in range(8)]
    pixels = np.zeros(augmented.batch_shape(8), np.uint8)
    labels = augmented.render_batch(keys, pixels)
    prefetcher = DevicePrefetcher([], "cpu", channels_last=layout == "NHWC", layout=layout)
    expected, _ = prefetcher.convert((torch.from_numpy(pixels), labels))
    floats = np.zeros(augmented.batch_shape(8), np.float32)
    assert torch.equal(augmented.render_batch(keys, floats, normalize=prefetcher.uint8_affine(layout)), labels)
    got = torch.from_numpy(floats)
    assert torch.equal(got if layout == "NCHW" else got.permute(0, 3, 1, 2), expected)
