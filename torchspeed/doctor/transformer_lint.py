"""lint for transformers: a forward's cost by part (embeddings, attention, MLP, head) and the rules that
judge a transformer, each fix timed here on the model's own shapes (`measure.compare`), so a finding says
what it is worth on this machine.

- `hand-written-attention`: attention written out as matmul, softmax, matmul (outside
  `F.scaled_dot_product_attention`, whose own math fallback decomposes the same way): SDPA timed against
  that computation at the module's shapes;
- `size-not-multiple-of-64`: a vocabulary or hidden size off a multiple of 64: the matmul timed as it is
  and padded to the next multiple (nanoGPT pads GPT-2's 50,257 tokens to 50,304);
- `dropout-at-inference`: dropout that runs with the model in eval mode (`F.dropout`'s default is
  training=True; SDPA's `dropout_p` passed without `if self.training`): random outputs at inference;
- `untied-head`: an output head the shape of the token embedding with weights of its own.

It reads linting's trace (every ATen op with its module, time, input shapes and producers) through the
lint context it is handed, and imports nothing of linting, which runs it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.doctor.advice import Finding, finding
from torchspeed.measure import Comparison, compare

__all__ = ["PARTS", "cost_by_part", "token_embedding", "token_input", "transformer_findings"]

PARTS = ("embeddings", "attention", "mlp", "head", "other")
ALIGN = 64  # matmul kernels work in blocks; nanoGPT pads its vocabulary to a multiple of 64
REPEATS = 5  # interleaved repeats of each fix timed
MIN_TIME_S = 0.02  # each repeat at least this long (calls repeated), so microsecond ops are timed at all

_EMBEDDING_NAMES = {"embeddings", "embed_tokens", "wte", "wpe", "embed_positions", "word_embeddings",
                    "position_embeddings", "token_type_embeddings", "tok_embeddings"}
_HEAD_NAMES = {"lm_head", "head", "classifier", "pooler", "cls", "score", "qa_outputs", "output_projection"}
_ATTENTION_NAMES = {"attn", "attention", "self_attn", "self_attention", "selfattention", "cross_attn",
                    "crossattention", "mha"}
_MLP_NAMES = {"mlp", "ffn", "feed_forward", "feedforward", "intermediate", "output", "ff"}
_SCORE_MATMULS = {"bmm", "baddbmm", "mm", "matmul"}  # _operands reads their factors' shapes
_DROPOUT_OPS = {"bernoulli", "bernoulli_", "native_dropout", "_fused_dropout", "feature_dropout", "alpha_dropout",
                "feature_alpha_dropout"}
_THROUGH = ("view", "elementwise", "other", "data-movement")  # op kinds between attention's matmuls and softmax


# ---------------------------------------------------------------- what the model is


def token_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The embedding that reads the token ids (name, module): a Hugging Face model's
    `get_input_embeddings()`, else an nn.Embedding registered before any layer with weights of
    another kind (a model that starts from token ids); None for a model that does not read tokens."""
    named = dict(model.named_modules())
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return next(((n, m) for n, m in named.items() if m is emb), None)
    for name, m in named.items():
        if isinstance(m, nn.Embedding):
            return name, m
        if not list(m.children()) and any(True for _ in m.parameters(recurse=False)):
            return None  # the first layer with weights is not an embedding: the model reads other input
    return None


