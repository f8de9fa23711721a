"""Data: demo images, the packed store, fast decoding, loaders that keep the model fed."""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "make_photo_folder": "demo",
    "demo_folder": "demo",
    "pack": "packer",
    "PackReport": "packer",
    "PackedDataset": "store",
    "fast_loader": "loader",
    "FastLoader": "loader",
    "tune_loader": "loader",
    "LoaderSettings": "tune",
    "LoaderTrial": "tune",
    "DevicePrefetcher": "prefetch",
    "normalize_batch": "prefetch",
    "available_backends": "decode",
    "measure_backends": "decode",
    "train_val_split": "sources",
    "evenly_spread": "sources",
}
__all__ = [*_EXPORTS, "IMAGENET_MEAN", "IMAGENET_STD"]


__getattr__ = lazy_getattr(__name__, _EXPORTS)
