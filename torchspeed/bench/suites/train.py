"""Train suite: training samples/s of ResNet-18 (10 classes, 128x128, batch 64) on the demo photos.

Rows are cumulative: each adds one technique to the row above, and the ratio is to the first row
(plain PyTorch: fp32, NCHW, torchvision ImageFolder loader with num_workers=0, a hand-written loop).
Every figure is the median over calls of K training steps (the first call, which carries one-off
costs, excluded), as many calls as fit the row's share of the suite's time budget (at least 2;
`torchspeed.bench.budget`), timed by torchspeed.measure. Rows carry the FLOPs per sample (counted by
torch.utils.flop_counter) so the runner can set them against the fp32 GEMM ceiling, and one step of the
chosen layout is profiled per op to show where the time goes. A precision this CPU only emulates (its
GEMM ceiling below fp32's) is not run. The full report also measures the tuned torchvision loader,
channels_last and torch.compile rows, the Trainer's overhead against a hand-written loop with the same
settings (same in-memory batches, interleaved) and evaluation under inference_mode against autograd left
on (time and peak memory); both measure the epochs early stopping saves on a task whose validation loss
plateaus.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

TITLE = "Training: ResNet-18 samples/s (10 classes, 128x128, batch 64; rows cumulative)"

BATCH, CROP, SHORT_SIDE, CLASSES = 64, 128, 160, 10
EXPECTED_STEPS = 1250  # a realistic run (20 epochs of the 4000 demo photos): what compile must repay


def _subset(n_images: int, quick: bool) -> list[int]:
    return list(range(0, n_images, 4)) if quick else list(range(n_images))


def _torchvision_dataset(folder: str, indices: list[int]) -> Any:
    import torch
    from torchvision import datasets
    from torchvision import transforms as T

    from torchspeed.images import IMAGENET_MEAN, IMAGENET_STD

    tf = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    ds = datasets.ImageFolder(folder, tf)
    return torch.utils.data.Subset(ds, indices) if len(indices) < len(ds) else ds


def _cached_store(folder: str, indices: list[int]) -> str:
    """The demo photos packed with short side 160 (the fast pipeline's input), built once into the cache."""
    import torch
    from torchvision import datasets

    from torchspeed.data import pack
    from torchspeed.runtime import cache_dir

    final = os.path.join(cache_dir("bench-train"), f"{os.path.basename(folder)}-n{len(indices)}-short{SHORT_SIDE}")
    if os.path.isdir(final):
        return final
    tmp = tempfile.mkdtemp(dir=os.path.dirname(final), prefix=".store-")
    try:
        ds = datasets.ImageFolder(folder)
        src = folder if len(indices) == len(ds) else torch.utils.data.Subset(ds, indices)
        pack(src, os.path.join(tmp, "store"), short_side=SHORT_SIDE, format="jpeg", quality=90, progress=False,
             overwrite=True, **({} if isinstance(src, str) else {"classes": ds.classes}))
        os.rename(os.path.join(tmp, "store"), final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class _Stream:
    """Endless batches from a re-iterable loader (a new pass starts when one ends)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader, self.it = loader, None

    def next(self) -> Any:
        if self.it is None:
            self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


class _Chunk:
    """k batches per pass from one continuing stream (the Trainer's pass = one timed chunk).

    Like the hand-written rows, the loader's iterator is never restarted between chunks, so no row
    pays a pipeline refill per repeat that the others do not.
    """

    yields_device_batches = True  # the stream's batches are already on the device

    def __init__(self, stream: _Stream, k: int):
        self.stream, self.k = stream, k

    def __iter__(self) -> Any:
        for _ in range(self.k):
            yield self.stream.next()

    def __len__(self) -> int:
        return self.k


def _hand_loop(model: Any, opt: Any, source: Callable[[], Any], k: int, precision: str, channels_last: bool) -> Callable[[], None]:
    """A hand-written training loop: k steps per call (what a user writes without torchspeed)."""
    import torch
    import torch.nn.functional as F

    from torchspeed.runtime import precision_dtype

    model.train()

    def chunk() -> None:
        for _ in range(k):
            x, y = source()
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            if precision != "fp32":
                with torch.autocast(x.device.type, dtype=precision_dtype(precision)):
                    loss = F.cross_entropy(model(x), y)
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
    return chunk


def _autograd_held_bytes(model: Any, x: Any, ctx: Callable[[], Any]) -> int:
    """Bytes of activations autograd keeps for backward during one forward (0 without autograd).

    Counted exactly through saved-tensor hooks: the process's peak RSS cannot show it reliably
    (freed memory cached by the allocator is reused without raising RSS)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        try:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        except RuntimeError:
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        out = model(x)
        del out
    return int(sum(seen.values()))


def _early_stopping(quick: bool) -> dict[str, Any]:
    """Epochs saved by EarlyStopping(patience=10) on a noisy task whose validation loss plateaus."""
    import time

    import torch
    from torch import nn

    from torchspeed.train import Callback, EarlyStopping, Trainer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, generator=g)

    def split(n: int) -> Any:
        x = torch.randn(n, 32, generator=g)
        y = ((x @ w + 2.0 * torch.randn(n, generator=g)) > 0).long()  # label noise: the loss floor is high
        return torch.utils.data.TensorDataset(x, y)

    train, val = split(1024), split(1024)
    budget = 40 if quick else 100

    def run(callbacks: list[Any]) -> tuple[list[float], float, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
        losses: list[float] = []

        class Record(Callback):
            def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
                losses.append(metrics["val_loss"])

        tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.functional.cross_entropy,
                     precision="fp32", channels_last=False, compile=False, progress=False,
                     callbacks=[Record(), *callbacks])
        dl = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        out = tr.fit(dl, torch.utils.data.DataLoader(val, batch_size=256), epochs=budget)
        return losses, time.perf_counter() - t0, out["epochs"]

    # one thread: a 32-64-2 MLP gains nothing from two, and on busy cores each op's thread barrier waits
    # for a time slice (the quick run measured 97 s with two threads, 11 s with one, on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full, t_full, _ = run([])
        es = EarlyStopping("val_loss", patience=10)
        stopped, t_es, epochs = run([es])
    finally:
        torch.set_num_threads(threads)
    best_epoch = min(range(len(full)), key=full.__getitem__) + 1
    return {"budget_epochs": budget, "stopped_at_epoch": epochs, "epochs_saved": budget - epochs,
            "time_saved_pct": 100 * (1 - t_es / t_full), "best_val_loss_full_run": min(full),
            "best_epoch_full_run": best_epoch, "best_val_loss_early_stopped": min(stopped),
            "final_val_loss_full_run": full[-1], "patience": 10, "reason": es.reason}


def flops_per_sample(model: Any, crop: int = CROP, device: Any = "cpu") -> tuple[float, dict[str, float]]:
    """Training FLOPs per sample (forward + backward, counted by torch.utils.flop_counter on a batch of 2,
    which costs a fraction of a real step) and the FLOPs per aten op."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(model).to(device).train()
    x = torch.randn(2, 3, crop, crop, device=device)
    y = torch.zeros(2, dtype=torch.long, device=device)
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(m(x), y).backward()
    per_op = {str(k): v / 2 for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return counter.get_total_flops() / 2, per_op


_CATEGORIES = (  # (category, substrings of the aten op names whose self time it gathers), first match wins
    ("convolution backward", ("convolution_backward",)),
    ("convolution forward", ("convolution",)),
    ("batch norm", ("batch_norm",)),
    ("ReLU", ("relu", "threshold_backward", "clamp")),
    ("pooling", ("pool",)),
    ("linear", ("addmm", "aten::mm", "aten::t")),
    ("residual add", ("aten::add",)),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
)


def step_profile(model: Any, opt: Any, x: Any, y: Any, per_op_flops: dict[str, float],
                 ceiling_gflops: float | None) -> dict[str, Any]:
    """Where one training step's time goes: self time per op category of forward + backward (torch.profiler),
    the optimizer step timed apart, and the GFLOP/s of the convolutions against the fp32 ceiling."""
    import time as _time

    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    model.train()

    def fwd_bwd() -> None:
        F.cross_entropy(model(x), y).backward()

    fwd_bwd()  # warm-up: oneDNN primitives created
    opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd()
    t0 = _time.perf_counter()
    opt.step()
    opt_s = _time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    cats: dict[str, float] = {}
    for ev in prof.key_averages():
        name = ev.key
        cat = next((c for c, keys in _CATEGORIES if any(k in name for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + ev.self_cpu_time_total / 1e6
    cats["optimizer step"] = opt_s
    total = sum(cats.values())
    batch = len(x)
    flops = {"convolution forward": per_op_flops.get("aten.convolution", 0.0) * batch,
             "convolution backward": per_op_flops.get("aten.convolution_backward", 0.0) * batch}
    out: dict[str, Any] = {"step_s": total, "categories": {}}
    for cat, sec in sorted(cats.items(), key=lambda kv: -kv[1]):
        row: dict[str, Any] = {"seconds": sec, "share_pct": 100 * sec / total if total else None}
        if flops.get(cat) and sec > 0:
            row["gflops"] = flops[cat] / sec / 1e9
            if ceiling_gflops:
                row["pct_of_fp32_ceiling"] = 100 * row["gflops"] / ceiling_gflops
        out["categories"][cat] = row
    return out


def conv_bound(model: Any, x: Any, ceiling_gflops: float | None, repeats: int = 3) -> dict[str, Any]:
    """Every convolution of one step timed alone at the step's shapes (its own input, forward + backward),
    summed: the rate a step would reach if every other op cost nothing, i.e. the most oneDNN's
    convolutions allow at these shapes, whatever the rest of the step does."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torchspeed.measure import time_callable

    seen: list[tuple[Any, Any]] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0].detach())))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    seconds = flops = 0.0
    for k, (conv, inp) in enumerate(seen):
        inp = inp.clone().requires_grad_(k > 0)  # the first convolution's input (the batch) needs no gradient
        weight = conv.weight.detach().requires_grad_()
        wrt = [t for t in (inp, weight) if t.requires_grad]
        with torch.no_grad():
            grad = torch.randn_like(conv(inp))

        # the module's own forward (its padding mode) on detached weights, not through the module: the
        # model's gradients stay untouched and no module hooks run inside autograd.grad
        def fwd_bwd(conv: Any = conv, inp: Any = inp, weight: Any = weight, wrt: list = wrt, grad: Any = grad) -> None:
            torch.autograd.grad(conv._conv_forward(inp, weight, conv.bias), wrt, grad)

        counter = FlopCounterMode(display=False)
        with counter:
            fwd_bwd()
        flops += counter.get_total_flops()
        seconds += time_callable(fwd_bwd, name=f"conv{k}", warmup=0, repeats=repeats).median_s  # warm: counted once
    gflops = flops / seconds / 1e9 if seconds else 0.0
    return {"convolutions": len(seen), "seconds": seconds, "gflops": gflops,
            "pct_of_fp32_ceiling": 100 * gflops / ceiling_gflops if ceiling_gflops else None}


