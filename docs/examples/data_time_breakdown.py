"""Where a sample's time goes in fast_loader: CPU time per image of each step, one thread (docs/data.md).

    python docs/examples/data_time_breakdown.py [STORE] [--crop 128] [--batch 64] [--images 1024]
                                                 [--decoder simplejpeg-fast]

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
from torchspeed.data.decode import get_decoder
from torchspeed.data.loader import EpochBatchSampler
from torchspeed.data.prefetch import normalize_batch
from torchspeed.data.store import HEADER, PackedDataset, key_of
from torchspeed.data.threads import ThreadedBatches
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD


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
    from torchspeed.bench.suites.data import _subset_folder
    from torchspeed.data.demo import demo_folder

    path = "/tmp/torchspeed-breakdown-store"
    if not os.path.isdir(path):
        pack(_subset_folder(demo_folder(4000), 1000), path, short_side=160, format="jpeg", quality=90, progress=False)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store", nargs="?")
    ap.add_argument("--crop", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--decoder", default="simplejpeg-fast", help="the one `torchspeed bench data` chose here")
    a = ap.parse_args()
    store = a.store or default_store()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    ds = PackedDataset(store)
    sampler = EpochBatchSampler(len(ds), a.batch, shuffle=True, drop_last=True, seed=0)
    keys = [k for batch in sampler for k in batch][:a.images]
    keys = keys[:len(keys) // a.batch * a.batch]
    n = len(keys)
    tf = RandomResizedCropFlip(a.crop)
    dec = get_decoder(a.decoder)
    txn = ds._transaction()
    raws = [txn.get(key_of(i)) for _, i in keys]
    recs = [ds.record(i) for _, i in keys]
    boxes = [tf.box(r.height, r.width, sample_rng(0, e, i)) for (e, i), r in zip(keys, recs)]
    # the smallest decode that still covers the output: any libjpeg scale (7/8, 3/4, ...) or powers of two only
    need = [(math.ceil(r.height * a.crop / b.height), math.ceil(r.width * a.crop / b.width)) for r, b in zip(recs, boxes)]
    pow2 = []
    for r, (h, w) in zip(recs, need):
        s = next((s for s in (8, 4, 2) if -(-r.height // s) >= h and -(-r.width // s) >= w), 1)
        pow2.append((-(-r.height // s), -(-r.width // s)) if s > 1 else (0, 0))
    imgs = [dec.decode(r.payload, h, w) for r, (h, w) in zip(recs, pow2)]
    odd = sum(h > -(-r.height // 2) or w > -(-r.width // 2) for r, (h, w) in zip(recs, need)
              if h < r.height and w < r.width)
    out = np.empty((a.batch, 3, a.crop, a.crop), np.uint8)
    hwc = np.empty((a.crop, a.crop, 3), np.uint8)
    rows = {}
    try:  # this torchspeed decodes at power-of-two scales only (torchspeed.data.decode.dct_factor)
        from torchspeed.data.decode import dct_factor  # noqa: F401
        plan = "decode, power-of-two DCT scales only"
    except ImportError:
        plan = "decode, any DCT scale (7/8, 3/4, ...)"
    rows["LMDB read (txn.get)"] = cpu_us(lambda: [txn.get(key_of(i)) for _, i in keys], n)
    rows["CRC32 check"] = cpu_us(lambda: [zlib.crc32(r) for r in raws], n)
    rows["header parse + payload slice"] = cpu_us(lambda: [(HEADER.unpack_from(r), r[HEADER.size:]) for r in raws], n)
    rows["record() in all (read, CRC, parse)"] = cpu_us(lambda: [ds.record(i) for _, i in keys], n)
    rows["crop box (seeded draw)"] = cpu_us(
        lambda: [tf.box(r.height, r.width, sample_rng(0, e, i)) for (e, i), r in zip(keys, recs)], n)
    rows["decode, full size"] = cpu_us(lambda: [dec.decode(r.payload) for r in recs], n)
    rows["decode, any DCT scale (7/8, 3/4, ...)"] = cpu_us(
        lambda: [get_decoder("simplejpeg-fast")._sj.decode_jpeg(r.payload, colorspace="RGB", fastdct=True,
                 fastupsample=True, min_height=h, min_width=w) for r, (h, w) in zip(recs, need)], n)
    rows["decode, power-of-two DCT scales only"] = cpu_us(
        lambda: [dec.decode(r.payload, h, w) for r, (h, w) in zip(recs, pow2)], n)

    def resize_only():
        for img, b in zip(imgs, boxes):
            cv2.resize(img[b.top:b.top + b.height, b.left:b.left + b.width], (a.crop, a.crop), dst=hwc,
                       interpolation=cv2.INTER_LINEAR)

    rows["  cv2.resize of the box"] = cpu_us(resize_only, n)
    rows["  cv2.flip (half the samples)"] = cpu_us(lambda: [cv2.flip(hwc, 1, dst=hwc) for b in boxes if b.flip], n)
    rows["  cv2.split HWC->CHW"] = cpu_us(lambda: [cv2.split(hwc, [out[0, c] for c in range(3)]) for _ in boxes], n)
    rows["render (resize + flip + CHW) in all"] = cpu_us(
        lambda: [render(img, b, out[j % a.batch], hwc, img.shape[0] / r.height, img.shape[1] / r.width)
                 for j, (img, b, r) in enumerate(zip(imgs, boxes, recs))], n)
    rows["labels tensor (per batch)"] = cpu_us(
        lambda: [torch.tensor([r.label for r in recs[s:s + a.batch]], dtype=torch.int64) for s in range(0, n, a.batch)], n)
    u8 = torch.from_numpy(out)
    buf = torch.empty(out.shape, dtype=torch.float32)
    rows["normalise uint8 -> float (per batch)"] = cpu_us(
        lambda: [normalize_batch(u8, IMAGENET_MEAN, IMAGENET_STD, False, layout="NCHW", out=buf)
                 for _ in range(n // a.batch)], n)
    batches = [keys[s:s + a.batch] for s in range(0, n, a.batch)]
    rows["thread hand-off (empty batches, 2 threads)"] = cpu_us(
        lambda: list(ThreadedBatches(lambda k: k, batches, 2)), n)
    rows["sum: record + box + decode (as the loader plans it) + render + labels + normalise + hand-off"] = sum(
        rows[k] for k in ("record() in all (read, CRC, parse)", "crop box (seeded draw)", plan,
                          "render (resize + flip + CHW) in all", "labels tensor (per batch)",
                          "normalise uint8 -> float (per batch)", "thread hand-off (empty batches, 2 threads)"))
    wall = {}
    for threads in (1, 2):
        loader = fast_loader(store, a.batch, crop=a.crop, device="cpu", channels_last=False, num_workers=0,
                             threads=threads, decoder=a.decoder)

        def epoch(loader=loader):
            for _ in loader:
                pass

        t0 = time.perf_counter()
        name = f"whole loader, {threads} thread{'s' * (threads > 1)}"
        rows[name] = cpu_us(epoch, len(loader) * a.batch, repeats=3)
        wall[name] = 4 * len(loader) * a.batch / (time.perf_counter() - t0)
    print(f"{store}: {n} samples, crop {a.crop}, batch {a.batch}, {a.decoder}; {odd} of {n} boxes would decode at "
          f"a scale between 1/2 and 1 if any libjpeg scale were allowed")
    print(f"{'step (one thread unless said)':92s} {'CPU us/image':>12s}")
    for k, v in rows.items():
        print(f"{k:92s} {v:12.1f}" + (f"   ({wall[k]:,.0f} img/s wall clock)" if k in wall else ""))


if __name__ == "__main__":
    main()
