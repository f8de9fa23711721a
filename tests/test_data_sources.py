"""Record sources: train/val splits and evenly spread subsets of folders, stores and Datasets."""
import os
import shutil

import numpy as np
import pytest

from torchspeed.data import evenly_spread, train_val_split
from torchspeed.data.sources import DatasetSource, FolderSource, Subset, as_source


class Labelled:
    """A map-style Dataset of tiny arrays; label i % 2."""

    classes = ["even", "odd"]

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((4, 5, 3), i, np.uint8), i % 2


def _paths(subset):
    return [subset.source.samples[i][0] for i in subset.indices]


def test_split_of_one_folder_is_seeded_disjoint_and_complete(photo_folder):
    train, val = train_val_split(photo_folder, val_fraction=0.25, seed=1)
    assert isinstance(train, Subset) and len(train) == 18 and len(val) == 6
    assert not set(train.indices) & set(val.indices) and sorted(train.indices + val.indices) == list(range(24))
    assert train.indices == sorted(train.indices)  # read in folder order
    assert train.classes == val.classes == ["class_00", "class_01", "class_02"]
    again, _ = train_val_split(photo_folder, val_fraction=0.25, seed=1)
    other, _ = train_val_split(photo_folder, val_fraction=0.25, seed=2)
    assert _paths(again) == _paths(train) != _paths(other)
    assert train.record(0).label == train.source.record(train.indices[0]).label


def test_split_uses_train_and_val_folders_when_they_exist(photo_folder, tmp_path):
    root = tmp_path / "splits"
    shutil.copytree(photo_folder, root / "train")
    shutil.copytree(photo_folder, root / "val", ignore=lambda d, files: files[4:])  # 4 per class
    train, val = train_val_split(root, val_fraction=0.5)  # the fraction does not apply
    assert isinstance(train, FolderSource) and isinstance(val, FolderSource)
    assert (len(train), len(val)) == (24, 12) and val.root == os.path.abspath(root / "val")


def test_split_of_a_store_and_of_a_dataset(photo_store):
    train, val = train_val_split(photo_store, val_fraction=0.1)
    assert (len(train), len(val)) == (22, 2) and train.classes == ["class_00", "class_01", "class_02"]
    train, val = train_val_split(Labelled(10), val_fraction=0.3, seed=0)
    assert (len(train), len(val)) == (7, 3) and isinstance(train.source, DatasetSource)
    assert {int(val.record(i).payload[0, 0, 0]) for i in range(3)} == set(val.indices)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.2])
def test_split_bad_fractions_and_too_few_samples(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(Labelled(10), val_fraction=fraction)
    with pytest.raises(ValueError, match="too few"):
        train_val_split(Labelled(1), val_fraction=0.5)


def test_evenly_spread_covers_every_class_of_a_sorted_folder(photo_folder, photo_store):
    picked = evenly_spread(photo_folder, 6)
    assert picked.indices == [0, 4, 8, 12, 16, 20]
    labels = [picked.record(i).label for i in range(len(picked))]
    assert sorted(set(labels)) == [0, 1, 2] and labels == sorted(labels)
    assert evenly_spread(photo_store, 3).indices == [0, 8, 16]
    assert len(evenly_spread(photo_folder, 100)) == 24  # never more than there is
    assert evenly_spread(Labelled(7), 2).indices == [0, 3]


def test_as_source_names_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data at"):
        as_source(tmp_path / "missing")
    with pytest.raises(ValueError, match="map-style Dataset"):
        as_source(42)
