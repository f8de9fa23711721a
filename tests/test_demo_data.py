"""The demo photos: deterministic whatever the process count, photo-like JPEGs, an ImageFolder torchvision reads."""
import hashlib
import os

import numpy as np
import pytest
from PIL import Image

from torchspeed.data import make_photo_folder


def _digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            h.update(f.encode())
            h.update(open(os.path.join(dirpath, f), "rb").read())
    return h.hexdigest()


def test_demo_folder_is_deterministic_and_complete(tmp_path):
    a = make_photo_folder(tmp_path / "a", 30, n_classes=3, seed=1, num_workers=1)
    b = make_photo_folder(tmp_path / "b", 30, n_classes=3, seed=1, num_workers=2)
    c = make_photo_folder(tmp_path / "c", 30, n_classes=3, seed=2, num_workers=1)
    assert _digest(a) == _digest(b) != _digest(c)
    assert sorted(os.listdir(a)) == ["class_00", "class_01", "class_02"]
    assert [len(os.listdir(os.path.join(a, d))) for d in sorted(os.listdir(a))] == [10, 10, 10]


def test_demo_images_decode_and_look_like_photos(tmp_path):
    root = make_photo_folder(tmp_path, 20, n_classes=2, seed=0, num_workers=1)
    sizes, stds = [], []
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            im = Image.open(path)
            assert im.format == "JPEG" and im.size == (500, 375) and im.mode == "RGB"
            a = np.asarray(im, dtype=np.float32)
            sizes.append(os.path.getsize(path))
            stds.append(a.std())
    assert 35_000 < np.mean(sizes) < 65_000  # real 500x375 q90 photos weigh 40-60 KB
    assert min(stds) > 10  # not flat colour


def test_torchvision_reads_it_as_imagefolder(tmp_path):
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(make_photo_folder(tmp_path, 12, n_classes=4, seed=0, num_workers=1))
    assert len(ds) == 12 and ds.classes == ["class_00", "class_01", "class_02", "class_03"]
    assert sorted({y for _, y in ds.samples}) == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, match", [({"n_images": 0}, "n_images"), ({"n_images": 5, "n_classes": 9}, "n_classes"),
                                           ({"n_images": 20, "seed": -1}, "seed")])
def test_bad_arguments_are_refused_naming_the_argument(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_photo_folder(tmp_path, **kwargs)
