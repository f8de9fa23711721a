"""Your own Dataset by name: `package.module:factory` / `path/file.py:factory` for fast_loader,
tune_loader and `torchspeed tune-loader` (a module written to tmp_path, put on sys.path)."""
import sys

import pytest
import torch

from torchspeed.cli import main
from torchspeed.data import fast_loader, tune_loader
from torchspeed.data.sources import DatasetSource, as_source, is_dataset_spec

MODULE = '''
import numpy as np
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    classes = ["even", "odd"]

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.full((20, 24, 3), i * 10, np.uint8), i % 2


class Dicts(Pairs):
    def __getitem__(self, i):
        return {"pixel_values": torch.full((3, 20, 24), i * 10, dtype=torch.uint8), "labels": i % 2}


class Transformed(Pairs):
    def __getitem__(self, i):
        return torch.rand(3, 8, 8), i % 2


def pairs():
    return Pairs()


def not_a_dataset():
    return 42


def broken():
    raise RuntimeError("no images under /data/x")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`tsdata_user` importable (tmp_path on sys.path) and the same code as tmp_path/mydata.py."""
    (tmp_path / "tsdata_user.py").write_text(MODULE)
    (tmp_path / "mydata.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tsdata_user", raising=False)
    yield tmp_path
    sys.modules.pop("tsdata_user", None)


def test_specs_are_told_from_paths(user_module, tmp_path):
    assert is_dataset_spec("tsdata_user:pairs") and is_dataset_spec("dir/file.py:build")
    assert not is_dataset_spec("photos") and not is_dataset_spec(str(tmp_path))
    (tmp_path / "odd:name").mkdir()
    assert not is_dataset_spec(str(tmp_path / "odd:name"))  # an existing path is a path


def test_a_module_factory_and_a_file_factory_become_sources(user_module):
    source = as_source("tsdata_user:pairs")
    assert isinstance(source, DatasetSource) and len(source) == 12 and source.classes == ["even", "odd"]
    rec = source.record(3)
    assert rec.label == 1 and rec.payload.shape == (20, 24, 3) and int(rec.payload[0, 0, 0]) == 30
    dicts = as_source(f"{user_module}/mydata.py:Dicts")  # a class is a factory too; dict samples
    rec = dicts.record(5)
    assert rec.label == 1 and rec.payload.shape == (20, 24, 3) and int(rec.payload[0, 0, 0]) == 50


def test_fast_loader_reads_a_dataset_spec(user_module):
    loader = fast_loader("tsdata_user:Dicts", 4, train=False, crop=8, device="cpu", num_workers=0, threads=1)
    labels = torch.cat([y for _, y in loader]).tolist()
    assert labels == [i % 2 for i in range(12)] and loader.dataset.classes == ["even", "odd"]
    with pytest.raises(ValueError, match=r"sample 0 of tsdata_user:Transformed: a float tensor image"):
        fast_loader("tsdata_user:Transformed", 4, crop=8, device="cpu", num_workers=0, threads=1)


def test_samples_that_are_not_image_and_label_are_named():
    class Odd:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return [{"image": 1}, {"a": 1, "b": 2, "labels": 0}][i]

    source = DatasetSource(Odd(), spec="pkg.mod:odd")
    with pytest.raises(ValueError, match=r"sample 0 of pkg.mod:odd is a dict with keys \['image'\]"):
        source.record(0)
    with pytest.raises(ValueError, match=r"sample 1 of pkg.mod:odd is a dict with keys \['a', 'b', 'labels'\]"):
        source.record(1)


@pytest.mark.parametrize("spec,error,match", [
    ("tsdata_absent_module:build", ValueError, r"cannot load the dataset factory 'tsdata_absent_module:build'.*PYTHONPATH"),
    ("tsdata_user:nope", ValueError, r"'tsdata_user:nope'.*has no callable 'nope'"),
    ("tsdata_user:not_a_dataset", ValueError, r"'tsdata_user:not_a_dataset' returned a int, not a map-style Dataset"),
    ("tsdata_user:broken", ValueError, r"'tsdata_user:broken' failed: RuntimeError: no images under /data/x"),
    ("missing_dir/data.py:build", FileNotFoundError, r"dataset factory 'missing_dir/data.py:build'.*does not exist"),
])
def test_a_bad_spec_is_one_error_naming_it(user_module, spec, error, match):
    with pytest.raises(error, match=match):
        as_source(spec)


def test_tune_loader_times_the_pipeline_or_the_datasets_own_transforms(user_module):
    piped = tune_loader("tsdata_user:pairs", 4, num_workers=[0], threads=1, tune_seconds=0.05, crop=8, device="cpu")
    assert piped.num_workers == 0 and piped.throughput > 0
    plain = tune_loader("tsdata_user:Transformed", 4, num_workers=[0], tune_seconds=0.05, device="cpu")
    assert plain.num_workers == 0 and plain.throughput > 0


def test_tune_loader_command_takes_a_spec(user_module, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    args = ["--batch-size", "4", "--crop", "8", "--num-workers", "0", "--threads", "1", "--tune-seconds", "0.05"]
    assert main(["tune-loader", "tsdata_user:pairs", *args]) == 0
    assert "best: fast_loader(..., num_workers=0" in capsys.readouterr().out
    assert main(["tune-loader", "tsdata_user:Transformed", *args]) == 0
    assert "best: DataLoader(..., num_workers=0" in capsys.readouterr().out
    assert main(["tune-loader", "tsdata_user:not_a_dataset", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tsdata_user:not_a_dataset" in err and "Traceback" not in err


def test_a_spec_splits_into_train_and_val(user_module):
    from torchspeed.data import train_val_split

    train, val = train_val_split("tsdata_user:pairs", 0.25, seed=0)
    assert (len(train), len(val)) == (9, 3) and not set(train.indices) & set(val.indices)
    assert "tsdata_user:pairs" in train.root and train.root != val.root
    loader = fast_loader(val, 3, train=False, crop=8, device="cpu", num_workers=0, threads=1)
    assert torch.cat([y for _, y in loader]).tolist() == [i % 2 for i in val.indices]
