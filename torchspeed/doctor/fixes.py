"""The fixes `torchspeed doctor --try` measures on the user's unchanged script: which apply (from the
baseline run's findings and this machine's capability), the code a user adds to keep one, and how
close its losses must stay to the baseline's. The parent plans without torch; how the bootstrap
injects a fix in the script's process is `injection`'s. What each fix injects and when it is tried:
the fix table of docs/doctor.md. Numerics: the loader fixes must give the same batches in order,
`fast_loader` the same files and labels with close image statistics (`datafix`), the others the
first losses within `TOLERANCES` ("precision" for bf16 / fp16, "math" for the rest); `length_grouped`
draws other batches of the same samples, so its losses are not compared (it must have been applied).
`compile` is tried by default on a compute-bound loop, whole and, where the model repeats a block,
regional; `trying` weighs its compile seconds against the script's planned steps.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torchspeed.doctor import datafix, script_code
from torchspeed.doctor.rules import loader_parallelism, training_loaders
from torchspeed.doctor.transformer_rules import PADDING_MIN_SHARE, SDPA_BACKENDS, padding_estimate, sdpa_gain

__all__ = ["FIX_NAMES", "FUSABLE", "TOLERANCES", "Plan", "check_names", "plan", "code_for", "label", "numerics"]

# relative tolerance on the first NUMERICS_STEPS losses, by kind of fix: the loss before any update
# (the forward's math) and the one after the first update (backward and optimizer). Later losses are
# not compared: early training amplifies rounding chaotically (ResNet-18, SGD lr 0.1: channels_last
# moved the 2nd loss by 3e-5 relative and the 3rd by 1e-2 on this project's CPU).
NUMERICS_STEPS = 2
BATCHES_COMPARED = 3
TOLERANCES = {"math": 1e-3, "precision": 5e-2}
KIND = {"workers": "loader", "persistent_workers": "loader", "pin_memory": "loader", "bf16": "precision",
        "fp16": "precision", "fast_loader": "images", "length_grouped": "order"}
# fixes that change the same loader: a combination keeps the faster one of each group
CONFLICTS = (("fast_loader", "workers", "persistent_workers", "pin_memory"),)
# the findings whose estimated gain a fix measures
RULES = {"workers": ("loader-no-workers", "data-bound"), "fast_loader": ("loader-no-workers", "data-bound"),
         "persistent_workers": ("loader-not-persistent",),
         "pin_memory": ("no-pin-memory",), "bf16": ("no-autocast",), "fp16": ("no-autocast",),
         "channels_last": ("no-channels-last",), "cudnn_benchmark": ("cudnn-benchmark-off",),
         "inference_mode": ("eval-without-no-grad",), "threads": ("cpu-oversubscribed",),
         "compile": ("python-overhead",), "sdpa": ("sdpa-backend",), "length_grouped": ("token-padding",)}
FUSABLE = ("SGD", "Adam", "AdamW")
# the phases a fix can shorten: removing them entirely bounds its speed-up (threads: everything)
PHASES_CHANGED = {"workers": ("data", "copy"), "fast_loader": ("data", "copy"), "persistent_workers": ("data", "copy"),
                  "pin_memory": ("data", "copy"),
                  "bf16": ("forward", "backward", "optimizer", "copy"), "fp16": ("forward", "backward", "optimizer", "copy"),
                  "channels_last": ("forward", "backward", "optimizer", "copy"), "cudnn_benchmark": ("forward", "backward"),
                  "fused_optimizer": ("optimizer",), "inference_mode": ("eval",),
                  "compile": ("forward", "backward", "other"), "sdpa": ("forward", "backward"),
                  "length_grouped": ("data", "copy", "forward", "backward")}


def max_speedup(name: str, payload: dict[str, Any]) -> float | None:
    """The speed-up the fix would give if the phases it changes took no time at all (baseline shares);
    a measured speed-up above it means the machine's load changed during the runs. None: no bound."""
    phases = (payload.get("steady") or {}).get("phases") or {}
    wall = (payload.get("steady") or {}).get("wall_s") or 0.0
    if name not in PHASES_CHANGED or wall <= 0:
        return None
    share = min(1.0, sum(phases.get(p, 0.0) for p in PHASES_CHANGED[name]) / wall)
    return None if share >= 0.999 else 1.0 / (1.0 - share)


