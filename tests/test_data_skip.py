"""on_error="skip" on every path: the GPU batch path (nvjpeg faked on the CPU) leaves an unreadable image out
like the CPU path does, and a batch whose every sample is bad is not handed to the training loop."""
from __future__ import annotations

import logging
import os
import pathlib
import shutil

import pytest
import torch

from torchspeed.data import decode, fast_loader


@pytest.fixture
def fake_nvjpeg(monkeypatch):
    """CUDA 'available' and nvjpeg replaced by torchvision's CPU batch decode (which fails a whole batch
    for one bad image, as nvjpeg does)."""
    real = decode._nvjpeg
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "_nvjpeg", lambda data, device: real(data, "cpu"))


def _folder_with_bad(src, dst: pathlib.Path, bad: dict[str, bytes]) -> str:
    """A copy of the folder `src` with the files `bad` added to its first class."""
    shutil.copytree(src, dst)
    cls = sorted(os.listdir(dst))[0]
    for name, data in bad.items():
        (dst / cls / name).write_bytes(data)
    return str(dst)


def test_nvjpeg_batch_path_skips_an_unreadable_image_and_names_it(small_photo_folder, tmp_path, fake_nvjpeg, caplog):
    from torchspeed.data.augment import ResizeCenterCrop
    from torchspeed.data.rendering import AugmentedDataset
    from torchspeed.data.sources import as_source

    good_jpeg = sorted(pathlib.Path(small_photo_folder).rglob("*.jpg"))[0].read_bytes()
    folder = _folder_with_bad(small_photo_folder, tmp_path / "f", {
        "zz_broken.jpg": b"\xff\xd8\xff\xdb" + b"\x00" * 64,  # no frame header: the record cannot be read
        "zz_truncated.jpg": good_jpeg[:len(good_jpeg) // 2]})  # readable header, no decoder reads its data
    source = as_source(folder, on_error="skip")
    n = len(source)
    keys = [(0, i) for i in range(n)]
    skipping = AugmentedDataset(source, ResizeCenterCrop(24), "nvjpeg", 0, device=torch.device("cpu"), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        images, labels = skipping.device_batch(keys)
    assert images.shape[0] == labels.shape[0] == n - 2
    assert "zz_broken.jpg" in caplog.text and "zz_truncated.jpg" in caplog.text
    failing = AugmentedDataset(source, ResizeCenterCrop(24), "nvjpeg", 0, device=torch.device("cpu"), on_error="fail")
    with pytest.raises(ValueError, match="zz_broken.jpg"):
        failing.device_batch(keys)
    with pytest.raises(ValueError, match="zz_truncated.jpg"):
        failing.device_batch([k for k in keys if "zz_broken" not in source.samples[k[1]][0]])
    # the batch kept is the one made from the good images alone
    good = [k for k in keys if "zz_" not in source.samples[k[1]][0]]
    ref, ref_labels = failing.device_batch(good)
    assert torch.equal(ref, images) and torch.equal(ref_labels, labels)


def test_a_batch_whose_every_sample_is_bad_is_not_yielded(small_photo_folder, tmp_path, caplog):
    bad = {f"zz_bad{i}.jpg": b"\xff\xd8 not a jpeg" for i in range(4)}
    folder = _folder_with_bad(small_photo_folder, tmp_path / "g", bad)
    loader = fast_loader(folder, 4, crop=16, train=False, device="cpu", decoder="simplejpeg", num_workers=0,
                         threads=1, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        batches = list(loader)
    total = len(loader.dataset)
    assert all(len(y) > 0 for _, y in batches)
    assert sum(len(y) for _, y in batches) == total - len(bad)
    assert len(batches) == len(loader) - 1  # the all-bad batch (the four files added to the first class) is left out
    assert "a whole batch was left out" in caplog.text
    assert loader.state_dict()["batches_done"] == 0 and loader.epoch == 1  # the epoch still ends
