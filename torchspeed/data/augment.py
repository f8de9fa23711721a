"""Augmentation on uint8, planned before decoding and seeded per sample.

Why: the crop box depends only on the stored size (known from the record header), so it is drawn
first; the decoder then downscales in the DCT domain as far as the box allows, and one OpenCV
resize of the box region (not of the whole image) writes the result straight into its slot of the
batch tensor. Every random draw comes from a generator seeded by (seed, epoch, index): a sample's
crop is the same whichever worker makes it and however many workers there are, which is what makes
batches reproducible and a mid-epoch resume exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch.nn.functional as F

from torchspeed.data.libturbojpeg import dct_factor
from torchspeed.optional import optional

__all__ = ["Box", "RandomResizedCropFlip", "ResizeCenterCrop", "SampleRandom", "sample_rng", "sample_draws", "needed_size",
           "render", "render_tensor"]


class Box(NamedTuple):
    """Region of the stored image to resize to the output (top, left, height, width), then flip or not.

    A NamedTuple, not a frozen dataclass: one is made per sample, and a frozen dataclass's
    __init__ (object.__setattr__ per field) costs about twice as much, with the GIL held."""

    top: int
    left: int
    height: int
    width: int
    flip: bool = False


_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SampleRandom:
    """The draws an augmentation needs (random, uniform, randint) from a splitmix64 stream.

    Why not random.Random: seeding a Mersenne Twister fills 624 words, about 10 us per sample of
    GIL-holding Python time, which decoding threads wait on; this costs well under a microsecond
    and passes the statistical tests splitmix64 is known for (BigCrush).
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int):
        self._state = seed & _MASK

    def random(self) -> float:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK
        return (_mix(self._state) >> 11) * (1.0 / (1 << 53))

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.random()

    def randint(self, a: int, b: int) -> int:
        """An integer in [a, b], both ends included (as random.randint)."""
        return a + min(int(self.random() * (b - a + 1)), b - a)


