"""Every dataset format opens through one guard (torchspeed/data/format_guard.py), and every decode path is
inside the per-sample error handling: the fault cases of tar shards, Hugging Face folders and LitData
directories (damage named with its file, labels bounded by the classes, files kept inside the dataset
folder), odd but valid JPEGs decoded (a chroma layout the TurboJPEG API cannot crop: decoded whole), and
records whose stored size is not their JPEG's named or skipped, on the native renderer too."""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image

from test_data_formats_promises import add_member, photo_bytes, write_hf, write_litdata, write_shards
from test_data_skip import fake_nvjpeg  # noqa: F401 -- a fixture: nvjpeg faked on the CPU
from torchspeed.data import fast_loader
from torchspeed.data import shards as shards_mod
from torchspeed.data.augment import Box, RandomResizedCropFlip, ResizeCenterCrop, needed_size, render
from torchspeed.data.decode import available_decoders, get_decoder, jpeg_sampling, turbojpeg_reads
from torchspeed.data.format_guard import MAX_CLASSES, DatasetError
from torchspeed.data.rendering import AugmentedDataset
from torchspeed.data.sources import FolderSource, as_source
from torchspeed.images import MAX_IMAGE_PIXELS

HAS_TURBOJPEG = available_decoders().get("turbojpeg") is None


def _loader(data, **kw):
    options = dict(batch_size=4, crop=16, device="cpu", decoder="simplejpeg", num_workers=0, threads=1, train=False)
    options.update(kw)
    return fast_loader(data, options.pop("batch_size"), **options)