def _context_length(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("block_size", "n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def token_input(model: nn.Module, shape: tuple[int, ...] | None = None, device: Any = "cpu") -> torch.Tensor | None:
    """Random token ids for a model that reads them (`token_embedding`), of `shape` (default: batch 1 of
    min(128, the model's context) tokens); None for a model that reads other input."""
    emb = token_embedding(model)
    if emb is None:
        return None
    if shape is None:
        shape = (1, min(128, _context_length(model) or 128))
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--input-shape {','.join(map(str, shape))}: every dimension must be >= 1 (e.g. 1,128)")
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, emb[1].num_embeddings, tuple(shape), generator=g).to(device)


def _output_head(model: nn.Module, emb: nn.Embedding) -> tuple[str, nn.Module] | None:
    """The head that turns hidden states into token logits: `get_output_embeddings()`, else a Linear with as
    many outputs as the vocabulary, named like a head (`lm_head`, ...) or else the last such registered (an
    MLP layer can have as many outputs as the vocabulary has tokens)."""
    named = dict(model.named_modules())
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            found = next(((n, m) for n, m in named.items() if m is head), None)
            if found:
                return found
    wide = [(n, m) for n, m in named.items() if isinstance(m, nn.Linear) and m.out_features == emb.num_embeddings]
    named_head = [(n, m) for n, m in wide if n.rsplit(".", 1)[-1].lower() in _HEAD_NAMES]
    return (named_head or wide or [None])[-1]


def part_of(module: str, mods: dict[str, nn.Module], head: str | None) -> str:
    """The part of a transformer an op's module belongs to, by its path and its ancestors' classes:
    embeddings, head, attention, mlp, or other (norms, residual adds, the model's own code)."""
    if module not in mods or not module:
        return "other"
    segments = module.split(".")
    prefixes = [".".join(segments[:i]) for i in range(1, len(segments) + 1)]
    names = [s.lower() for s in segments]
    classes = [type(mods[p]).__name__.lower() for p in prefixes if p in mods]
    if any(n in _EMBEDDING_NAMES for n in names) or isinstance(mods[module], nn.Embedding):
        return "embeddings"
    if (head is not None and head in prefixes) or names[0] in _HEAD_NAMES:
        return "head"
    if any(n in _ATTENTION_NAMES for n in names) or any("attention" in c for c in classes):
        return "attention"
    if any(n in _MLP_NAMES for n in names) or any(k in c for c in classes for k in ("mlp", "feedforward")):
        return "mlp"
    return "other"


def cost_by_part(c: Any) -> dict[str, dict[str, float]]:
    """Time, FLOPs, memory access and ops of the forward per part (`PARTS`), for a model that reads
    tokens or computes attention; {} for other models."""
    emb = token_embedding(c.model)
    if emb is None and not c.sdpa_calls:
        return {}
    head = _output_head(c.model, emb[1]) if emb else None
    parts = {p: {"ops": 0, "flops": 0.0, "memory_bytes": 0.0, "time_s": 0.0} for p in PARTS}
    for op in c.ops:  # views too, so the shares add up to the forward (they are not counted as ops)
        row = parts[part_of(op.module, c.mods, head[0] if head else None)]
        row["ops"] += op.kind != "view"
        row["flops"] += op.flops
        row["memory_bytes"] += op.bytes
        row["time_s"] += op.time_s
    for row in parts.values():
        row["time_share"] = row["time_s"] / c.total_t
    return parts


def transformer_findings(c: Any) -> list[Finding]:
    """The transformer rules' findings on a lint context (none for a model without tokens or attention)."""
    return [f for rule in _RULES if (f := rule(c)) is not None]


# ---------------------------------------------------------------- timing a fix on the model's shapes


def _timed(contenders: dict[str, Callable[[], Any]], device: torch.device) -> Comparison:
    """The contenders timed interleaved, without autograd (lint judges the inference forward)."""
    with torch.no_grad():
        # calls of small shapes take microseconds: each repeat runs them for MIN_TIME_S at least
        return compare(contenders, warmup=1, repeats=REPEATS, min_time_s=MIN_TIME_S, cooldown_s=0.02, device=device)


def _random(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _device_dtype(c: Any) -> tuple[torch.device, torch.dtype]:
    p = next(c.model.parameters(), None)
    if p is None:
        return torch.device("cpu"), torch.float32
    return p.device, p.dtype if p.is_floating_point() else torch.float32


def _share(seconds: float, c: Any) -> str:
    return f"{seconds / c.total_t:.0%} of the forward time"


# ---------------------------------------------------------------- rules


_RULES: list[Callable[[Any], Finding | None]] = []


def _rule(fn: Callable[[Any], Finding | None]) -> Callable[[Any], Finding | None]:
    _RULES.append(fn)
    return fn


def _back_to(ops: list[Any], start: int, want: Callable[[int], bool], depth: int = 8) -> int | None:
    """The op `want` accepts that feeds op `start`, looking back through its inputs' producers (over ops of
    the kinds in `_THROUGH`) at most `depth` ops deep."""
    frontier, seen = [start], {start}
    for _ in range(depth):
        nxt = []
        for i in frontier:
            for p in ops[i].inputs:
                if p < 0 or p in seen:
                    continue
                seen.add(p)
                if want(p):
                    return p
                if ops[p].kind in _THROUGH or ops[p].kind == "softmax":
                    nxt.append(p)
        frontier = nxt
    return None


def _operands(op: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a matmul's two factors (`addmm` / `baddbmm` take the added term first)."""
    shapes = op.shapes[1:3] if op.name in ("addmm", "baddbmm") else op.shapes[:2]
    return shapes[0], shapes[1]


def attention_cores(ops: list[Any]) -> list[tuple[int, int, int]]:
    """Hand-written attention in the trace: (scores matmul, softmax, output matmul) op indices, for each
    softmax outside SDPA fed by a batched matmul and feeding one."""
    def matmul(i: int) -> bool:
        return ops[i].name in _SCORE_MATMULS and not ops[i].in_sdpa and len(ops[i].shapes) >= 2

    cores = []
    for i, op in enumerate(ops):
        if op.kind != "softmax" or "log" in op.name or op.in_sdpa or op.phase != "model":
            continue
        scores = _back_to(ops, i, matmul)
        out = next((j for j in range(i + 1, min(len(ops), i + 40))
                    if matmul(j) and _back_to(ops, j, lambda k: k == i) is not None), None)
        if scores is not None and out is not None:
            cores.append((scores, i, out))
    return cores


def _attention_speedup(q_shape: tuple[int, ...], kt_shape: tuple[int, ...], v_shape: tuple[int, ...], causal: bool,
                       device: torch.device, dtype: torch.dtype) -> float:
    """SDPA against matmul-softmax-matmul at these shapes (causal-masked when the model masks), timed here."""
    q, kt, v = (_random(s, device, dtype, seed) for seed, s in enumerate((q_shape, kt_shape, v_shape)))
    k = kt.transpose(-2, -1).contiguous()
    t, s = q.shape[-2], k.shape[-2]
    causal = causal and t == s
    keep = torch.ones(t, s, dtype=torch.bool, device=device).tril()
    scale = 1.0 / math.sqrt(q.shape[-1])

    def by_hand() -> torch.Tensor:
        att = (q @ kt) * scale
        if causal:
            att = att.masked_fill(~keep, float("-inf"))
        return torch.softmax(att, dim=-1) @ v

    def fused() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return _timed({"by hand": by_hand, "sdpa": fused}, device).speedup("sdpa")


@_rule
def hand_written_attention(c: Any) -> Finding | None:
    cores = attention_cores(c.ops)
    if not cores:
        return None
    device, dtype = _device_dtype(c)
    measured: dict[tuple[Any, ...], float | str] = {}
    modules: dict[str, str] = {}
    saved = spent = 0.0
    for a, i, b in cores:
        ops, module = c.ops, c.ops[i].module
        causal = any(ops[k].name in ("masked_fill", "masked_fill_", "where") for k in range(a, i))
        key = (*_operands(ops[a]), _operands(ops[b])[1], causal)
        if key not in measured:
            try:
                measured[key] = _attention_speedup(*key, device, dtype)
            except RuntimeError as e:  # shapes SDPA does not take as they are: named, not timed
                measured[key] = f"not timed ({str(e).splitlines()[0][:80]})"
        core_t = sum(ops[k].time_s for k in range(a, b + 1) if ops[k].module == module)
        spent += core_t
        if isinstance(measured[key], float):
            saved += core_t * max(0.0, 1.0 - 1.0 / measured[key])
        where = type(c.mods[module]).__name__ if module in c.mods else "the model's forward"
        modules.setdefault(module, f"{module} ({where}" + (f", {ops[i].source}" if ops[i].source else "") + ")")
    figures = "; ".join((f"{s:.2f}x here" if isinstance(s, float) else s) + f" at q {tuple(k[0])}"
                        + (" (causal)" if k[3] else "") for k, s in measured.items())
    listed = list(modules.values())
    return finding("hand-written-attention", f"attention written out as matmul, softmax, matmul in {len(listed)} module(s): "
                   + ", ".join(listed[:3]) + (" ..." if len(listed) > 3 else "")
                   + f" ({_share(spent, c)}); F.scaled_dot_product_attention on the same shapes measured {figures}",
                   saved / c.total_t,
                   "measured: SDPA and the hand-written attention timed interleaved here on the module's shapes "
                   "(measure.compare), the gain applied to those ops' traced time", list(modules))


def _matmul_dims(op: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((M, K), (K, N)) of a 2-D weight matmul (`mm`, `addmm`), else None."""
    shapes = op.shapes[1:3] if op.name == "addmm" else op.shapes[:2] if op.name == "mm" else []
    if len(shapes) != 2 or any(len(s) != 2 for s in shapes):
        return None
    return (shapes[0][0], shapes[0][1]), (shapes[1][0], shapes[1][1])


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _padding_speedup(dims: tuple[tuple[int, int], tuple[int, int]], device: torch.device, dtype: torch.dtype) -> float:
    """The matmul at its size and with its K and N padded to multiples of 64, timed here: padded's speed-up."""
    (m, k), (_, n) = dims
    x, w = _random((m, k), device, dtype, 0), _random((k, n), device, dtype, 1)
    xp, wp = _random((m, _up(k)), device, dtype, 0), _random((_up(k), _up(n)), device, dtype, 1)
    return _timed({"as it is": lambda: x @ w, "padded": lambda: xp @ wp}, device).speedup("padded")


@_rule
def sizes_off_64(c: Any) -> Finding | None:
    emb = token_embedding(c.model)
    if emb is None:
        return None
    vocab = emb[1].num_embeddings
    weights = [(op, d) for op in c.ops if op.phase == "model" and not op.in_sdpa and (d := _matmul_dims(op))]
    head = [(op, d) for op, d in weights if d[1][1] == vocab and vocab % ALIGN]
    hidden = [(op, d) for op, d in weights if not (d[1][1] == vocab and vocab % ALIGN) and any(
        n % ALIGN and n >= ALIGN for n in (d[1][0], d[1][1]))]
    device, dtype = _device_dtype(c)
    parts, saved, where = [], 0.0, []
    for label, group in (("vocabulary", head), ("hidden size", hidden)):
        if not group:
            continue
        op, dims = max(group, key=lambda od: od[0].time_s)
        t = sum(o.time_s for o, _ in group)
        (m, k), (_, n) = dims
        try:
            speedup = _padding_speedup(dims, device, dtype)
            timed = f"measured {speedup:.2f}x here padded to {_up(k)}x{_up(n):,}" + (
                "" if speedup > 1 else ", no gain on this machine")
            saved += t * max(0.0, 1.0 - 1.0 / speedup)
        except RuntimeError as e:  # no memory for a padded copy of the weight, say: named, not timed
            timed = f"not timed padded ({str(e).splitlines()[0][:80]})"
        sizes = [vocab] if label == "vocabulary" else sorted(
            {n for _, d in group for n in (d[1][0], d[1][1]) if n % ALIGN and n >= ALIGN})
        parts.append(f"{label} {', '.join(f'{s:,}' for s in sizes)} (not a multiple of {ALIGN}): "
                     f"{op.module or 'a matmul'}'s {m}x{k} @ {k}x{n:,} {timed} "
                     f"({len(group)} matmul(s), {_share(t, c)})")
        where += sorted({o.module for o, _ in group})
    if not parts:
        return None
    return finding("size-not-multiple-of-64", "; ".join(parts), saved / c.total_t,
                   "measured: the slowest such matmul timed as it is and padded (measure.compare), the gain applied "
                   "to the traced time of the matmuls of that size", where)


@_rule
def dropout_at_inference(c: Any) -> Finding | None:
    dropped = [op for op in c.ops if op.phase == "model" and op.name in _DROPOUT_OPS and not op.in_sdpa]
    calls = [s for s in c.sdpa_calls if s["dropout_p"] > 0]
    if not dropped and not calls:
        return None
    seen = []
    if dropped:
        mods = sorted({op.module for op in dropped})
        seen.append(f"{len(dropped)} dropout op(s) in {', '.join(mods[:3])}" + (" ..." if len(mods) > 3 else "")
                    + f" ({_share(sum(op.time_s for op in dropped), c)}, the random draws alone)")
    if calls:
        mods = sorted({s["module"] for s in calls})
        ps = sorted({s["dropout_p"] for s in calls})
        seen.append(f"F.scaled_dot_product_attention(dropout_p={', '.join(f'{p:g}' for p in ps)}) in "
                    + ", ".join(mods[:3]) + (" ..." if len(mods) > 3 else ""))
    where = sorted({op.module for op in dropped} | {s["module"] for s in calls})
    return finding("dropout-at-inference", "dropout runs with the model in eval mode: " + "; ".join(seen)
                   + ": inference outputs are random and scaled", 0.0, "correctness, not speed", where)


@_rule
def untied_head(c: Any) -> Finding | None:
    emb = token_embedding(c.model)
    if emb is None:
        return None
    head = _output_head(c.model, emb[1])
    weight = getattr(head[1], "weight", None) if head else None
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(emb[1].weight.shape):
        return None
    if weight is emb[1].weight or weight.data_ptr() == emb[1].weight.data_ptr():
        return None
    n = weight.numel()
    size = n * weight.element_size()
    return finding("untied-head", f"{head[0]}.weight and {emb[0]}.weight are both {weight.shape[0]:,} x "
                   f"{weight.shape[1]:,} and separate: tying them removes {n:,} parameters "
                   f"({size / 2**20:,.1f} MiB; {3 * size / 2**20:,.1f} MiB of training memory with AdamW's two "
                   "moments) and their gradient and update each step; the forward's time does not change", 0.0,
                   "counted: the head's parameters; no forward time to gain", [head[0], emb[0]])