def run(quick: bool, progress: bool | Callable[[str], Any] = False, budget_s: float | None = None) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader
    from torchvision.models import resnet18

    from torchspeed.args import progress_fn
    from torchspeed.bench import ceilings as ceil
    from torchspeed.bench.budget import Budget, time_in_window
    from torchspeed.measure import compare
    from torchspeed.data import fast_loader, tune_loader
    from torchspeed.data.demo import demo_folder
    from torchspeed.runtime import default_precision, describe, usable_cores
    from torchspeed.train import Trainer

    import time

    budget = Budget.of("train", quick, budget_s)
    k = 1 if quick else 2  # steps per timed call; how many calls fit is measured (time_in_window)
    repeats = 5  # for the interleaved comparisons of the full report
    phases: dict[str, float] = {}
    clock = {"name": "start", "t": time.perf_counter()}
    report_progress = progress_fn(progress)

    def step(text: str) -> None:  # also records how long each phase took (results["phase_s"])
        now = time.perf_counter()
        phases[clock["name"]] = round(phases.get(clock["name"], 0.0) + now - clock["t"], 1)
        clock.update(name=text, t=now)
        report_progress(text)

    device = torch.device("cpu")  # the suite measures the CPU path here; CUDA runs use the same code
    if torch.cuda.is_available():
        device = torch.device("cuda")
    machine_prec = default_precision(device)
    mixed = machine_prec.name
    if mixed == "fp32":
        mixed = "bf16" if device.type == "cpu" else "fp16"
    ceilings = ceil.load_cached(describe())
    items = (ceilings or {}).get("items", {})
    fp32_ceiling = (items.get("fp32") or {}).get("value")
    # An emulated precision (its GEMM slower than fp32's here) is not run: its step would be many times slower.
    mixed_ceiling = (items.get(ceil.PRECISION_CEILING.get(mixed, mixed)) or {}).get("value")
    emulated = device.type == "cpu" and machine_prec.name == "fp32"
    if emulated:
        emulated_why = machine_prec.reason
        if mixed_ceiling and fp32_ceiling:
            emulated_why = (f"{mixed} GEMM measures {mixed_ceiling:.2g} GFLOP/s here vs {fp32_ceiling:.0f} for fp32 "
                            f"({mixed_ceiling / fp32_ceiling:.2g}x: emulated), so a {mixed} step would take about "
                            f"{fp32_ceiling / mixed_ceiling:.0f}x longer")
    step("demo photos (generated once)")
    folder = demo_folder(4000)
    indices = _subset(4000, quick)
    step(f"packing {len(indices)} photos for the fast pipeline (cached)")
    store = _cached_store(folder, indices)
    torch.manual_seed(0)
    base_model = resnet18(num_classes=CLASSES)
    step("counting FLOPs per sample (torch.utils.flop_counter)")
    flops, per_op = flops_per_sample(base_model, CROP, device)
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"images": len(indices), "batch_size": BATCH, "crop": CROP, "steps_per_call": k,
                               "device": str(device), "flops_per_sample": flops, "budget_s": budget.seconds}
    # the measurements still to come, for sharing the budget (each about one window)
    todo = {"rows": 3 + (0 if quick else 3) + (0 if emulated else 1), "setup": 2.0, "profile": 1.0}

    def windows_left() -> float:
        return sum(todo.values())

    def fresh(channels_last: bool = False) -> tuple[Any, Any]:
        m = copy.deepcopy(base_model).to(device)
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def to_dev(stream: _Stream) -> Callable[[], Any]:
        def get() -> Any:
            x, y = stream.next()
            return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return get

    def row(name: str, median: float | None, what: str, precision: str = "fp32", **kw: Any) -> dict[str, Any]:
        r = {"technique": name, "median": median, "min": None, "max": None, "unit": "samples/s", "ratio": None,
             "cumulative": None, "metric_drop": None, "what": what, "headline": name == "torchspeed auto",
             "ceiling": ceil.PRECISION_CEILING.get(precision, "fp32"), "flops_per_item": flops, **kw}
        rows.append(r)
        return r

    def measure(name: str, chunk: Callable[[], None], what: str, precision: str = "fp32") -> float:
        window = budget.share(windows_left())
        step(f"timing {name} ({window:.0f} s window)")
        t = time_in_window(chunk, window, name=name, items=k * BATCH, unit="samples", device=device)
        todo["rows"] -= 1
        rates = t.rates
        row(name, t.throughput, what, precision, min=min(rates), max=max(rates), calls=len(rates),
            first_call_s=round(t.extra["first_s"], 2))
        return float(t.throughput)

    def not_run(name: str, why: str, precision: str = "fp32") -> None:
        row(name, None, f"not run: {why}", precision)

    def plain_loader(num_workers: int, **kw: Any) -> Any:
        return DataLoader(_torchvision_dataset(folder, indices), BATCH, shuffle=True, drop_last=True,
                          num_workers=num_workers, persistent_workers=num_workers > 0, **kw)

    # 1. plain PyTorch
    m, o = fresh()
    plain = measure("plain PyTorch", _hand_loop(m, o, to_dev(_Stream(plain_loader(0))), k, "fp32", False),
                    "fp32, NCHW, torchvision ImageFolder + PIL transforms, num_workers=0, hand-written loop")
    # 2. + tuned loader (num_workers etc. measured by tune_loader); the quick report leaves it out
    if quick:
        not_run("+ tuned loader", "--quick (the full report measures it)")
    else:
        step("tuning the torchvision DataLoader (num_workers, prefetch; measured)")
        s = tune_loader(_torchvision_dataset(folder, indices), BATCH, num_workers=list(range(usable_cores() + 1)),
                        seconds=1.0, device=device, prefetch_factors=(2,), persistent=(True,))
        m, o = fresh()
        measure("+ tuned loader", _hand_loop(m, o, to_dev(_Stream(plain_loader(s.num_workers, pin_memory=s.pin_memory))),
                                             k, "fp32", False),
                f"the same with num_workers={s.num_workers} (measured best), persistent workers")
    # 3. + fast data pipeline
    step("fast_loader: choosing decoder and num_workers (measured)")
    fast_nchw = fast_loader(store, BATCH, crop=CROP, device=device, channels_last=False, num_workers="auto",
                            tune_seconds=0.3 if quick else 0.8)
    workers = fast_nchw.settings.num_workers if fast_nchw.settings else 0
    m, o = fresh()
    fast_stream = _Stream(fast_nchw)
    measure("+ fast data pipeline", _hand_loop(m, o, fast_stream.next, k, "fp32", False),
            f"fast_loader on a store packed at short side {SHORT_SIDE} ({fast_nchw.decoder}, {workers} workers, "
            "normalised batches on the device)")
    # 4. + mixed precision, unless this machine only emulates it
    hand_prec = "fp32"
    if emulated:
        not_run(f"+ {mixed} autocast", emulated_why, mixed)
        results["mixed_precision"] = {"tried": False, "reason": emulated_why}
    else:
        m, o = fresh()
        measure(f"+ {mixed} autocast", _hand_loop(m, o, fast_stream.next, k, mixed, False),
                f"torch.autocast({mixed}), fp32 weights", mixed)
        hand_prec = mixed
    fast = fast_loader(store, BATCH, crop=CROP, device=device, channels_last=True, num_workers=workers)
    # 6. + channels_last (the full report; accelerate() measures it for the auto row in both)
    cl = best = plain
    best_compile = False
    if quick:
        not_run("+ channels_last", "--quick (torchspeed auto below measures NCHW against NHWC)", hand_prec)
        not_run("+ torch.compile", "--quick (compiling ResNet-18 training takes about a minute on 2 cores)", hand_prec)
        results["compile"] = {"tried": False, "reason": "not tried: quick mode budget"}
    else:
        m, o = fresh(channels_last=True)
        cl = best = measure("+ channels_last", _hand_loop(m, o, _Stream(fast).next, k, hand_prec, True),
                            "model and batches in channels_last (NHWC) memory format", hand_prec)
        # 7. + compile, kept only if it wins (its compile time is reported as the one-off cost)
        m, o = fresh(channels_last=True)
        cm = torch.compile(m)
        chunk = _hand_loop(cm, o, _Stream(fast).next, k, hand_prec, True)
        step("compiling ResNet-18 (torch.compile; measured)")
        t0 = time.perf_counter()
        chunk()
        compile_s = time.perf_counter() - t0
        c = measure("+ torch.compile", chunk, "torch.compile(model) (default mode)", hand_prec)
        compile_s = max(0.0, compile_s - k * BATCH / c)
        kept = c > cl * 1.05 and (1 / cl - 1 / c) * BATCH * EXPECTED_STEPS > compile_s
        rows[-1]["what"] += f"; compile {compile_s:.0f} s; {'kept' if kept else 'not kept'} for the rows below"
        results["compile"] = {"tried": True, "compile_s": compile_s, "samples_s": c, "kept": kept}
        if kept:
            best, best_compile = c, True
        torch._dynamo.reset()
    # 8. torchspeed auto: the Trainer with every setting on "auto" (measured on this model and data)
    m, o = fresh()
    akw: dict[str, Any] = {"expected_steps": EXPECTED_STEPS}
    if quick:
        akw["untried"] = {"compile": "quick mode budget"}
        # two timed steps per option, interleaved (one alone let a 4% noise decide NCHW over NHWC under load,
        # where 4 interleaved pairs all had NHWC faster)
        akw["trial_steps"] = 2
    trainer = Trainer(m, o, torch.nn.functional.cross_entropy, progress=False, accelerate_kwargs=akw)

    chunks = _Chunk(_Stream(fast), k)

    def trainer_chunk() -> None:
        trainer.fit(chunks, epochs=10**9, max_steps=trainer.global_step + k)

    step("torchspeed auto: accelerate() measuring candidates")
    t0 = time.perf_counter()
    trainer.prepare(fast, EXPECTED_STEPS)
    results["accelerate_setup_s"] = time.perf_counter() - t0
    todo["setup"] = 0
    rep = trainer.report
    auto_prec = rep.precision
    auto = measure("torchspeed auto", trainer_chunk,
                   f"Trainer, everything on auto: chose {rep.precision}, channels_last={rep.channels_last}, "
                   f"compile={rep.compile}, {rep.optimizer} optimizer (setup {results['accelerate_setup_s']:.0f} s)",
                   auto_prec)
    results["accelerate"] = rep.to_dict()
    batches = [chunks.stream.next() for _ in range(2 if quick else 8)]
    # where the chosen setting's step time goes (per-op profile of one fp32 step), if the budget allows
    step_s = max(r.get("first_call_s") or 0.0 for r in rows) / k  # about one step (the slowest first call)
    if not quick or budget.allows(2 * step_s):
        layout = "NHWC" if rep.channels_last else "NCHW"
        step(f"profiling one training step (per-op self time, fp32 {layout})")
        m, o = fresh(channels_last=rep.channels_last)
        x0 = batches[0][0].contiguous(memory_format=torch.channels_last if rep.channels_last else torch.contiguous_format)
        results["step_profile"] = dict(step_profile(m, o, x0, batches[0][1], per_op, fp32_ceiling), layout=layout)
        if not quick or budget.allows(6 * step_s):
            step("timing each convolution of the step alone (the bound oneDNN sets at these shapes)")
            results["step_profile"]["conv_bound"] = conv_bound(m, x0, fp32_ceiling, repeats=1 if quick else 3)
    todo["profile"] = 0
    del fast, trainer_chunk
    chunks = None  # the stream over the fast loader goes with it (its threads and buffers)
    overhead = None
    notes: list[str] = []
    if not quick:
        # Trainer overhead: same settings, same in-memory batches, interleaved with a hand-written loop
        step("Trainer overhead vs a hand-written loop (interleaved)")
        mh, _ = fresh(channels_last=True)
        oh = torch.optim.SGD(mh.parameters(), lr=0.05, momentum=0.9, fused=True)
        it_h = iter(())

        def from_list() -> Any:
            nonlocal it_h
            try:
                return next(it_h)
            except StopIteration:
                it_h = iter(batches)
                return next(it_h)

        hand = _hand_loop(mh, oh, from_list, len(batches), auto_prec, True)
        mt, ot = fresh(channels_last=True)
        tr2 = Trainer(mt, ot, torch.nn.functional.cross_entropy, precision=auto_prec, channels_last=True,
                      compile=False, strategy=None, progress=False)

        def trainer_list() -> None:
            tr2.fit(batches, epochs=10**9, max_steps=tr2.global_step + len(batches))

        cmp = compare({"hand-written loop": hand, "Trainer": trainer_list}, warmup=1, repeats=repeats, cooldown_s=0.1,
                      device=device, items=len(batches) * BATCH)
        overhead = 100 * (cmp["Trainer"].median_s / cmp["hand-written loop"].median_s - 1)
        results["trainer_overhead"] = {"hand_s": cmp["hand-written loop"].median_s, "trainer_s": cmp["Trainer"].median_s,
                                       "steps": len(batches), "precision": auto_prec}
        notes.append(f"Trainer overhead {overhead:+.1f}% vs a hand-written loop (same settings and batches, interleaved)")
        # Evaluation: inference_mode vs autograd left on (article 001's torch.no_grad claim)
        step("evaluation: inference_mode vs autograd on (time, peak memory)")
        me, _ = fresh()
        me.eval()
        xs = [b[0].contiguous() for b in batches[:2]]

        def ev(ctx: Callable[[], Any]) -> Callable[[], None]:
            def f() -> None:
                with ctx():
                    for x in xs:
                        me(x).sum().item()
            return f

        ec = compare({"autograd on": ev(torch.enable_grad), "no_grad": ev(torch.no_grad),
                      "inference_mode": ev(torch.inference_mode)}, warmup=1, repeats=repeats, cooldown_s=0.1,
                     device=device, items=len(xs) * BATCH, measure_memory=True)
        held = {n: _autograd_held_bytes(me, xs[0], ctx) for n, ctx in
                (("autograd on", torch.enable_grad), ("no_grad", torch.no_grad),
                 ("inference_mode", torch.inference_mode))}
        results["eval"] = {n: {"median_s": ec[n].median_s, "peak_rss_bytes": ec[n].peak_mem_bytes,
                               "autograd_held_bytes": held[n], "speedup": ec.speedup(n)}
                           for n in ("autograd on", "no_grad", "inference_mode")}
        for n in ("autograd on", "inference_mode"):
            t = ec[n]
            rows.append({"technique": f"eval: {n}", "median": t.median_s * 1e3, "min": t.min_s * 1e3,
                         "max": t.max_s * 1e3, "unit": "ms", "ratio": ec.speedup(n), "cumulative": None,
                         "metric_drop": None, "what": f"fp32 forward of {len(xs)} x {BATCH} images; activations held "
                                                      f"for backward: {held[n] / 2**20:.0f} MiB per batch"})
        notes.append(f"eval: inference_mode {ec.speedup('inference_mode'):.2f}x the speed of autograd-on; activations "
                     f"held for backward {held['inference_mode'] / 2**20:.0f} vs {held['autograd on'] / 2**20:.0f} "
                     "MiB per batch")
    step("early stopping on a plateauing task")
    results["early_stopping"] = _early_stopping(quick)
    for r in rows:
        if r["unit"] == "samples/s" and r["median"] is not None:
            r["ratio"] = r["cumulative"] = r["median"] / plain
    results.update(rows=rows, plain_samples_s=plain, torchspeed_samples_s=auto, ratio=auto / plain,
                   best_hand_samples_s=best, best_hand_uses_compile=best_compile, trainer_overhead_pct=overhead)
    step("done")
    results["phase_s"] = phases
    results["seconds_used"] = round(budget.elapsed(), 1)
    es = results["early_stopping"]
    notes.insert(0, f"ratio {auto / plain:.2f}x (torchspeed auto vs plain); each row timed in a window of the suite's "
                    f"{budget.seconds:.0f} s budget (calls of {k} step(s) of {BATCH}, as many as fit, at least 2)")
    notes.append(f"early stopping: stopped at epoch {es['stopped_at_epoch']} of {es['budget_epochs']} "
                 f"({es['epochs_saved']} epochs, {es['time_saved_pct']:.0f}% of the time saved); best val_loss "
                 f"{es['best_val_loss_early_stopped']:.4f} vs {es['best_val_loss_full_run']:.4f} with the full budget")
    notes.append(f"FLOPs per training sample (forward + backward, torch.utils.flop_counter): {flops / 1e9:.2f} G")
    results["limits"] = [_train_limit(auto, flops, fp32_ceiling, results.get("step_profile"), rep, auto_prec)]
    results["notes"] = notes
    return results