def _cli_error(capsys, monkeypatch, data) -> str:
    """What `torchspeed tune-loader DATA` prints on stderr; it must fail in one line (exit 2, no traceback)."""
    from torchspeed.cli import main

    monkeypatch.setenv("COLUMNS", "1000")
    capsys.readouterr()  # what came before (datasets' progress bars)
    assert main(["tune-loader", str(data), "--batch-size", "4", "--crop", "16", "--num-workers", "0",
                 "--threads", "1", "--tune-seconds", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _tar(path, members) -> str:
    """A tar of (name, bytes) members."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            add_member(tar, name, data)
    return str(path)


# ---------------- tar shards


def _cached_index_files() -> list[str]:
    folder = os.path.join(os.environ["TORCHSPEED_CACHE"], "tar-index")
    return [os.path.join(folder, f) for f in os.listdir(folder)]


def _edited(field, value):
    def edit(doc):
        doc[field][0] = value
        return doc
    return edit


# what a damaged or edited cache entry may hold: each is rebuilt from the shard, the samples as they are
DAMAGED_INDEXES = {
    "a list": lambda doc: [],
    "null": lambda doc: None,
    "a string": lambda doc: "index",
    "nested too deeply": lambda doc: "[" * 100_000 + "]" * 100_000,
    "no keys": lambda doc: {k: v for k, v in doc.items() if k != "keys"},
    "labels of the wrong type": lambda doc: {**doc, "labels": "0,1,2"},
    "a label that is no class index": _edited("labels", 99_999_999_999),
    "a negative label": _edited("labels", -1),
    "an offset past the shard": _edited("offsets", 10 ** 12),
    "a size past the shard": _edited("sizes", 10 ** 12),
    "a boolean offset": _edited("offsets", True),
    "problems of the wrong shape": lambda doc: {**doc, "problems": [["k", 3]]},
    "columns of different lengths": lambda doc: {**doc, "keys": doc["keys"][:-1]},
}


@pytest.mark.parametrize("damage", list(DAMAGED_INDEXES))
def test_a_damaged_tar_index_cache_entry_is_rebuilt_from_the_shard(small_photo_folder, tmp_path, damage):
    shutil.rmtree(os.path.join(os.environ["TORCHSPEED_CACHE"], "tar-index"), ignore_errors=True)  # this test's alone
    pattern = write_shards(small_photo_folder, tmp_path / "s", sizes=(3, 5))
    assert as_source(pattern).targets == list(range(8))
    for path in _cached_index_files():
        with open(path) as f:
            doc = json.load(f)
        damaged = DAMAGED_INDEXES[damage](doc)
        with open(path, "w") as f:
            f.write(damaged if isinstance(damaged, str) and damaged.startswith("[") else json.dumps(damaged))
    shards_mod._INDEX_CACHE.clear()  # another process: only the cache on disk is left
    source = as_source(pattern)
    assert source.targets == list(range(8)) and source.shard_sizes == [3, 5]
    assert [bytes(source.record(i).payload) for i in range(8)] == photo_bytes(small_photo_folder)


@pytest.mark.parametrize("label,said", [(b"99999999999", "more than the 1,000,000 classes"),
                                        (b"-1", "not a class index"),
                                        (b"9" * 5000, "unreadable|Exceeds|more than"),
                                        (b"3.0", "not an integer class index")])
def test_a_label_that_is_no_class_index_is_named_before_anything_is_allocated(small_photo_folder, tmp_path, caplog,
                                                                             label, said):
    images = photo_bytes(small_photo_folder)
    shard = _tar(tmp_path / "x-0.tar", [m for i, data in enumerate(images[:4])
                                        for m in ((f"k{i}.jpg", data), (f"k{i}.cls", label if i == 2 else b"1"))])
    with pytest.raises(ValueError, match=rf"sample 'k2' of shard '.*x-0\.tar' has a bad \.cls label: .*({said})"):
        as_source(shard)
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        source = as_source(shard, on_error="skip")
    assert source.targets == [1, 1, 1] and source.classes == ["0", "1"] and "'k2'" in caplog.text


def test_a_label_past_the_class_bound_in_a_json_member_is_named(small_photo_folder, tmp_path):
    images = photo_bytes(small_photo_folder)
    shard = _tar(tmp_path / "j-0.tar", [(f"k{i}.jpg", images[i]) for i in range(1)] +
                 [("k0.json", json.dumps({"label": MAX_CLASSES}).encode())])
    with pytest.raises(ValueError, match=r"sample 'k0' .* has a bad \.json label: its label is 1000000, more than"):
        as_source(shard)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_deeply_nested_json_label_is_a_bad_sample_not_a_recursion_error(small_photo_folder, tmp_path, on_error):
    images = photo_bytes(small_photo_folder)
    members = [m for i in range(3) for m in ((f"k{i}.jpg", images[i]), (f"k{i}.json", b'{"label": 1}'))]
    members[3] = ("k1.json", b"[" * 30_000 + b"]" * 30_000)  # within the bound on a label's size, past Python's depth
    shard = _tar(tmp_path / "n-0.tar", members)
    if on_error == "fail":
        with pytest.raises(ValueError, match=r"sample 'k1' of shard .* has a bad \.json label: it is JSON nested too deeply"):
            as_source(shard)
    else:
        batches = list(_loader(shard, on_error="skip"))
        assert sum(len(y) for _, y in batches) == 2


def test_a_label_member_too_large_to_be_one_is_not_read(small_photo_folder, tmp_path):
    images = photo_bytes(small_photo_folder)
    shard = _tar(tmp_path / "l-0.tar", [("k0.jpg", images[0]), ("k0.cls", b"1" + b" " * (1 << 20))])
    with pytest.raises(ValueError, match=r"sample 'k0' .* has a \.cls label of 1,048,577 bytes: not a class index"):
        as_source(shard)


def test_an_empty_shard_or_directory_of_shards_is_named(small_photo_folder, tmp_path, capsys, monkeypatch):
    os.makedirs(tmp_path / "d")
    empty = _tar(tmp_path / "d" / "e-0.tar", [])
    _tar(tmp_path / "d" / "e-1.tar", [])
    for data, said in ((empty, r"no samples in the tar shards '.*e-0\.tar' \(1 shard\)"),
                       (str(tmp_path / "d"), r"no samples in the tar shards '.*/d' \(2 shards\)")):
        with pytest.raises(ValueError, match=rf"the dataset is empty: {said}"):
            _loader(data)
    assert "e-0.tar" in _cli_error(capsys, monkeypatch, empty)
    nolabels = _tar(tmp_path / "n-0.tar", [(f"k{i}.jpg", data) for i, data in enumerate(photo_bytes(small_photo_folder))])
    with pytest.raises(ValueError, match=r"n-0\.tar' \(1 shard\) \(8 left out: see the warnings\)"):
        _loader(nolabels, on_error="skip")
    (tmp_path / "z-0.tar").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot read tar shard '.*z-0\.tar'.*empty file.*is it a \(complete\) tar"):
        as_source(str(tmp_path / "z-0.tar"))


def test_a_hard_linked_image_member_reads_the_data_it_links_to(small_photo_folder, tmp_path):
    """GNU tar stores a file added twice as a hard link to the first copy."""
    images = photo_bytes(small_photo_folder)
    path = tmp_path / "h-0.tar"
    with tarfile.open(path, "w") as tar:
        add_member(tar, "a.jpg", images[0])
        add_member(tar, "a.cls", b"0")
        link = tarfile.TarInfo("b.jpg")
        link.type, link.linkname = tarfile.LNKTYPE, "a.jpg"
        tar.addfile(link)
        add_member(tar, "b.cls", b"1")
        dangling = tarfile.TarInfo("c.jpg")
        dangling.type, dangling.linkname = tarfile.LNKTYPE, "nowhere.jpg"
        tar.addfile(dangling)
        add_member(tar, "c.cls", b"1")
    with pytest.raises(ValueError, match=r"sample 'c' .* has a hard link 'c\.jpg' to 'nowhere\.jpg', which the shard"):
        as_source(str(path))
    source = as_source(str(path), on_error="skip")
    assert source.targets == [0, 1] and bytes(source.record(1).payload) == images[0]
    assert sum(len(y) for _, y in _loader(source)) == 2


def test_two_members_of_one_name_in_a_sample_are_refused_as_webdataset_refuses_them(small_photo_folder, tmp_path):
    images = photo_bytes(small_photo_folder)
    shard = _tar(tmp_path / "t-0.tar", [("a.jpg", images[0]), ("a.jpg", images[1]), ("a.cls", b"0"),
                                        ("b.jpg", images[2]), ("b.cls", b"1")])
    with pytest.raises(ValueError, match=r"sample 'a' of shard .* has two members named 'a\.jpg'"):
        as_source(shard)
    assert as_source(shard, on_error="skip").targets == [1]


def test_compressed_shards_are_named_not_read(small_photo_folder, tmp_path, capsys, monkeypatch):
    import gzip

    tar = write_shards(small_photo_folder, tmp_path / "s", sizes=(8,)).replace("{0000..0000}", "0000")
    os.makedirs(tmp_path / "gz")
    gz = str(tmp_path / "gz" / "train-0000.tar.gz")
    with open(tar, "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    for data in (gz, str(tmp_path / "gz"), [gz]):
        with pytest.raises(ValueError, match=r"train-0000\.tar\.gz'.*compressed shards are not read"):
            as_source(data)
    assert "compressed shards are not read" in _cli_error(capsys, monkeypatch, gz)
    disguised = str(tmp_path / "gz" / "disguised.tar")
    shutil.copy(gz, disguised)
    with pytest.raises(ValueError, match=r"disguised\.tar' is gzip-compressed: compressed shards are not read"):
        as_source(disguised)


def test_a_truncated_or_damaged_shard_is_named_and_keeps_the_samples_before_the_damage(small_photo_folder, tmp_path,
                                                                                     caplog):
    """tarfile stops quietly at a header it cannot read, or cut short: that is named too, not taken for the end."""
    shard = write_shards(small_photo_folder, tmp_path / "s", sizes=(8,)).replace("{0000..0000}", "0000")
    with tarfile.open(shard) as tar:
        cut = next(m for m in tar if m.name == "sample00005.jpg")
    data = open(shard, "rb").read()
    garbled = data[:cut.offset] + b"\x07" * 512 + data[cut.offset + 512:]
    for damaged, said in ((data[:cut.offset_data + cut.size // 2],  # inside the image's bytes
                           r"sample 'sample00005' of shard .* has a member 'sample00005\.jpg' of .* bytes that runs "
                           r"past the end of the shard"),
                          (data[:cut.offset + 100], r"shard .* cannot be read past its sample 'sample00004' \(it ends "
                                                    r"inside a tar header; a truncated or damaged shard\?\)"),
                          (garbled, r"shard .* cannot be read past its sample 'sample00004' \(what follows is not a "
                                    r"readable tar header")):
        with open(shard, "wb") as f:
            f.write(damaged)
        with pytest.raises(ValueError, match=said):
            as_source(shard)
        with caplog.at_level(logging.WARNING, logger="torchspeed"):
            assert as_source(shard, on_error="skip").targets == [0, 1, 2, 3, 4]
        assert "samples after it are lost" in caplog.text


def test_a_sparse_member_is_a_bad_sample(small_photo_folder, tmp_path):
    images = photo_bytes(small_photo_folder)
    path = _tar(tmp_path / "sp-0.tar", [("a.jpg", images[0]), ("a.cls", b"0"), ("b.jpg", images[1]), ("b.cls", b"1")])
    raw = bytearray(open(path, "rb").read())
    header = raw[:512]
    header[156:157] = b"S"  # a GNU sparse file: its bytes are not stored in one piece
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}".encode() + b"\0 "
    raw[:512] = header
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match=r"sample 'a' of shard .* has a sparse member 'a\.jpg'"):
        as_source(path)
    assert as_source(path, on_error="skip").targets == [1]


def _octal_field(header: bytearray, offset: int, width: int, value: int) -> None:
    header[offset:offset + width] = f"{value:0{width - 1}o}".encode() + b"\0"


def test_a_crafted_tar_header_claiming_gigabytes_costs_no_more_than_the_shard(small_photo_folder, tmp_path):
    """A pax header whose size field claims 8 GiB: tarfile reads the claimed size in one call, which used
    to allocate it; the shard is read no further than its end, and the damage is named."""
    import tracemalloc

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("k0.jpg")
        info.pax_headers = {"comment": "x"}
        data = photo_bytes(small_photo_folder)[0]
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    raw = bytearray(buf.getvalue())
    header = raw[:512]
    assert header[156:157] == b"x"  # the pax extended header comes first
    _octal_field(header, 124, 12, 8 << 30)
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}".encode() + b"\0 "
    raw[:512] = header
    (tmp_path / "p-0.tar").write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"tar shard '.*p-0\.tar'"):
            as_source(str(tmp_path / "p-0.tar"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak:,} bytes held while reading a {len(raw):,}-byte shard"


# ---------------- Hugging Face folders


def _hf_folder(small_photo_folder, tmp_path, **kw) -> str:
    return write_hf(small_photo_folder, tmp_path / "hf", **kw)


def _data_file(folder) -> str:
    with open(os.path.join(folder, "state.json")) as f:
        return json.load(f)["_data_files"][0]["filename"]


def _rewrite_json(path, edit) -> None:
    with open(path) as f:
        doc = json.load(f)
    doc = edit(doc)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def _truncate_half(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garbage(path) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


def _empty(path) -> None:
    open(path, "wb").close()


HF_DAMAGE = {  # what is done to the folder -> what the message must name
    "a corrupt .arrow": (lambda d: _garbage(os.path.join(d, _data_file(d))), r"its file 'data-.*\.arrow'"),
    "a truncated .arrow": (lambda d: _truncate_half(os.path.join(d, _data_file(d))), r"its file 'data-.*\.arrow'"),
    "an empty .arrow": (lambda d: _empty(os.path.join(d, _data_file(d))), r"its file 'data-.*\.arrow'"),
    "features a list": (lambda d: _rewrite_json(os.path.join(d, "dataset_info.json"),
                                                lambda doc: {**doc, "features": [1, 2]}), r"its features are a list"),
    "class names not strings": (lambda d: _rewrite_json(os.path.join(d, "dataset_info.json"), lambda doc: {
        **doc, "features": {**doc["features"], "label": {"_type": "ClassLabel", "names": {"a": 1}}}}),
        r"class names of its column 'label'"),
    "no state.json": (lambda d: os.remove(os.path.join(d, "state.json")), r"has no state\.json"),
    "state.json garbage": (lambda d: _garbage(os.path.join(d, "state.json")), r"its state\.json is not readable JSON"),
    "state.json a list": (lambda d: _rewrite_json(os.path.join(d, "state.json"), lambda doc: [doc]),
                          r"its state\.json holds a JSON list"),
    "state.json nested too deeply": (lambda d: _rewrite_json(os.path.join(d, "state.json"),
                                                             lambda doc: "[" * 100_000 + "]" * 100_000),
                                     r"its state\.json is not readable JSON \(nested too deeply\)"),
    "data files not a list": (lambda d: _rewrite_json(os.path.join(d, "state.json"),
                                                      lambda doc: {**doc, "_data_files": "data.arrow"}),
                              r"'_data_files' of its state\.json is not a list"),
    "a data file outside the folder": (lambda d: _rewrite_json(os.path.join(d, "state.json"), lambda doc: {
        **doc, "_data_files": [{"filename": "../outside.arrow"}]}), r"lists the file '\.\./outside\.arrow', outside"),
    "an absolute data file": (lambda d: _rewrite_json(os.path.join(d, "state.json"), lambda doc: {
        **doc, "_data_files": [{"filename": os.path.abspath(os.path.join(d, _data_file(d)))}]}), r"outside the dataset"),
    "dataset_dict.json a list": (lambda d: (open(os.path.join(d, "dataset_dict.json"), "w").write("[1]")),
                                 r"its dataset_dict\.json holds a JSON list"),
}


@pytest.mark.parametrize("damage", list(HF_DAMAGE))
def test_a_damaged_hugging_face_folder_names_the_file(small_photo_folder, tmp_path, capsys, monkeypatch, damage):
    pytest.importorskip("datasets")
    folder = _hf_folder(small_photo_folder, tmp_path)
    if damage == "a data file outside the folder":
        shutil.copy(os.path.join(folder, _data_file(folder)), tmp_path / "outside.arrow")  # readable, if it were read
    do, said = HF_DAMAGE[damage]
    do(folder)
    with pytest.raises(DatasetError, match=rf"Hugging Face dataset '.*hf'.*{said}"):
        as_source(folder)
    assert "hf" in _cli_error(capsys, monkeypatch, folder)


def _hf_with_labels(small_photo_folder, tmp_path, labels, names=("cat", "dog")):
    datasets = pytest.importorskip("datasets")
    label = datasets.ClassLabel(names=list(names)) if names else datasets.Value("int64")
    features = datasets.Features({"image": datasets.Image(), "label": label})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in photo_bytes(small_photo_folder)],
                                     "label": labels}, features=features)
    ds.save_to_disk(str(tmp_path / "labels"))
    return ds, str(tmp_path / "labels")


@pytest.mark.parametrize("labels,names,said", [
    ([0, 1, -1, 0, 1, -1, 0, 1], ("cat", "dog"), r"row 2 of .* has label -1, not a class index .*\(1 more such "
                                                 r"labels\); a label of -1 is a row without one"),
    ([0, 1, 2 ** 40, 0, 1, 0, 0, 1], None, r"row 2 of .* has label 1099511627776, more than the 1,000,000 classes"),
])
def test_hugging_face_labels_outside_the_classes_are_refused_at_open(small_photo_folder, tmp_path, labels, names,
                                                                     said):
    ds, folder = _hf_with_labels(small_photo_folder, tmp_path, labels, names)
    for data in (ds, folder):
        with pytest.raises(DatasetError, match=said):
            as_source(data)


def test_a_hugging_face_label_past_its_class_names_is_refused_at_open(small_photo_folder, tmp_path):
    _, folder = _hf_with_labels(small_photo_folder, tmp_path, [0, 1, 2, 0, 1, 0, 0, 1], ("cat", "dog", "eel"))
    _rewrite_json(os.path.join(folder, "dataset_info.json"), lambda doc: {  # datasets itself refuses to write it
        **doc, "features": {**doc["features"], "label": {"_type": "ClassLabel", "names": ["cat", "dog"]}}})
    with pytest.raises(DatasetError, match=r"row 2 of .* has label 2, outside its 2 classes \(0\.\.1\)"):
        as_source(folder)


# ---------------- LitData directories


def _chunk_files(folder) -> list[str]:
    with open(os.path.join(folder, "index.json")) as f:
        return [c["filename"] for c in json.load(f)["chunks"]]


def _damaged_footer(path) -> None:
    """The end of the chunk's Arrow table (the Arrow file's own footer) overwritten; litdata's length and magic
    after it kept."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 12 - 64)
        f.write(b"\x07" * 64)


LITDATA_DAMAGE = {
    "index.json garbage": (lambda d: _garbage(os.path.join(d, "index.json")), r"its index\.json is not readable JSON"),
    "index.json truncated": (lambda d: _truncate_half(os.path.join(d, "index.json")),
                             r"its index\.json is not readable JSON"),
    "index.json a list": (lambda d: _rewrite_json(os.path.join(d, "index.json"), lambda doc: [doc]),
                          r"its index\.json holds a JSON list"),
    "index.json nested too deeply": (lambda d: _rewrite_json(os.path.join(d, "index.json"),
                                                             lambda doc: "[" * 100_000 + "]" * 100_000),
                                     r"nested too deeply"),
    "chunks not objects": (lambda d: _rewrite_json(os.path.join(d, "index.json"), lambda doc: {**doc, "chunks": [1]}),
                           r"no config object or list of chunks"),
    "a chunk outside the folder": (lambda d: _rewrite_json(os.path.join(d, "index.json"), lambda doc: {
        **doc, "chunks": [{**doc["chunks"][0], "filename": "../../etc/passwd"}]}), r"outside the dataset folder"),
    "a chunk size that is no count": (lambda d: _rewrite_json(os.path.join(d, "index.json"), lambda doc: {
        **doc, "chunks": [{**c, "chunk_size": "3"} for c in doc["chunks"]]}), r"chunk size that is not a count"),
    "a chunk size that is wrong": (lambda d: _rewrite_json(os.path.join(d, "index.json"), lambda doc: {
        **doc, "chunks": [{**c, "chunk_size": 10 ** 12} for c in doc["chunks"]]}),
        r"its chunk 'chunk-.*\.bin' holds 3 items, index\.json says 1000000000000"),
    "a damaged chunk footer": (lambda d: _damaged_footer(os.path.join(d, _chunk_files(d)[-1])),
                               r"its chunk 'chunk-.*\.bin' is damaged"),
}


@pytest.mark.parametrize("damage", list(LITDATA_DAMAGE))
def test_a_damaged_litdata_directory_names_the_file(small_photo_folder, tmp_path, capsys, monkeypatch, damage):
    folder = write_litdata(small_photo_folder, tmp_path / "lit", chunk_size=3)
    do, said = LITDATA_DAMAGE[damage]
    do(folder)
    with pytest.raises(ValueError, match=rf"LitData directory '.*lit'.*{said}"):
        as_source(folder)
    assert "lit" in _cli_error(capsys, monkeypatch, folder)


# ---------------- decoding: odd but valid JPEGs, records whose size is not their JPEG's


def _photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), ((x + y) * 3) % 256], -1)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _zigzag() -> list[tuple[int, int]]:
    cells = [(r, c) for r in range(8) for c in range(8)]
    return sorted(cells, key=lambda p: (p[0] + p[1], p[0] if (p[0] + p[1]) % 2 else p[1]))


