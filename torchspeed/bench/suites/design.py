"""ShuffleNet V2's four design guidelines (Ma et al. 2018, arXiv 1807.11164, Tables 1-4), re-measured here.

Each experiment holds FLOPs fixed and changes one thing, so any time difference is what FLOPs miss:
- G1: 10 blocks of two 1x1 convs c1->c2->c1 with c1:c2 = 1:1, 1:2, 1:6, 1:12 (the paper's widths);
- G2: 10 blocks of two 1x1 group convs with groups 1, 2, 4, 8, widths grown to keep FLOPs;
- G3: 10 blocks of one 1x1 conv split into 2 or 4 fragments, in series (narrower) or in parallel
  (branches concatenated);
- G4: 10 ResNet bottlenecks (1x1, 3x3, 1x1) with and without ReLU and the shortcut add.
Contenders of one experiment are timed interleaved (measure.compare), fp32 inference, one thread
(as the paper's ARM CPU figures), batch 1 at 56x56 (28x28 with --quick). `ratio` is the experiment's reference time / this time (>1: faster than the reference).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchspeed.bench.rows import Row, to_json
from torchspeed.bench.suite_kit import cpu_suite_notes

TITLE = "Design rules (ShuffleNet V2 G1-G4): measured time at equal FLOPs"


def _blocks(torch: Any, make: Callable[[], Any], n: int = 10) -> Any:
    return torch.nn.Sequential(*[make() for _ in range(n)]).eval()


def _models(torch: Any) -> dict[str, dict[str, Any]]:
    nn = torch.nn

    def pair(c1: int, c2: int, g: int = 1) -> Any:
        return nn.Sequential(nn.Conv2d(c1, c2, 1, groups=g, bias=False), nn.Conv2d(c2, c1, 1, groups=g, bias=False))

    class Parallel(nn.Module):
        def __init__(self, c: int, k: int):
            super().__init__()
            self.branches = nn.ModuleList(nn.Conv2d(c, c // k, 1, bias=False) for _ in range(k))

        def forward(self, x):
            return torch.cat([b(x) for b in self.branches], 1)

    class Bottleneck(nn.Module):
        def __init__(self, c: int, relu: bool, shortcut: bool):
            super().__init__()
            m = c // 4
            self.c1, self.c2, self.c3 = nn.Conv2d(c, m, 1, bias=False), nn.Conv2d(m, m, 3, padding=1, bias=False), \
                nn.Conv2d(m, c, 1, bias=False)
            self.relu, self.shortcut = relu, shortcut

        def forward(self, x):
            act = torch.relu if self.relu else (lambda t: t)
            y = self.c3(act(self.c2(act(self.c1(x)))))
            if self.shortcut:
                y = y + x
            return act(y)

    def series(c: int, k: int) -> Any:
        return nn.Sequential(*[nn.Conv2d(c, c, 1, bias=False) for _ in range(k)])

    return {
        "g1": {"guideline": "G1: equal channel width minimises memory access",
               "paper": "1:1 fastest; slower as c1:c2 moves away from 1:1", "short": "fastest",
               "input_channels": [128, 90, 52, 36],
               "models": {f"G1 1x1 convs c1:c2={r} ({c1}:{c2})": _blocks(torch, lambda c1=c1, c2=c2: pair(c1, c2))
                          for r, c1, c2 in (("1:1", 128, 128), ("1:2", 90, 180), ("1:6", 52, 312), ("1:12", 36, 432))}},
        "g2": {"guideline": "G2: excessive group convolution increases memory access",
               "paper": "g=1 fastest; slower as groups grow", "short": "fastest, slower with more groups",
               "input_channels": [128, 180, 256, 360],
               "models": {f"G2 1x1 group convs g={g} (c={c})": _blocks(torch, lambda c=c, g=g: pair(c, c, g))
                          for g, c in ((1, 128), (2, 180), (4, 256), (8, 360))}},
        "g3": {"guideline": "G3: network fragmentation reduces parallelism",
               "paper": "1-fragment fastest; 4 parallel fragments slowest (on GPU)", "short": "fastest",
               "input_channels": [128, 90, 64, 128, 128],
               "models": {"G3 1-fragment (one 1x1 conv, c=128)": _blocks(torch, lambda: series(128, 1)),
                          "G3 2-fragment series (c=90)": _blocks(torch, lambda: series(90, 2)),
                          "G3 4-fragment series (c=64)": _blocks(torch, lambda: series(64, 4)),
                          "G3 2-fragment parallel (2 x 128->64, cat)": _blocks(torch, lambda: Parallel(128, 2)),
                          "G3 4-fragment parallel (4 x 128->32, cat)": _blocks(torch, lambda: Parallel(128, 4))}},
        "g4": {"guideline": "G4: element-wise operations are not negligible",
               "paper": "removing ReLU and shortcut is ~20% faster at the same FLOPs",
               "short": "slower than without ReLU and shortcut",
               "input_channels": [256] * 4,
               "models": {f"G4 bottleneck (c=256) ReLU {'on' if r else 'off'}, shortcut {'on' if s else 'off'}":
                          _blocks(torch, lambda r=r, s=s: Bottleneck(256, r, s))
                          for r, s in ((True, True), (False, True), (True, False), (False, False))}},
    }


def _holds(name: str, med: list[float]) -> bool:
    """Does this machine show the paper's direction (by medians)?"""
    if name == "g4":
        return med[3] < med[0]  # neither ReLU nor shortcut beats both
    if name == "g3":
        return med[0] <= min(med[1:])
    return med[0] <= min(med[1:]) and med[-1] > med[0]


