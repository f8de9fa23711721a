"""pack() and PackedDataset: round trips, bad input, atomicity, integrity, no pickle."""
import json
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from torchspeed.data import PackedDataset, make_photo_folder, pack
from torchspeed.data import store as store_mod
from torchspeed.data.store import HEADER


class ArrayDataset:
    """Map-style dataset of random HWC uint8 arrays of varied shapes, label = index % 3."""

    classes = ["a", "b", "c"]

    def __init__(self, n=12, seed=0):
        rng = np.random.default_rng(seed)
        self.images = [rng.integers(0, 256, (int(rng.integers(20, 40)), int(rng.integers(20, 40)), 3), dtype=np.uint8)
                       for _ in range(n)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i % 3


def _psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize("workers", [1, 2])
def test_raw_round_trip_is_exact(tmp_path, workers):
    src = ArrayDataset()
    report = pack(src, tmp_path / "s", format="raw", num_workers=workers, progress=False)
    assert report.written == 12 and not report.skipped and report.bytes > sum(a.nbytes for a in src.images)
    ds = PackedDataset(tmp_path / "s")
    assert len(ds) == 12 and ds.classes == ["a", "b", "c"] and ds.targets == [i % 3 for i in range(12)]
    for i in range(12):
        img, label = ds[i]
        np.testing.assert_array_equal(img, src.images[i])
        assert label == i % 3


def test_jpeg_round_trip_keeps_labels_classes_and_quality(photo_folder, tmp_path):
    from torchvision.datasets import ImageFolder

    report = pack(photo_folder, tmp_path / "s", format="jpeg", quality=90, num_workers=2, progress=False)
    assert report.written == 24
    ref = ImageFolder(photo_folder)
    ds = PackedDataset(tmp_path / "s")
    assert ds.classes == ref.classes
    for i, (path, label) in enumerate(ref.samples):  # same sorted order as torchvision
        img, y = ds[i]
        assert y == label
        original = np.asarray(Image.open(path).convert("RGB"))
        assert img.shape == original.shape
        assert _psnr(img, original) > 32


def test_short_side_resizes_down_only_and_keeps_aspect(tmp_path):
    src = ArrayDataset()
    pack(src, tmp_path / "s", short_side=25, format="raw", num_workers=1, progress=False)
    ds = PackedDataset(tmp_path / "s")
    for i in range(len(ds)):
        h, w = src.images[i].shape[:2]
        got = ds[i][0].shape
        if min(h, w) <= 25:
            assert got[:2] == (h, w)  # never upscaled
        else:
            assert min(got[:2]) == 25 and abs(got[0] / got[1] - h / w) < 0.06
    assert ds.manifest["short_side"] == 25


def _bad_folder(root, which):
    good = make_photo_folder(root, 6, n_classes=2, seed=1, size=(64, 48), num_workers=1)
    ok = open(os.path.join(good, "class_00", "img_000000.jpg"), "rb").read()
    bad = {
        "corrupt": ("class_00", "corrupt.jpg", b"\xff\xd8\xff\xe0" + os.urandom(300)),
        "truncated": ("class_01", "truncated.jpg", ok[: len(ok) // 2]),
        "notimage": ("class_01", "notes.txt", b"these are not pixels\n"),
    }
    paths = []
    for key in which:
        cls, name, data = bad[key]
        p = os.path.join(good, cls, name)
        with open(p, "wb") as f:
            f.write(data)
        paths.append(p)
    return good, paths


def test_on_error_skip_reports_every_bad_file(tmp_path):
    src, bad = _bad_folder(tmp_path / "f", ["corrupt", "truncated", "notimage"])
    report = pack(src, tmp_path / "s", on_error="skip", num_workers=2, progress=False)
    assert report.written == 6
    assert sorted(s["path"] for s in report.skipped) == sorted(bad)
    assert all(s["reason"] for s in report.skipped)
    ds = PackedDataset(tmp_path / "s")
    assert len(ds) == 6 and ds.targets == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("which", ["corrupt", "truncated", "notimage"])
def test_on_error_fail_names_the_file_and_leaves_nothing(tmp_path, which):
    src, (bad,) = _bad_folder(tmp_path / "f", [which])
    with pytest.raises(ValueError, match="cannot read .*" + os.path.basename(bad)) as e:
        pack(src, tmp_path / "s", on_error="fail", num_workers=1, progress=False)
    assert bad in str(e.value) and "skip" in str(e.value)
    assert not (tmp_path / "s").exists()


class Interrupting(ArrayDataset):
    def __getitem__(self, i):
        if i == 7:
            raise KeyboardInterrupt  # not an image error: the pack itself is interrupted
        return super().__getitem__(i)


def test_interrupted_pack_leaves_no_store(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        pack(Interrupting(40), tmp_path / "s", num_workers=1, progress=False)
    assert os.listdir(tmp_path) == []  # neither dst nor a partial build beside it


def test_existing_dst_needs_overwrite(tmp_path):
    pack(ArrayDataset(4), tmp_path / "s", format="raw", num_workers=1, progress=False)
    with pytest.raises(ValueError, match="already exists"):
        pack(ArrayDataset(4), tmp_path / "s", num_workers=1, progress=False)
    pack(ArrayDataset(5, seed=3), tmp_path / "s", format="raw", num_workers=1, progress=False, overwrite=True)
    assert len(PackedDataset(tmp_path / "s")) == 5


def test_crc_mismatch_is_detected_and_named(tmp_path):
    src = ArrayDataset()
    pack(src, tmp_path / "s", format="raw", num_workers=1, progress=False)
    data = tmp_path / "s" / "data.mdb"
    blob = bytearray(data.read_bytes())
    needle = src.images[5].tobytes()[:64]
    pos = blob.find(needle)
    assert pos > 0
    blob[pos + 10] ^= 0xFF
    data.write_bytes(bytes(blob))
    ds = PackedDataset(tmp_path / "s")
    ds[4]  # others still read
    with pytest.raises(ValueError, match=r"record 5 .*CRC32"):
        ds[5]


def test_not_a_store_and_unknown_version(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a torchspeed packed store"):
        PackedDataset(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no packed store"):
        PackedDataset(tmp_path / "missing")
    pack(ArrayDataset(3), tmp_path / "s", format="raw", num_workers=1, progress=False)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["format_version"] = 99
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format version 99"):
        PackedDataset(tmp_path / "s")


def test_store_contains_no_pickle(tmp_path, monkeypatch, photo_folder):
    def forbidden(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "dump", "loads", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(pickle, "Pickler", forbidden)
    pack(photo_folder, tmp_path / "j", num_workers=1, progress=False)
    pack(ArrayDataset(4), tmp_path / "r", format="raw", num_workers=1, progress=False)
    monkeypatch.undo()
    import lmdb

    for name, kind in (("j", 1), ("r", 0)):
        json.loads((tmp_path / name / "manifest.json").read_text())  # the metadata is plain JSON
        assert sorted(os.listdir(tmp_path / name)) == ["data.mdb", "manifest.json"]
        env = lmdb.open(str(tmp_path / name), readonly=True, lock=False)
        with env.begin() as txn:
            for key, value in txn.cursor():
                magic, code, c, h, w, label = HEADER.unpack_from(value)
                payload = value[HEADER.size:]
                assert magic == b"TSR1" and code == kind and len(key) == 8
                if kind == 1:
                    assert payload[:2] == b"\xff\xd8" and payload[-2:] == b"\xff\xd9"  # a bare JPEG
                else:
                    assert len(payload) == h * w * c  # bare pixels
                assert b"\x80\x04\x95" not in value and b"\x80\x05\x95" not in value
        env.close()


def test_len_and_classes_do_not_open_lmdb_and_pickling_drops_the_handle(tmp_path):
    pack(ArrayDataset(6), tmp_path / "s", format="raw", num_workers=1, progress=False)
    ds = PackedDataset(tmp_path / "s")
    assert len(ds) == 6 and ds.classes == ["a", "b", "c"]
    assert ds._env is None and not any(k[0] == ds.path for k in store_mod._ENVS)
    first = ds[2][0].copy()
    assert ds._env is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._env is None
    np.testing.assert_array_equal(clone[2][0], first)


def test_a_store_released_while_another_opens_in_the_same_thread_does_not_deadlock(photo_store):
    """Garbage collection can run a PackedDataset's __del__ (which releases its handle) inside another
    dataset's open, in the same thread, while the open holds the lock over the handles."""
    import threading

    collected = PackedDataset(photo_store)
    collected.record(0)  # holds a handle
    done = threading.Event()

    def release_inside_an_open():
        with store_mod._ENVS_LOCK:  # what an open in progress holds
            collected.close()
        done.set()

    threading.Thread(target=release_inside_an_open, daemon=True).start()
    assert done.wait(30)


def test_in_memory_reads_the_same_and_is_one_buffer(photo_store):
    disk = PackedDataset(photo_store)
    ram = PackedDataset(photo_store, in_memory=True)
    assert ram.in_memory and isinstance(ram._blob, np.ndarray) and ram._offsets.shape == (25,)
    assert ram._env is None  # the store was read once and closed
    for i in range(len(disk)):
        np.testing.assert_array_equal(ram[i][0], disk[i][0])
        assert ram[i][1] == disk[i][1]


def test_pack_bad_arguments(tmp_path, photo_folder):
    with pytest.raises(ValueError, match="format"):
        pack(photo_folder, tmp_path / "s", format="png")
    with pytest.raises(ValueError, match="on_error"):
        pack(photo_folder, tmp_path / "s", on_error="ignore")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pack(tmp_path / "nope", tmp_path / "s")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "x.jpg")
    with pytest.raises(ValueError, match="no class sub-directories"):
        pack(tmp_path / "flat", tmp_path / "s")


def test_pack_accepts_pil_and_chw_tensors(tmp_path):
    import torch

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (10, 14, 3), dtype=np.uint8) for _ in range(4)]
    samples = [(Image.fromarray(arrays[0]), 0), (torch.from_numpy(arrays[1]).permute(2, 0, 1), 1),
               (Image.fromarray(arrays[2][..., 0]), 0), (arrays[3], 1)]
    pack(samples, tmp_path / "s", format="raw", num_workers=1, progress=False, classes=["x", "y"])
    ds = PackedDataset(tmp_path / "s")
    np.testing.assert_array_equal(ds[0][0], arrays[0])
    np.testing.assert_array_equal(ds[1][0], arrays[1])
    np.testing.assert_array_equal(ds[2][0], np.repeat(arrays[2][..., :1], 3, axis=2))  # grey -> RGB
    assert ds.classes == ["x", "y"] and ds.targets == [0, 1, 0, 1]
