"""Fault suite for the data area: bad inputs are named, nothing of the user's is lost, no crash.

Each test asserts the exception (or exit status), that the message names the file or store, and that
nothing was lost (source files intact, the previous store still loadable). Two tests run a subprocess:
the truncated store (read unchecked, it would kill pytest with SIGBUS) and SIGKILL during pack.
"""
from __future__ import annotations

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
