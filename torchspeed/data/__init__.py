"""Data: demo images, the packed store, fast decoding, loaders that keep the model fed."""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "make_photo_folder": "demo",
    "demo_folder": "demo",
    "pack": "packer",
    "PackReport": "packer",
    "PackedDataset": "store",
    "fast_loader": "loader",
    "FastLoader": "loader",
    "tune_loader": "tune",
    "LoaderSettings": "tune",
    "DevicePrefetcher": "prefetch",
    "normalize_batch": "prefetch",
    "IMAGENET_MEAN": "prefetch",
    "IMAGENET_STD": "prefetch",
    "available_backends": "decode",
    "measure_backends": "decode",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
