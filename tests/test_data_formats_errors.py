"""The formats' bad input: a bad sample named by its shard and key (or row), on_error="skip"|"fail",
columns detected or named, layouts that cannot be read refused with the reason."""
from __future__ import annotations

import json
import logging
import os
import tarfile

import pytest

from test_data_formats_promises import add_member, hf_dataset, loader, photo_bytes, write_hf, write_litdata, write_shards
from torchspeed.data import fast_loader
from torchspeed.data.shards import expand_braces
from torchspeed.data.sources import as_source


def test_brace_patterns_expand_as_webdataset_reads_them():
    assert expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_braces("{train,val}-{8..10}.tar") == ["train-8.tar", "train-9.tar", "train-10.tar",
                                                         "val-8.tar", "val-9.tar", "val-10.tar"]


def test_shards_as_a_list_a_directory_or_a_pattern_are_the_same_samples(small_photo_folder, tmp_path):
    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    paths = [str(tmp_path / "s" / f"train-{i:04d}.tar") for i in range(2)]
    for data in (pattern, paths, str(tmp_path / "s")):
        assert as_source(data).targets == list(range(8))


def test_a_missing_shard_is_named(small_photo_folder, tmp_path):
    write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    with pytest.raises(FileNotFoundError, match=r"train-0002\.tar"):
        as_source(str(tmp_path / "s" / "train-{0000..0002}.tar"))


def test_webdataset_writer_shards_are_read(small_photo_folder, tmp_path):
    wds = pytest.importorskip("webdataset")
    images = photo_bytes(small_photo_folder)
    with wds.TarWriter(str(tmp_path / "w-0.tar")) as writer:
        for i, data in enumerate(images):
            writer.write({"__key__": f"k{i}", "jpg": data, "cls": i % 2})
    source = as_source(str(tmp_path / "w-0.tar"))
    assert source.targets == [i % 2 for i in range(8)] and source.classes == ["0", "1"]


def _shards_with_a_corrupt_jpeg(folder, out):
    """Two shards; sample00004 (the 2nd of shard 1) holds bytes that are no JPEG."""
    os.makedirs(out)
    images = photo_bytes(folder)
    for s, idx in enumerate([range(0, 3), range(3, 8)]):
        with tarfile.open(os.path.join(out, f"d-{s}.tar"), "w") as tar:
            for i in idx:
                add_member(tar, f"sample{i:05d}.jpg", b"\xff\xd8 broken" if i == 4 else images[i])
                add_member(tar, f"sample{i:05d}.cls", str(i).encode())
    return str(out)


def test_a_corrupt_image_is_named_by_shard_and_key(small_photo_folder, tmp_path):
    data = _shards_with_a_corrupt_jpeg(small_photo_folder, tmp_path / "d")
    with pytest.raises(ValueError, match=r"sample 'sample00004' of shard '.*d-1\.tar'"):
        list(loader(data, train=False))


@pytest.mark.parametrize("workers", [0, 2])
def test_on_error_skip_leaves_the_bad_sample_out_and_says_which(small_photo_folder, tmp_path, caplog, workers):
    data = _shards_with_a_corrupt_jpeg(small_photo_folder, tmp_path / "d")
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        batches = list(loader(data, train=False, on_error="skip", num_workers=workers, persistent_workers=False))
    assert sorted(v for _, y in batches for v in y.tolist()) == [0, 1, 2, 3, 5, 6, 7]
    assert all(x.shape[0] == y.shape[0] for x, y in batches)
    if workers == 0:  # worker processes log in their own process
        assert "sample00004" in caplog.text


def test_a_sample_without_a_label_fails_naming_it_or_is_skipped(small_photo_folder, tmp_path, caplog):
    out = tmp_path / "nolabel"
    os.makedirs(out)
    images = photo_bytes(small_photo_folder)
    with tarfile.open(out / "x-0.tar", "w") as tar:
        for i, data in enumerate(images):
            add_member(tar, f"k{i}.jpg", data)
            if i != 5:
                add_member(tar, f"k{i}.cls", b"1")
    with pytest.raises(ValueError, match=r"sample 'k5' of shard '.*x-0\.tar' has no label"):
        as_source(str(out))
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        assert len(as_source(str(out), on_error="skip")) == 7
    assert "'k5'" in caplog.text


def test_member_names_given_for_other_extensions(small_photo_folder, tmp_path):
    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(8,), label_ext="target", image_ext="jpeg")
    with pytest.raises(ValueError, match="has no label"):
        as_source(pattern)
    assert as_source(pattern, label_column="target").targets == list(range(8))


def test_tune_loader_and_the_command_line_take_a_shard_pattern(small_photo_folder, tmp_path):
    from torchspeed.cli import main
    from torchspeed.data import tune_loader

    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    tuned = tune_loader(pattern, 4, crop=16, num_workers=[0], threads=[1], tune_seconds=0.05, device="cpu")
    assert tuned.num_workers == 0 and tuned.throughput > 0
    assert main(["tune-loader", pattern, "--batch-size", "4", "--crop", "16", "--num-workers", "0",
                 "--threads", "1", "--tune-seconds", "0.05"]) == 0


# Hugging Face datasets

def test_hf_columns_are_detected_or_named(small_photo_folder, tmp_path):
    folder = write_hf(small_photo_folder, tmp_path / "hf", labels=[i % 2 for i in range(8)], image="img", label="target")
    assert as_source(folder).targets == [i % 2 for i in range(8)]  # the Image feature; an int column named target
    with pytest.raises(ValueError, match=r"label_column='nope'.*no such column.*img, target"):
        as_source(folder, label_column="nope")


