"""Model lint: per-layer FLOPs, memory access and measured time from a traced forward pass, and the
rules that judge them (the ShuffleNet V2 guidelines G1-G4, Conv+BN fusion, channel alignment, the
output-activation / loss pairing; a transformer's in `transformer_lint`). "Memory access" is the
ShuffleNet V2 paper's MAC (bytes read + written by an op), not called MACs here, which usually means
multiply-accumulates.

The trace runs under a TorchDispatchMode, so it sees every ATen op the model really runs (functional
calls too), the module that ran it, its FLOPs (torch's formulas), the bytes it touched, its input
shapes, its time (synchronised, without the tracer's overhead) and the producer of each input (for the
pairing, fragmentation and attention rules). A TorchFunctionMode beside it marks the ops run inside
`F.scaled_dot_product_attention` (its math fallback decomposes into the matmul-softmax-matmul that
hand-written attention is) and records each call's dropout.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from torchspeed.doctor.advice import Finding, finding, rank
from torchspeed.doctor.output import format_lint
from torchspeed.doctor.transformer_lint import cost_by_part, token_embedding, transformer_findings
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.runtime import process_as_found

__all__ = ["LintResult", "lint", "loss_pairing"]

_VIEW = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze", "slice", "select",
         "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "reshape", "lift_fresh",
         "empty", "empty_like", "zeros", "ones", "_reshape_alias", "unflatten", "flatten", "narrow", "view_as"}
_ELEMENTWISE = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "relu", "relu_", "threshold",
                "threshold_", "sigmoid", "sigmoid_", "tanh", "tanh_", "hardswish", "hardswish_", "hardsigmoid",
                "hardsigmoid_", "silu", "silu_", "gelu", "gelu_", "clamp", "clamp_", "clamp_min", "clamp_min_",
                "clamp_max", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "neg", "exp",
                "log", "sqrt", "rsqrt", "pow", "where", "abs", "mish", "mish_", "addcmul", "_to_copy", "copy_",
                "clone", "fill_", "masked_fill", "masked_fill_", "erf"}
_NORM = {"native_batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
         "native_layer_norm", "native_group_norm", "batch_norm", "cudnn_batch_norm", "_batch_norm_impl_index",
         "_native_batch_norm_legit_functional"}
_CONV = {"convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution", "convolution_overrideable"}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
           "_efficient_attention_forward"}
# ops with no FLOP formula of their own that compute what one with a formula does (the same arguments first)
_FLOPS_AS = {"_scaled_dot_product_flash_attention_for_cpu": torch.ops.aten._scaled_dot_product_flash_attention}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))


_KINDS = (("view", _VIEW), ("conv", _CONV), ("matmul", _MATMUL), ("norm", _NORM), ("elementwise", _ELEMENTWISE))


def _kind(name: str) -> str:
    kind = next((k for k, names in _KINDS if name in names), None)
    if kind is not None:
        return kind
    if "pool" in name or name in ("mean", "sum", "amax"):
        return "pool"
    if name in ("cat", "stack", "constant_pad_nd", "contiguous", "index", "gather", "embedding"):
        return "data-movement"
    if "softmax" in name:
        return "softmax"
    return "other"


@dataclass
class _Op:
    name: str
    kind: str
    module: str
    flops: float
    bytes: float
    inputs: list[int]  # producer op index of each tensor input (-1: a parameter / the model input)
    arg0: int  # producer of the first tensor argument
    arg0_id: int = 0  # identity of the first tensor argument (tells apart inputs with no producer)
    time_s: float = 0.0
    phase: str = "model"
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # of its tensor inputs, in order
    in_sdpa: bool = False  # run inside F.scaled_dot_product_attention
    source: str = ""  # file:line of the model's code that called it (softmax ops: where attention is written)


def _caller() -> str:
    """file:line of the innermost frame outside torch and doctor: the model code that called the op."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and not path.startswith(_HERE):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class _Tracer(TorchDispatchMode):
    """Records every ATen op: name, module, FLOPs, bytes touched, producers of its inputs, time."""

    def __init__(self, timed: bool, sync: bool):
        super().__init__()
        self.timed, self.sync = timed, sync
        self.ops: list[_Op] = []
        self.producer: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # keeps traced tensors alive so their ids stay unique
        self.modules: list[str] = []
        self.phase = "model"
        self.in_sdpa = 0  # depth of F.scaled_dot_product_attention calls under way (_SdpaWatch)
        self.sdpa_calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if self.timed and self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.timed and self.sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        kind = _kind(name)
        flops = 0.0
        fn = flop_registry.get(_FLOPS_AS.get(name, func._overloadpacket))
        if fn is not None:
            try:
                flops = float(fn(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take these arguments: count none
                flops = 0.0
        elif kind in ("elementwise", "norm", "softmax", "pool"):
            flops = float(sum(t.numel() for t in outs))
        touched = 0.0 if kind == "view" else float(
            sum(t.numel() * t.element_size() for t in {id(t): t for t in ins + outs}.values()))
        producers = [self.producer.get(id(t), -1) for t in ins]
        self.ops.append(_Op(name, kind, self.modules[-1] if self.modules else "", flops, touched, producers,
                            producers[0] if producers else -1, id(ins[0]) if ins else 0, dt, self.phase,
                            [tuple(t.shape) for t in ins], self.in_sdpa > 0, _caller() if kind == "softmax" else ""))
        idx = len(self.ops) - 1
        for t in outs:
            self.producer[id(t)] = idx
            self.keep.append(t)
        return out


class _SdpaWatch(TorchFunctionMode):
    """Marks the ops run inside F.scaled_dot_product_attention on the tracer and records each call: its
    module, shapes and dropout_p (dropout at inference is a bug the transformer rules name)."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        t = self.tracer
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        t.sdpa_calls.append({"module": t.modules[-1] if t.modules else "", "dropout_p": float(dropout),
                             "shapes": [tuple(a.shape) for a in args[:3] if isinstance(a, torch.Tensor)]})
        t.in_sdpa += 1
        try:
            return func(*args, **kwargs)
        finally:
            t.in_sdpa -= 1


def _trace(model: nn.Module, example_input: Any, loss_fn: Any = None, target: Any = None,
           timed: bool = True) -> tuple[_Tracer, Any, dict[str, dict[str, Any]]]:
    """Run model (and loss) once under the tracer; returns it, the output, and per-module shapes."""
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    if isinstance(loss_fn, nn.Module):
        names[id(loss_fn)] = "loss"
    on_cuda = any(p.is_cuda for p in model.parameters())
    tracer = _Tracer(timed=timed, sync=on_cuda and torch.cuda.is_available())
    shapes: dict[str, dict[str, Any]] = {}

    def pre(m, inputs):
        tracer.modules.append(names.get(id(m), type(m).__name__))

    def post(m, inputs, output):
        name = tracer.modules.pop() if tracer.modules else names.get(id(m), "")
        if name not in shapes:
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            shapes[name] = {"in": tuple(x.shape) if x is not None else None,
                            "out": tuple(output.shape) if isinstance(output, torch.Tensor) else None}

    h1 = register_module_forward_pre_hook(pre)
    h2 = register_module_forward_hook(post)
    try:
        # a dispatch mode's first use imports torch._dynamo (env, warning filter)
        with process_as_found(), _SdpaWatch(tracer), tracer:
            out = model(*example_input) if isinstance(example_input, tuple) else model(example_input)
            if loss_fn is not None:
                tracer.phase = "loss"
                tracer.modules.append("loss")
                if target is None:
                    target = _default_target(out)
                if target is not None:
                    loss_fn(out, target)
    finally:
        h1.remove()
        h2.remove()
    return tracer, out, shapes


def _default_target(out: Any) -> torch.Tensor | None:
    """Class indices matching a [N, C] (or [N, C, ...]) output, for the pairing check."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return None
    g = torch.Generator().manual_seed(0)
    shape = (out.shape[0], *out.shape[2:])
    return torch.randint(0, out.shape[1], shape, generator=g).to(out.device)


def _pairing_findings(ops: list[_Op]) -> list[Finding]:
    """softmax -> (log_)softmax inside CrossEntropyLoss, and softmax (or log of it) -> NLLLoss."""
    out: list[Finding] = []

    def made_by(i: int, *names: str) -> bool:
        return 0 <= i < len(ops) and ops[i].name in names

    for op in ops:
        if op.phase != "loss":
            continue
        src = op.arg0
        if op.name == "_log_softmax" and made_by(src, "_softmax", "softmax"):
            out.append(finding("double-softmax", f"the model's output comes from softmax ({ops[src].module or 'forward'}) "
                               "and the loss applies log_softmax again (CrossEntropyLoss expects raw logits): the "
                               "gradients shrink and training can stall", 0.0, "correctness, not speed",
                               where=[ops[src].module]))
        elif op.name.startswith("nll_loss") and (made_by(src, "_softmax", "softmax") or (
                made_by(src, "log") and made_by(ops[src].arg0, "_softmax", "softmax"))):
            how = "softmax" if made_by(src, "_softmax", "softmax") else "log(softmax(x))"
            out.append(finding("softmax-nll", f"NLLLoss is fed {how} output: it expects log-probabilities "
                               "from log_softmax" + (" (log of softmax underflows to -inf)" if how != "softmax" else ""),
                               0.0, "correctness, not speed", where=[ops[src].module]))
    return out


def loss_pairing(model: nn.Module, example_input: Any, loss_fn: Any, target: Any = None) -> list[Finding]:
    """Only the output-activation / loss pairing check (cheap: one untimed traced pass, no_grad)."""
    was = model.training
    model.eval()  # no BatchNorm statistics updated by this check
    try:
        with torch.no_grad():
            tracer, _, _ = _trace(model, example_input, loss_fn, target, timed=False)
    finally:
        model.train(was)
    return _pairing_findings(tracer.ops)


@dataclass
class LintResult:
    """Per-layer costs, model totals and the ranked findings of `lint`."""

    model: str
    input_shape: list[int]
    totals: dict[str, float]
    layers: list[dict[str, Any]]
    by_kind: dict[str, dict[str, float]]
    findings: list[Finding] = field(default_factory=list)
    others_cores: float | None = None  # cores other processes used while the forward was timed (None: unknown)
    waited_s: float = 0.0  # how long lint waited for other processes to leave the cores before timing
    by_part: dict[str, dict[str, float]] = field(default_factory=dict)  # a transformer's cost per part ({}: not one)

    @property
    def busy(self) -> str | None:
        """A sentence when other processes shared the cores while the forward was timed, else None."""
        return busy_warning(self.others_cores)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "input_shape": self.input_shape, "totals": self.totals,
                "by_kind": self.by_kind, "by_part": self.by_part, "layers": self.layers,
                "findings": [f.to_dict() for f in self.findings],
                "others_cores": self.others_cores, "busy": self.busy, "waited_s": round(self.waited_s, 2)}

    def __str__(self) -> str:
        return format_lint(self)


def _fastest_times(runs: list[list[_Op]]) -> list[float]:
    """Per op, its time in the least-disturbed traced pass (the last pass's if the passes differ)."""
    n = len(runs[-1])
    if any(len(r) != n for r in runs):
        return [op.time_s for op in runs[-1]]
    # the minimum over passes: on a shared machine the least-disturbed run is the closest to the op's cost
    return [min(r[i].time_s for r in runs) for i in range(n)]


def lint(model: nn.Module, example_input: Any, loss_fn: Any = None, target: Any = None,
         repeats: int = 3, quiet_wait_s: float = 2.0) -> LintResult:
    """Trace one inference forward pass (eval mode, no_grad) and judge the model.

    `example_input`: a tensor (or tuple of tensors) on the model's device; token ids for a transformer
    (`transformer_lint.token_input` makes them), whose findings then time their fixes here on the model's
    shapes and whose cost is split by part (`by_part`). `loss_fn` (optional, e.g.
    nn.CrossEntropyLoss()) is applied to the output to check the activation/loss pairing; `target`
    defaults to random class indices. Times are per-op minimums over `repeats` traced passes after a warm-up,
    taken once other processes have left the cores or `quiet_wait_s` has passed (then `busy` says so).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"lint needs an nn.Module, got {type(model).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    was = model.training
    model.eval()
    quiet = wait_for_quiet_machine(max_s=quiet_wait_s) if quiet_wait_s > 0 else None
    load = OthersLoad()
    try:
        with torch.no_grad():
            model(*example_input) if isinstance(example_input, tuple) else model(example_input)  # warm-up
            runs, tracer, out, shapes = [], None, None, {}
            for _ in range(repeats):
                tracer, out, shapes = _trace(model, example_input, loss_fn, target, timed=True)
                runs.append([op for op in tracer.ops if op.phase == "model"])
    finally:
        model.train(was)
    others = load.cores()
    ops = tracer.ops
    for op, t in zip(ops, _fastest_times(runs)):
        op.time_s = t
    mops = [op for op in ops if op.phase == "model"]
    total_t = sum(op.time_s for op in mops) or 1e-12
    mods = dict(model.named_modules())
    layers = _layer_rows(model, mods, mops, shapes, total_t)
    ctx = _Ctx(model, mods, mops, layers, shapes, total_t, out, tracer.sdpa_calls)
    findings = [f for r in _MODEL_RULES if (f := r(ctx)) is not None]
    with torch.no_grad():
        findings += transformer_findings(ctx)
    findings += _pairing_findings(ops)
    shape = list(example_input.shape) if isinstance(example_input, torch.Tensor) else []
    totals = {"flops": sum(op.flops for op in mops) or 1.0, "memory_bytes": sum(op.bytes for op in mops) or 1.0,
              "time_s": total_t, "params": float(sum(p.numel() for p in model.parameters())), "ops": float(len(mops))}
    return LintResult(type(model).__name__, shape, totals, sorted(layers.values(), key=lambda r: -r["time_s"]),
                      _by_kind(mops, total_t), rank(findings), others_cores=others,
                      waited_s=quiet.waited_s if quiet is not None else 0.0, by_part=cost_by_part(ctx))


def _by_kind(ops: list[_Op], total_t: float) -> dict[str, dict[str, float]]:
    """Ops, FLOPs, memory access and time per kind of op (conv, matmul, norm, elementwise...)."""
    by_kind: dict[str, dict[str, float]] = {}
    for op in ops:
        k = by_kind.setdefault(op.kind, {"ops": 0, "flops": 0.0, "memory_bytes": 0.0, "time_s": 0.0})
        k["ops"] += 1
        k["flops"] += op.flops
        k["memory_bytes"] += op.bytes
        k["time_s"] += op.time_s
    for k in by_kind.values():
        k["time_share"] = k["time_s"] / total_t
    return by_kind


def _layer_rows(model: nn.Module, mods: dict[str, nn.Module], ops: list[_Op], shapes: dict[str, dict[str, Any]],
                total_t: float) -> dict[str, dict[str, Any]]:
    """Per module that ran ops (views aside): its type, ops, FLOPs, memory access, time, shapes."""
    layers: dict[str, dict[str, Any]] = {}
    for op in ops:
        if op.kind == "view":
            continue
        row = layers.setdefault(op.module, {"layer": op.module, "type": type(mods[op.module]).__name__
                                            if op.module in mods else type(model).__name__,
                                            "ops": [], "flops": 0.0, "memory_bytes": 0.0, "time_s": 0.0})
        if op.name not in row["ops"]:
            row["ops"].append(op.name)
        row["flops"] += op.flops
        row["memory_bytes"] += op.bytes
        row["time_s"] += op.time_s
    for row in layers.values():
        row["time_share"] = row["time_s"] / total_t
        row["flops_per_byte"] = row["flops"] / row["memory_bytes"] if row["memory_bytes"] else None
        row.update(shapes.get(row["layer"], {}))
    return layers


@dataclass
class _Ctx:
    model: nn.Module
    mods: dict[str, nn.Module]
    ops: list[_Op]
    layers: dict[str, dict[str, Any]]
    shapes: dict[str, dict[str, Any]]
    total_t: float
    output: Any
    sdpa_calls: list[dict[str, Any]] = field(default_factory=list)  # F.scaled_dot_product_attention calls seen

    def convs(self) -> list[tuple[str, nn.Conv2d]]:
        return [(n, m) for n, m in self.mods.items() if isinstance(m, nn.Conv2d) and n in self.layers]

    def time(self, name: str) -> float:
        return self.layers.get(name, {}).get("time_s", 0.0)

    def ref_rate(self) -> float:
        """FLOP/s of the model's dense (groups=1), non-1x1-deficient convs/linears: the yardstick."""
        rates = [self.layers[n]["flops"] / self.layers[n]["time_s"] for n, m in self.mods.items()
                 if n in self.layers and self.layers[n]["time_s"] > 0 and self.layers[n]["flops"] > 0
                 and ((isinstance(m, nn.Conv2d) and m.groups == 1) or isinstance(m, nn.Linear))]
        return statistics.median(rates) if rates else 0.0

    def deficit(self, names: list[str]) -> float:
        """Time these layers lose against the yardstick rate, as a share of the forward pass."""
        ref = self.ref_rate()
        if ref <= 0:
            return 0.0
        lost = 0.0
        for n in names:
            row = self.layers.get(n)
            if row and row["time_s"] > 0:
                lost += max(0.0, row["time_s"] - row["flops"] / ref)
        return lost / self.total_t


_MODEL_RULES = []


def _model_rule(fn):
    _MODEL_RULES.append(fn)
    return fn


@_model_rule
def _g1(c: _Ctx) -> Finding | None:
    """1x1 convs far from c_in == c_out: memory access above the minimum for the same FLOPs."""
    hits, saved = [], 0.0
    for n, m in c.convs():
        if m.kernel_size != (1, 1) or m.groups != 1:
            continue
        c1, c2 = m.in_channels, m.out_channels
        ratio = max(c1, c2) / min(c1, c2)
        shp = c.shapes.get(n, {}).get("in")
        if ratio < 4 or not shp or len(shp) != 4:
            continue
        hw = shp[2] * shp[3]
        mac = hw * (c1 + c2) + c1 * c2
        mac_min = 2 * hw * math.sqrt(c1 * c2) + c1 * c2  # paper's lower bound at the same FLOPs
        saved += c.time(n) * (1 - mac_min / mac)
        hits.append(f"{n} ({c1}->{c2}, 1:{ratio:.0f})")
    if not hits:
        return None
    return finding("g1-channel-ratio", f"{len(hits)} 1x1 conv(s) with input:output channels of 1:4 or more: "
                   + ", ".join(hits[:5]) + (" ..." if len(hits) > 5 else ""), saved / c.total_t,
                   "their measured time x the memory access above the c1 = c2 minimum (ShuffleNet V2 eq. 1)", hits)


@_model_rule
def _g2(c: _Ctx) -> Finding | None:
    hits = [n for n, m in c.convs() if m.groups >= 4 and m.groups != m.in_channels]
    if not hits:
        return None
    gs = sorted({c.mods[n].groups for n in hits})
    return finding("g2-groups", f"{len(hits)} grouped conv(s) with groups {gs}: "
                   + ", ".join(hits[:5]) + (" ..." if len(hits) > 5 else ""), c.deficit(hits),
                   "their measured time beyond what the model's dense convs take for the same FLOPs", hits)


@_model_rule
def _g3(c: _Ctx) -> Finding | None:
    """A tensor feeding 3+ conv/matmul branches: many small parallel ops instead of one wide one."""
    consumers: dict[Any, list[int]] = {}
    for i, op in enumerate(c.ops):
        if op.kind in ("conv", "matmul"):
            src, key = op.arg0, ("tensor", op.arg0_id)
            # look through views so x.view(...) feeding several branches still counts as one fork
            while 0 <= src < len(c.ops) and c.ops[src].kind == "view":
                src, key = c.ops[src].arg0, ("tensor", c.ops[src].arg0_id)
            consumers.setdefault(("op", src) if src >= 0 else key, []).append(i)
    forks = [(s, v) for s, v in consumers.items() if len(v) >= 3]
    if not forks:
        return None
    branch_layers = sorted({c.ops[i].module for _, v in forks for i in v})
    widest = max(len(v) for _, v in forks)
    return finding("g3-fragmentation", f"{len(forks)} point(s) where one tensor feeds {widest} or more parallel "
                   f"conv branches ({len(branch_layers)} branch layers, e.g. {', '.join(branch_layers[:4])})",
                   c.deficit(branch_layers), "the branch layers' measured time beyond the dense-conv rate for "
                   "their FLOPs", branch_layers)


@_model_rule
def _g4(c: _Ctx) -> Finding | None:
    ew = [op for op in c.ops if op.kind in ("elementwise", "norm")]
    t = sum(op.time_s for op in ew)
    share = t / c.total_t
    if share < 0.25:
        return None
    flops = sum(op.flops for op in ew) / max(1.0, sum(op.flops for op in c.ops))
    mem = sum(op.bytes for op in ew) / max(1.0, sum(op.bytes for op in c.ops))
    names = sorted({op.name for op in ew})
    return finding("g4-elementwise", f"element-wise ops ({', '.join(names[:6])}) take {share:.0%} of the measured "
                   f"forward time for {flops:.1%} of its FLOPs ({mem:.0%} of its memory access)", share * 0.5,
                   "assumes fusion into the producing op removes half their time (one read and write instead of two)")


@_model_rule
def _unfused_bn(c: _Ctx) -> Finding | None:
    hits = []
    for op in c.ops:
        if op.kind == "norm" and "batch_norm" in op.name and 0 <= op.arg0 < len(c.ops) and c.ops[op.arg0].kind == "conv":
            hits.append(op)
    if not hits:
        return None
    t = sum(op.time_s for op in hits)
    return finding("unfused-bn", f"{len(hits)} BatchNorm layer(s) directly after a conv run as separate ops at "
                   f"inference ({t / c.total_t:.0%} of forward time)", t / c.total_t,
                   "fusion removes the BatchNorm ops entirely: their measured time", sorted({op.module for op in hits}))


@_model_rule
def _channels8(c: _Ctx) -> Finding | None:
    out_features = c.output.shape[-1] if isinstance(c.output, torch.Tensor) and c.output.dim() >= 1 else None
    transformer = token_embedding(c.model) is not None  # its matmul sizes are judged against 64 (transformer_lint)
    hits = []
    for n, m in c.mods.items():
        if n not in c.layers:
            continue
        if isinstance(m, nn.Conv2d):
            cin, cout = m.in_channels, m.out_channels
        elif isinstance(m, nn.Linear) and not transformer:
            cin, cout = m.in_features, m.out_features
        else:
            continue
        # the input image's channels and the classifier's width (the number of classes) are not design choices
        if (cin > 4 and cin % 8) or (cout % 8 and cout != out_features):
            hits.append(f"{n} ({cin}->{cout})")
    if not hits:
        return None
    names = [h.split(" ")[0] for h in hits]
    t = sum(c.time(n) for n in names) / c.total_t
    return finding("channels-not-multiple-of-8", f"{len(hits)} layer(s) with channel counts that are not multiples "
                   f"of 8: {', '.join(hits[:5])}" + (" ..." if len(hits) > 5 else ""), t * 0.1,
                   "assumes 10% of these layers' measured time (padding to vector/tensor-core blocks)", names)


@_model_rule
def _depthwise(c: _Ctx) -> Finding | None:
    hits = [n for n, m in c.convs() if m.groups > 1 and m.groups == m.in_channels]
    t = sum(c.time(n) for n in hits) / c.total_t
    if not hits or t < 0.2:
        return None
    return finding("depthwise-heavy", f"{len(hits)} depthwise conv(s) take {t:.0%} of forward time", c.deficit(hits),
                   "their measured time beyond the dense-conv rate for their FLOPs", hits)
