"""Rules on what doctor saw of a transformer loop: attention (the SDPA backends measured on the
model's own shapes; attention written by hand, named by module and line, with the SDPA replacement
measured on its shapes) and padding in token batches (its share, and what batching samples of similar
length or packing them would save). Plain dicts in, Findings out, as `rules`; the parent imports it
without torch. The measurements are made in the script's process (`attention`, `grouping`).
"""
from __future__ import annotations

import os
import statistics
from typing import Any

from torchspeed.doctor.advice import Finding, finding

__all__ = ["PADDING_MIN_SHARE", "SDPA_BACKENDS", "padding_estimate", "sdpa_gain", "transformer_findings"]

# the SDPA backends' names in reports and in `--try sdpa=NAME`, and torch's SDPBackend members
SDPA_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
PADDING_MIN_SHARE = 0.05  # padding below this share of the tokens is not worth a finding nor a --try run

Facts = dict[str, Any]


def padding_estimate(batches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """From the recorded batches ({"lengths": each row's real tokens, "padded": the padded length}): the
    share of padding, and the tokens the same samples would take grouped by length (sorted, cut into
    batches of the same size, each padded to its longest), padded per batch only, and packed (no padding):
    `grouped_gain`, `per_batch_gain`, `packed_gain` are the padded tokens now over those."""
    rows = [(b["lengths"], int(b["padded"])) for b in batches or [] if b.get("lengths")]
    if not rows:
        return None
    padded = sum(len(ls) * t for ls, t in rows)
    real = sum(sum(ls) for ls, _ in rows)
    per_batch = sum(len(ls) * max(ls) for ls, _ in rows)
    size = max(1, round(statistics.median(len(ls) for ls, _ in rows)))
    ordered = sorted((x for ls, _ in rows for x in ls), reverse=True)
    grouped = sum(len(chunk) * chunk[0] for chunk in (ordered[i:i + size] for i in range(0, len(ordered), size)))
    return {"batches": len(rows), "batch_size": size, "tokens": padded, "real_tokens": real,
            "share": 1.0 - real / padded if padded else 0.0,
            "fixed_length": all(t > max(ls) for ls, t in rows), "padded_to": sorted({t for _, t in rows}),
            "grouped_gain": padded / grouped if grouped else 1.0, "per_batch_gain": padded / per_batch if per_batch else 1.0,
            "packed_gain": padded / real if real else 1.0}


def _site(r: dict[str, Any]) -> str:
    s = r.get("site") or {}
    return f"{os.path.basename(s.get('file', '?'))}:{s.get('line', '?')}"


def _module(r: dict[str, Any]) -> str:
    m = r.get("module") or {}
    return f"{m.get('name') or '?'} ({m.get('class', '?')})" if m else "?"


def _per_step(r: dict[str, Any], f: Facts) -> float:
    """Calls of this attention per training step (the sites count every training forward's calls)."""
    return r.get("calls", 0) / max(1, f.get("all_steps") or f.get("steps") or 1)


def sdpa_gain(r: dict[str, Any]) -> tuple[str, float] | None:
    """(the fastest backend measured, its speed-up over torch's default choice) when it is not the default
    and beats it beyond both timings' spread; None otherwise."""
    m = r.get("measured") or {}
    backends = m.get("backends") or {}
    base = m.get("baseline")
    if not backends or base not in backends:
        return None
    best = min(backends, key=lambda n: backends[n]["ms"])
    x = backends[best]["speedup"]
    if best == base or x <= 1.0 + max(backends[best]["spread"], backends[base]["spread"]):
        return None
    return best, x


def _sdpa(f: Facts, r: dict[str, Any]) -> Finding | None:
    m = r.get("measured") or {}
    shape = f"q {tuple(r['q'])}, k {tuple(r['k'])} {r['dtype']}" + (", causal" if r.get("is_causal") else "") \
        + (f", mask {tuple(r['mask'])}" if r.get("mask") else "")
    seen = (f"F.scaled_dot_product_attention at {_site(r)} in {_module(r)} ({shape}), {_per_step(r, f):.0f} calls "
            "per step")
    if not m.get("backends"):
        why = m.get("error") or "not measured (doctor --try measures the backends)"
        return finding("sdpa-backends", f"{seen}; backends: {why}", 0.0, "not measured", where=[_site(r), _module(r)])
    times = ", ".join(f"{n} {b['ms']:.2f} ms{' (torch default)' if n == m.get('default') else ''} ({b['speedup']:.2f}x)"
                      for n, b in sorted(m["backends"].items(), key=lambda kv: kv[1]["ms"]))
    base = m["baseline"] if m["baseline"] == m.get("default") else f"{m['baseline']} (torch's default could not be read)"
    refused = "; not usable here: " + ", ".join(f"{n} ({why})" for n, why in m["refused"].items()) if m.get("refused") else ""
    gain = sdpa_gain(r)
    measured = f"{seen}; forward + backward on these shapes, measured here: {times}{refused}"
    if gain is None:
        return finding("sdpa-backends", f"{measured}; none beats {base} beyond the timings' spread", 0.0,
                       "measured on the model's shapes: no backend beats the default", where=[_site(r), _module(r)])
    best, x = gain
    saved = _per_step(r, f) * m["backends"][m["baseline"]]["ms"] * (1 - 1 / x) / 1e3
    return finding("sdpa-backend", f"{measured}; {best} is {x:.2f}x {base} here", saved / f["wall_s"] * f["steps"]
                   if f.get("wall_s") else 0.0, "measured on the model's shapes (attention alone): the per-step saving "
                   "over the measured step time; --try sdpa measures it on the script", where=[_site(r), _module(r)])


def _replacement(r: dict[str, Any], f: Facts) -> str:
    """The SDPA call that replaces a hand-written attention (the script's own code, or a library's option)."""
    if (r.get("site") or {}).get("package") == "transformers":
        return ("the model's attention is transformers' eager implementation: build it with "
                "attn_implementation=\"sdpa\" (the config, from_config or from_pretrained)")
    mask = ", is_causal=True" if r.get("mask") == "causal" else ", attn_mask=mask" if r.get("mask") else ""
    return (f"replace the lines around {_site(r)} (`{r.get('source', '')}`: matmul, softmax, matmul) with "
            f"`y = torch.nn.functional.scaled_dot_product_attention(q, k, v{mask}, dropout_p=p if self.training else 0.0)`")


def _hand(f: Facts, r: dict[str, Any]) -> Finding:
    m = r.get("measured") or {}
    scores = tuple(r["scores"])
    seen = (f"attention computed by hand (matmul, softmax, matmul) at {_site(r)} in {_module(r)}: scores {scores} "
            f"{r['dtype']}, head dim {r['head_dim']}" + (f", {r['mask']} mask" if r.get("mask") else "")
            + f", {_per_step(r, f):.0f} calls per step; {_replacement(r, f)}")
    if "speedup" not in m:
        why = m.get("error") or "doctor --try measures it on these shapes"
        return finding("hand-written-attention", f"{seen} (not measured: {why})", 0.0, "not measured",
                       where=[_site(r), _module(r)])
    same = "the same output" if m["same_output"] else "a DIFFERENT output"
    seen += (f"; measured on these shapes (forward + backward): {m['sdpa_ms']:.2f} ms with SDPA against "
             f"{m['hand_ms']:.2f} ms by hand ({m['speedup']:.2f}x, {same}: max difference {m['max_abs_diff']:.1e})")
    saved = _per_step(r, f) * (m["hand_ms"] - m["sdpa_ms"]) / 1e3
    gain = saved * f["steps"] / f["wall_s"] if f.get("wall_s") and m["speedup"] > 1 + m.get("spread", 0.0) else 0.0
    return finding("hand-written-attention", seen, gain, "measured on the module's shapes (attention alone, forward and "
                   "backward): the per-step saving over the measured step time", where=[_site(r), _module(r)])


def _padding(f: Facts) -> Finding | None:
    tokens = (f["settings"].get("tokens") or {})
    est = padding_estimate(tokens.get("batches") or [])
    if est is None or est["share"] < PADDING_MIN_SHARE:
        return None
    compute = sum(f["phases"].get(p, 0.0) for p in ("forward", "backward")) / f["wall_s"] if f.get("wall_s") else 0.0
    how = (f"the batches are padded to a fixed length ({', '.join(map(str, est['padded_to']))}): padding each batch to its "
           f"longest sample alone would compute {est['per_batch_gain']:.2f}x fewer tokens; " if est["fixed_length"] else "")
    msg = (f"{est['share']:.0%} of the tokens in the training batches are padding ({tokens.get('source')}, "
           f"{est['batches']} batches of {est['batch_size']}): {how}batching samples of similar length would compute "
           f"{est['grouped_gain']:.2f}x fewer tokens, packing them without padding {est['packed_gain']:.2f}x")
    return finding("token-padding", msg, compute * (1 - 1 / est["grouped_gain"]),
                   "token counts of the recorded batches: forward and backward time taken as proportional to the "
                   "tokens computed (attention grows faster); --try length_grouped measures it", where=["training batches"])


def transformer_findings(f: Facts) -> list[Finding]:
    """Attention and padding findings of a doctor run (unranked; `launch` ranks them with the loop rules')."""
    att = f["settings"].get("attention") or {}
    out = [x for r in att.get("sdpa") or [] if (x := _sdpa(f, r)) is not None]
    out += [_hand(f, r) for r in att.get("hand") or []]
    if (pad := _padding(f)) is not None:
        out.append(pad)
    return out
