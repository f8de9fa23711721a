"""torchspeed: fast PyTorch training and inference, proven by measurement.

Subpackages load on first use (`ts.data`, `ts.train`, ...), so `import torchspeed` stays cheap.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each loads on first use
    from torchspeed import (
        batches,
        bench,
        compress,
        data,
        doctor,
        images,
        infer,
        measure,
        metrics,
        models,
        recipes,
        runtime,
        train,
    )

__version__ = "0.1.0"
__all__ = ["runtime", "measure", "models", "batches", "metrics", "images", "data", "train", "infer", "compress",
           "recipes", "doctor", "bench"]

# Every measured choice is logged at INFO on "torchspeed.*"; a program shows them with
# logging.basicConfig(level=logging.INFO) (the command line shows them by default).
logging.getLogger("torchspeed").addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"torchspeed.{name}")
    raise AttributeError(f"module 'torchspeed' has no attribute {name!r}")