def label(name: str, value: Any = True) -> str:
    """How a fix with its value is named in progress lines and tables: `workers=2`, `channels_last`,
    `fast_loader(threads=1)`."""
    if isinstance(value, dict):
        return f"{name}(threads={value.get('threads')})"
    return name if value is True else f"{name}={value}"


def check_names(requested: list[str] | None) -> None:
    """The one check of `--try` fix names, made before any run starts: an error listing the valid ones."""
    unknown = [n for n in requested or () if n not in FIX_NAMES]
    if unknown:
        raise ValueError(f"--try: unknown fix {', '.join(map(repr, unknown))}; choose from {', '.join(FIX_NAMES)}")


@dataclass(frozen=True)
class _Seen:
    """What the baseline run saw, as the per-fix checks read it. `forced`: the user listed the fix."""

    s: dict[str, Any]  # the report's settings
    rules: set[str]  # the findings' rule ids
    loaders: list[dict[str, Any]]  # the torch DataLoaders feeding training
    eval_s: float  # evaluation time in the steady steps
    forced: bool
    verdict: str | None = None  # the baseline's: compute-bound, data-bound, overhead-bound

    @property
    def cuda(self) -> bool:
        return self.s.get("device") == "cuda"

    @property
    def cores(self) -> int:
        return int(self.s.get("cores") or 1)

    @property
    def mixed(self) -> dict[str, Any]:
        return self.s.get("mixed_precision") or {}  # runtime.default_precision's pick and its reason


