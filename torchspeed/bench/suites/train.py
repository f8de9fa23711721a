"""Train suite: training samples/s of ResNet-18 (10 classes, 128x128, batch 64) on the demo photos.

One concept, one file: the rows build on each other (same model, photos, loaders and budget), each
adding one technique to the row above, from plain PyTorch (fp32, NCHW, torchvision ImageFolder with
num_workers=0, a hand-written loop) to the Trainer on "auto"; ratios are to that first row. Each figure
is the median over calls of K steps (the first call excluded), as many as fit the row's share of the
budget (`torchspeed.bench.budget`). Rows carry their FLOPs per sample for the GEMM ceiling, and one step
is profiled per op to show where the time goes; a precision this CPU only emulates is not run. The fast
pipeline's loader setting is chosen with the step in the loop (its threads share the cores with the step,
so the setting fastest alone can make the step slower). A row slower than the row above is timed again,
interleaved with it, and says what that found (`Row.vs_above`). Also measured: the Trainer's overhead
against a hand-written loop and the epochs early stopping saves; the full report adds the tuned
torchvision loader, channels_last, torch.compile and evaluation under inference_mode.
"""
from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

from torchspeed.bench.budget import Budget
from torchspeed.bench.rows import Row, to_json
from torchspeed.bench.suite_kit import Phases, Windows
from torchspeed.runtime import FLOAT_PRECISIONS

TITLE = "Training: ResNet-18 samples/s (10 classes, 128x128, batch 64; rows cumulative)"

BATCH, CROP, SHORT_SIDE, CLASSES = 64, 128, 160, 10
EXPECTED_STEPS = 1250  # a realistic run (20 epochs of the 4000 demo photos): what compile must repay
SLOWER = 0.03  # a row this much slower than the row above is timed again, interleaved with it


def _subset(n_images: int, quick: bool) -> list[int]:
    return list(range(0, n_images, 4)) if quick else list(range(n_images))


def _torchvision_dataset(folder: str, indices: list[int]) -> Any:
    import torch

    from torchspeed.bench.suites.data import torchvision_folder

    ds = torchvision_folder(folder)
    return torch.utils.data.Subset(ds, indices) if len(indices) < len(ds) else ds


def _cached_store(folder: str, indices: list[int]) -> str:
    """The demo photos packed with short side 160 (the fast pipeline's input), built once into the cache."""
    import torch
    from torchvision import datasets

    from torchspeed.data import pack
    from torchspeed.runtime import cache_dir

    final = os.path.join(cache_dir("bench-train"), f"{os.path.basename(folder)}-n{len(indices)}-short{SHORT_SIDE}")
    if not os.path.isdir(final):  # pack writes atomically: a store there is whole
        ds = datasets.ImageFolder(folder)
        src = folder if len(indices) == len(ds) else torch.utils.data.Subset(ds, indices)
        pack(src, final, short_side=SHORT_SIDE, format="jpeg", quality=90, progress=False,
             **({} if isinstance(src, str) else {"classes": ds.classes}))
    return final


