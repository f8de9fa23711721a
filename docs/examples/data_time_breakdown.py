"""Where a sample's time goes in fast_loader: CPU time per image of each step, one thread (docs/data.md).

    python docs/examples/data_time_breakdown.py [STORE] [--crop 128] [--batch 64] [--images 1024]
                                                 [--decoder turbojpeg]

STORE: a packed store (default: the one `torchspeed bench data --quick` packs: the first 1000 demo
photos, short side 160, JPEG q90, built once under /tmp). Each step runs alone over the same
samples (`time.process_time`, the CPU time of this process: robust when other processes share the
cores), median of 5 repeats; then the whole loader, at 1 thread and at 2, for the end-to-end cost.
"""
import argparse
import math
import os
import statistics
import time
import zlib

import cv2
import numpy as np
import torch

from torchspeed.data import fast_loader, pack
from torchspeed.data.augment import RandomResizedCropFlip, render, sample_rng
from torchspeed.data.decode import dct_factor, get_decoder
from torchspeed.data.loader import EpochBatchSampler
from torchspeed.data.prefetch import normalize_batch
from torchspeed.data.store import HEADER, PackedDataset, key_of
from torchspeed.data.threads import ThreadedBatches
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD, scan_folder


def cpu_us(fn, n, repeats=5):
    """Median CPU microseconds per item of `fn()` doing `n` items."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e6 * statistics.median(times) / n


def default_store():
    """The store `torchspeed bench data --quick` packs: the first 1000 demo photos (by file name)."""
    from torchspeed.data.demo import demo_folder

    path = "/tmp/torchspeed-breakdown-store"
    if not os.path.isdir(path):
        subset = "/tmp/torchspeed-breakdown-photos"
        if not os.path.isdir(subset):
            classes, samples = scan_folder(demo_folder(4000))
            for c in classes:
                os.makedirs(os.path.join(subset, c))
            for photo, label in sorted(samples, key=lambda s: os.path.basename(s[0]))[:1000]:
                os.symlink(photo, os.path.join(subset, classes[label], os.path.basename(photo)))
        pack(subset, path, short_side=160, format="jpeg", quality=90, progress=False)
    return path


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("store", nargs="?")
    ap.add_argument("--crop", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--decoder", default="turbojpeg", help="the one `torchspeed bench data` chose here")
    return ap.parse_args()


class Samples:
    """The samples every step runs over: their keys, records, crop boxes and decode sizes, decoded once."""

    def __init__(self, ds, a):
        sampler = EpochBatchSampler(len(ds), a.batch, shuffle=True, drop_last=True, seed=0)
        keys = [k for batch in sampler for k in batch][:a.images]
        self.keys = keys[:len(keys) // a.batch * a.batch]
        self.n = len(self.keys)
        self.tf = RandomResizedCropFlip(a.crop)
        self.recs = [ds.record(i) for _, i in self.keys]
        self.boxes = [self.tf.box(r.height, r.width, sample_rng(0, e, i)) for (e, i), r in zip(self.keys, self.recs)]
        # the smallest decode that still covers the output: any libjpeg scale (7/8, 3/4, ...) or powers of two only
        self.need = [(math.ceil(r.height * a.crop / b.height), math.ceil(r.width * a.crop / b.width))
                     for r, b in zip(self.recs, self.boxes)]
        self.pow2 = []
        for r, (h, w) in zip(self.recs, self.need):
            s = dct_factor(r.height, r.width, h, w)
            self.pow2.append((-(-r.height // s), -(-r.width // s)) if s > 1 else (0, 0))
        self.imgs = [get_decoder(a.decoder).decode(r.payload, h, w) for r, (h, w) in zip(self.recs, self.pow2)]
        self.odd = sum(h > -(-r.height // 2) or w > -(-r.width // 2) for r, (h, w) in zip(self.recs, self.need)
                       if h < r.height and w < r.width)


def read_and_decode_rows(ds, sm, a):
    """CPU us per image of reading a record and of decoding it, each way."""
    txn = ds._transaction()
    raws = [txn.get(key_of(i)) for _, i in sm.keys]
    dec = get_decoder(a.decoder)
    n = sm.n
    return {
        "LMDB read (txn.get)": cpu_us(lambda: [txn.get(key_of(i)) for _, i in sm.keys], n),
        "CRC32 check": cpu_us(lambda: [zlib.crc32(r) for r in raws], n),
        "header parse + payload slice": cpu_us(lambda: [(HEADER.unpack_from(r), r[HEADER.size:]) for r in raws], n),
        "record() in all (read, CRC, parse)": cpu_us(lambda: [ds.record(i) for _, i in sm.keys], n),
        "crop box, one sample at a time (seeded draw)": cpu_us(
            lambda: [sm.tf.box(r.height, r.width, sample_rng(0, e, i)) for (e, i), r in zip(sm.keys, sm.recs)], n),
        "crop boxes, a batch at a time (the loader's)": cpu_us(
            lambda: [sm.tf.boxes([r.height for r in sm.recs[s:s + a.batch]], [r.width for r in sm.recs[s:s + a.batch]],
                                 0, [e for e, _ in sm.keys[s:s + a.batch]], [i for _, i in sm.keys[s:s + a.batch]])
                     for s in range(0, n, a.batch)], n),
        "decode, full size": cpu_us(lambda: [dec.decode(r.payload) for r in sm.recs], n),
        "decode, any DCT scale (7/8, 3/4, ...)": cpu_us(
            lambda: [get_decoder("simplejpeg-fast")._sj.decode_jpeg(r.payload, colorspace="RGB", fastdct=True,
                     fastupsample=True, min_height=h, min_width=w) for r, (h, w) in zip(sm.recs, sm.need)], n),
        "decode, power-of-two DCT scales only": cpu_us(
            lambda: [dec.decode(r.payload, h, w) for r, (h, w) in zip(sm.recs, sm.pow2)], n),
        "decode as the loader asks (decode_region: turbojpeg skips the columns outside the box)": cpu_us(
            lambda: [dec.decode_region(r.payload, h, w, (b.top, b.left, b.height, b.width))
                     for r, (h, w), b in zip(sm.recs, sm.pow2, sm.boxes)], n),
    }


def render_and_batch_rows(sm, a):
    """CPU us per image of resizing, flipping and splitting each box into its slot, and of the per-batch steps."""
    out = np.empty((a.batch, 3, a.crop, a.crop), np.uint8)
    hwc = np.empty((a.crop, a.crop, 3), np.uint8)
    n = sm.n

    def resize_only():
        for img, b in zip(sm.imgs, sm.boxes):
            cv2.resize(img[b.top:b.top + b.height, b.left:b.left + b.width], (a.crop, a.crop), dst=hwc,
                       interpolation=cv2.INTER_LINEAR)

    rows = {
        "  cv2.resize of the box": cpu_us(resize_only, n),
        "  cv2.flip (half the samples)": cpu_us(lambda: [cv2.flip(hwc, 1, dst=hwc) for b in sm.boxes if b.flip], n),
        "  cv2.split HWC->CHW": cpu_us(lambda: [cv2.split(hwc, [out[0, c] for c in range(3)]) for _ in sm.boxes], n),
        "render (resize + flip + CHW) in all": cpu_us(
            lambda: [render(img, b, out[j % a.batch], hwc, img.shape[0] / r.height, img.shape[1] / r.width)
                     for j, (img, b, r) in enumerate(zip(sm.imgs, sm.boxes, sm.recs))], n),
        "labels tensor (per batch)": cpu_us(
            lambda: [torch.tensor([r.label for r in sm.recs[s:s + a.batch]], dtype=torch.int64)
                     for s in range(0, n, a.batch)], n),
    }
    u8 = torch.from_numpy(out)
    buf = torch.empty(out.shape, dtype=torch.float32)
    rows["normalise uint8 -> float (per batch)"] = cpu_us(
        lambda: [normalize_batch(u8, IMAGENET_MEAN, IMAGENET_STD, False, layout="NCHW", out=buf)
                 for _ in range(n // a.batch)], n)
    crops = get_decoder(a.decoder).crops
    if crops is not None:  # what the loader runs instead of decode + render + normalise: one native call per batch
        floats = np.empty((a.batch, 3, a.crop, a.crop), np.float32)
        affine = ([1 / (255 * s) for s in IMAGENET_STD], [-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)])
        rows["native batch render: decode as the loader asks + resize + flip + normalise (data/_crops.c)"] = cpu_us(
            lambda: [crops.render([r.payload for r in sm.recs[s:s + a.batch]], [r.height for r in sm.recs[s:s + a.batch]],
                                  [r.width for r in sm.recs[s:s + a.batch]], sm.boxes[s:s + a.batch], floats, True,
                                  max_pixels=1 << 40, normalize=affine) for s in range(0, n, a.batch)], n)
    batches = [sm.keys[s:s + a.batch] for s in range(0, n, a.batch)]
    rows["thread hand-off (empty batches, 2 threads)"] = cpu_us(lambda: list(ThreadedBatches(lambda k: k, batches, 2)), n)
    return rows


def whole_loader_rows(store, a):
    """CPU us per image of the whole loader at 1 and 2 threads, and its wall-clock images/s; with a decoder
    that has the native batch render, also without it (sample by sample in Python, then the conversion)."""
    rows, wall = {}, {}
    decoder = get_decoder(a.decoder)
    ways = [("", decoder.crops)] + ([(", sample by sample in Python", None)] if decoder.crops is not None else [])
    for how, crops in ways:
        decoder.crops = crops
        for threads in (1, 2):
            loader = fast_loader(store, a.batch, crop=a.crop, device="cpu", channels_last=False, num_workers=0,
                                 threads=threads, decoder=a.decoder)

            def epoch(loader=loader):
                for _ in loader:
                    pass

            t0 = time.perf_counter()
            name = f"whole loader, {threads} thread{'s' * (threads > 1)}{how}"
            rows[name] = cpu_us(epoch, len(loader) * a.batch, repeats=3)
            wall[name] = 4 * len(loader) * a.batch / (time.perf_counter() - t0)
    decoder.crops = ways[0][1]
    return rows, wall


def main():
    a = parse_args()
    store = a.store or default_store()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    ds = PackedDataset(store)
    sm = Samples(ds, a)
    rows = {**read_and_decode_rows(ds, sm, a), **render_and_batch_rows(sm, a)}
    rows["sum: record + box + decode (as the loader plans it) + render + labels + normalise + hand-off"] = sum(
        rows[k] for k in ("record() in all (read, CRC, parse)", "crop boxes, a batch at a time (the loader's)",
                          "decode as the loader asks (decode_region: turbojpeg skips the columns outside the box)",
                          "render (resize + flip + CHW) in all",
                          "labels tensor (per batch)", "normalise uint8 -> float (per batch)",
                          "thread hand-off (empty batches, 2 threads)"))
    native = "native batch render: decode as the loader asks + resize + flip + normalise (data/_crops.c)"
    if native in rows:
        rows["sum with the native render: record + box + native render + labels + hand-off"] = sum(
            rows[k] for k in ("record() in all (read, CRC, parse)", "crop boxes, a batch at a time (the loader's)",
                              native, "labels tensor (per batch)", "thread hand-off (empty batches, 2 threads)"))
    loader_rows, wall = whole_loader_rows(store, a)
    rows.update(loader_rows)
    print(f"{store}: {sm.n} samples, crop {a.crop}, batch {a.batch}, {a.decoder}; {sm.odd} of {sm.n} boxes would "
          f"decode at a scale between 1/2 and 1 if any libjpeg scale were allowed")
    print(f"{'step (one thread unless said)':96s} {'CPU us/image':>12s}")
    for k, v in rows.items():
        print(f"{k:96s} {v:12.1f}" + (f"   ({wall[k]:,.0f} img/s wall clock)" if k in wall else ""))


if __name__ == "__main__":
    main()
