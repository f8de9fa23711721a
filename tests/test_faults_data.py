"""Fault suite for the data area: bad inputs are named, nothing of the user's is lost, no crash.

Each test asserts the exception (or exit status), that the message names the file or store, and that
nothing was lost (source files intact, the previous store still loadable). Three tests run a subprocess:
the truncated store (read unchecked, it would kill pytest with SIGBUS), SIGKILL during pack, and a pack
whose writes fail for real (a file-size limit makes LMDB's own writes fail, as a full disk does).
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from torchspeed.data import PackedDataset, fast_loader, pack
from torchspeed.data.sources import FolderSource, as_source, train_val_split
from torchspeed.images import MAX_IMAGE_PIXELS, scan_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------- helpers


def _digest(root) -> dict[str, str]:
    """Every file under `root` -> sha1 of its bytes (to prove nothing was touched)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _jpeg(mode="RGB", size=(40, 30), **kw) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    bands = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    a = rng.integers(0, 255, (size[1], size[0], bands), dtype=np.uint8)
    im = Image.fromarray(a[..., 0] if bands == 1 else a, mode)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _png(mode="RGBA", size=(40, 30)) -> bytes:
    from PIL import Image

    im = Image.new(mode, size)
    if mode == "P":
        im.info["transparency"] = 0
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _huge_header_jpeg(width=60000, height=60000) -> bytes:
    """A valid small JPEG whose SOF header claims width x height."""
    data = bytearray(_jpeg())
    i = data.index(b"\xff\xc0")
    data[i + 5:i + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_header_bomb(side=20000) -> bytes:
    """A tiny PNG whose IHDR claims side x side (1-bit grey): 400 M pixels from a few bytes."""
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")


def _png_text_bomb() -> bytes:
    """A 1x1 PNG with a zTXt chunk that inflates to 4 MiB (a decompression bomb in the metadata)."""
    good = _png("RGB", (1, 1))
    bomb = _chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"A" * (4 << 20), 9))
    return good[:33] + bomb + good[33:]  # after the signature and IHDR


GOOD = {  # name -> bytes that pack and folder reading must read correctly (RGB out)
    "cmyk.jpg": lambda: _jpeg("CMYK"),
    "grey.jpg": lambda: _jpeg("L"),
    "grey.png": lambda: _png("L"),
    "alpha.png": lambda: _png("RGBA"),
    "grey_alpha.png": lambda: _png("LA"),
    "palette.png": lambda: _png("P"),
    "progressive.jpg": lambda: _jpeg("RGB", progressive=True),
}


BAD = {  # name -> bytes that must be refused with the file named
    "zero_byte.jpg": lambda: b"",
    "not_an_image.jpg": lambda: b"just some text, not an image\n" * 10,
    "random_bytes.png": lambda: bytes(np.random.default_rng(1).integers(0, 255, 3000, dtype=np.uint8)),
    "truncated.jpg": lambda: _jpeg()[:400],
    "truncated.png": lambda: _png("RGB", (64, 64))[:60],
    "header_bomb.jpg": _huge_header_jpeg,
    "header_bomb.png": _png_header_bomb,
    "text_bomb.png": _png_text_bomb,
}


def _folder(tmp_path, files: dict[str, bytes], name="src"):
    """ROOT/a/<files> plus ROOT/b/ok.jpg (pack and loaders need a real image beside the odd one)."""
    root = tmp_path / name
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for fname, data in files.items():
        with open(os.path.join(os.fsencode(root / "a"), os.fsencode(fname) if isinstance(fname, str) else fname), "wb") as f:
            f.write(data)
    (root / "b" / "ok.jpg").write_bytes(_jpeg())
    return root


def _copy_store(photo_store, tmp_path) -> str:
    dst = str(tmp_path / "copy.store")
    shutil.copytree(photo_store, dst)
    return dst


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------- pack never writes into its source, and replaces nothing but a store


