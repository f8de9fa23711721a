"""Attention in the script's training forward, as doctor sees and measures it in the script's process.

Seen: each call site of `F.scaled_dot_product_attention` (shapes, mask, causal, dtype), and attention
written by hand: a softmax over the last dimension of scores that autograd shows came from a batched
matmul (through scaling and masking), named by its module and source line. Measured (after the run's
steps, when doctor asks): the SDPA backends that run these shapes here, each through
`torch.nn.attention.sdpa_kernel` (CPU: math and the flash CPU kernel; CUDA: flash, efficient, cuDNN,
math), forward and backward timed interleaved against the backend torch picks by default; and for
hand-written attention, the same attention through SDPA on the module's shapes, with its output
compared. The findings these feed are `transformer_rules`'.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchspeed.doctor.script_code import caller, where
from torchspeed.doctor.transformer_rules import SDPA_BACKENDS as BACKENDS
from torchspeed.measure import compare

__all__ = ["AttentionSeen", "backend", "measure_backends", "measure_hand"]

CUDA_ONLY = ("efficient", "cudnn")  # SDPA backends without a CPU kernel
SITES = 4  # call sites recorded (a model has one or two attention implementations)
SOFTMAX_CHECKS = 64  # softmax calls examined for hand-written attention, then no more
# autograd nodes between the scores' matmul and the softmax: scaling, masking, views
_PASS = ("Mul", "Div", "Add", "Sub", "MaskedFill", "Where", "View", "UnsafeView", "Expand", "Clone", "ToCopy",
         "Reshape", "Transpose", "Permute", "Squeeze", "Unsqueeze")


def backend(name: str) -> Any:
    """torch's SDPBackend for a report name ("flash")."""
    return getattr(SDPBackend, BACKENDS[name])


