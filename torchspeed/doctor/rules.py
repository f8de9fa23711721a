"""Rules on a measured training loop (what `profile` and `doctor` saw), each a small function that
returns a Finding or None. Inputs are plain dicts ("facts"), so the same rules judge an in-process
profile and an instrumented script. Model-structure rules live in `lint`.

facts = {"device": "cpu"|"cuda", "steps", "wall_s", "phases": {...}, "settings": {...}} with the
settings the Recorder records (docs/doctor.md).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchspeed.doctor.advice import Finding, finding, rank

__all__ = ["RULES", "image_files", "loader_parallelism", "loop_findings", "training_loaders"]

Facts = dict[str, Any]
RULES: list[Callable[[Facts], Finding | None]] = []


def rule(fn: Callable[[Facts], Finding | None]) -> Callable[[Facts], Finding | None]:
    RULES.append(fn)
    return fn


def _share(f: Facts, *phases: str) -> float:
    wall = f.get("wall_s") or 0.0
    return sum(f["phases"].get(p, 0.0) for p in phases) / wall if wall > 0 else 0.0


def training_loaders(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The loaders that fed training (they yielded batches and are not evaluation-only), or every loader
    that yielded batches when none is marked training: what the loop rules and `--try`'s fixes judge."""
    used = [ld for ld in settings.get("loaders") or [] if (ld.get("batches") or 0) > 0]
    return [ld for ld in used if ld.get("training", True)] or used


def loader_parallelism(settings: dict[str, Any]) -> int:
    """The cores the training loaders keep busy: worker processes, or a FastLoader's decoding threads
    when it has no workers (the oversubscription rule and the `threads` fix both count them)."""
    return max((ld.get("num_workers", 0) or ld.get("threads", 0) for ld in training_loaders(settings)), default=0)


def image_files(settings: dict[str, Any]) -> dict[str, Any] | None:
    """What the first training DataLoader that reads image files through the standard transforms reads
    (`datafix.describe`), or None: where the data fix (`--try fast_loader`) applies."""
    return next((ld["images"] for ld in training_loaders(settings) if (ld.get("images") or {}).get("supported")), None)


def _with_data_fix(found: Finding, settings: dict[str, Any]) -> Finding:
    """A loader finding on image files: say what they are and measure fast_loader's cheaper decoding
    first (on a machine with few cores, worker processes add no core to decode on)."""
    img = image_files(settings)
    if img is None:
        return found
    crop = "RandomResizedCrop" if img["train"] else "Resize + CenterCrop"
    found.message += (f"; it decodes the image files of {img['dataset']} ({img['samples']} files, {crop} "
                      f"{img['crop']}) with PIL in the loop, which fast_loader's DCT-scaled decoding makes cheaper")
    found.fix += ("; or decode for less: ts.data.fast_loader(data, batch_size) (DCT-scaled JPEG decoding, crops "
                  "on uint8, in threads)")
    found.command = found.command.replace("--try ", "--try fast_loader,", 1)
    return found


def _compute_share(f: Facts) -> float:
    return _share(f, "forward", "backward", "optimizer")


MIN_DATA_SHARE = 0.02  # of step time: a loader without workers that waits less is not worth a finding


@rule
def loader_no_workers(f: Facts) -> Finding | None:
    # a FastLoader makes batches in the background (threads or a prefetcher) even with num_workers=0
    loaders = [ld for ld in training_loaders(f["settings"]) if ld.get("num_workers") == 0 and not ld.get("background")]
    if not loaders:
        return None
    data = _share(f, "data")
    if data < MIN_DATA_SHARE:  # loading in the training process costs next to nothing: no worker can win it back
        return None
    # with workers, loading overlaps the step: step time -> max(data, rest) instead of the sum
    gain = min(data, 1.0 - data)
    ld = loaders[0]
    msg = (f"DataLoader(num_workers=0, batch_size={ld.get('batch_size')}) loads every batch in the training "
           f"process: the loop waited in next(loader) for {data:.0%} of step time")
    basis = "overlap: with workers the step takes max(data wait, rest) instead of their sum"
    if f.get("device") == "cpu":
        basis += "; on a CPU-only machine workers also compete with compute for cores, so measure"
    return _with_data_fix(finding("loader-no-workers", msg, gain, basis, where=[ld.get("name", "DataLoader")]),
                          f["settings"])


