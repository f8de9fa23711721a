"""A batch's crop boxes drawn together are the boxes drawn one sample at a time, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from torchspeed.data.augment import RandomResizedCropFlip, ResizeCenterCrop, sample_draws, sample_rng


def test_draws_of_a_batch_are_the_scalar_generators():
    draws = sample_draws(7, [0, 3, 3], [0, 5, 2**40], 23)
    for row, (epoch, index) in zip(draws, [(0, 0), (3, 5), (3, 2**40)]):
        rng = sample_rng(7, epoch, index)
        assert row.tolist() == [rng.random() for _ in range(23)]


@pytest.mark.parametrize("transform", [RandomResizedCropFlip(128), RandomResizedCropFlip(64, scale=(0.5, 1.0), ratio=(0.5, 2.0)),
                                       RandomResizedCropFlip(32, scale=(0.9, 1.0), ratio=(3.0, 4.0)), ResizeCenterCrop(40)])
def test_batch_boxes_equal_the_per_sample_boxes(transform):
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 80))
        heights = rng.integers(1, 700, n).tolist()
        widths = (rng.integers(1, 12, n) if trial % 3 == 0 else rng.integers(1, 700, n)).tolist()  # thin: fallbacks
        seed, epochs = int(rng.integers(0, 2**63)), rng.integers(0, 1000, n).tolist()
        indices = rng.integers(0, 2**40, n).tolist()
        expected = [transform.box(h, w, sample_rng(seed, e, i)) for h, w, e, i in zip(heights, widths, epochs, indices)]
        assert transform.boxes(heights, widths, seed, epochs, indices) == expected
    assert transform.boxes([], [], 0, [], []) == []