def run(quick: bool, progress: bool | Callable[[str], Any] = False) -> dict[str, Any]:
    import torch

    from torchspeed.args import progress_fn
    from torchspeed.runtime import seed_everything

    say = progress_fn(progress)
    seed_everything(0)
    batch = 1
    # quick: 28x28 maps, short repeats; full: the paper's 56x56 with longer, more repeats
    hw, warm, reps, min_t, cool = (28, 1, 5, 0.02, 0.02) if quick else (56, 2, 7, 0.2, 0.2)
    # one thread, as the paper's CPU (ARM) figures: each op's own cost, no thread-pool barriers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows: list[Row] = []
        experiments: dict[str, Any] = {}
        for name, exp in _models(torch).items():
            say(f"{name.upper()}: {exp['guideline']}")
            exp_rows, holds = _experiment_rows(torch, name, exp, batch, hw, warm, reps, min_t, cool)
            experiments[name] = {"guideline": exp["guideline"], "paper": exp["paper"], "holds": holds,
                                 "rows": to_json(exp_rows)}
            rows += exp_rows
        return {
            "rows": to_json(rows), "experiments": experiments, "holds": {k: v["holds"] for k, v in experiments.items()},
            "settings": {"batch": batch, "spatial": hw, "blocks": 10, "dtype": "float32", "mode": "inference",
                         "threads": torch.get_num_threads(), "repeats": reps, "quick": quick},
            "notes": [f"{k.upper()} ({v['guideline']}): paper says {v['paper']}; "
                      f"{'holds' if v['holds'] else 'does NOT hold'} on this machine" for k, v in experiments.items()]
            + cpu_suite_notes(),
        }
    finally:
        torch.set_num_threads(threads)


def _experiment_rows(torch: Any, name: str, exp: dict[str, Any], batch: int, hw: int, warm: int, reps: int,
                     min_t: float, cool: float) -> tuple[list[Row], bool]:
    """One experiment's models timed interleaved at equal FLOPs, and whether this machine shows the paper's
    direction (which the reference row, the first, also says)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torchspeed.measure import compare

    inputs = {k: torch.randn(batch, c, hw, hw) for k, c in zip(exp["models"], exp["input_channels"])}
    flops = {}
    for k, m in exp["models"].items():
        with torch.inference_mode(), FlopCounterMode(display=False) as fc:
            m(inputs[k])
        flops[k] = fc.get_total_flops()

    def runner(m: Any, x: Any) -> Callable[[], Any]:
        def fn() -> Any:
            with torch.inference_mode():
                return m(x)
        return fn

    cmp = compare({k: runner(m, inputs[k]) for k, m in exp["models"].items()}, warmup=warm, repeats=reps,
                  min_time_s=min_t, cooldown_s=cool)
    reference = flops[list(exp["models"])[0]]
    rows = [Row.in_ms(k, cmp[k], f"reference; paper: {exp['paper']}" if i == 0 else
                      f"same FLOPs ({flops[k] / 1e9:.2f} G) as the reference ({reference / 1e9:.2f} G)",
                      ratio=cmp.speedup(k), gflops=flops[k] / 1e9, others_cores=cmp.others_cores)
            for i, k in enumerate(exp["models"])]
    if name == "g4":  # the summary's row: what dropping element-wise ops buys here
        rows[-1].headline = True
    holds = _holds(name, [cmp[k].median_s for k in exp["models"]])
    # the console table shows only rows: say the paper's direction and the verdict on the reference row
    rows[0].technique += f" - paper: {exp['short']}; here: {'holds' if holds else 'does not hold'}"
    return rows, holds