@rule
def loader_not_persistent(f: Facts) -> Finding | None:
    for ld in training_loaders(f["settings"]):
        starts = ld.get("startup_s") or []
        if ld.get("num_workers", 0) > 0 and not ld.get("persistent_workers") and len(starts) > 1:
            lost = sum(starts[1:])
            gain = lost / f["wall_s"] if f.get("wall_s") else 0.0
            return finding("loader-not-persistent",
                           f"workers are restarted every epoch ({len(starts)} epochs seen; first batch of later epochs "
                           f"waited {lost / (len(starts) - 1):.2f} s on average)", gain,
                           "the measured first-batch waits of epochs after the first", where=[ld.get("name", "DataLoader")])
    return None


@rule
def data_bound(f: Facts) -> Finding | None:
    if f.get("verdict") != "data-bound":
        return None
    if any(ld.get("num_workers") == 0 for ld in training_loaders(f["settings"])):
        return None  # loader-no-workers says it more precisely
    data = _share(f, "data", "copy")
    return _with_data_fix(finding("data-bound", f"the loop is data-bound even with loader workers: {data:.0%} of "
                                  "step time is spent waiting for input", min(data, 1.0 - data),
                                  "overlap: a fast enough pipeline hides the wait behind compute"), f["settings"])


def _low_precision_capability(f: Facts) -> tuple[str, str] | None:
    """What this machine's own capability says of mixed precision: ("plausible", the capability read) where
    it has tensor cores or native bf16 instructions, ("emulated", why) on a CPU without them, else None."""
    s = f["settings"]
    if f.get("device") == "cuda":
        cap = s.get("cuda_capability") or [0, 0]
        if cap[0] < 7:
            return None
        return "plausible", f"this GPU (sm {cap[0]}.{cap[1]}) has {'bf16 and fp16' if cap[0] >= 8 else 'fp16'} tensor cores"
    if f.get("device") != "cpu":
        return None
    flags = s.get("cpu_bf16_flags") or (["amx_bf16"] if s.get("cpu_amx") else ["avx512_bf16"] if s.get("cpu_bf16") else [])
    if flags:
        return "plausible", f"this CPU has native bf16 instructions ({', '.join(flags)})"
    return "emulated", "this CPU has no native bf16 instructions (neither avx512_bf16 nor amx_bf16 in its flags)"


@rule
def no_autocast(f: Facts) -> Finding | None:
    s = f["settings"]
    if s.get("autocast") or str((s.get("model") or {}).get("dtype", "float32")) in ("torch.bfloat16", "torch.float16"):
        return None
    cap = _low_precision_capability(f)
    if cap is None:
        return None
    kind, hw = cap
    compute = _compute_share(f)
    if kind == "emulated":
        return finding("bf16-emulated", f"training runs in fp32 and {hw}: bf16 would run emulated there, so "
                       "no gain is expected from it", 0.0, "no gain expected: the capability this machine lacks")
    try_ = "bf16,fp16" if f.get("device") == "cuda" else "bf16"
    return finding("no-autocast", f"training runs in fp32 (no autocast seen) although {hw}, so mixed precision "
                   f"may be faster here; compute is {compute:.0%} of step time; `doctor --try {try_}` measures it",
                   compute * 0.5, "a guess, not a measurement: half the compute time (forward, backward, optimizer); "
                   f"doctor --try {try_} measures it on this machine and replaces the guess")


@rule
def pin_memory_without_cuda(f: Facts) -> Finding | None:
    if f.get("device") == "cuda" or f["settings"].get("cuda_available"):
        return None
    pinned = [ld for ld in training_loaders(f["settings"]) if ld.get("pin_memory")]
    if not pinned:
        return None
    return finding("pin-memory-without-cuda", "DataLoader(pin_memory=True) on a machine without CUDA: pinning "
                   "has nothing to speed up", 0.0, "no gain expected; it only removes wasted work and a warning",
                   where=[pinned[0].get("name", "DataLoader")])


@rule
def no_pin_memory(f: Facts) -> Finding | None:
    if f.get("device") != "cuda":
        return None
    copies = f["settings"].get("copies") or {}
    copy = _share(f, "copy")
    if copy < 0.03 or (copies.get("from_pinned") and copies.get("non_blocking")):
        return None
    return finding("no-pin-memory", f"host-to-device copies take {copy:.0%} of step time and are "
                   f"{'not from pinned memory' if not copies.get('from_pinned') else 'blocking'}",
                   copy * 0.5, "assumes half the copy time is hidden once it runs asynchronously from pinned memory")