def _workers(b: _Seen) -> str | list[Any]:
    if not b.loaders:
        return "no torch DataLoader feeds the loop"
    if not any(ld.get("num_workers") == 0 for ld in b.loaders) and not b.forced:
        return "the loop's DataLoader already has worker processes"
    return sorted({max(1, b.cores // 2), min(b.cores, 4)})


def _fast_loader(b: _Seen) -> str | list[Any]:
    if not b.loaders:
        return "no torch DataLoader feeds the loop"
    return datafix.candidates(b.loaders, b.cores, "cuda" if b.cuda else "cpu")


def _persistent_workers(b: _Seen) -> str | list[Any]:
    if "loader-not-persistent" in b.rules or b.forced and any(ld.get("num_workers") for ld in b.loaders):
        return [True]
    return "no DataLoader restarts its workers between the measured epochs"


def _pin_memory(b: _Seen) -> str | list[Any]:
    if not b.cuda:
        return "needs CUDA: without a GPU there is no host-to-device copy to speed up"
    if not b.loaders or all(ld.get("pin_memory") for ld in b.loaders):
        return "the loop's DataLoader already pins memory"
    return [True]


def _under_autocast(b: _Seen) -> str | None:
    return f"the script already trains under autocast ({b.s.get('autocast_precision')})" if b.s.get("autocast") else None


def _bf16(b: _Seen) -> str | list[Any]:
    if reason := _under_autocast(b):
        return reason
    if b.mixed.get("name") != "bf16":
        return f"needs bf16 hardware: {b.mixed.get('reason', 'capability unknown')}"
    return [True]


def _fp16(b: _Seen) -> str | list[Any]:
    if reason := _under_autocast(b):
        return reason
    if not b.cuda:
        return "needs CUDA (fp16 autocast with a GradScaler)"
    if b.mixed.get("name") == "bf16" and not b.forced:
        return "bf16 is tried instead (this GPU has bf16 tensor cores; no GradScaler needed)"
    return [True]


def _channels_last(b: _Seen) -> str | list[Any]:
    inp = b.s.get("input") or {}
    if not (b.s.get("model") or {}).get("convs") or len(inp.get("shape") or []) != 4:
        return "no conv model fed 4-D batches"
    if inp.get("channels_last"):
        return "the batches are already channels_last"
    return [True]


def _cudnn_benchmark(b: _Seen) -> str | list[Any]:
    if not b.cuda:
        return "needs CUDA (cuDNN autotuning)"
    if b.s.get("cudnn_benchmark"):
        return "torch.backends.cudnn.benchmark is already on"
    return [True]


def _fused_optimizer(b: _Seen) -> str | list[Any]:
    opts = b.s.get("optimizers") or []
    options = b.s.get("optimizer_options") or {}
    if not opts:
        return "no torch.optim optimizer steps the model"
    if all(options.get(o, {}).get("fused") or options.get(o, {}).get("foreach") for o in opts):
        return "the optimizer already runs fused or foreach"
    return [True]


def _inference_mode(b: _Seen) -> str | list[Any]:
    if b.eval_s > 0 or b.forced:
        return [True]
    return "no evaluation forward runs inside the measured steps"


def _threads(b: _Seen) -> str | list[Any]:
    if b.s.get("device") != "cpu":
        return "the model runs on the GPU: intra-op threads matter little"
    threads = int(b.s.get("torch_threads") or 1)
    workers = loader_parallelism(b.s)
    want = max(1, b.cores - workers) if workers else b.cores
    if want == threads:
        return f"torch already uses {threads} intra-op threads with {workers} loader workers on {b.cores} cores"
    return [want]


def _compile(b: _Seen) -> str | list[Any]:
    if b.s.get("compiled"):
        return "the script already compiles its model (torch.compile)"
    if b.verdict != "compute-bound" and not b.forced:
        return f"the loop is {b.verdict or 'not measured'}: compile speeds up compute; `--try compile` measures it anyway"
    return ["whole", "regional"] if (b.s.get("model") or {}).get("repeated_blocks") else ["whole"]


def _sdpa(b: _Seen) -> str | list[Any]:
    sites = (b.s.get("attention") or {}).get("sdpa") or []
    if not sites:
        return "no F.scaled_dot_product_attention call in the training forward"
    if b.forced:  # every backend measured usable here but torch's default
        found = {n for r in sites for n in ((r.get("measured") or {}).get("backends") or {})
                 if n != (r.get("measured") or {}).get("default")}
        return sorted(found) or "no other SDPA backend runs the model's shapes here"
    faster = sorted({g[0] for r in sites if (g := sdpa_gain(r)) is not None})
    return faster or "torch's default SDPA backend measured fastest on the model's shapes (or was not measured)"


def _length_grouped(b: _Seen) -> str | list[Any]:
    est = padding_estimate(((b.s.get("tokens") or {}).get("batches")) or [])
    if est is None:
        return "no token batch with an attention mask or the model's pad id was seen"
    if est["share"] < PADDING_MIN_SHARE and not b.forced:
        return f"padding is {est['share']:.0%} of the tokens: little to save"
    if not b.loaders:
        return "the batches do not come from a torch DataLoader: group samples by length where the script makes them"
    if est["fixed_length"] and not b.forced:
        return ("the batches are padded to a fixed length: pad each batch to its longest sample first (a collate_fn, "
                "DataCollatorWithPadding), then group by length")
    return [True]


# per fix, in the order they are tried: why the fix is not tried (str), or the values to try it with
CHECKS: dict[str, Callable[[_Seen], str | list[Any]]] = {
    "workers": _workers, "fast_loader": _fast_loader, "persistent_workers": _persistent_workers,
    "pin_memory": _pin_memory, "length_grouped": _length_grouped, "bf16": _bf16, "fp16": _fp16,
    "channels_last": _channels_last, "cudnn_benchmark": _cudnn_benchmark,
    "fused_optimizer": _fused_optimizer, "inference_mode": _inference_mode, "threads": _threads, "sdpa": _sdpa,
    "compile": _compile}
FIX_NAMES = tuple(CHECKS)


class Plan(NamedTuple):
    run: list[tuple[str, Any]]  # (fix name, value), one run each
    skipped: list[dict[str, str]]  # {"fix", "reason"}


def plan(payload: dict[str, Any], requested: list[str] | None = None) -> Plan:
    """The fixes to run for a baseline doctor report, and the skipped ones with the reason.

    `requested` None tries every fix the findings call for (`compile` on a compute-bound loop); a list
    (names already checked by `check_names`) tries those fixes where this machine can run them. Hardware
    checks read the capability: bf16 needs native bf16 (`runtime.default_precision`), fp16 + GradScaler,
    pin_memory and cudnn.benchmark need CUDA."""
    s = payload.get("settings") or {}
    seen = _Seen(s=s, rules={f["rule"] for f in payload.get("findings") or []},
                 loaders=[ld for ld in training_loaders(s) if ld.get("name", "").startswith("DataLoader")],
                 eval_s=((payload.get("steady") or {}).get("phases") or {}).get("eval", 0.0),
                 forced=requested is not None, verdict=payload.get("verdict"))
    out = Plan([], [])
    for name in requested if requested is not None else FIX_NAMES:
        result = CHECKS[name](seen)
        if isinstance(result, str):
            out.skipped.append({"fix": name, "reason": result})
        else:
            out.run.extend((name, v) for v in result)
    return out


def code_for(name: str, value: Any, payload: dict[str, Any]) -> str:
    """The lines to add to the script to keep the fix (what the bootstrap injected)."""
    s = payload.get("settings") or {}
    ld = (training_loaders(s) or [{}])[0]
    bs = ld.get("batch_size")
    dev = "cuda" if s.get("device") == "cuda" else "cpu"
    opt = (s.get("optimizers") or ["SGD"])[0]
    if name == "workers":
        return (f"loader = torch.utils.data.DataLoader(dataset, batch_size={bs}, ..., num_workers={value},\n"
                "                                     persistent_workers=True)")
    if name == "fast_loader":
        return datafix.code(value, training_loaders(s))
    if name == "persistent_workers":
        return "loader = torch.utils.data.DataLoader(dataset, ..., persistent_workers=True)"
    if name == "pin_memory":
        return ("loader = torch.utils.data.DataLoader(dataset, ..., pin_memory=True)\n"
                "x = x.to(device, non_blocking=True)  # each batch")
    if name == "bf16":
        return (f"with torch.autocast(\"{dev}\", dtype=torch.bfloat16):  # forward and loss\n"
                "    output = model(x)\n"
                "loss = loss_fn(output.float(), y)")
    if name == "fp16":
        return ("scaler = torch.amp.GradScaler(\"cuda\")\n"
                "with torch.autocast(\"cuda\", dtype=torch.float16):\n"
                "    output = model(x)\n"
                "loss = loss_fn(output.float(), y)\n"
                "scaler.scale(loss).backward()\n"
                "scaler.step(optimizer)\n"
                "scaler.update()")
    if name == "channels_last":
        return ("model = model.to(memory_format=torch.channels_last)\n"
                "x = x.contiguous(memory_format=torch.channels_last)  # each batch, before model(x)")
    if name == "cudnn_benchmark":
        return "torch.backends.cudnn.benchmark = True  # input shapes are fixed"
    if name == "fused_optimizer":
        return _optimizer_code(s, opt)
    if name == "inference_mode":
        return "with torch.inference_mode():  # instead of torch.no_grad(), around evaluation"
    if name == "threads":
        return f"torch.set_num_threads({value})  # at the start of the script"
    if name == "compile":
        return _compile_code(s, value)
    if name == "sdpa":
        return ("from torch.nn.attention import SDPBackend, sdpa_kernel\n"
                f"with sdpa_kernel(SDPBackend.{SDPA_BACKENDS[value]}):  # around the training loop\n    ...")
    if name == "length_grouped":
        if s.get("driver") == "transformers.Trainer":
            return ('TrainingArguments(..., train_sampling_strategy="group_by_length")  # transformers >= 5; '
                    "before: group_by_length=True")
        return ("from transformers.trainer_pt_utils import LengthGroupedSampler  # the order doctor measured\n"
                'lengths = [len(sample["input_ids"]) for sample in dataset]\n'
                f"loader = torch.utils.data.DataLoader(dataset, batch_size={bs}, sampler=LengthGroupedSampler({bs}, "
                "lengths=lengths), ...)  # instead of shuffle=True; pad each batch to its longest sample")
    raise ValueError(f"unknown fix {name!r}")


def _optimizer_code(s: dict[str, Any], opt: str) -> str:
    """The script's own optimizer call with `fused=True` (SGD / Adam / AdamW) or `foreach=True` added, its
    parameter groups and other arguments as written; a Hugging Face Trainer's option where the Trainer
    made the optimizer; a generic line only where the call cannot be read."""
    kw = "fused" if opt in FUSABLE else "foreach"
    site = (s.get("optimizer_calls") or {}).get(opt) or {}
    if site.get("package") == "transformers" and opt == "AdamW":
        return 'TrainingArguments(..., optim="adamw_torch_fused")'
    edited = script_code.with_keyword(site["file"], site["line"], opt, kw, "True") if site.get("file") else None
    if edited is None:
        return f"optimizer = torch.optim.{opt}(<its parameters or parameter groups, as now>, ..., {kw}=True)"
    return f"# {os.path.basename(site['file'])}:{site['line']}, the script's own call with {kw}=True added\n{edited}"


def _compile_code(s: dict[str, Any], value: Any) -> str:
    """compile=whole: torch.compile of the model (the Trainer's option under a Hugging Face Trainer);
    compile=regional: torchspeed's regional compilation, and the same in plain torch."""
    if value != "regional":
        if s.get("driver") == "transformers.Trainer":
            return "TrainingArguments(..., torch_compile=True)"
        return "model = torch.compile(model)  # before the training loop"
    blocks = (s.get("model") or {}).get("repeated_blocks") or {}
    path = blocks.get("path") or "blocks"
    each = f"each {blocks.get('class', 'block')} of model.{path} compiled once, in place"
    return (f"import torchspeed as ts\nts.train.compile_regions(model)  # {each}\n"
            f"# plain torch: for block in model.{path}: block.compile()")


def numerics(name: str, base: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """Does the fix keep the results? Loader fixes: the same samples in the same order (losses move with
    random augmentation, whose draws come from worker seeds, so they are shown, not judged). Other fixes:
    the first NUMERICS_STEPS losses within the kind's relative tolerance of the baseline's (same seed)."""
    kind = KIND.get(name, "math")
    if kind == "images":
        return datafix.numerics(base, fixed, BATCHES_COMPARED)
    if kind == "order":
        return {"kind": kind, "steps_compared": 0, "max_rel_diff": None, "ok": None,
                "tolerance": "not judged: the same samples in other batches (grouped by length) give other losses"}
    dropout = ((base.get("settings") or {}).get("model") or {}).get("dropout") or 0.0
    if name == "compile" and dropout > 0:
        return {"kind": kind, "steps_compared": 0, "max_rel_diff": None, "ok": None,
                "tolerance": f"not judged: the model's dropout (p={dropout:g}) draws other random numbers when "
                             "compiled (torch._inductor.config.fallback_random = True draws eager's, to compare)"}
    lb, lf = base.get("losses") or [], fixed.get("losses") or []
    k = min(NUMERICS_STEPS, len(lb), len(lf))
    diff = max((abs(a - b) / max(abs(a), 1e-8) for a, b in zip(lb[:k], lf[:k])), default=None)
    out: dict[str, Any] = {"kind": kind, "steps_compared": k, "max_rel_diff": diff}
    if kind == "loader":
        pb, pf = base.get("batch_prints") or [], fixed.get("batch_prints") or []
        n = min(len(pb), len(pf), BATCHES_COMPARED)
        out.update(tolerance="the same batches (labels, shapes) in the same order", ok=pb[:n] == pf[:n] if n else None)
        return out
    tol = TOLERANCES[kind]
    out.update(tolerance=f"relative {tol:g} on the first {NUMERICS_STEPS} losses",
               ok=None if diff is None or k == 0 else diff <= tol)
    return out
