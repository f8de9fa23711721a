"""Fold BatchNorm into the Conv or Linear before it, for inference.

At inference BatchNorm is a fixed per-channel affine map, so it can be folded into the weights and
bias of the layer that feeds it: one layer instead of two, one pass over the activations fewer
(article 000). The fold is exact up to float rounding. ReLU is left as its own op right after the
folded conv: the runtimes that gain from a fused conv+ReLU (oneDNN under torch.compile, ONNX
Runtime, OpenVINO) fuse that pair themselves, while eager PyTorch has no faster fused kernel for it.

FX tracing finds conv -> bn pairs wherever the model traces; a model that does not trace (data-
dependent control flow) falls back to a module walk that fuses consecutive pairs inside
`nn.Sequential` containers only, where module order is execution order.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

__all__ = ["fuse_conv_bn", "FuseResult", "fuse_conv_bn_report"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass
class FuseResult:
    """How many BatchNorms were folded, and by which method ('fx' or 'module-walk' and why)."""

    fused: int
    method: str


def _fold(layer: nn.Module, bn: nn.Module) -> nn.Module | None:
    if not isinstance(bn, _BNS) or not bn.track_running_stats or bn.running_mean is None:
        return None
    if isinstance(layer, _CONVS) and layer.out_channels == bn.num_features:
        return fuse_conv_bn_eval(layer.eval(), bn.eval())
    if isinstance(layer, nn.Linear) and layer.out_features == bn.num_features and isinstance(bn, nn.BatchNorm1d):
        return fuse_linear_bn_eval(layer.eval(), bn.eval())
    return None


def _get(root: nn.Module, target: str) -> nn.Module:
    return root.get_submodule(target)


def _set(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _fuse_fx(model: nn.Module) -> tuple[nn.Module, int]:
    gm = torch.fx.symbolic_trace(model)
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(_get(gm, node.target), _BNS):
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue  # the conv's raw output is used elsewhere too: folding would change that use
        folded = _fold(_get(gm, src.target), _get(gm, node.target))
        if folded is None:
            continue
        _set(gm, src.target, folded)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        fused += 1
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, fused


def _fuse_walk(model: nn.Module) -> int:
    fused = 0
    for module in model.modules():
        if not isinstance(module, nn.Sequential):
            continue
        names = list(module._modules)
        for a, b in zip(names, names[1:]):
            layer, bn = module._modules[a], module._modules[b]
            folded = _fold(layer, bn) if layer is not None and bn is not None else None
            if folded is not None:
                module._modules[a] = folded
                module._modules[b] = nn.Identity()
                fused += 1
    return fused


def fuse_conv_bn_report(model: nn.Module, inplace: bool = False) -> tuple[nn.Module, FuseResult]:
    """`fuse_conv_bn` that also says how many BatchNorms it folded and how."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse_conv_bn expects an nn.Module, got {type(model).__name__}")
    model = (model if inplace else copy.deepcopy(model)).eval()
    try:
        fused_model, n = _fuse_fx(model)
        return fused_model, FuseResult(n, "fx")
    except Exception as e:  # noqa: BLE001 - any tracing failure means: use the module walk
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    n = _fuse_walk(model)
    return model, FuseResult(n, f"module-walk (FX tracing failed: {reason})")


def fuse_conv_bn(model: nn.Module, inplace: bool = False) -> nn.Module:
    """A copy of `model` (eval mode) with every BatchNorm folded into the Conv/Linear that feeds it.

    Returns an `nn.Module` computing the same function up to float rounding (relative error ~1e-6).
    For inference only: the folded model has no BatchNorm left to train.
    """
    return fuse_conv_bn_report(model, inplace)[0]