def sample_rng(seed: int, epoch: int, index: int) -> SampleRandom:
    """The generator for one sample's augmentation: a pure function of (seed, epoch, index)."""
    return SampleRandom(_mix(_mix(_mix(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK)))


def _mix_array(z: np.ndarray) -> np.ndarray:
    """`_mix` on a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64, as `& _MASK` does)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sample_draws(seed: int, epochs: Sequence[int], indices: Sequence[int], k: int) -> np.ndarray:
    """The first `k` `random()` draws of `sample_rng(seed, epoch, index)` for each sample, as an (n, k)
    float64 array: bit for bit the scalar generator's, made for a whole batch in a few numpy passes."""
    with np.errstate(over="ignore"):
        e = np.asarray(epochs, dtype=np.int64).astype(np.uint64)
        i = np.asarray(indices, dtype=np.int64).astype(np.uint64)
        state = _mix_array(_mix_array(np.uint64(_mix(seed & _MASK)) ^ e) ^ i)
        steps = np.arange(1, k + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        draws = _mix_array(state[:, None] + steps[None, :]) >> np.uint64(11)
    return draws.astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop (same scale/ratio sampling, 10 tries then centre fallback) + flip."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "_log_r", (math.log(self.ratio[0]), math.log(self.ratio[1])))  # once, not per sample

    def boxes(self, heights: Sequence[int], widths: Sequence[int], seed: int, epochs: Sequence[int],
              indices: Sequence[int]) -> list[Box]:
        """`box(height, width, sample_rng(seed, epoch, index))` for a whole batch at once, the same boxes
        (a test compares them): the draws and the ten tries in numpy, instead of ~5 us of Python per
        sample that a decoding thread holds the GIL for."""
        n = len(indices)
        if n == 0:
            return []
        d = sample_draws(seed, epochs, indices, 23)  # flip, 10 x (scale, ratio), top, left after the last try
        hs, ws = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
        (s0, s1), (r0, r1) = self.scale, self._log_r  # type: ignore[attr-defined]
        target = (hs * ws)[:, None] * (s0 + (s1 - s0) * d[:, 1:21:2])
        # math.exp, not np.exp: numpy's vectorised exp may differ from libm's in the last bit
        aspect = np.array(list(map(math.exp, (r0 + (r1 - r0) * d[:, 2:21:2]).ravel().tolist()))).reshape(n, 10)
        w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
        h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fits = (w > 0) & (w <= ws[:, None]) & (h > 0) & (h <= hs[:, None])
        first = fits.argmax(axis=1)
        rows = np.arange(n)
        bw, bh = w[rows, first], h[rows, first]
        room_h, room_w = hs - bh, ws - bw
        top = np.minimum((d[rows, 3 + 2 * first] * (room_h + 1)).astype(np.int64), room_h)
        left = np.minimum((d[rows, 4 + 2 * first] * (room_w + 1)).astype(np.int64), room_w)
        flips = (d[:, 0] < self.flip_p).tolist()
        out = [Box(*b) for b in zip(top.tolist(), left.tolist(), bh.tolist(), bw.tolist(), flips)]
        for j in np.flatnonzero(~fits.any(axis=1)).tolist():
            out[j] = self._fallback(int(hs[j]), int(ws[j]), flips[j])
        return out

    def _fallback(self, height: int, width: int, flip: bool) -> Box:
        """Ten tries failed: a central crop at the closest allowed ratio (as torchvision)."""
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return Box((height - h) // 2, (width - w) // 2, h, w, flip)

    def box(self, height: int, width: int, rng: SampleRandom) -> Box:
        area = height * width
        (s0, s1), (r0, r1) = self.scale, self._log_r  # type: ignore[attr-defined]
        flip = rng.random() < self.flip_p
        for _ in range(10):
            target = area * rng.uniform(s0, s1)
            aspect = math.exp(rng.uniform(r0, r1))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return Box(rng.randint(0, height - h), rng.randint(0, width - w), h, w, flip)
        return self._fallback(height, width, flip)


@dataclass(frozen=True)
class ResizeCenterCrop:
    """Evaluation: resize the short side to size/crop_fraction, centre-crop `size` (as one box)."""

    size: int
    crop_fraction: float = 0.875

    def box(self, height: int, width: int, rng: Any = None) -> Box:
        side = max(1, min(height, width, int(round(min(height, width) * self.crop_fraction))))
        return Box((height - side) // 2, (width - side) // 2, side, side, False)

    def boxes(self, heights: Sequence[int], widths: Sequence[int], seed: int = 0, epochs: Any = None,
              indices: Any = None) -> list[Box]:
        return [self.box(h, w) for h, w in zip(heights, widths)]


def needed_size(height: int, width: int, box: Box, size: int) -> tuple[int, int]:
    """(min_h, min_w) for a decoder: the smallest DCT-scaled image (1/2, 1/4, 1/8: powers of two only, see
    `libturbojpeg.dct_factor`) on which `box` still covers `size` x `size` output pixels; (0, 0) for full size."""
    s = dct_factor(height, width, math.ceil(height * size / box.height), math.ceil(width * size / box.width))
    return (-(-height // s), -(-width // s)) if s > 1 else (0, 0)


def render(img: np.ndarray, box: Box, out: np.ndarray, tmp: np.ndarray | None = None, scale_h: float = 1.0,
           scale_w: float = 1.0, chw: bool = True, origin: tuple[int, int] = (0, 0),
           full: tuple[int, int] | None = None) -> None:
    """Resize `img`'s box region to the output size, flip it if asked, and write it into `out`.

    `out` is a slot of the uint8 batch: CHW if `chw` (for an NCHW batch: the transposition costs ~8 us here,
    per sample in cache, versus a strided pass over the whole float batch later), else HWC (channels_last,
    written directly). `tmp`: an HWC scratch buffer of the output size. `scale_h`, `scale_w` map stored
    coordinates to the decoded image (DCT-scaled); when only part of it was decoded (`decode_region`),
    `img` is that part, its first pixel at `origin` of the whole decoded image, whose size is `full`.
    """
    cv2 = optional("cv2", "data", "resizing crops in Python (OpenCV)")
    c, oh, ow = out.shape if chw else (out.shape[2], out.shape[0], out.shape[1])
    if not chw:
        tmp = out
    elif tmp is None:
        tmp = np.empty((oh, ow, c), np.uint8)
    fh, fw = full or img.shape[:2]
    if box.height <= 0 or box.width <= 0 or box.top < 0 or box.left < 0:
        raise ValueError(f"the crop box (top {box.top}, left {box.left}, height {box.height}, width {box.width}) is "
                         "empty or starts outside the image")
    t, l = int(box.top * scale_h), int(box.left * scale_w)
    h = max(1, min(fh - t, int(round(box.height * scale_h))))
    w = max(1, min(fw - l, int(round(box.width * scale_w))))
    t, l = t - origin[0], l - origin[1]
    region = img[max(t, 0):t + h, max(l, 0):l + w]
    if region.shape[:2] != (h, w):  # before OpenCV, whose error on an empty region names nothing
        raise ValueError(f"the crop box (top {box.top}, left {box.left}, height {box.height}, width {box.width}) "
                         f"leaves the {fh}x{fw} decoded image (is the stored size the image's?)")
    if (h, w) == (oh, ow):
        tmp[...] = region
    else:
        # INTER_LINEAR: DCT scaling already brought the region within 2x of the output, so the
        # cheap bilinear kernel does not alias; INTER_AREA only when a larger shrink remains.
        interp = cv2.INTER_AREA if h > 2 * oh or w > 2 * ow else cv2.INTER_LINEAR
        cv2.resize(region, (ow, oh), dst=tmp, interpolation=interp)
    if box.flip:
        cv2.flip(tmp, 1, dst=tmp)
    if chw:
        cv2.split(tmp, [out[i] for i in range(c)])  # HWC -> CHW, written in place


def render_tensor(img: Any, box: Box, out: Any, chw: bool = True) -> None:
    """`render` for an image already on the device (CHW uint8 tensor, e.g. decoded by nvjpeg).

    The box region is resized with torch's bilinear kernel (antialiased when it shrinks more than 2x,
    where `render` uses INTER_AREA: nvjpeg decodes at full size, so larger shrinks are common), flipped
    if asked and written into `out` (a CHW slot of the uint8 batch, or HWC with `chw=False`).
    """
    oh, ow = (out.shape[1], out.shape[2]) if chw else (out.shape[0], out.shape[1])
    t, l = box.top, box.left
    h = max(1, min(img.shape[1] - t, box.height))
    w = max(1, min(img.shape[2] - l, box.width))
    region = img[:, t:t + h, l:l + w]
    if (h, w) != (oh, ow):
        region = F.interpolate(region.unsqueeze(0).float(), size=(oh, ow), mode="bilinear", align_corners=False,
                               antialias=h > 2 * oh or w > 2 * ow)[0].round_().clamp_(0, 255)
    if box.flip:
        region = region.flip(-1)
    out.copy_(region if chw else region.permute(1, 2, 0))