class AttentionSeen:
    """What the script's training forwards did for attention; the Recorder's patches report to it."""

    def __init__(self) -> None:
        self.sdpa: dict[str, dict[str, Any]] = {}  # "file:line" -> the first call's description, calls counted
        self.hand: dict[str, dict[str, Any]] = {}
        self._softmax_left = SOFTMAX_CHECKS

    # ------------------------------------------------------------------ seen in the loop
    def sdpa_call(self, model: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        site = _site()
        if site is None:
            return
        key = f"{site['file']}:{site['line']}"
        if key in self.sdpa:
            self.sdpa[key]["calls"] += 1
            return
        if len(self.sdpa) >= SITES:
            return
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args)) | kwargs
        q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return
        self.sdpa[key] = {"site": site, "module": _module_name(model), "calls": 1, "q": list(q.shape),
                          "k": list(k.shape), "v": list(v.shape), "dtype": str(q.dtype).replace("torch.", ""),
                          "device": q.device.type,
                          "mask": list(mask.shape) if isinstance(mask, torch.Tensor) else None,
                          "mask_dtype": str(mask.dtype).replace("torch.", "") if isinstance(mask, torch.Tensor) else None,
                          "is_causal": bool(a.get("is_causal", False)), "dropout_p": float(a.get("dropout_p") or 0.0),
                          "scale": a.get("scale"), "enable_gqa": bool(a.get("enable_gqa", False))}

    def softmax_call(self, model: Any, x: Any, dim: Any) -> None:
        """A softmax in a training forward: hand-written attention when it runs over the last dimension of
        scores that a batched matmul made (through scaling, masking and views)."""
        if self._softmax_left <= 0 or not isinstance(x, torch.Tensor) or x.dim() < 3 or x.grad_fn is None:
            return
        if not isinstance(dim, int) or dim % x.dim() != x.dim() - 1:
            return
        self._softmax_left -= 1
        site = _site()
        if site is None:
            return
        key = f"{site['file']}:{site['line']}"
        if key in self.hand:
            self.hand[key]["calls"] += 1
            return
        origin = _scores_origin(x.grad_fn)
        if origin is None:
            return
        matmul, mask = origin
        q = getattr(matmul, "_saved_self", None)
        if not isinstance(q, torch.Tensor) or len(self.hand) >= SITES:
            return
        self.hand[key] = {"site": site, "module": _module_name(model), "calls": 1, "scores": list(x.shape),
                          "head_dim": int(q.shape[-1]), "dtype": str(x.dtype).replace("torch.", ""),
                          "device": x.device.type, "mask": mask, "source": _line(site)}

    # ------------------------------------------------------------------ measured after the run
    def summary(self, measure: bool = False) -> dict[str, Any] | None:
        """The sites seen (and, with `measure`, each measured here); None when the forward has no attention."""
        if not self.sdpa and not self.hand:
            return None
        out: dict[str, Any] = {"sdpa": list(self.sdpa.values()), "hand": list(self.hand.values())}
        for r in out["hand"]:
            if isinstance(r["mask"], _MaskSeen):
                r["mask"] = r["mask"].kind()
        if measure:
            for r in out["sdpa"]:
                r["measured"] = _guarded(lambda r=r: measure_backends(r))
            for r in out["hand"]:
                r["measured"] = _guarded(lambda r=r: measure_hand(r))
        return out


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A measurement that fails is reported as such, never costs the report."""
    try:
        with warnings.catch_warnings():  # SDPA warns about every backend it cannot use
            warnings.simplefilter("ignore")
            return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}


def _site() -> dict[str, Any] | None:
    return where(caller())


def _line(site: dict[str, Any]) -> str:
    try:
        with open(site["file"], encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()[site["line"] - 1].strip()
    except (OSError, IndexError):
        return ""


def _module_name(model: Any) -> dict[str, str] | None:
    """The innermost nn.Module whose forward is on the stack (its class, and its name inside `model`)."""
    f = caller()
    while f is not None:
        obj = f.f_locals.get("self", f.f_locals.get("module"))
        if isinstance(obj, nn.Module):
            name = next((n for n, m in model.named_modules() if m is obj), None) if isinstance(model, nn.Module) else None
            return {"class": type(obj).__name__, "name": name if name is not None else "?"}
        f = f.f_back
    return None


def _scores_origin(fn: Any, depth: int = 10) -> tuple[Any, str | None] | None:
    """(the bmm autograd node that made the scores, the mask seen on the way: a boolean one (`_MaskSeen`),
    "additive" or None), walking back from the softmax input through scaling, masking and views."""
    mask = None
    stack = [(fn, 0)]
    while stack:
        node, d = stack.pop()
        if node is None or d > depth:
            continue
        name = node.name()
        if name.startswith(("BmmBackward", "BaddbmmBackward")):
            return node, mask
        if not name.startswith(_PASS):
            continue
        if name.startswith("MaskedFill"):
            mask = _MaskSeen(getattr(node, "_saved_mask", None), upper=True)
        elif name.startswith("Where"):
            mask = _MaskSeen(getattr(node, "_saved_condition", None), upper=False)
        elif name.startswith("Add") and any(n is None for n, _ in node.next_functions) and mask is None:
            mask = "additive"
        stack.extend((n, d + 1) for n, _ in node.next_functions)
    return None


class _MaskSeen:
    """A boolean mask met on the way to the scores, told "causal" or "masked" after the run (`kind`): reading
    its values then costs the training loop no device sync. Holds the first matrix of the mask only."""

    def __init__(self, m: Any, upper: bool):
        ok = isinstance(m, torch.Tensor) and m.dim() >= 2 and m.dtype == torch.bool
        self.matrix = m[(0,) * (m.dim() - 2)].clone() if ok else None  # a copy: not the whole mask kept alive
        self.upper = upper

    def kind(self) -> str:
        """"causal" where the mask is True above the diagonal (positions masked out) or, not `upper`, on and
        below it (positions kept); else "masked"."""
        m = self.matrix
        if m is None:
            return "masked"
        ones = torch.ones(m.shape, dtype=torch.bool, device=m.device)
        return "causal" if torch.equal(m, ones.triu(1) if self.upper else ones.tril()) else "masked"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _inputs(r: dict[str, Any]) -> tuple[Any, ...]:
    """Random q, k, v (requiring grad), the mask and the output gradient of a recorded SDPA call."""
    dt, dev = _dtype(r["dtype"]), r["device"]
    q, k, v = (torch.randn(r[n], dtype=dt, device=dev, requires_grad=True) for n in ("q", "k", "v"))
    mask = None
    if r.get("mask"):
        mdt = _dtype(r["mask_dtype"])
        make = torch.ones if mdt == torch.bool else torch.zeros  # every position attended to
        mask = make(r["mask"], dtype=mdt, device=dev)
    grad = torch.randn(*r["q"][:-1], r["v"][-1], dtype=dt, device=dev)
    return q, k, v, mask, grad


def _sdpa_step(r: dict[str, Any], q: Any, k: Any, v: Any, mask: Any, grad: Any) -> Callable[[], None]:
    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=r["is_causal"], scale=r.get("scale"),
                                             enable_gqa=r.get("enable_gqa", False))
        out.backward(grad)
    return step


def _default_backend(r: dict[str, Any], q: Any, k: Any, v: Any, mask: Any) -> str | None:
    """The backend torch's dispatch picks for these inputs (None where torch does not say)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, r["is_causal"], scale=r.get("scale"),
                                         enable_gqa=r.get("enable_gqa", False))
        member = SDPBackend(choice)
    except Exception:  # noqa: BLE001 - a private helper of torch: a name, not a requirement
        return None
    return next((n for n, m in BACKENDS.items() if m == member.name), None)


