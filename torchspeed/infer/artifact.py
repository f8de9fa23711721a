"""`load`: run a saved inference artifact (model file + manifest.json) with the runtime it names."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from torchspeed.infer.program import PROGRAM_FILE, load_program
from torchspeed.infer.runners import RUNNERS, RUNTIME_KEY, Runner, TorchRunner, artifact_dir, read_manifest

__all__ = ["load"]


def load(directory: str | os.PathLike, *, model: nn.Module | None = None, trust_code: bool = False) -> Runner:
    """The artifact in `directory` as a callable `runner(batch) -> outputs` (any batch size it supports).

    The manifest says which runtime, precision and thread count to use; nothing is unpickled
    (torch weights load with `weights_only=True`). A torch artifact rebuilds its architecture with
    `torchspeed.models.create`; one built from your own code (`package.module:factory` or
    `file.py:factory`) is loaded only into `model=` (your freshly built instance) or with
    `trust_code=True`, since rebuilding it would import the code its manifest names. A torch artifact
    of a model with no name (your own class) is a program captured by torch.export: it loads without
    your code, after a check that it holds only tensors and torch's own operators (`model=` is not
    needed). While a save into `directory` is under way (or after one was killed), the previous
    artifact is what loads.
    """
    directory = artifact_dir(directory)
    manifest = read_manifest(directory)
    cls = RUNNERS[manifest[RUNTIME_KEY]]
    if issubclass(cls, TorchRunner) and manifest["file"] == PROGRAM_FILE:
        runner: Runner = _load_program_runner(directory, manifest)
    elif issubclass(cls, TorchRunner):
        runner = cls.load(directory, manifest, model=model, trust_code=trust_code)
    else:
        runner = cls.load(directory, manifest)
    runner.manifest_data = manifest  # type: ignore[attr-defined]
    return runner


def _load_program_runner(directory: str, manifest: dict[str, Any]) -> TorchRunner:
    """The program re-run with the variant's recipe (precision, channels_last, torch.compile); the
    Conv+BN fold, when the variant had it, is already in the program."""
    where = f"the torch artifact in {directory!r}"
    recipe, program = manifest.get("recipe"), manifest.get("program")
    if not isinstance(recipe, dict) or not isinstance(program, dict):
        raise ValueError(f"{where} is damaged: its manifest has no {'recipe' if not isinstance(recipe, dict) else 'program'}")
    device = str(manifest.get("device") or "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{where} holds a program captured on a GPU ({device}) and this machine has none: save it "
                         "again from the model on the CPU")
    module = load_program(os.path.join(directory, PROGRAM_FILE), program.get("inputs"))
    return TorchRunner(module, {**recipe, "fuse": False}, manifest.get("threads"), example=module)
