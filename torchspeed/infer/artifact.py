"""`load`: run a saved inference artifact (model file + manifest.json) with the runtime it names."""
from __future__ import annotations

import os

from torch import nn

from torchspeed.infer.runners import RUNNERS, RUNTIME_KEY, Runner, TorchRunner, artifact_dir, read_manifest

__all__ = ["load"]


def load(directory: str | os.PathLike, *, model: nn.Module | None = None, trust_code: bool = False) -> Runner:
    """The artifact in `directory` as a callable `runner(batch) -> outputs` (any batch size it supports).

    The manifest says which runtime, precision and thread count to use; nothing is unpickled
    (torch weights load with `weights_only=True`). A torch artifact rebuilds its architecture with
    `torchspeed.models.create`; one built from your own code (`package.module:factory` or
    `file.py:factory`) is loaded only into `model=` (your freshly built instance) or with
    `trust_code=True`, since rebuilding it would import the code its manifest names. While a save
    into `directory` is under way (or after one was killed), the previous artifact is what loads.
    """
    directory = artifact_dir(directory)
    manifest = read_manifest(directory)
    cls = RUNNERS[manifest[RUNTIME_KEY]]
    if issubclass(cls, TorchRunner):
        runner: Runner = cls.load(directory, manifest, model=model, trust_code=trust_code)
    else:
        runner = cls.load(directory, manifest)
    runner.manifest_data = manifest  # type: ignore[attr-defined]
    return runner