@rule
def host_syncs(f: Facts) -> Finding | None:
    # counted on CUDA tensors only (patches): on CPU a host read waits for nothing
    if f.get("device") != "cuda" or not f.get("steps"):
        return None
    per_step = f["settings"].get("host_syncs", 0) / f["steps"]
    if per_step < 2:
        return None
    return finding("host-syncs", f"{per_step:.1f} host syncs per step (.item(), .cpu(), .tolist(), .numpy(), "
                   "float(t), int(t), bool(t) on CUDA tensors) stall the GPU queue", _share(f, "other") * 0.5,
                   "assumes half the 'other' time is queue stalls the syncs cause")


@rule
def cudnn_benchmark_off(f: Facts) -> Finding | None:
    s = f["settings"]
    if f.get("device") != "cuda" or s.get("cudnn_benchmark") or not (s.get("model") or {}).get("convs"):
        return None
    return finding("cudnn-benchmark-off", "torch.backends.cudnn.benchmark is off for a conv model",
                   _compute_share(f) * 0.1, "assumes 10% faster convolutions with autotuned kernels (shapes static)")


@rule
def data_parallel(f: Facts) -> Finding | None:
    if f["settings"].get("parallel") != "DataParallel":
        return None
    return finding("data-parallel", "the model is wrapped in nn.DataParallel (one process, replicas re-made "
                   "every step, GIL-bound)", _compute_share(f) * 0.25,
                   "a guess, not a measurement: DDP runs the same work a quarter faster; run both to know")


@rule
def eval_without_no_grad(f: Facts) -> Finding | None:
    n = f["settings"].get("eval_forwards_with_grad", 0)
    if not n:
        return None
    share = _share(f, "eval") or _share(f, "forward") * 0.1
    return finding("eval-without-no-grad", f"{n} forward passes ran in eval mode with autograd on (no "
                   "torch.no_grad()): each builds a graph it never uses", share * 0.3,
                   "assumes evaluation gets 30% faster without autograd bookkeeping")


@rule
def train_mode_eval(f: Facts) -> Finding | None:
    n = f["settings"].get("train_mode_eval_forwards", 0)
    if not n:
        return None
    return finding("train-mode-eval", f"{n} forward passes ran under no_grad with the model in train mode, "
                   "and it has Dropout/BatchNorm: evaluation metrics use train-mode behaviour", 0.0,
                   "correctness, not speed")


@rule
def cpu_oversubscribed(f: Facts) -> Finding | None:
    if f.get("device") != "cpu":
        return None
    s = f["settings"]
    cores, threads = s.get("cores") or 0, s.get("torch_threads") or 0
    workers = loader_parallelism(s)
    if not cores or workers == 0 or threads + workers <= cores:
        return None
    kind = "loader worker" if any(ld.get("num_workers") for ld in training_loaders(s)) else "loader thread"
    kind += "s" if workers != 1 else ""
    return finding("cpu-oversubscribed", f"{workers} {kind} + {threads} intra-op threads on {cores} "
                   "cores: they time-slice each other", 0.1,
                   "a guess, not a measurement: a tenth of the step; doctor --try threads,workers measures the split")


@rule
def python_overhead(f: Facts) -> Finding | None:
    if f.get("verdict") != "overhead-bound":
        return None
    other = _share(f, "other")
    return finding("python-overhead", f"{other:.0%} of step time is outside data, copies and compute (Python in "
                   "the loop, kernel launches, host syncs)", other * 0.5,
                   "assumes compiling / batching removes half the overhead")


@rule
def no_channels_last(f: Facts) -> Finding | None:
    s = f["settings"]
    inp = s.get("input") or {}
    if not (s.get("model") or {}).get("convs") or len(inp.get("shape") or []) != 4 or inp.get("channels_last"):
        return None
    if f.get("device") == "cuda" and not s.get("autocast"):
        return None  # channels_last often loses in fp32 on GPUs
    return finding("no-channels-last", "a conv model is fed NCHW-contiguous batches", _compute_share(f) * 0.1,
                   "assumes 10% faster convolutions (oneDNN / tensor cores prefer NHWC); accelerate measures it")


def loop_findings(facts: Facts) -> list[Finding]:
    """All loop rules' findings, plus loss/activation checks already made at run time, ranked."""
    out = [f for r in RULES if (f := r(facts)) is not None]
    seen = set()
    for chk in facts["settings"].get("loss_checks") or []:
        if chk["rule"] in seen:
            continue
        seen.add(chk["rule"])
        out.append(finding(chk["rule"], chk["message"], 0.0, "correctness, not speed", where=chk.get("where")))
    return rank(out)
