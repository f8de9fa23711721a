"""What a model name on the command line means, resolved in one place: a model spec (built through
`torchspeed.models.create`), a torch artifact folder saved by `optimize`, or an `.onnx` file (parsed
once; `optimize` takes the parsed graph). Errors are ValueError / FileNotFoundError naming the flag or
file at fault, which the command line prints as one line."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchspeed.infer.artifact import load
from torchspeed.infer.export import OnnxGraph, onnx_example, read_onnx
from torchspeed.models import build, default_input_shape

__all__ = ["ResolvedModel", "resolve_model", "DEFAULT_INPUT_SHAPE"]

DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)


@dataclass(frozen=True)
class ResolvedModel:
    """The model a name resolved to: an `nn.Module`, or the `OnnxGraph` of an .onnx file; the input shape
    to use (the one asked for, else the model's own, else 1,3,224,224; an .onnx file's from its graph);
    and whether it came from a saved artifact folder."""

    model: nn.Module | OnnxGraph
    input_shape: tuple[int, ...]
    from_artifact: bool = False

    @property
    def is_onnx(self) -> bool:
        return isinstance(self.model, OnnxGraph)


def resolve_model(name: str, weights: str | None = None, model_kwargs: str | Mapping[str, Any] | None = None,
                  num_classes: int | None = None, input_shape: Sequence[int] | None = None) -> ResolvedModel:
    """Resolve `name` (an .onnx file, a torch artifact folder, or a model spec) to a `ResolvedModel`.

    `weights` (a state-dict file) and `model_kwargs` (a dict, or its JSON text) apply to a spec only;
    `num_classes` is the classifier width of a torchvision / timm model built by name (`model_kwargs`
    wins). `input_shape` overrides the default shape; for an .onnx file it fills the graph's dynamic
    dimensions. Only one-input .onnx files resolve here (a several-input model needs the API's dict).
    """
    if name.lower().endswith(".onnx"):
        return _onnx_file(name, weights, model_kwargs, num_classes, input_shape)
    if os.path.isdir(name):
        return _artifact_folder(name, weights, model_kwargs, input_shape)
    model = build(name, weights=weights, model_kwargs=model_kwargs, num_classes=num_classes)

    shape = tuple(input_shape) if input_shape else (default_input_shape(model) or DEFAULT_INPUT_SHAPE)
    return ResolvedModel(model, shape)


def _onnx_file(path: str, weights: str | None, model_kwargs: Any, num_classes: int | None,
               input_shape: Sequence[int] | None) -> ResolvedModel:
    given = [flag for flag, value in (("--weights", weights), ("--model-kwargs", model_kwargs),
                                      ("--num-classes", num_classes)) if value]
    if given:
        raise ValueError(f"{', '.join(given)} apply to a model built from a spec, not to the ONNX file {path!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ONNX model {path!r} does not exist")
    graph = read_onnx(path)
    example = onnx_example(graph, input_shape)
    if not hasattr(example, "shape"):
        raise ValueError(f"{path!r} takes several inputs ({', '.join(example)}); the command line feeds "
                         "one-input models: call torchspeed.infer.optimize with example_input= as a dict")
    return ResolvedModel(graph, tuple(example.shape))


def _artifact_folder(directory: str, weights: str | None, model_kwargs: Any,
                     input_shape: Sequence[int] | None) -> ResolvedModel:
    if weights or model_kwargs:
        raise ValueError(f"--weights and --model-kwargs apply to a model built from a spec, not to {directory!r}")
    runner = load(directory)
    source = getattr(runner, "source", None)
    if source is None:
        raise ValueError(f"{directory!r} holds a {runner.runtime} artifact; optimize needs a PyTorch model "
                         "(a torch artifact directory, or a model spec with --weights)")
    return ResolvedModel(source, tuple(input_shape) if input_shape else DEFAULT_INPUT_SHAPE, from_artifact=True)