def _huffman(lengths_count: dict[int, int], symbols: list[int]) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """A canonical Huffman table: (the DHT counts + symbols, symbol -> (code, length))."""
    counts = [lengths_count.get(n, 0) for n in range(1, 17)]
    codes, code, k = {}, 0, 0
    for length in range(1, 17):
        for _ in range(counts[length - 1]):
            codes[symbols[k]] = (code, length)
            code, k = code + 1, k + 1
        code <<= 1
    return bytes(counts) + bytes(symbols), codes


# Every DC category (0..11) a code of 4 bits, every AC symbol (EOB, ZRL, run/size for sizes 1..10) one of 8 bits:
# valid tables (no all-ones code), larger files than the standard ones, which no test cares about.
_DC_SYMBOLS = list(range(12))
_AC_SYMBOLS = [0x00, 0xF0] + [(run << 4) | size for run in range(16) for size in range(1, 11)]
_DC_TABLE, _DC_CODES = _huffman({4: 12}, _DC_SYMBOLS)
_AC_TABLE, _AC_CODES = _huffman({8: len(_AC_SYMBOLS)}, _AC_SYMBOLS)


def jpeg_with_sampling(rgb: np.ndarray, factors: tuple[tuple[int, int], ...], q: int = 2) -> bytes:
    """A baseline YCbCr JPEG of `rgb` (HWC uint8) with each component's (horizontal, vertical) sampling factors
    as given (any layout JPEG allows, e.g. ((4, 2), (1, 1), (1, 1)) for 4:1:0), one interleaved scan, a flat
    quantisation table of `q`. PIL and OpenCV write only the usual layouts; this writes the others."""
    height, width = rgb.shape[:2]
    hmax, vmax = max(h for h, _ in factors), max(v for _, v in factors)
    mcux, mcuy = -(-width // (8 * hmax)), -(-height // (8 * vmax))
    padded = np.pad(rgb.astype(np.float64), ((0, mcuy * 8 * vmax - height), (0, mcux * 8 * hmax - width), (0, 0)),
                    mode="edge")
    r, g, b = padded[..., 0], padded[..., 1], padded[..., 2]
    planes = [0.299 * r + 0.587 * g + 0.114 * b,
              -0.168736 * r - 0.331264 * g + 0.5 * b + 128,
              0.5 * r - 0.418688 * g - 0.081312 * b + 128]
    u = np.arange(8)
    dct = np.sqrt(2 / 8) * np.cos((2 * u[None, :] + 1) * u[:, None] * np.pi / 16)
    dct[0] /= np.sqrt(2)
    zigzag = _zigzag()
    blocks = []  # per component: its blocks, quantised, in zigzag order, as a (rows, cols, 64) array
    for plane, (h, v) in zip(planes, factors):
        fy, fx = vmax // v, hmax // h
        ph, pw = plane.shape[0] // fy, plane.shape[1] // fx
        small = plane.reshape(ph, fy, pw, fx).mean(axis=(1, 3)) - 128
        tiles = small.reshape(ph // 8, 8, pw // 8, 8).transpose(0, 2, 1, 3)
        coefficients = np.rint(dct @ tiles @ dct.T / q).astype(np.int64)
        blocks.append(np.stack([coefficients[..., a, b] for a, b in zigzag], axis=-1))
    bits: list[str] = []

    def put(value: int, size: int) -> None:
        if size:
            bits.append(format(value, f"0{size}b"))

    def amplitude(x: int) -> tuple[int, int]:
        size = abs(x).bit_length()
        return size, (x if x >= 0 else x + (1 << size) - 1)

    previous = [0] * len(factors)
    for my in range(mcuy):
        for mx in range(mcux):
            for c, (h, v) in enumerate(factors):
                for by in range(v):
                    for bx in range(h):
                        block = blocks[c][my * v + by, mx * h + bx]
                        size, value = amplitude(int(block[0]) - previous[c])
                        previous[c] = int(block[0])
                        put(*_DC_CODES[size])
                        put(value, size)
                        run = 0
                        last = max((k for k in range(1, 64) if block[k]), default=0)
                        for k in range(1, last + 1):
                            if block[k] == 0:
                                run += 1
                                continue
                            while run > 15:
                                put(*_AC_CODES[0xF0])
                                run -= 16
                            size, value = amplitude(int(block[k]))
                            put(*_AC_CODES[(run << 4) | size])
                            put(value, size)
                            run = 0
                        if last < 63:
                            put(*_AC_CODES[0x00])
    stream = "".join(bits)
    stream += "1" * (-len(stream) % 8)
    data = bytes(int(stream[i:i + 8], 2) for i in range(0, len(stream), 8)).replace(b"\xff", b"\xff\x00")

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload

    quant = segment(0xDB, bytes([0]) + bytes([q] * 64))
    frame = segment(0xC0, bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes([len(factors)])
                    + b"".join(bytes([i + 1, (h << 4) | v, 0]) for i, (h, v) in enumerate(factors)))
    tables = segment(0xC4, bytes([0x00]) + _DC_TABLE + bytes([0x10]) + _AC_TABLE)
    scan = segment(0xDA, bytes([len(factors)]) + b"".join(bytes([i + 1, 0x00]) for i in range(len(factors)))
                   + bytes([0, 63, 0]))
    return b"\xff\xd8" + quant + frame + tables + scan + data + b"\xff\xd9"


# the layouts the audit found (all components 2x1; 4:1:0; Y 2x2, Cb 1x2, Cr 1x1) and more of the kind
ODD_LAYOUTS = {"all 2x1": ((2, 1), (2, 1), (2, 1)), "4:1:0": ((4, 2), (1, 1), (1, 1)),
               "Y 2x2 Cb 1x2 Cr 1x1": ((2, 2), (1, 2), (1, 1)), "Y 3x1": ((3, 1), (1, 1), (1, 1)),
               "chroma finer than luma": ((1, 1), (2, 2), (2, 2)), "all 1x2": ((1, 2), (1, 2), (1, 2))}


def test_the_test_writer_makes_jpegs_pil_reads_with_the_layout_asked():
    for factors in [((2, 2), (1, 1), (1, 1))] + list(ODD_LAYOUTS.values()):
        rgb = _photo(61, 45)
        data = jpeg_with_sampling(rgb, factors)
        assert jpeg_sampling(data) == factors
        decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
        assert decoded.shape == rgb.shape and np.abs(decoded - rgb).mean() < 12  # subsampled noisy chroma: a little
    assert turbojpeg_reads(((2, 2), (1, 1), (1, 1))) and not turbojpeg_reads(ODD_LAYOUTS["all 2x1"])


def _odd_folder(tmp_path, factors) -> str:
    root = tmp_path / "odd"
    for k, (w, h) in enumerate([(61, 45), (203, 150), (64, 64), (130, 97)]):
        os.makedirs(root / f"c{k % 2}", exist_ok=True)
        (root / f"c{k % 2}" / f"i{k}.jpg").write_bytes(jpeg_with_sampling(_photo(w, h, seed=k), factors))
    return str(root)


def _reference(source, transform, keys, layout="NCHW") -> np.ndarray:
    """Each sample decoded by PIL at the scale the loader asks for, then cropped and resized by `render`."""
    out = np.empty((len(keys), 3, transform.size, transform.size), np.uint8)
    records = [source.record(i) for _, i in keys]
    boxes = transform.boxes([r.height for r in records], [r.width for r in records], 1, [e for e, _ in keys],
                            [i for _, i in keys])
    for j, (rec, box) in enumerate(zip(records, boxes)):
        img = get_decoder("pil").decode(rec.payload, *needed_size(rec.height, rec.width, box, transform.size))
        render(img, box, out[j], None, img.shape[0] / rec.height, img.shape[1] / rec.width)
    return out


@pytest.mark.parametrize("layout", list(ODD_LAYOUTS))
@pytest.mark.parametrize("decoder,native", [("turbojpeg", True), ("turbojpeg", False), ("simplejpeg", False)])
def test_a_chroma_layout_the_turbojpeg_api_cannot_crop_is_decoded_with_pils_pixels(tmp_path, monkeypatch, caplog,
                                                                                  layout, decoder, native):
    if available_decoders().get(decoder) is not None:
        pytest.skip(f"{decoder} not available here")
    if native and get_decoder(decoder).crops is None:
        pytest.skip("the native renderer was not compiled")
    if not native:
        monkeypatch.setattr(get_decoder(decoder), "crops", None)
    source = FolderSource(_odd_folder(tmp_path, ODD_LAYOUTS[layout]))
    for transform in (ResizeCenterCrop(32), RandomResizedCropFlip(24)):
        augmented = AugmentedDataset(source, transform, decoder, seed=1)
        keys = [(0, i) for i in range(len(source))]
        out = np.empty(augmented.batch_shape(len(keys)), np.uint8)
        with caplog.at_level(logging.DEBUG, logger="torchspeed.data"):
            labels = augmented.render_batch(keys, out)
        assert labels.tolist() == source.targets
        diff = np.abs(out.astype(int) - _reference(source, transform, keys))
        psnr = 10 * np.log10(255 ** 2 / max((diff ** 2).mean(), 1e-9))
        # as close as a usual 4:2:0 JPEG's crops come to PIL's (fast DCT, DCT-scaled: 1.1-2.9 levels, 28-39 dB)
        assert diff.mean() < 3.5 and psnr > 27, (diff.mean(), psnr)
    if layout not in ("all 2x1", "all 1x2"):  # those it crops on their own column grid (the next test)
        assert "i0.jpg" in caplog.text and "decoded whole" in caplog.text


@pytest.mark.skipif(not HAS_TURBOJPEG, reason="libturbojpeg 3 not available here")
def test_a_layout_turbojpeg_calls_four_four_four_is_cropped_on_its_own_column_grid():
    """All components 2x1 is 4:4:4 to libjpeg-turbo, but its iMCU is 16 columns wide: crops whose left edge is
    not on that grid used to fail ("Unexplained mismatch ... cropping region left boundary")."""
    dec = get_decoder("turbojpeg")
    data = jpeg_with_sampling(_photo(203, 150), ODD_LAYOUTS["all 2x1"])
    rng = np.random.default_rng(0)
    for min_size in (0, 40, 20):
        whole = dec.decode(data, min_size, min_size)
        for _ in range(40):
            top, left = int(rng.integers(0, 150)), int(rng.integers(0, 203))
            region = (top, left, int(rng.integers(1, 151 - top)), int(rng.integers(1, 204 - left)))
            img, r0, c0, fh, fw = dec.decode_region(data, min_size, min_size, region)
            assert (fh, fw) == whole.shape[:2]
            inner = img[1:-1, 1:-1]  # the outermost margin sees no neighbour (test_region_decode.py)
            np.testing.assert_array_equal(inner, whole[r0 + 1:r0 + img.shape[0] - 1, c0 + 1:c0 + img.shape[1] - 1])


@pytest.mark.parametrize("decoder", ["auto", "turbojpeg", "simplejpeg", "opencv", "pil"])
def test_a_folder_of_such_jpegs_loads_with_every_decoder(tmp_path, decoder):
    if decoder != "auto" and available_decoders().get(decoder) is not None:
        pytest.skip(f"{decoder} not available here")
    folder = _odd_folder(tmp_path, ODD_LAYOUTS["4:1:0"])
    batches = list(_loader(folder, decoder=decoder, batch_size=2))
    assert sum(len(y) for _, y in batches) == 4


def _store_with_record_size(photo_store, tmp_path, index: int, height: int, width: int) -> str:
    """A copy of the store whose record `index` claims height x width (its JPEG and CRC otherwise intact)."""
    import lmdb

    from torchspeed.data.store import HEADER, key_of

    store = str(tmp_path / "sized.store")
    shutil.copytree(photo_store, store)
    env = lmdb.open(store, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        raw = txn.get(key_of(index))
        magic, code, channels, _, _, label = HEADER.unpack_from(raw)
        record = HEADER.pack(magic, code, channels, height, width, label) + raw[HEADER.size:]
        txn.put(key_of(index), record)
    env.close()
    with open(os.path.join(store, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["crc32"][index] = zlib.crc32(record)
    with open(os.path.join(store, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return store


@pytest.mark.parametrize("size", [(700, 900), (8, 9), (64, 3000)])
@pytest.mark.parametrize("decoder,native", [("turbojpeg", True), ("turbojpeg", False), ("simplejpeg", False),
                                            ("opencv", False)])
def test_a_record_whose_stored_size_is_not_its_jpegs_is_named_or_skipped(photo_store, tmp_path, monkeypatch, caplog,
                                                                         size, decoder, native):
    if available_decoders().get(decoder) is not None:
        pytest.skip(f"{decoder} not available here")
    if native and get_decoder(decoder).crops is None:
        pytest.skip("the native renderer was not compiled")
    if not native:
        monkeypatch.setattr(get_decoder(decoder), "crops", None)
    store = _store_with_record_size(photo_store, tmp_path, 5, *size)
    for train in (False, True):
        with pytest.raises(ValueError, match=rf"record 5 of store '.*sized\.store'.*its JPEG is \d+x\d+ pixels, but "
                                             rf"the record says {size[0]}x{size[1]}"):
            list(_loader(store, decoder=decoder, train=train, batch_size=8, crop=24))
        with caplog.at_level(logging.WARNING, logger="torchspeed"):
            got = sum(len(y) for _, y in _loader(store, decoder=decoder, train=train, batch_size=8, crop=24,
                                                 on_error="skip", drop_last=False))
        assert got == 23 and "record 5 of store" in caplog.text


def test_a_record_whose_stored_size_is_not_its_jpegs_is_named_or_skipped_on_the_gpu_path(photo_store, tmp_path,
                                                                                         fake_nvjpeg, caplog):
    import torch

    from torchspeed.data.store import PackedDataset

    source = PackedDataset(_store_with_record_size(photo_store, tmp_path, 5, 700, 900))
    keys = [(0, i) for i in range(len(source))]
    failing = AugmentedDataset(source, ResizeCenterCrop(24), "nvjpeg", 0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"record 5 of store .*its JPEG is \d+x\d+ pixels, but the record says 700x900"):
        failing.device_batch(keys)
    skipping = AugmentedDataset(source, ResizeCenterCrop(24), "nvjpeg", 0, device=torch.device("cpu"), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        images, labels = skipping.device_batch(keys)
    assert images.shape[0] == labels.shape[0] == len(keys) - 1 and "record 5 of store" in caplog.text
    good = failing.device_batch(keys[:5] + keys[6:])
    assert torch.equal(good[0], images) and torch.equal(good[1], labels)


@pytest.mark.skipif(not HAS_TURBOJPEG, reason="libturbojpeg 3 not available here")
def test_the_native_renderer_refuses_an_empty_box_or_one_outside_its_image():
    crops = get_decoder("turbojpeg").crops
    if crops is None:
        pytest.skip("the native renderer was not compiled")
    buf = io.BytesIO()
    Image.fromarray(_photo(64, 48)).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    boxes = [(0, 0, 0, 10, False), (0, 0, 10, 0, False), (40, 0, 20, 10, False), (0, 60, 10, 10, False),
             (-1, 0, 10, 10, False), (0, 0, 48, 64, False)]
    out = np.full((len(boxes), 3, 16, 16), 7, np.uint8)
    status = crops.render([data] * len(boxes), [48] * len(boxes), [64] * len(boxes), boxes, out, True,
                          max_pixels=MAX_IMAGE_PIXELS)
    assert (status[:-1] != 0).all() and status[-1] == 0 and (out[:-1] == 7).all()
    status = crops.render([data, data], [480, 48], [640, 64], [(0, 0, 480, 640, False), (0, 0, 48, 64, True)],
                          out[:2], True, max_pixels=MAX_IMAGE_PIXELS)  # a stored size that is not the JPEG's
    assert status.tolist()[0] != 0 and status.tolist()[1] == 0
    with pytest.raises(ValueError, match="at least one pixel"):
        crops.render([data], [48], [64], [(0, 0, 48, 64, False)], np.empty((1, 3, 0, 16), np.uint8), True,
                     max_pixels=MAX_IMAGE_PIXELS)
    img = get_decoder("turbojpeg").decode(data)
    for box in boxes[:2] + boxes[4:5]:  # the Python path refuses the empty boxes, naming them (and clips the others)
        with pytest.raises(ValueError, match="crop box .* is empty or starts outside the image"):
            render(img, Box(*box), np.empty((3, 16, 16), np.uint8))


def test_a_datasets_label_outside_its_classes_is_named_with_the_index():
    class Labelled:
        classes = ["a", "b"]

        def __init__(self, bad):
            self.bad = bad

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full((20, 20, 3), 100, np.uint8), (self.bad if i == 2 else 0)

    for bad, said in ((-1, "not a class index"), (2, "outside its 2 classes"), (10 ** 12, "outside its 2 classes")):
        with pytest.raises(ValueError, match=rf"sample 2 of Labelled: its label is {bad}, {said}"):
            list(_loader(Labelled(bad)))
    assert sum(len(y) for _, y in _loader(Labelled(-1), on_error="skip")) == 3


@pytest.mark.skipif(not HAS_TURBOJPEG, reason="libturbojpeg 3 not available here")
def test_a_box_that_shrinks_one_side_past_2x_and_grows_the_other_is_left_to_opencv():
    """OpenCV's INTER_AREA with one axis growing follows rules of its own version (5.0 differs from the 4.x
    emulation the native resize follows by up to 200 levels): the native call hands such a box back (its status),
    and every box it renders is within one level of the Python path's OpenCV resize."""
    from torchspeed.data.libturbojpeg import dct_factor

    crops = get_decoder("turbojpeg").crops
    if crops is None:
        pytest.skip("the native renderer was not compiled")
    dec = get_decoder("turbojpeg")
    buf = io.BytesIO()
    Image.fromarray(_photo(640, 480)).save(buf, format="JPEG", quality=95)
    data, rng, mixed = buf.getvalue(), np.random.default_rng(0), 0
    for trial in range(300):
        bh, bw = int(rng.integers(1, 481)), int(rng.integers(1, 641))
        box = Box(int(rng.integers(0, 481 - bh)), int(rng.integers(0, 641 - bw)), bh, bw, bool(trial % 2))
        oh, ow = int(rng.integers(1, 200)), int(rng.integers(1, 200))
        out = np.empty((1, 3, oh, ow), np.uint8)
        status = crops.render([data], [480], [640], [box], out, True, max_pixels=MAX_IMAGE_PIXELS)[0]
        s = dct_factor(480, 640, -(-480 * oh // bh), -(-640 * ow // bw))
        part, r0, c0, fh, fw = dec.decode_region(data, *((-(-480 // s), -(-640 // s)) if s > 1 else (0, 0)), box[:4])
        h, w = round(bh * fh / 480), round(bw * fw / 640)
        one_grows_other_shrinks_past_2x = (h > 2 * oh or w > 2 * ow) and (h < oh or w < ow)
        if one_grows_other_shrinks_past_2x:
            mixed += 1
            assert status != 0
            continue
        assert status == 0
        ref = np.empty((3, oh, ow), np.uint8)
        render(part, box, ref, None, fh / 480, fw / 640, origin=(r0, c0), full=(fh, fw))
        assert np.abs(out[0].astype(int) - ref).max() <= 1, (box, oh, ow)
    assert mixed > 10
