"""Old public names that keep working: every renamed function, class, attribute, keyword and flag.

A user's script written against an earlier torchspeed must not break on a rename: the old name still
works and warns once per process (FutureWarning: shown to end users) naming the new one. The tables
here are the whole list; `tests/test_deprecated_names.py` uses every entry. Nothing here imports torch.
"""
from __future__ import annotations

import warnings

__all__ = ["NAMES", "ATTRIBUTES", "KEYWORDS", "FLAGS", "renamed"]

# `torchspeed.<area>.<old>` -> the new name in the same area
NAMES = {
    "torchspeed.data.available_backends": "available_decoders",
    "torchspeed.data.measure_backends": "measure_decoders",
    "torchspeed.data.PackReport": "PackResult",
    "torchspeed.data.LoaderSettings": "TuneResult",
    "torchspeed.data.LoaderTrial": "LoaderRow",
    "torchspeed.train.AccelerateReport": "AccelerateResult",
    "torchspeed.infer.available_backends": "available_runtimes",
    "torchspeed.infer.VariantResult": "VariantRow",
    "torchspeed.compress.PruneReport": "PruneResult",
    "torchspeed.compress.BackboneTiming": "BackboneRow",
    "torchspeed.doctor.ProfileReport": "ProfileResult",
    "torchspeed.doctor.LintReport": "LintResult",
}
# `Class.old` -> the new attribute
ATTRIBUTES = {
    "VariantRow.backend": "runtime",
    "Runner.backend": "runtime",
}
# `function(old=)` -> the new keyword
KEYWORDS = {
    "optimize(backends=)": "runtimes",
}
# `command --old` -> the new flag
FLAGS = {
    "optimize --backends": "--runtimes",
    "tune-loader --seconds": "--tune-seconds",
    "pack --workers": "--num-workers",
    "train --workers": "--num-workers",
    "train --image-size": "--crop",
}

_SAID: set[str] = set()


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn, once per process, that `old` is now `new` (the old name goes on working)."""
    if old in _SAID:
        return
    _SAID.add(old)
    warnings.warn(f"torchspeed: {old} is now {new}; the old name still works but will be removed",
                  FutureWarning, stacklevel=stacklevel)
