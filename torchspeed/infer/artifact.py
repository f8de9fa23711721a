"""`load`: run a saved inference artifact (model file + manifest.json) with the runtime it names."""
from __future__ import annotations

import os

from torchspeed.infer.runtimes import RUNNERS, Runner, read_manifest

__all__ = ["load"]


def load(directory: str | os.PathLike) -> Runner:
    """The artifact in `directory` as a callable `runner(batch) -> outputs` (any batch size it supports).

    The manifest says which runtime, precision and thread count to use; nothing is unpickled
    (torch weights load with `weights_only=True`).
    """
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    runner = RUNNERS[manifest["backend"]].load(directory, manifest)
    runner.manifest_data = manifest  # type: ignore[attr-defined]
    return runner