def test_hf_without_an_image_column_says_what_it_has(small_photo_folder):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Value("binary"), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": photo_bytes(small_photo_folder), "label": list(range(8))},
                                    features=features)
    with pytest.raises(ValueError, match=r"no Image column .*image \(Value\).*image_column="):
        as_source(ds)
    assert len(as_source(ds, image_column="image")) == 8  # plain bytes, named


def test_hf_row_map_after_select_and_shuffle_is_followed(small_photo_folder):
    ds = hf_dataset(small_photo_folder).shuffle(seed=2).select(range(5))
    source = as_source(ds)
    assert source.targets == ds["label"]
    ld = fast_loader(ds, batch_size=5, crop=16, device="cpu", decoder="simplejpeg", num_workers=0, threads=1,
                     train=False)
    assert next(iter(ld))[1].tolist() == ds["label"]


def test_hf_a_corrupt_row_is_named(small_photo_folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    images = photo_bytes(small_photo_folder)
    images[6] = b"\xff\xd8 broken"
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images], "label": list(range(8))},
                                    features=features)
    ds.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"row 6 of Hugging Face dataset '.*bad'"):
        list(loader(str(tmp_path / "bad"), train=False))
    got = [v for _, y in loader(str(tmp_path / "bad"), train=False, on_error="skip") for v in y.tolist()]
    assert got == [0, 1, 2, 3, 4, 5, 7]


def test_hf_dataset_dict_folder_names_its_splits(small_photo_folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": hf_dataset(small_photo_folder), "test": hf_dataset(small_photo_folder)}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict \(splits: train, test\).*dd/train"):
        as_source(str(tmp_path / "dd"))
    assert len(as_source(str(tmp_path / "dd" / "train"))) == 8


# LitData

def test_litdata_layouts_it_cannot_read_are_refused_with_the_reason(small_photo_folder, tmp_path):
    folder = write_litdata(small_photo_folder, tmp_path / "lit", chunk_size=3)
    assert as_source(folder).targets == list(range(8))
    index_path = os.path.join(folder, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["config"]["compression"] = "zstd"
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=r"compression='zstd' chunks: .*litdata's own deserialisers"):
        as_source(folder)


def test_a_later_litdata_chunk_without_its_table_is_named(small_photo_folder, tmp_path):
    folder = write_litdata(small_photo_folder, tmp_path / "lit", chunk_size=3)
    with open(os.path.join(folder, "index.json")) as f:
        last = json.load(f)["chunks"][-1]["filename"]
    path = os.path.join(folder, last)
    with open(path, "r+b") as f:  # the footer's magic gone: the first chunk still reads, the last does not
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match=rf"chunk {last!r} holds no Arrow table"):
        source = as_source(folder)
        source.targets


def test_a_tar_shards_source_with_its_own_shuffle_buffer_and_a_train_val_split(small_photo_folder, tmp_path):
    from torchspeed.data import TarShards, train_val_split

    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    shards = TarShards(pattern, shuffle_buffer=0)
    labels = [v for _, y in loader(shards, batch_size=8) for v in y.tolist()]
    assert sorted(labels) == list(range(8)) and (labels[:3] == [0, 1, 2] or labels[:5] == [3, 4, 5, 6, 7])
    train, val = train_val_split(pattern, val_fraction=0.25)  # what `torchspeed train --data PATTERN` splits
    assert sorted(train.indices + val.indices) == list(range(8)) and len(val) == 2
    assert train.classes == [str(c) for c in range(8)]


def test_tune_loader_times_a_hf_dataset_object_as_the_torchspeed_pipeline(small_photo_folder):
    from torchspeed.data import tune_loader

    tuned = tune_loader(hf_dataset(small_photo_folder), 4, crop=16, num_workers=[0], threads=[1, 2],
                        tune_seconds=0.05, device="cpu")
    assert {r.threads for r in tuned.table} >= {1, 2}  # threads are searched: the pipeline, not a plain DataLoader


def test_the_tar_index_is_cached_and_read_again_when_a_shard_changes(small_photo_folder, tmp_path, monkeypatch):
    from torchspeed.data import shards as shards_mod

    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    reads = []
    real = shards_mod._read_index
    monkeypatch.setattr(shards_mod, "_read_index", lambda *a: reads.append(a[0]) or real(*a))
    assert as_source(pattern).targets == list(range(8))
    shards_mod._INDEX_CACHE.clear()  # another process: only the cache on disk is left
    assert as_source(pattern).targets == list(range(8)) and len(reads) == 2  # both from the cache the 2nd time
    write_shards(small_photo_folder, tmp_path / "s", sizes=(5, 3))  # rewritten: other sizes
    shards_mod._INDEX_CACHE.clear()
    assert as_source(pattern).shard_sizes == [5, 3] and len(reads) == 4
    index_dir = os.path.join(os.environ["TORCHSPEED_CACHE"], "tar-index")
    for name in os.listdir(index_dir):  # a damaged cache entry is read again from the shard
        with open(os.path.join(index_dir, name), "w") as f:
            f.write("{not json")
    shards_mod._INDEX_CACHE.clear()
    assert as_source(pattern).shard_sizes == [5, 3] and len(reads) == 6