def _train_limit(auto: float, flops: float, fp32_ceiling: float | None, profile: dict[str, Any] | None,
                 rep: Any, precision: str) -> dict[str, Any]:
    """The train goal (a step at >= 75% of the fp32 GEMM ceiling) and, from the step's profile, why not."""
    achieved = auto * flops / 1e9
    lim: dict[str, Any] = {"goal": "ResNet-18 training step >= 75% of the fp32 GEMM ceiling",
                           "measured": f"{achieved:.1f} GFLOP/s" + (f" = {100 * achieved / fp32_ceiling:.0f}% of "
                                                                    f"{fp32_ceiling:.0f}" if fp32_ceiling else ""),
                           "met": (achieved >= 0.75 * fp32_ceiling) if fp32_ceiling else None}
    if not profile:
        lim["why"] = "no step profile in this run (budget)"
        return lim
    cats = profile["categories"]
    conv = [f"{c} {v['gflops']:.0f} GFLOP/s" + (f" ({v['pct_of_fp32_ceiling']:.0f}% of the ceiling)"
                                                  if "pct_of_fp32_ceiling" in v else "")
            for c, v in cats.items() if "gflops" in v]
    rest = sum(v["seconds"] for c, v in cats.items() if not c.startswith("convolution"))
    top = ", ".join(f"{c} {v['share_pct']:.0f}%" for c, v in list(cats.items())[:5])
    lim["why"] = (f"one fp32 {profile.get('layout', '')} step profiled: {top} of the step; the convolutions run at "
                  + "; ".join(conv) + "; the ops without GEMM work (batch norm, ReLU, pooling, adds, optimizer, other) "
                  f"take {100 * rest / profile['step_s']:.0f}% of the time at ~0 FLOPs; accelerate() chose "
                  f"{precision}, channels_last={rep.channels_last}")
    conv_cats = [v for c, v in cats.items() if c.startswith("convolution") and "gflops" in v]
    if fp32_ceiling and conv_cats:
        # the convolutions' own rate bounds the step: with every other op free, the step runs at their rate
        in_step = sum(v["gflops"] * v["seconds"] for v in conv_cats) / sum(v["seconds"] for v in conv_cats)
        bound = profile.get("conv_bound") or {}
        alone = bound.get("gflops") or 0.0
        lim["bound_pct"] = 100 * max(in_step, alone) / fp32_ceiling
        lim["why"] += (f". The convolutions together run at {100 * in_step / fp32_ceiling:.0f}% of the ceiling in the step"
                       + (f" ({100 * alone / fp32_ceiling:.0f}% with each of the {bound['convolutions']} timed alone at "
                          "its shapes, forward + backward)" if alone else "")
                       + f", so even if every other op cost nothing a step would reach about {lim['bound_pct']:.0f}%")
    return lim