def test_pack_refuses_dst_equal_to_src_and_deletes_nothing(small_photo_folder, tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # the one-line error is not wrapped

    src = tmp_path / "photos"
    shutil.copytree(small_photo_folder, src)
    (tmp_path / "unrelated.txt").write_text("keep me")
    before = _digest(tmp_path)
    with pytest.raises(ValueError) as e:
        pack(src, src, overwrite=True, progress=False, num_workers=1)
    assert str(src) in str(e.value) and "is the source folder itself" in str(e.value)
    assert main(["pack", str(src), str(src), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(src) in err and "refusing" in err
    assert _digest(tmp_path) == before  # source images and the file beside them intact


def test_pack_refuses_dst_inside_or_around_src(small_photo_folder, tmp_path):
    src = tmp_path / "outer" / "photos"
    shutil.copytree(small_photo_folder, src)
    link = tmp_path / "link_to_photos"
    link.symlink_to(src)
    before = _digest(tmp_path / "outer")
    for dst, where in [(src / "store", "inside"), (tmp_path / "outer", "contains"), (link, "itself"),
                       (link / "a_class" / "s", "inside")]:
        with pytest.raises(ValueError) as e:
            pack(src, dst, overwrite=True, progress=False, num_workers=1)
        assert where in str(e.value) and str(src) in str(e.value) and str(dst) in str(e.value)
    assert _digest(tmp_path / "outer") == before
    assert sorted(os.listdir(tmp_path / "outer")) == ["photos"]  # no partial directory left either


def test_pack_overwrite_replaces_only_a_store(small_photo_folder, tmp_path):
    # a plain directory, a file, and a store the user has put a file into: none is replaced
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "thesis.tex").write_text("years of work")
    afile = tmp_path / "afile"
    afile.write_text("keep")
    store = tmp_path / "store"
    pack(small_photo_folder, store, progress=False, num_workers=1)
    (store / "notes.txt").write_text("mine")
    for dst in (plain, afile, store):
        before = _digest(tmp_path)
        with pytest.raises(ValueError) as e:
            pack(small_photo_folder, dst, overwrite=True, progress=False, num_workers=1)
        assert "not a torchspeed store" in str(e.value) and str(dst) in str(e.value)
        assert _digest(tmp_path) == before
    # a store (manifest + data only) is replaced
    os.unlink(store / "notes.txt")
    report = pack(small_photo_folder, store, short_side=20, overwrite=True, progress=False, num_workers=1)
    assert report.written == 8 and PackedDataset(store).manifest["short_side"] == 20


# ---------------- damaged stores are refused at open, named


def test_truncated_store_is_refused_at_open_not_sigbus(photo_store, tmp_path):
    store = _copy_store(photo_store, tmp_path)
    data = os.path.join(store, "data.mdb")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    # in a subprocess: without the check the reader dies of SIGBUS, which would take pytest with it
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "tune-loader", store, "--batch-size", "2", "--crop",
                           "16", "--num-workers", "0", "--threads", "1", "--tune-seconds", "0.05"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert store in proc.stderr and "truncated" in proc.stderr and "re-pack" in proc.stderr
    assert "Traceback" not in proc.stderr
    # in this process: the check comes before LMDB maps the file, so nothing here can fault
    for reader in (PackedDataset, as_source):
        with pytest.raises(ValueError, match="truncated.*re-pack"):
            reader(store)


@pytest.mark.parametrize("damage", ["zero_bytes", "garbage_header"])
def test_store_with_a_broken_data_file_is_named(photo_store, tmp_path, damage):
    store = _copy_store(photo_store, tmp_path)
    data = os.path.join(store, "data.mdb")
    with open(data, "r+b") as f:
        if damage == "zero_bytes":
            f.truncate(0)
        else:
            f.write(b"\0" * 8192)
    with pytest.raises(ValueError) as e:
        PackedDataset(store)
    assert store in str(e.value) and "re-pack" in str(e.value)


def test_store_without_manifest_says_damaged(photo_store, tmp_path):
    store = _copy_store(photo_store, tmp_path)
    os.unlink(os.path.join(store, "manifest.json"))
    for read in (PackedDataset, as_source, lambda p: train_val_split(p),
                 lambda p: fast_loader(p, 2, crop=16, device="cpu", num_workers=0, threads=1, decoder="simplejpeg")):
        with pytest.raises(ValueError) as e:
            read(store)
        assert "damaged" in str(e.value) and store in str(e.value) and "class sub-directories" not in str(e.value)


# ---------------- bad images are named wherever they are read: pack, folder reading, the loader


def test_header_bomb_jpeg_is_refused_before_decoding(tmp_path):
    root = _folder(tmp_path, {"huge.jpg": _huge_header_jpeg()})
    bad = str(root / "a" / "huge.jpg")
    source = FolderSource(str(root))
    i = [p for p, _ in source.samples].index(bad)
    for read in (source.record, source.__getitem__):
        with pytest.raises(ValueError) as e:
            read(i)
        assert bad in str(e.value) and "60000x60000" in str(e.value) and "not decoded" in str(e.value)
    # fast_loader on the folder (decoder measured on the samples: the header is read first)
    with pytest.raises(ValueError, match="huge.jpg"):
        fast_loader(str(root), 1, crop=16, device="cpu", num_workers=0, threads=1, train=False)
    # pack refuses the same image with the same limit
    with pytest.raises(ValueError) as e:
        pack(root, tmp_path / "s", progress=False, num_workers=1)
    assert bad in str(e.value) and f"{MAX_IMAGE_PIXELS:,}" in str(e.value)


@pytest.mark.parametrize("name", ["header_bomb.png", "text_bomb.png"])
def test_png_bomb_gives_a_clear_error(tmp_path, name):
    root = _folder(tmp_path, {name: BAD[name]()})
    bad = str(root / "a" / name)
    source = FolderSource(str(root))
    i = [p for p, _ in source.samples].index(bad)
    with pytest.raises(ValueError) as e:
        source[i]
    assert bad in str(e.value)
    with pytest.raises(ValueError) as e:  # read when its batch is made
        list(fast_loader(str(root), 1, crop=16, device="cpu", num_workers=0, threads=1, train=False,
                         decoder="simplejpeg"))
    assert bad in str(e.value)
    with pytest.raises(ValueError) as e:
        pack(root, tmp_path / "s", progress=False, num_workers=1)
    assert bad in str(e.value) and "Traceback" not in str(e.value)


def test_truncated_jpeg_is_named_on_every_decode_path(tmp_path):
    root = _folder(tmp_path, {"cut.jpg": _jpeg()[:400]})
    bad = str(root / "a" / "cut.jpg")
    source = FolderSource(str(root))
    i = [p for p, _ in source.samples].index(bad)
    with pytest.raises(ValueError, match="cut.jpg"):
        source[i]
    for decoder in ("simplejpeg", "pil", "opencv"):  # decoding in the loader's batch makers
        loader = fast_loader(str(root), 2, crop=16, device="cpu", num_workers=0, threads=1, train=False,
                             decoder=decoder)
        with pytest.raises(ValueError) as e:
            list(loader)
        assert bad in str(e.value), (decoder, str(e.value))
    loader = fast_loader(str(root), 2, crop=16, device="cpu", num_workers=1, train=False, decoder="simplejpeg")
    with pytest.raises(ValueError) as e:  # in a worker process: the same one line, not the worker's traceback
        list(loader)
    assert bad in str(e.value) and "\n" not in str(e.value)
    # decoder="auto": the decoders are measured on the samples first; the failing one is named
    with pytest.raises(ValueError) as e:
        fast_loader(str(root), 2, crop=16, device="cpu", num_workers=0, threads=1, train=False)
    assert bad in str(e.value)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_files_are_named_in_pack_and_skipped_on_request(tmp_path, name):
    root = _folder(tmp_path, {name: BAD[name]()})
    bad = str(root / "a" / name)
    before = _digest(root)
    with pytest.raises(ValueError) as e:
        pack(root, tmp_path / "s", progress=False, num_workers=1)
    assert bad in str(e.value) and "Traceback" not in str(e.value)
    assert not os.path.exists(tmp_path / "s") and os.listdir(tmp_path) == ["src"]  # no half store, no partial
    report = pack(root, tmp_path / "s", on_error="skip", progress=False, num_workers=1)
    assert report.written == 1 and [s["path"] for s in report.skipped] == [bad]
    assert len(PackedDataset(tmp_path / "s")) == 1
    source = FolderSource(str(root))  # folder reading: the same file named
    i = [p for p, _ in source.samples].index(bad)
    with pytest.raises(ValueError) as e:
        source[i]
    assert bad in str(e.value)
    assert _digest(root) == before


# ---------------- odd but valid images and file names are read


@pytest.mark.parametrize("name", sorted(GOOD))
def test_odd_but_valid_images_pack_and_read_as_rgb(tmp_path, name):
    root = _folder(tmp_path, {name: GOOD[name]()})
    before = _digest(root)
    report = pack(root, tmp_path / "s", progress=False, num_workers=1)
    assert report.written == 2 and not report.skipped
    store = PackedDataset(tmp_path / "s")
    for i in range(2):
        img, _ = store[i]
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    source = FolderSource(str(root))
    for i in range(len(source)):
        img, _ = source[i]
        assert img.dtype == np.uint8 and img.shape[2] == 3 and img.shape[:2] == (30, 40)
    batches = list(fast_loader(str(root), 2, crop=16, device="cpu", num_workers=0, threads=1, train=False,
                               decoder="simplejpeg"))
    assert batches[0][0].shape == (2, 3, 16, 16)
    assert _digest(root) == before


def test_non_utf8_file_names_pack_and_read(tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping inside the printed paths

    raw_name = b"caf\xe9 \xff.jpg"  # Latin-1 bytes: not UTF-8
    root = _folder(tmp_path, {raw_name: _jpeg(), b"bad \xff.jpg": b"not a jpeg"})
    with pytest.raises(ValueError) as e:
        pack(root, tmp_path / "s", progress=False, num_workers=1)
    assert "bad \\xff.jpg" in str(e.value)
    str(e.value).encode("utf-8")  # printable: no lone surrogates
    assert main(["pack", str(root), str(tmp_path / "s"), "--on-error", "skip", "--num-workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "bad \\xff.jpg" in out
    store = PackedDataset(tmp_path / "s")
    assert len(store) == 2 and store[0][0].shape[2] == 3
    source = FolderSource(str(root))
    assert len(source) == 3
    i = [os.fsencode(p) for p, _ in source.samples].index(os.fsencode(root / "a") + b"/" + raw_name)
    assert source[i][0].shape == (30, 40, 3)


def test_directory_symlink_loop_is_followed_once(tmp_path):
    root = _folder(tmp_path, {"x.jpg": _jpeg(), "y.jpg": _jpeg()})
    os.symlink(".", root / "a" / "loop")                # a/loop -> a
    os.symlink("..", root / "a" / "up")                 # a/up -> ROOT (holds a and b)
    os.symlink(os.path.join("..", "a"), root / "b" / "to_a")  # from one class into another
    (root / "a" / "sub").mkdir()
    (root / "a" / "sub" / "z.jpg").write_bytes(_jpeg())
    os.symlink(root / "a" / "sub", root / "a" / "sub_again")  # a second link to a directory already read
    classes, samples = scan_folder(str(root))
    names = sorted(os.path.relpath(p, root) for p, _ in samples)
    assert classes == ["a", "b"]
    assert names == ["a/sub/z.jpg", "a/x.jpg", "a/y.jpg", "b/ok.jpg"]
    report = pack(root, tmp_path / "s", on_error="skip", progress=False, num_workers=1)
    assert report.written == 4 and not report.skipped
    assert len(FolderSource(str(root))) == 4


# ---------------- an interrupted pack leaves the previous store, and the next pack cleans up


def test_next_pack_cleans_stale_partials_and_only_those(small_photo_folder, tmp_path):
    from torchspeed.data.packer import _host

    host = _host()
    dead = _dead_pid()
    stale = tmp_path / f".old.store.partial-{dead}-{host}-abc123"
    stale.mkdir()
    (stale / "data.mdb").write_bytes(b"\0" * 100)
    alive = tmp_path / f".other.store.partial-{os.getppid()}-{host}-def456"  # our parent: alive
    alive.mkdir()
    (alive / "data.mdb").write_bytes(b"\0")
    foreign = tmp_path / f".mine.partial-{dead}-{host}-ghi789"  # named like ours but holds a user's file
    foreign.mkdir()
    (foreign / "paper.tex").write_text("keep")
    unrelated = tmp_path / ".cache.partial-zzz"  # no pid, recent: left alone
    unrelated.mkdir()
    (unrelated / "data.mdb").write_bytes(b"\0")
    pack(small_photo_folder, tmp_path / "new.store", progress=False, num_workers=1)
    left = set(os.listdir(tmp_path))
    assert stale.name not in left
    assert {alive.name, foreign.name, unrelated.name, "new.store"} <= left
    assert (foreign / "paper.tex").read_text() == "keep"


def test_interrupted_overwrite_puts_the_previous_store_back(small_photo_folder, tmp_path):
    from torchspeed.data.packer import _host

    pack(small_photo_folder, tmp_path / "s", progress=False, num_workers=1)
    aside = tmp_path / f".s.old-{_dead_pid()}-{_host()}-abc123"  # killed between its two renames
    aside.mkdir()
    os.rename(tmp_path / "s", aside / "store")
    pack(small_photo_folder, tmp_path / "other", progress=False, num_workers=1)
    assert sorted(os.listdir(tmp_path)) == ["other", "s"]
    assert len(PackedDataset(tmp_path / "s")) == 8


_KILLABLE_PACK = """
import sys, time
from torchspeed.data import pack
def progress(msg):
    print(msg, flush=True)
    time.sleep(60)  # killed here, with a chunk written and the store not finished
pack(sys.argv[1], sys.argv[2], overwrite=True, num_workers=1, progress=progress)
"""


def test_sigkill_during_pack_leaves_the_previous_store(photo_folder, small_photo_folder, tmp_path):
    dst = tmp_path / "s"
    pack(small_photo_folder, dst, progress=False, num_workers=1)
    before = _digest(dst)
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE_PACK, str(photo_folder), str(dst)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the first chunk is in the partial store
        assert "packed" in line, proc.stderr.read()
        partials = [n for n in os.listdir(tmp_path) if ".partial-" in n]
        assert partials and partials[0].startswith(f".s.partial-{proc.pid}-")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # no half store at DST: the previous one, whole and loadable
    assert _digest(dst) == before and len(PackedDataset(dst)) == 8 and PackedDataset(dst)[7][0].ndim == 3
    assert os.path.isdir(tmp_path / partials[0])
    report = pack(photo_folder, dst, overwrite=True, progress=False, num_workers=1)  # the next pack cleans up
    assert report.written == 24
    assert sorted(os.listdir(tmp_path)) == ["s"]


# ---------------- what is written gets the usual permissions and appears whole


def test_stores_and_demo_folders_get_the_usual_permissions(small_photo_folder, tmp_path, monkeypatch):
    from torchspeed.data import demo_folder, make_photo_folder

    old = os.umask(0o022)
    try:
        pack(small_photo_folder, tmp_path / "s", progress=False, num_workers=1)
        make_photo_folder(tmp_path / "photos", 4, n_classes=2, size=(16, 12), num_workers=1)
        monkeypatch.setenv("TORCHSPEED_CACHE", str(tmp_path / "cache"))
        cached = demo_folder(n_images=4, n_classes=2, size=(16, 12))
    finally:
        os.umask(old)
    for path in (tmp_path / "s", tmp_path / "photos", tmp_path / "photos" / "class_00", cached):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o755, path
    for path in (tmp_path / "s" / "manifest.json", tmp_path / "s" / "data.mdb",
                 tmp_path / "photos" / "class_00" / "img_000000.jpg"):
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o044 == 0o044, path


def test_demo_photos_are_written_atomically(tmp_path, monkeypatch):
    from torchspeed.data import demo, make_photo_folder

    real, calls = demo._render, []

    class Broken:  # the third image dies half-written
        def save(self, f, *a, **k):
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as fh:
                    fh.write(b"\xff\xd8 half a jpeg")
            else:
                f.write(b"\xff\xd8 half a jpeg")
            raise RuntimeError("killed")

    def failing(*a, **k):
        calls.append(1)
        return (0, Broken()) if len(calls) == 3 else real(*a, **k)

    monkeypatch.setattr(demo, "_render", failing)
    with pytest.raises(RuntimeError):
        make_photo_folder(tmp_path / "new", 4, n_classes=2, size=(16, 12), num_workers=1)
    assert os.listdir(tmp_path) == []  # a new folder appears whole or not at all
    (tmp_path / "existing").mkdir()
    calls.clear()
    with pytest.raises(RuntimeError):
        make_photo_folder(tmp_path / "existing", 4, n_classes=2, size=(16, 12), num_workers=1)
    files = [f for _, _, fs in os.walk(tmp_path / "existing") for f in fs]
    assert sorted(files) == ["img_000000.jpg", "img_000001.jpg"]  # whole images only, no temporaries
    monkeypatch.setattr(demo, "_render", real)
    a = make_photo_folder(tmp_path / "a", 4, n_classes=2, size=(16, 12), num_workers=1)
    b = make_photo_folder(tmp_path / "existing", 4, n_classes=2, size=(16, 12), num_workers=1)
    assert _digest(a) == _digest(b)  # the same bytes either way


# ---------------- the pixel limit holds on every decode path: store records, every decoder, nvjpeg


def _rewrite_record(store: str, index: int, record: bytes) -> None:
    """Replace record `index` of `store` (its CRC32 in the manifest too, so only the pixel limit can refuse it)."""
    import json

    import lmdb

    from torchspeed.data.store import key_of

    env = lmdb.open(store, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(key_of(index), record)
    env.close()
    with open(os.path.join(store, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["crc32"][index] = zlib.crc32(record)
    with open(os.path.join(store, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _peak_bytes(read) -> int:
    """The most memory (numpy and Python allocations) `read()` held at once; it must raise ValueError."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as e:
            read()
        return tracemalloc.get_traced_memory()[1], str(e.value)
    finally:
        tracemalloc.stop()


def test_a_store_record_claiming_a_huge_jpeg_is_refused_before_decoding(photo_store, tmp_path):
    from torchspeed.data.record import decode_record
    from torchspeed.data.store import HEADER, MAGIC

    store = _copy_store(photo_store, tmp_path)
    bomb = _huge_header_jpeg(20000, 20000)
    _rewrite_record(store, 0, HEADER.pack(MAGIC, 1, 3, 30, 40, 0) + bomb)  # a modest header, the JPEG's own says 20000
    _rewrite_record(store, 1, HEADER.pack(MAGIC, 1, 3, 20000, 20000, 0) + bomb)  # the record's header says so too
    ds = PackedDataset(store)
    peak, text = _peak_bytes(lambda: ds.record(1))
    assert "record 1" in text and store in text and "20000x20000" in text and "not decoded" in text
    assert peak < 64 << 20  # refused from the header: the 1.2 GB of pixels were never allocated
    for read in (lambda: ds[0], lambda: decode_record(ds.record(0), "pil"), lambda: decode_record(ds.record(0), "opencv"),
                 lambda: list(fast_loader(store, 1, crop=16, device="cpu", num_workers=0, threads=1, train=False,
                                          decoder="simplejpeg"))):  # batch 1: record 0 alone (its JPEG lies)
        peak, text = _peak_bytes(read)
        assert "20000x20000" in text and "not decoded" in text and peak < 64 << 20, text
    assert "record 0" in text and store in text  # the loader names the record
    assert ds[2][0].shape[2] == 3  # the other records still read


def test_every_decoder_refuses_a_header_bomb_before_decoding(monkeypatch):
    from torchspeed.data import decode

    bomb = _huge_header_jpeg(20000, 20000)
    for name, why in decode.available_decoders().items():
        if why is None and name not in decode.GPU_DECODERS:
            peak, text = _peak_bytes(lambda: decode.get_decoder(name).decode(bomb))
            assert "20000x20000" in text and "not decoded" in text and peak < 64 << 20, name
    # nvjpeg's batch path: the image is refused, named, before any GPU or CPU decoder sees it
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "_nvjpeg", lambda data, device: pytest.fail("nvjpeg was given the bomb"))
    with pytest.raises(ValueError, match=r"bomb\.jpg: the JPEG claims 20000x20000.*not decoded"):
        decode.decode_jpeg_batch_cuda([_jpeg(), bomb], "cpu", names=["ok.jpg", "bomb.jpg"])


# ---------------- 16-bit and other modes are converted faithfully to 8-bit RGB


def _encoded(im, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def _faithful_cases() -> dict[str, tuple[bytes, np.ndarray]]:
    """name -> (file bytes, the RGB pixels that file shows)."""
    from PIL import Image

    ramp16 = np.tile(np.linspace(0, 65535, 40).round().astype(np.uint16), (30, 1))
    grey16 = np.rint(ramp16 / 257).astype(np.uint8)
    ramp_f = np.tile(np.linspace(0, 1, 40, dtype=np.float32), (30, 1))
    pgm12 = b"P5\n40 30\n4095\n" + np.tile(np.linspace(0, 4095, 40).round().astype(">u2"), (30, 1)).tobytes()
    la = np.zeros((30, 40, 2), np.uint8)
    la[..., 0], la[:, 20:, 1] = 50, 255  # left half transparent (over white), right half opaque grey 50
    white_then_50 = np.where(np.arange(40) < 20, 255, 50).astype(np.uint8)
    palette = Image.new("P", (40, 30), 1)
    palette.putpalette([255, 0, 255, 10, 20, 30] + [0] * 762)  # colour 0 (magenta) is the transparent one
    palette.paste(0, (0, 0, 20, 30))
    palette.info["transparency"] = 0
    rgb = lambda grey: np.repeat(grey[..., None], 3, axis=2)  # noqa: E731
    return {
        "grey16.png": (_encoded(Image.fromarray(ramp16), "PNG"), rgb(grey16)),
        "grey16.tif": (_encoded(Image.fromarray(ramp16), "TIFF"), rgb(grey16)),
        "grey12.pgm": (pgm12, rgb(grey16)),  # PIL scales a 12-bit PGM to 16 bits: the same ramp
        "float.tif": (_encoded(Image.fromarray(ramp_f, "F"), "TIFF"), rgb(np.rint(ramp_f * 255).astype(np.uint8))),
        "grey_alpha.png": (_encoded(Image.fromarray(la, "LA"), "PNG"), rgb(np.tile(white_then_50, (30, 1)))),
        "palette_transparent.png": (
            _encoded(palette, "PNG"),
            np.concatenate([np.full((30, 20, 3), 255, np.uint8), np.tile(np.uint8([10, 20, 30]), (30, 20, 1))], 1)),
    }


def test_sixteen_bit_alpha_and_palette_images_convert_faithfully_everywhere(tmp_path):
    from PIL import Image

    from torchspeed.data.record import to_hwc_uint8

    cases = _faithful_cases()
    root = _folder(tmp_path, {name: data for name, (data, _) in cases.items()})
    pack(root, tmp_path / "s", format="raw", progress=False, num_workers=1)
    store, source = PackedDataset(tmp_path / "s"), FolderSource(str(root))
    packed = {os.path.basename(source.samples[i][0]): store[i][0] for i in range(len(store))}
    read = {os.path.basename(p): source[i][0] for i, (p, _) in enumerate(source.samples)}
    for name, (data, expected) in cases.items():
        from_dataset = to_hwc_uint8(Image.open(io.BytesIO(data)))  # a Dataset's PIL image: the same conversion
        for how, got in (("pack", packed[name]), ("folder", read[name]), ("dataset", from_dataset)):
            assert got.shape == (30, 40, 3) and got.dtype == np.uint8, (name, how)
            assert np.abs(got.astype(int) - expected).max() <= 1, (name, how, got.mean(), expected.mean())
    assert abs(packed["grey16.png"].mean() - 127.5) < 1  # not the near-white of PIL's clipping convert
    ramp16 = np.tile(np.linspace(0, 65535, 40).round().astype(np.uint16), (30, 1))
    assert np.abs(to_hwc_uint8(ramp16).astype(int) - cases["grey16.png"][1]).max() <= 1  # a uint16 array alike


# ---------------- damaged stores: wrong manifest types, corrupted pages


@pytest.mark.parametrize("field,value,said", [
    ("count", "24", "'count' is '24'"),
    ("classes", "class_00", "'classes' is not a list"),
    ("labels", [0] * 3, "'labels' is not a list of 24"),
    ("labels", ["cat"] * 24, "'labels' holds 'cat'"),
    ("labels", [7] * 24, "'labels' holds 7, outside 0..2"),
    ("crc32", [-1] * 24, "'crc32' holds -1"),
    ("crc32", None, "'crc32' is not a list"),
    ("encoding", "png", "'encoding' is 'png'"),
])
def test_manifest_fields_of_the_wrong_type_are_named(photo_store, tmp_path, capsys, monkeypatch, field, value, said):
    import json

    from torchspeed.cli import main

    monkeypatch.setenv("COLUMNS", "1000")
    store = _copy_store(photo_store, tmp_path)
    with open(os.path.join(store, "manifest.json")) as f:
        manifest = json.load(f)
    manifest[field] = value
    with open(os.path.join(store, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    for read in (PackedDataset, as_source):
        with pytest.raises(ValueError) as e:
            read(store)
        assert store in str(e.value) and said in str(e.value) and "re-pack" in str(e.value)
    assert main(["tune-loader", store, "--num-workers", "0", "--threads", "1", "--tune-seconds", "0.05"]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_corrupted_lmdb_page_is_named_with_re_pack(photo_store, tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main

    monkeypatch.setenv("COLUMNS", "1000")
    store = _copy_store(photo_store, tmp_path)
    with open(os.path.join(store, "data.mdb"), "r+b") as f:
        f.seek(2 * 4096)  # the B-tree's first page after the two meta pages
        f.write(b"\xa5" * 4096)
    ds = PackedDataset(store)
    for i in (0, 1):  # the failed read does not poison the next one with MDB_BAD_TXN
        with pytest.raises(ValueError) as e:
            ds[i]
        assert store in str(e.value) and "damaged" in str(e.value) and "re-pack" in str(e.value)
        assert "MDB_CORRUPTED" in str(e.value) and f"record {i}" in str(e.value)
    with pytest.raises(ValueError, match="damaged.*re-pack"):
        PackedDataset(store, in_memory=True)
    with pytest.raises(ValueError, match="damaged.*re-pack"):
        list(fast_loader(store, 2, crop=16, device="cpu", num_workers=1, train=False, decoder="simplejpeg"))
    assert main(["tune-loader", store, "--num-workers", "0", "--threads", "1", "--tune-seconds", "0.05"]) == 2
    err = capsys.readouterr().err
    assert store in err and "re-pack" in err and len(err.strip().splitlines()) == 1


# ---------------- folders: empty classes, train/val classes, files that are not files


def test_an_empty_class_folder_is_kept_and_named_in_a_warning(tmp_path, caplog):
    import logging

    root = _folder(tmp_path, {"x.jpg": _jpeg()})
    (root / "c_empty").mkdir()
    (root / "d_no_images").mkdir()
    (root / "d_no_images" / "notes.txt").write_text("not an image")
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        source = FolderSource(str(root))
    assert source.classes == ["a", "b", "c_empty", "d_no_images"] and sorted(source.targets) == [0, 1]
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("torchspeed")]
    assert len(warned) == 1 and "'c_empty', 'd_no_images'" in warned[0] and str(root) in warned[0]
    assert "never sees" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        FolderSource(str(root))  # once per process, not once per loader
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        report = pack(root, tmp_path / "s", on_error="skip", progress=False, num_workers=1)
    assert PackedDataset(tmp_path / "s").classes == ["a", "b", "c_empty", "d_no_images"]
    assert report.written == 2 and any("'c_empty'" in r.getMessage() for r in caplog.records)


def test_train_and_val_folders_with_different_classes_are_named(tmp_path):
    for split, names in (("train", ["cat", "dog", "eel"]), ("val", ["cat", "dog", "fox"])):
        for name in names:
            (tmp_path / "data" / split / name).mkdir(parents=True)
            (tmp_path / "data" / split / name / "1.jpg").write_bytes(_jpeg())
    with pytest.raises(ValueError) as e:
        train_val_split(str(tmp_path / "data"))
    text = str(e.value)
    assert "'eel' only in train/" in text and "'fox' only in val/" in text and str(tmp_path / "data" / "val") in text
    os.rename(tmp_path / "data" / "val" / "fox", tmp_path / "data" / "val" / "eel")
    train, val = train_val_split(str(tmp_path / "data"))
    assert train.classes == val.classes == ["cat", "dog", "eel"]
    (tmp_path / "data" / "val" / "eel" / "1.jpg").unlink()  # an empty val class keeps the numbering: allowed
    train, val = train_val_split(str(tmp_path / "data"))
    assert val.classes == train.classes and len(val) == 2


def test_a_fifo_or_other_non_regular_file_is_skipped_and_named(tmp_path, capsys, caplog, monkeypatch):
    import logging

    from torchspeed.cli import main
    from torchspeed.images import read_image_file

    monkeypatch.setenv("COLUMNS", "1000")
    root = _folder(tmp_path, {"x.jpg": _jpeg()})
    os.mkfifo(root / "a" / "pipe.jpg")  # opened for reading, it would wait for ever for a writer
    os.symlink(root / "a" / "gone.jpg", root / "a" / "dangling.jpg")
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("reading the folder blocked on the FIFO"))
    signal.alarm(120)
    try:
        report = pack(root, tmp_path / "s", progress=False, num_workers=1)
        assert report.written == 2 and len(PackedDataset(tmp_path / "s")) == 2
        reasons = {os.path.basename(s["path"]): s["reason"] for s in report.skipped}
        assert "FIFO" in reasons["pipe.jpg"] and "broken symbolic link" in reasons["dangling.jpg"]
        with caplog.at_level(logging.WARNING, logger="torchspeed"):
            source = FolderSource(str(root))
        assert len(source) == 2 and "pipe.jpg" in caplog.text and "FIFO" in caplog.text
        assert main(["pack", str(root), str(tmp_path / "s2"), "--num-workers", "1"]) == 0
        out = capsys.readouterr().out
        assert f"skipped {root / 'a' / 'pipe.jpg'}: a FIFO" in out
        with pytest.raises(ValueError, match="pipe.jpg' is a FIFO"):  # a FIFO put under an image's name later
            read_image_file(root / "a" / "pipe.jpg")
    finally:
        signal.alarm(0)


# ---------------- a user's Dataset: its errors are named with the index


class _Photos:
    """Four PIL images with integer labels, except where `broken` says otherwise."""

    def __init__(self, broken: str | None = None):
        from PIL import Image

        self.broken, self.images = broken, [Image.new("RGB", (40, 30), (i * 40, 0, 0)) for i in range(4)]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if self.broken == "raises" and i == 2:
            raise KeyError("row 2 is missing")
        label = "cat" if self.broken == "string_labels" else i % 2
        return self.images[i], label


class _RaggedTensors:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch

        return torch.zeros(3, 32, 32 if i != 5 else 30), 0


def test_a_datasets_errors_are_named_with_the_index(tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main
    from torchspeed.data import tune_loader

    monkeypatch.setenv("COLUMNS", "1000")
    loader = lambda ds: fast_loader(ds, 2, crop=16, device="cpu", num_workers=0, threads=1,  # noqa: E731
                                    train=False, decoder="simplejpeg")
    with pytest.raises(ValueError, match=r"sample 2 of _Photos: the Dataset raised KeyError: 'row 2 is missing'"):
        list(loader(_Photos("raises")))
    with pytest.raises(ValueError, match=r"sample 0 of _Photos: its label is a str \('cat'\): labels must be integer"):
        list(loader(_Photos("string_labels")))
    with pytest.raises(ValueError, match=r"sample 0.*its label is a str \('cat'\)"):
        pack(_Photos("string_labels"), tmp_path / "s", progress=False, num_workers=1)
    for workers in (0, 1):  # a plain DataLoader (samples that are already tensors), in this process and in a worker
        with pytest.raises(ValueError) as e:
            tune_loader(_RaggedTensors(), 8, num_workers=[workers], tune_seconds=0.05, device="cpu")
        text = str(e.value)
        assert "sample 5 of _RaggedTensors cannot be batched" in text and "sample 5 is (Tensor(3, 32, 30)" in text
        assert "Traceback" not in text and "\n" not in text
    (tmp_path / "ds.py").write_text("import torch\n"
                                    "class Rows(torch.utils.data.Dataset):\n"
                                    "    def __len__(self): return 8\n"
                                    "    def __getitem__(self, i):\n"
                                    "        if i == 3: raise IndexError('no row 3')\n"
                                    "        return torch.zeros(3, 8, 8), 0\n"
                                    "def make(): return Rows()\n")
    spec = f"{tmp_path / 'ds.py'}:make"
    assert main(["tune-loader", spec, "--batch-size", "8", "--num-workers", "0", "--tune-seconds", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "error: sample 3 of Rows: the Dataset raised IndexError: no row 3\n" in err and "Traceback" not in err


# ---------------- demo-data never replaces a file


def test_demo_data_never_replaces_a_same_named_image(tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main
    from torchspeed.data import make_photo_folder

    monkeypatch.setenv("COLUMNS", "1000")
    folder = tmp_path / "photos"
    demo_data = ["demo-data", str(folder), "--images", "4", "--classes", "2", "--num-workers", "1"]
    assert main(demo_data) == 0
    mine = folder / "class_00" / "img_000002.jpg"
    mine.write_bytes(b"my own photo")
    (folder / "class_01" / "img_000003.jpg").unlink()
    before = _digest(folder)
    with pytest.raises(FileExistsError) as e:
        make_photo_folder(folder, 4, n_classes=2, num_workers=1)
    assert str(mine) in str(e.value) and "never replaced" in str(e.value) and "more" not in str(e.value)
    capsys.readouterr()
    assert main(demo_data) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and len(err.strip().splitlines()) == 1
    assert _digest(folder) == before  # nothing written, not even the missing image
    mine.unlink()
    assert main(demo_data) == 0  # its own images are kept, the gaps filled
    assert _digest(folder) == _digest(make_photo_folder(tmp_path / "fresh", 4, n_classes=2, num_workers=1))


# ---------------- disk full and read-only destinations


_PACK_WITH_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from torchspeed.cli import main
sys.exit(main(["pack", sys.argv[1], sys.argv[2], "--overwrite", "--num-workers", "1"]))
"""


def test_a_full_disk_during_pack_overwrite_is_one_line_and_keeps_the_old_store(
        small_photo_folder, photo_folder, tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main
    from torchspeed.data import packer

    monkeypatch.setenv("COLUMNS", "1000")
    dst = tmp_path / "s"
    pack(small_photo_folder, dst, progress=False, num_workers=1)
    before = _digest(dst)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(a[0]))

    monkeypatch.setattr(packer, "atomic_write", full)  # the manifest, the last file written
    assert main(["pack", str(photo_folder), str(dst), "--overwrite", "--num-workers", "1"]) == 2
    err = capsys.readouterr().err
    assert str(dst) in err and "disk is full" in err and "untouched" in err and len(err.strip().splitlines()) == 1
    assert _digest(dst) == before and len(PackedDataset(dst)) == 8 and sorted(os.listdir(tmp_path)) == ["s"]
    monkeypatch.undo()
    proc = subprocess.run([sys.executable, "-c", _PACK_WITH_A_FILE_SIZE_LIMIT, str(photo_folder), str(dst)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "COLUMNS": "1000"})
    assert proc.returncode == 2 and str(dst) in proc.stderr and "untouched" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1  # LMDB's own write error
    assert _digest(dst) == before and sorted(os.listdir(tmp_path)) == ["s"]


def test_an_unwritable_pack_destination_fails_before_any_work(small_photo_folder, tmp_path, capsys, monkeypatch):
    from torchspeed.cli import main
    from torchspeed.data import packer

    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(packer, "scan_folder", lambda *a, **k: pytest.fail("the source was read first"))
    (tmp_path / "blocker").write_text("a file")
    targets = [tmp_path / "blocker" / "s"]
    if os.geteuid() != 0:  # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o555)
        targets.append(tmp_path / "ro" / "s")
    for dst in targets:
        with pytest.raises(OSError) as e:
            pack(small_photo_folder, dst, progress=False, num_workers=1)
        assert str(dst) in str(e.value) and "cannot write the store" in str(e.value)
        assert main(["pack", str(small_photo_folder), str(dst)]) == 2
        err = capsys.readouterr().err
        assert str(dst) in err and "cannot write the store" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "blocker").read_text() == "a file"
    monkeypatch.undo()
    store = tmp_path / "store"
    pack(small_photo_folder, store, progress=False, num_workers=1)
    before = _digest(store)
    monkeypatch.setattr(packer, "scan_folder", lambda *a, **k: pytest.fail("the source was read first"))
    monkeypatch.setattr(packer.os, "access", lambda path, mode, **k: os.fspath(path) != str(store))  # read-only
    with pytest.raises(OSError, match="read-only"):
        pack(small_photo_folder, store, overwrite=True, progress=False, num_workers=1)
    assert _digest(store) == before


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 0, -1])
def test_a_loader_tuning_budget_that_never_ends_is_refused_in_the_api(tmp_path, seconds):
    """`tune_seconds` nan or inf would time a configuration forever: refused by name, as on the command line."""
    import torchspeed as ts

    ts.data.make_photo_folder(str(tmp_path / "photos"), 8, n_classes=2, size=(48, 36))
    with pytest.raises(ValueError, match="tune_seconds = .*a measuring budget must be a positive number of seconds"):
        ts.data.tune_loader(str(tmp_path / "photos"), batch_size=4, tune_seconds=seconds)
    with pytest.raises(ValueError, match="tune_seconds = .*a measuring budget must be a positive number of seconds"):
        ts.data.fast_loader(str(tmp_path / "photos"), batch_size=4, tune_seconds=seconds, num_workers=[0, 1])
