"""Data: demo images, the packed store, data where users keep it (tar shards, Hugging Face datasets,
LitData), fast decoding, loaders that keep the model fed."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchspeed._lazy import lazy_getattr
from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name loads on first use
    from torchspeed.data.decode import available_decoders
    from torchspeed.data.decoder_choice import measure_decoders
    from torchspeed.data.demo import demo_folder, make_photo_folder
    from torchspeed.data.loader import FastLoader, LoaderOptions, fast_loader
    from torchspeed.data.loader_tuning import tune_loader
    from torchspeed.data.packer import PackResult, pack
    from torchspeed.data.shards import TarShards
    from torchspeed.data.prefetch import DevicePrefetcher, normalize_batch
    from torchspeed.data.sources import evenly_spread, train_val_split
    from torchspeed.data.store import PackedDataset
    from torchspeed.data.tune import LoaderRow, TuneResult

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "make_photo_folder": "demo",
    "demo_folder": "demo",
    "pack": "packer",
    "PackResult": "packer",
    "PackedDataset": "store",
    "TarShards": "shards",
    "fast_loader": "loader",
    "LoaderOptions": "loader",
    "FastLoader": "fastloader",
    "tune_loader": "loader_tuning",
    "TuneResult": "tune",
    "LoaderRow": "tune",
    "DevicePrefetcher": "prefetch",
    "normalize_batch": "prefetch",
    "available_decoders": "decode",
    "measure_decoders": "decoder_choice",
    "train_val_split": "sources",
    "evenly_spread": "sources",
}
__all__ = [*_EXPORTS, "IMAGENET_MEAN", "IMAGENET_STD"]


__getattr__ = lazy_getattr(__name__, _EXPORTS)