def measure_backends(r: dict[str, Any]) -> dict[str, Any]:
    """Forward and backward of one recorded SDPA call under each backend that runs it here, timed
    interleaved (`measure.compare`), against the backend torch picks by default. Dropout is left out
    (it draws random numbers and does not change which kernel is fastest)."""
    q, k, v, mask, grad = _inputs(r)
    default = _default_backend(r, q, k, v, mask)
    usable, refused = {}, {}
    for name in BACKENDS:
        if name in CUDA_ONLY and r["device"] == "cpu":
            refused[name] = "CUDA only"
            continue
        step = _sdpa_step(r, q, k, v, mask, grad)

        def run(step=step, b=backend(name)) -> None:
            with sdpa_kernel([b]):
                step()
        try:
            run()
        except RuntimeError as e:
            refused[name] = (str(e).splitlines() or ["no kernel for these inputs"])[0][:160]
            continue
        usable[name] = run
    if not usable:
        return {"default": default, "refused": refused}
    base = default if default in usable else next(iter(usable))
    c = compare(usable, baseline=base, warmup=1, repeats=5, min_time_s=0.05, cooldown_s=0.05, device=q.device)
    return {"default": default, "baseline": base, "refused": refused, "others_cores": c.others_cores,
            "backends": {t.name: {"ms": t.median_s * 1e3, "spread": _spread(t.times_s), "speedup": c.speedup(t.name)}
                         for t in c.timings}}


def _spread(times: list[float]) -> float:
    return (max(times) - min(times)) / sorted(times)[len(times) // 2] if times else 0.0


def measure_hand(r: dict[str, Any]) -> dict[str, Any]:
    """The hand-written attention of a recorded site (matmul, scale, mask, softmax, matmul) against
    `F.scaled_dot_product_attention` on the same shapes, forward and backward, timed interleaved; the
    two outputs are compared, so the replacement shown is known to compute the same attention."""
    *lead, t, s = r["scores"]
    d = r["head_dim"]
    dt, dev = _dtype(r["dtype"]), r["device"]
    q = torch.randn(*lead, t, d, dtype=dt, device=dev, requires_grad=True)
    k, v = (torch.randn(*lead, s, d, dtype=dt, device=dev, requires_grad=True) for _ in range(2))
    grad = torch.randn(*lead, t, d, dtype=dt, device=dev)
    causal = r["mask"] == "causal" and t == s
    additive = None  # a padding mask added to the scores (BERT's), broadcast over heads and queries
    if r["mask"] == "additive":
        additive = torch.zeros(*lead[:1], *([1] * (len(lead) - 1)), 1, s, dtype=dt, device=dev)
    hidden = torch.ones(t, s, dtype=torch.bool, device=dev).triu(1) if causal else None
    scale = d ** -0.5

    def hand_forward() -> Any:
        att = (q @ k.transpose(-2, -1)) * scale
        if hidden is not None:
            att = att.masked_fill(hidden, float("-inf"))
        if additive is not None:
            att = att + additive
        return att.softmax(dim=-1) @ v

    def sdpa_forward() -> Any:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, is_causal=causal)

    with torch.no_grad():
        diff = float((hand_forward().float() - sdpa_forward().float()).abs().max())
    tol = 1e-4 if dt == torch.float32 else 2e-2
    contenders = {"by hand": lambda: hand_forward().backward(grad), "sdpa": lambda: sdpa_forward().backward(grad)}
    c = compare(contenders, baseline="by hand", warmup=1, repeats=5, min_time_s=0.05, cooldown_s=0.05, device=q.device)
    return {"hand_ms": c["by hand"].median_s * 1e3, "sdpa_ms": c["sdpa"].median_s * 1e3, "speedup": c.speedup("sdpa"),
            "spread": max(_spread(c["by hand"].times_s), _spread(c["sdpa"].times_s)),
            "max_abs_diff": diff, "same_output": diff <= tol * max(1.0, float(v.detach().abs().max())),
            "is_causal": causal, "additive_mask": additive is not None, "others_cores": c.others_cores}