class _Stream:
    """Endless batches from a re-iterable loader (a new pass starts when one ends)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader, self.it = loader, iter(())

    def close(self) -> None:
        """End the pass under way (its threads stop); the next batch starts a new one."""
        close = getattr(self.it, "close", None)
        if close is not None:
            close()
        self.it = iter(())

    def next(self) -> Any:
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


def _hand_step(model: Any, opt: Any, precision: str, channels_last: bool, device: Any = None) -> Callable[[Any], None]:
    """One step of a hand-written training loop on a batch (moved to `device` first when given)."""
    import torch
    import torch.nn.functional as F

    from torchspeed.runtime import precision_dtype

    model.train()

    def step(batch: Any) -> None:
        x, y = batch
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
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
    return step


def _hand_loop(step: Callable[[Any], None], source: Callable[[], Any], k: int) -> Callable[[], None]:
    """A hand-written training loop: k steps per call (what a user writes without torchspeed)."""
    def chunk() -> None:
        for _ in range(k):
            step(source())
    return chunk


class _OnDevice(list):
    """Batches already on the device, for the Trainer (one step per batch)."""

    yields_device_batches = True


class _Feed:
    """What a row timed: its batches (a stream over its loader) and its step; kept so a row found slower
    than the row above can be timed again, interleaved with it."""

    def __init__(self, stream: _Stream, step: Callable[[Any], None]):
        self.stream, self.step = stream, step


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
    suite = _TrainSuite(quick, progress, budget_s)
    suite.prepare()
    suite.loader_rows()
    suite.pipeline_rows()
    suite.layout_rows()
    suite.auto_row()
    suite.profile_step()
    suite.close_fast_stream()
    suite.trainer_overhead()
    if not quick:
        suite.eval_rows()
    suite.say("early stopping on a plateauing task")
    suite.results["early_stopping"] = _early_stopping(quick)
    return suite.finish()


def precision_ceilings(device_type: str, items: dict[str, Any]) -> tuple[dict[str, str], dict[str, float | None]]:
    """Per precision, the ceiling a step on `device_type` is judged against (a GPU's own there, never the
    CPU's) and its GFLOP/s from the cached `items` (None: not measured)."""
    from torchspeed.bench.ceilings import gpu_ceiling

    names = {p: gpu_ceiling(p) if device_type == "cuda" else p for p in FLOAT_PRECISIONS}
    return names, {p: (items.get(name) or {}).get("value") for p, name in names.items()}


def _mixed_precision(device: Any, items: dict[str, Any], fp32_ceiling: float | None) -> tuple[str, bool, str]:
    """(the mixed precision to try, whether this machine only emulates it, why it is not run if so)."""
    from torchspeed.bench.ceilings import PRECISION_CEILING
    from torchspeed.runtime import default_precision

    machine_prec = default_precision(device)
    mixed = machine_prec.name
    if mixed == "fp32":
        mixed = "bf16" if device.type == "cpu" else "fp16"
    mixed_ceiling = (items.get(PRECISION_CEILING.get(mixed, mixed)) or {}).get("value")
    # An emulated precision (its GEMM slower than fp32's here) is not run: its step would be many times slower.
    emulated = device.type == "cpu" and machine_prec.name == "fp32"
    why = machine_prec.reason
    if emulated and mixed_ceiling and fp32_ceiling:
        why = (f"{mixed} GEMM measures {mixed_ceiling:.2g} GFLOP/s here vs {fp32_ceiling:.0f} for fp32 "
               f"({mixed_ceiling / fp32_ceiling:.2g}x: emulated), so a {mixed} step would take about "
               f"{fp32_ceiling / mixed_ceiling:.0f}x longer")
    return mixed, emulated, why


def speedups(rows: list[Row], plain: float) -> None:
    """Each samples/s row's speed-up over plain PyTorch (`ratio`, `cumulative`): its figure over plain's,
    except for a row re-measured interleaved with the row above, which takes the row above's speed-up
    times the ratio the two had timed under the same load (not a figure over one timed apart)."""
    above = None
    for r in rows:
        if r.unit == "samples/s" and r.median is not None:
            r.ratio = r.cumulative = r.median / plain
            if r.remeasured and above is not None:
                r.ratio = r.cumulative = above.cumulative * r.remeasured["ratio_to_above"]
            above = r


class _TrainSuite:
    """One run of the suite: its stages share the model, the data, the budget, the rows and the JSON.

    Rows 1-6 are hand-written loops, each adding one technique; row 7 is the Trainer on "auto". The
    loaders of the fast pipeline stay open from the row that starts them to the stage that closes them.
    """

    def __init__(self, quick: bool, progress: bool | Callable[[str], Any], budget_s: float | None):
        import torch

        from torchspeed.bench import ceilings as ceil
        from torchspeed.runtime import describe

        self.quick = quick
        self.budget = Budget.of("train", quick, budget_s)
        self.k = 1 if quick else 2  # steps per timed call; how many calls fit is measured (time_in_window)
        self.repeats = 5  # for the interleaved comparisons of the full report
        self.say = Phases(progress)
        # the suite measures the CPU path here; CUDA runs use the same code
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        items = (ceil.load_cached(describe()) or {}).get("items", {})
        self.ceiling_names, self.ceilings = precision_ceilings(self.device.type, items)
        self.no_profile = "no step profile in this run (budget)"  # why the train goal has no "why"
        self.fp32_ceiling = self.ceilings["fp32"]
        self.mixed, self.emulated, self.emulated_why = _mixed_precision(self.device, items, self.fp32_ceiling)
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.results: dict[str, Any] = {}
        self.overhead: float | None = None
        self.fast: Any = None
        self.chunks: Any = None
        self.fed: list[tuple[Row, _Feed]] = []  # the rows measured, in order, with what each timed
        self.threads = 1

    # ---------------------------------------------------------------- shared pieces

    def fresh(self, channels_last: bool = False) -> tuple[Any, Any]:
        """A copy of the untrained model on the device, with its SGD optimizer."""
        import torch

        m = copy.deepcopy(self.base_model).to(self.device)
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def plain_loader(self, num_workers: int, **kw: Any) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(_torchvision_dataset(self.folder, self.indices), BATCH, shuffle=True, drop_last=True,
                          num_workers=num_workers, persistent_workers=num_workers > 0, **kw)

    def _columns(self, name: str, precision: str) -> dict[str, Any]:
        from torchspeed.bench.ceilings import PRECISION_CEILING

        return {"headline": name == "torchspeed auto", "ceiling": PRECISION_CEILING.get(precision, "fp32"),
                "flops_per_item": self.flops}

    def measure(self, name: str, feed: _Feed, what: str, precision: str = "fp32",
                chunk: Callable[[], None] | None = None) -> float:
        """k steps of `feed` (or `chunk`, when the row runs its steps its own way) timed in its window of the
        budget, as a samples/s row; a row slower than the row above is timed again interleaved with it
        (`recheck`). Returns the row's samples/s."""
        chunk = chunk or _hand_loop(feed.step, feed.stream.next, self.k)
        row = self.windows.rate_row(name, chunk, what, items=self.k * BATCH, unit="samples", device=self.device,
                                    **self._columns(name, precision))
        above = self.fed[-1] if self.fed else None
        self.rows.append(row)
        self.fed.append((row, feed))
        if above is not None and row.median < above[0].median * (1 - SLOWER):
            self.recheck(row, feed, *above)
        return float(row.median)

    def recheck(self, row: Row, feed: _Feed, above: Row, above_feed: _Feed) -> None:
        """A row slower than the row above, timed again interleaved with it (fresh passes of each loader,
        `train.loader_choice.time_fed_steps`), and each step timed on a batch in memory too; the row takes the
        interleaved figure, and `vs_above` says what the re-measure found: not slower after all, or
        slower because the machine was busy, because the step itself is slower, or because of its data."""
        import statistics

        from torchspeed.measure import busy_warning, wait_for_quiet_machine
        from torchspeed.train.loader_choice import time_fed_steps

        self.say(f"{row.technique}: slower than {above.technique}; timing both again, interleaved")
        for f in (feed, above_feed):
            f.stream.close()  # a pass of each loader at a time: the re-measure starts fresh ones
        quiet = wait_for_quiet_machine(max_s=3.0)
        steps, rounds = 2, 2 if self.quick else 3  # single steps vary too much on a loaded machine to name a cause
        feeds = {"above": above_feed, "this": feed}
        fed, others = time_fed_steps({k: (f.stream.loader, f.step) for k, f in feeds.items()}, steps=steps,
                                     rounds=rounds, device=self.device)
        in_memory = {k: (itertools.repeat(next(iter(f.stream.loader))), f.step) for k, f in feeds.items()}
        alone, _ = time_fed_steps(in_memory, steps=steps, rounds=rounds, device=self.device)
        med = {k: statistics.median(v) for k, v in fed.items()}
        solo = {k: statistics.median(v) for k, v in alone.items()}
        first, rate = row.median, BATCH / med["this"]
        rates = [BATCH / t for t in fed["this"]]
        row.median, row.min, row.max, row.calls = rate, min(rates), max(rates), len(rates)
        row.others_cores = others
        row.remeasured = {"first_samples_s": first, "samples_s": rate, "above_samples_s": BATCH / med["above"],
                          "step_alone_s": solo["this"], "above_step_alone_s": solo["above"],
                          "ratio_to_above": med["above"] / med["this"], "others_cores": others,
                          "waited_for_quiet_s": round(quiet.waited_s, 1)}
        found = (f"first timed at {first:.1f} samples/s; re-measured interleaved with {above.technique}: "
                 f"{rate:.1f} vs {BATCH / med['above']:.1f} samples/s ({med['above'] / med['this']:.2f}x, the "
                 "ratio its speed-up columns take)")
        data = {k: max(0.0, med[k] - solo[k]) for k in med}
        if med["this"] <= med["above"] * (1 + SLOWER):
            row.vs_above = f"{found}: not slower (the first window was noise)"
        elif solo["this"] > solo["above"] * (1 + SLOWER):
            row.vs_above = (f"{found}; the step itself is slower: {solo['this']:.3g} vs {solo['above']:.3g} s on a "
                            "batch in memory")
        else:
            row.vs_above = (f"{found}; the step alone is as fast ({solo['this']:.3g} vs {solo['above']:.3g} s on a "
                            f"batch in memory), so the difference is the data: waiting for batches adds "
                            f"{data['this']:.3g} s per step vs {data['above']:.3g} s above")
        if busy_warning(others) and not row.vs_above.endswith("was noise)"):
            row.vs_above += (f"; other processes used {others:.1f} cores meanwhile, so the machine may be the cause: "
                             "re-run on a quiet machine")
        self.results.setdefault("rechecks", {})[row.technique] = dict(row.remeasured, why=row.vs_above)

    def not_run(self, name: str, why: str, precision: str = "fp32") -> None:
        self.rows.append(Row.not_run(name, why, "samples/s", **self._columns(name, precision)))

    # ---------------------------------------------------------------- stages

    def prepare(self) -> None:
        """The demo photos, their store for the fast pipeline, the model and its FLOPs per sample."""
        import torch
        from torchvision.models import resnet18

        from torchspeed.data.demo import demo_folder

        self.say("demo photos (generated once)")
        self.folder = demo_folder(4000)
        self.indices = _subset(4000, self.quick)
        self.say(f"packing {len(self.indices)} photos for the fast pipeline (cached)")
        self.store = _cached_store(self.folder, self.indices)
        torch.manual_seed(0)
        self.base_model = resnet18(num_classes=CLASSES)
        self.say("counting FLOPs per sample (torch.utils.flop_counter)")
        self.flops, self.per_op = flops_per_sample(self.base_model, CROP, self.device)
        self.results.update(images=len(self.indices), batch_size=BATCH, crop=CROP, steps_per_call=self.k,
                            device=str(self.device), flops_per_sample=self.flops, budget_s=self.budget.seconds)
        # the measurements still to come, for sharing the budget (each about one window)
        self.windows = Windows(self.budget, self.say, rows=3 + (0 if self.quick else 3) + (0 if self.emulated else 1),
                               setup=2.0, profile=1.0, loader=0.5, overhead=0.5 if self.quick else 1.0)

    def loader_rows(self) -> None:
        """1. plain PyTorch; 2. + the torchvision loader tuned by tune_loader (the full report only)."""
        from torchspeed.data import tune_loader
        from torchspeed.runtime import usable_cores

        m, o = self.fresh()
        self.plain = self.measure("plain PyTorch", _Feed(_Stream(self.plain_loader(0)), _hand_step(m, o, "fp32", False,
                                                                                                 self.device)),
                                  "fp32, NCHW, torchvision ImageFolder + PIL transforms, num_workers=0, hand-written loop")
        if self.quick:
            self.not_run("+ tuned loader", "--quick (the full report measures it)")
            return
        self.say("tuning the torchvision DataLoader (num_workers, prefetch; measured)")
        s = tune_loader(_torchvision_dataset(self.folder, self.indices), BATCH,
                        num_workers=list(range(usable_cores() + 1)), tune_seconds=1.0, device=self.device,
                        prefetch_factor=(2,), persistent_workers=(True,), refresh=True)
        m, o = self.fresh()
        tuned = _Stream(self.plain_loader(s.num_workers, pin_memory=s.pin_memory))
        self.measure("+ tuned loader", _Feed(tuned, _hand_step(m, o, "fp32", False, self.device)),
                     f"the same with num_workers={s.num_workers} (measured best), persistent workers")

    def pipeline_rows(self) -> None:
        """3. + the fast data pipeline; 4. + mixed precision, unless this machine only emulates it."""
        from torchspeed.data import fast_loader

        from torchspeed.train.loader_choice import choose_loader_with_step, step_candidates

        self.say("fast_loader: choosing decoder and num_workers (measured)")
        alone = fast_loader(self.store, BATCH, crop=CROP, device=self.device, channels_last=False,
                            num_workers="auto", tune_seconds=0.3 if self.quick else 0.8, refresh=True)
        alone_setting = (alone.num_workers, alone.threads)
        m, o = self.fresh()
        step = _hand_step(m, o, "fp32", False)

        def make(num_workers: int, threads: int) -> Any:
            return fast_loader(self.store, BATCH, crop=CROP, device=self.device, channels_last=False,
                               num_workers=num_workers, threads=threads)

        # the loader's threads share the cores with the step: its setting is chosen with the step in the loop
        self.fast_nchw, choice = choose_loader_with_step(make, step, step_candidates(*alone_setting),
                                                         steps=1 if self.quick else 2, rounds=2 if self.quick else 3,
                                                         device=self.device, built={alone_setting: alone},
                                                         progress=self.say)
        self.results["loader_choice"] = dict(choice.to_dict(), alone=list(alone_setting))
        self.workers, self.threads = choice.num_workers, choice.threads
        self.windows.finish("loader")
        m, o = self.fresh()
        self.fast_stream = _Stream(self.fast_nchw)
        if len(choice.table) < 2:
            chosen = f"{choice.setting}, measured fastest alone (no less parallel setting to try)"
        elif (choice.num_workers, choice.threads) == alone_setting:
            chosen = (f"{choice.setting}, fastest alone and with the training step in the loop ({len(choice.table)} "
                      "settings timed)")
        else:
            alone_text = ", ".join(f"{k}={v}" for k, v in zip(("num_workers", "threads"), alone_setting)
                                   if k == "num_workers" or alone_setting[0] == 0)
            chosen = (f"{choice.setting} chosen with the training step in the loop ({len(choice.table)} settings "
                      f"timed; alone the loader was fastest at {alone_text})")
        self.measure("+ fast data pipeline", _Feed(self.fast_stream, _hand_step(m, o, "fp32", False)),
                     f"fast_loader on a store packed at short side {SHORT_SIDE} ({self.fast_nchw.decoder}, {chosen}; "
                     "normalised batches on the device)")
        self.hand_prec = "fp32"
        mixed = self.mixed
        if self.emulated:
            self.not_run(f"+ {mixed} autocast", self.emulated_why, mixed)
            self.results["mixed_precision"] = {"tried": False, "reason": self.emulated_why}
            return
        m, o = self.fresh()
        self.measure(f"+ {mixed} autocast", _Feed(self.fast_stream, _hand_step(m, o, mixed, False)),
                     f"torch.autocast({mixed}), fp32 weights", mixed)
        self.hand_prec = mixed

    def layout_rows(self) -> None:
        """5. + channels_last and 6. + torch.compile, kept only if it wins (the full report; accelerate()
        measures channels_last for the auto row in both)."""
        from torchspeed.data import fast_loader

        self.fast = fast_loader(self.store, BATCH, crop=CROP, device=self.device, channels_last=True,
                                num_workers=self.workers, threads=self.threads)
        self.cl = self.best = self.plain
        self.best_compile = False
        if self.quick:
            self.not_run("+ channels_last", "--quick (torchspeed auto below measures NCHW against NHWC)", self.hand_prec)
            self.not_run("+ torch.compile", "--quick (compiling ResNet-18 training takes about a minute on 2 cores)",
                         self.hand_prec)
            self.results["compile"] = {"tried": False, "reason": "not tried: quick mode budget"}
            return
        m, o = self.fresh(channels_last=True)
        self.cl = self.best = self.measure("+ channels_last", _Feed(_Stream(self.fast), _hand_step(m, o, self.hand_prec,
                                                                                                   True)),
                                           "model and batches in channels_last (NHWC) memory format", self.hand_prec)
        self.compile_row()

    def compile_row(self) -> None:
        """6. + torch.compile; its compile time is reported as the one-off cost."""
        import time

        import torch

        m, o = self.fresh(channels_last=True)
        feed = _Feed(_Stream(self.fast), _hand_step(torch.compile(m), o, self.hand_prec, True))
        self.say("compiling ResNet-18 (torch.compile; measured)")
        t0 = time.perf_counter()
        _hand_loop(feed.step, feed.stream.next, self.k)()
        compile_s = time.perf_counter() - t0
        c = self.measure("+ torch.compile", feed, "torch.compile(model) (default mode)", self.hand_prec)
        compile_s = max(0.0, compile_s - self.k * BATCH / c)
        kept = c > self.cl * 1.05 and (1 / self.cl - 1 / c) * BATCH * EXPECTED_STEPS > compile_s
        self.rows[-1].what += f"; compile {compile_s:.0f} s; {'kept' if kept else 'not kept'} for the rows below"
        self.results["compile"] = {"tried": True, "compile_s": compile_s, "samples_s": c, "kept": kept}
        if kept:
            self.best, self.best_compile = c, True
        torch._dynamo.reset()
        self.fed.pop()  # its compiled step is gone: the row below is set against channels_last's

    def auto_row(self) -> None:
        """7. torchspeed auto: the Trainer with every setting on "auto" (measured on this model and data)."""
        import time

        import torch

        from torchspeed.train import Trainer

        m, o = self.fresh()
        akw: dict[str, Any] = {"expected_steps": EXPECTED_STEPS, "refresh": True}  # a benchmark measures, never recalls
        if self.quick:
            akw["untried"] = {"compile": "quick mode budget"}
            # two timed steps per option, interleaved (one alone let a 4% noise decide NCHW over NHWC under load,
            # where 4 interleaved pairs all had NHWC faster)
            akw["trial_steps"] = 2
        self.trainer = trainer = Trainer(m, o, torch.nn.functional.cross_entropy, progress=False,
                                         accelerate_kwargs=akw)
        self.chunks = chunks = _Chunk(_Stream(self.fast), self.k)

        def trainer_step(batch: Any) -> None:
            trainer.fit(_OnDevice([batch]), epochs=10**9, max_steps=trainer.global_step + 1)

        def trainer_chunk() -> None:
            trainer.fit(chunks, epochs=10**9, max_steps=trainer.global_step + self.k)

        self.say("torchspeed auto: accelerate() measuring candidates")
        t0 = time.perf_counter()
        trainer.prepare(self.fast, EXPECTED_STEPS)
        self.results["accelerate_setup_s"] = time.perf_counter() - t0
        self.windows.finish("setup")
        rep = self.rep = trainer.report
        self.auto_prec = rep.precision
        self.auto = self.measure("torchspeed auto", _Feed(chunks.stream, trainer_step),
                                 f"Trainer, everything on auto: chose {rep.precision}, channels_last={rep.channels_last}, "
                                 f"compile={rep.compile}, {rep.optimizer} optimizer (setup "
                                 f"{self.results['accelerate_setup_s']:.0f} s)", self.auto_prec, chunk=trainer_chunk)
        self.results["accelerate"] = rep.to_dict()
        self.batches = [chunks.stream.next() for _ in range(2 if self.quick else 8)]

    def profile_step(self) -> None:
        """Where the chosen setting's step time goes (per-op profile of one fp32 step), if the budget allows."""
        import torch

        rep = self.rep
        step_s = max(r.first_call_s or 0.0 for r in self.rows) / self.k  # about one step (the slowest first call)
        if self.device.type != "cpu":  # the profile reads each op's CPU time: on a GPU, that of launching it
            self.no_profile = "no step profile on a GPU (it reads each op's CPU time, not the GPU's)"
        elif not self.quick or self.budget.allows(2 * step_s):
            layout = "NHWC" if rep.channels_last else "NCHW"
            self.say(f"profiling one training step (per-op self time, fp32 {layout})")
            m, o = self.fresh(channels_last=rep.channels_last)
            x0 = self.batches[0][0].contiguous(memory_format=torch.channels_last if rep.channels_last
                                               else torch.contiguous_format)
            self.results["step_profile"] = dict(step_profile(m, o, x0, self.batches[0][1], self.per_op,
                                                             self.fp32_ceiling), layout=layout)
            if not self.quick or self.budget.allows(6 * step_s):
                self.say("timing each convolution of the step alone (the bound its library sets at these shapes)")
                self.results["step_profile"]["conv_bound"] = conv_bound(m, x0, self.fp32_ceiling,
                                                                        repeats=1 if self.quick else 3)
        self.windows.finish("profile")

    def close_fast_stream(self) -> None:
        """Every row's loader pass ends (their threads and buffers go) before the in-memory measurements."""
        for _, feed in self.fed:
            feed.stream.close()
        self.fed.clear()
        self.fast = self.chunks = None

    def trainer_overhead(self) -> None:
        """The Trainer against a hand-written loop: same settings, same in-memory batches, interleaved."""
        import torch

        from torchspeed.measure import busy_warning, compare
        from torchspeed.train import Trainer

        batches, prec = self.batches, self.auto_prec
        repeats = 3 if self.quick else self.repeats
        step_s = max(r.first_call_s or 0.0 for r in self.rows) / self.k  # about one step (the slowest first call)
        if self.quick and not self.budget.allows((1 + repeats) * 2 * len(batches) * step_s):
            self.windows.finish("overhead")
            self.results["trainer_overhead"] = {"tried": False, "reason": "quick mode budget"}
            self.notes.append("Trainer overhead vs a hand-written loop: not measured (--quick, its budget spent; "
                              "the full report measures it)")
            return
        self.say("Trainer overhead vs a hand-written loop (interleaved)")
        mh, _ = self.fresh(channels_last=True)
        oh = torch.optim.SGD(mh.parameters(), lr=0.05, momentum=0.9, fused=True)
        hand = _hand_loop(_hand_step(mh, oh, prec, True), _Stream(batches).next, len(batches))
        mt, ot = self.fresh(channels_last=True)
        tr2 = Trainer(mt, ot, torch.nn.functional.cross_entropy, precision=prec, channels_last=True,
                      compile=False, strategy=None, progress=False)

        def trainer_list() -> None:
            tr2.fit(batches, epochs=10**9, max_steps=tr2.global_step + len(batches))

        cmp = compare({"hand-written loop": hand, "Trainer": trainer_list}, warmup=1, repeats=repeats,
                      cooldown_s=0.1, device=self.device, items=len(batches) * BATCH)
        self.windows.finish("overhead")
        self.overhead = 100 * (cmp["Trainer"].median_s / cmp["hand-written loop"].median_s - 1)
        self.results["trainer_overhead"] = {"hand_s": cmp["hand-written loop"].median_s,
                                            "trainer_s": cmp["Trainer"].median_s, "steps": len(batches),
                                            "repeats": repeats, "precision": prec,
                                            "others_cores": cmp.others_cores}
        busy = busy_warning(cmp.others_cores)
        self.notes.append(f"Trainer overhead {self.overhead:+.1f}% vs a hand-written loop (same settings and batches, "
                          f"interleaved: {repeats} calls of {len(batches)} steps each)" + (f"; {busy}" if busy else ""))

    def eval_rows(self) -> None:
        """Evaluation under inference_mode against autograd left on (article 001's torch.no_grad claim):
        time, peak memory and the activations autograd holds."""
        import torch

        from torchspeed.measure import compare

        self.say("evaluation: inference_mode vs autograd on (time, peak memory)")
        me, _ = self.fresh()
        me.eval()
        xs = [b[0].contiguous() for b in self.batches[:2]]

        def ev(ctx: Callable[[], Any]) -> Callable[[], None]:
            def f() -> None:
                with ctx():
                    for x in xs:
                        me(x).sum().item()
            return f

        contexts = {"autograd on": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
        ec = compare({n: ev(ctx) for n, ctx in contexts.items()}, warmup=1, repeats=self.repeats, cooldown_s=0.1,
                     device=self.device, items=len(xs) * BATCH, measure_memory=True)
        held = {n: _autograd_held_bytes(me, xs[0], ctx) for n, ctx in contexts.items()}
        self.results["eval"] = {n: {"median_s": ec[n].median_s, "peak_rss_bytes": ec[n].peak_mem_bytes,
                                    "autograd_held_bytes": held[n], "speedup": ec.speedup(n)} for n in contexts}
        for n in ("autograd on", "inference_mode"):
            self.rows.append(Row.in_ms(f"eval: {n}", ec[n], f"fp32 forward of {len(xs)} x {BATCH} images; activations "
                                                            f"held for backward: {held[n] / 2**20:.0f} MiB per batch",
                                       ratio=ec.speedup(n)))
        self.notes.append(f"eval: inference_mode {ec.speedup('inference_mode'):.2f}x the speed of autograd-on; "
                          f"activations held for backward {held['inference_mode'] / 2**20:.0f} vs "
                          f"{held['autograd on'] / 2**20:.0f} MiB per batch")

    def finish(self) -> dict[str, Any]:
        """Ratios to the plain row, the headline figures, the notes and the goal against the ceiling."""
        plain, auto, results = self.plain, self.auto, self.results
        speedups(self.rows, plain)
        ratio = next(r.cumulative for r in self.rows if r.technique == "torchspeed auto")
        results.update(rows=to_json(self.rows), plain_samples_s=plain, torchspeed_samples_s=auto, ratio=ratio,
                       best_hand_samples_s=self.best, best_hand_uses_compile=self.best_compile,
                       trainer_overhead_pct=self.overhead)
        self.say("done")
        results["phase_s"] = self.say.seconds
        results["seconds_used"] = round(self.budget.elapsed(), 1)
        es = results["early_stopping"]
        notes = self.notes
        notes.insert(0, f"ratio {ratio:.2f}x (torchspeed auto vs plain); each row timed in a window of the "
                        f"suite's {self.budget.seconds:.0f} s budget (calls of {self.k} step(s) of {BATCH}, as many as "
                        "fit, at least 2)")
        notes.append(f"early stopping: stopped at epoch {es['stopped_at_epoch']} of {es['budget_epochs']} "
                     f"({es['epochs_saved']} epochs, {es['time_saved_pct']:.0f}% of the time saved); best val_loss "
                     f"{es['best_val_loss_early_stopped']:.4f} vs {es['best_val_loss_full_run']:.4f} with the full "
                     "budget")
        notes.append(f"FLOPs per training sample (forward + backward, torch.utils.flop_counter): {self.flops / 1e9:.2f} G")
        results["limits"] = [_train_limit(auto, self.flops, self.ceilings, results.get("step_profile"), self.rep,
                                          self.auto_prec, self.ceiling_names, self.no_profile)]
        results["notes"] = notes
        return results


def _train_limit(auto: float, flops: float, ceilings: dict[str, float | None], profile: dict[str, Any] | None,
                 rep: Any, precision: str, names: dict[str, str] | None = None,
                 no_profile: str = "no step profile in this run (budget)") -> dict[str, Any]:
    """The train goal (the chosen step at >= 75% of the GEMM ceiling of the precision it runs) and, from
    the profile of an fp32 step, why not. `names`: the ceiling each precision is judged against (a GPU's
    own: gpu_tf32 for fp32); `ceilings` holds their values."""
    names = names or {}
    achieved = auto * flops / 1e9
    ceiling, fp32_ceiling = ceilings.get(precision), ceilings.get("fp32")
    name, fp32_name = names.get(precision, precision), names.get("fp32", "fp32")
    lim: dict[str, Any] = {"goal": f"ResNet-18 training step >= 75% of the GEMM ceiling of its precision ({name})",
                           "measured": (f"{name}: {achieved:.0f} of {ceiling:.0f} GFLOP/s "
                                        f"({100 * achieved / ceiling:.0f}%)" if ceiling
                                        else f"{achieved:.1f} GFLOP/s (no {name} ceiling measured)"),
                           "met": (achieved >= 0.75 * ceiling) if ceiling else None}
    if not profile:
        lim["why"] = no_profile
        return lim
    cats = profile["categories"]
    conv = [f"{c} {v['gflops']:.0f} GFLOP/s" + (f" ({v['pct_of_fp32_ceiling']:.0f}% of the {fp32_name} ceiling)"
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
        lim["why"] += (f". The convolutions together run at {100 * in_step / fp32_ceiling:.0f}% of the {fp32_name} "
                       "ceiling in the step"
                       + (f" ({100 * alone / fp32_ceiling:.0f}% with each of the {bound['convolutions']} timed alone at "
                          "its shapes, forward + backward)" if alone else "")
                       + f", so even if every other op cost nothing a step would reach about {lim['bound_pct']:.0f}%")
    return lim
