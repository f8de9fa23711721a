"""GPT suite: training tokens/s of a small GPT (`bench.gpt_model`: 4 layers of width 256, a 128-token
context, an 8,192-token vocabulary, random init, generated tokens, batch 8), techniques added one by one:
plain eager (fp32, AdamW's defaults) -> + fused AdamW -> + compile, regional (each repeated block compiled
once in place, `train.compiling.compile_regions`) or whole (`torch.compile` of the model; the full report)
-> + bf16 autocast where this machine has it natively (fp16 with a GradScaler on a GPU without fast bf16)
-> torchspeed auto (`ts.train.accelerate` on the same model, optimizer and batch, every setting on "auto").

Rows are timed interleaved (`measure.compare`, each row once per round), so a 1.1x gain stands out of a
shared machine's drift. Each row's first call is timed apart: for a compile row, its compile seconds, set
against its per-step gain over EXPECTED_STEPS; the compile row that makes such a run shortest is kept for
the rows below, if it pays back at all. The rows below (mixed precision, auto) are timed interleaved with
the row they build on, timed again beside them, which ties their ratios to plain's. Rows carry the
training FLOPs per token (torch.utils.flop_counter, attention counted through its math form) for the GEMM
ceiling of their precision.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable
from typing import Any

from torchspeed.bench.budget import Budget
from torchspeed.bench.rows import Row, to_json
from torchspeed.bench.suite_kit import Phases

TITLE = "Training: a small GPT's tokens/s (4 layers of width 256, 128-token context, batch 8; rows cumulative)"

CONFIG = {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256}
BATCH = 8
BATCHES = 4  # generated batches each row cycles through
EXPECTED_STEPS = 2000  # the run a compile must repay within (a short run of such a model)
MARGIN = 0.05  # a compile row is kept only when this much faster per step than fused AdamW (accelerate's margin)
TOLERANCE = 0.03  # the auto row's goal allows this much below the best hand-built row (rounds' noise)
MIN_REPEATS, MAX_REPEATS = 3, 15  # interleaved rounds of each timing (at least 3: a median of 3)
FIRST_SHARE = 0.45  # of the budget left after building the first rows: their rounds (the rest: auto's)


def flops_per_token(model: Any, batches: list[Any]) -> float:
    """Training FLOPs of one token (forward with targets + backward) by torch.utils.flop_counter, attention
    through SDPA's math form (its fused CPU kernel has no FLOP formula), on one generated batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(model).train()
    idx, y = batches[0]
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        m(idx, y)[1].backward()
    return counter.get_total_flops() / idx.numel()


def training_step(model: Any, opt: Any, batches: list[Any], precision: str, device: Any) -> Callable[[], None]:
    """One training step of a hand-written loop per call, cycling through `batches`: forward with the
    targets (the model returns the loss), backward, step (with a GradScaler under fp16)."""
    import torch

    from torchspeed.runtime import precision_dtype

    model.train()
    cycle = itertools.cycle(batches)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def step() -> None:
        idx, y = next(cycle)
        with (torch.autocast(device.type, dtype=precision_dtype(precision)) if precision != "fp32"
              else contextlib.nullcontext()):
            _, loss = model(idx, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def accelerated_step(acc: Any, batches: list[Any]) -> Callable[[], None]:
    """The same loop on what `ts.train.accelerate` returned: its model, and its backward and step."""
    cycle = itertools.cycle(batches)

    def step() -> None:
        idx, y = next(cycle)
        _, loss = acc.model(idx, y)
        acc.backward(loss)
        acc.queue_step(acc.optimizer)  # as the Trainer steps: no host wait per step under fp16 with a fused optimizer
    return step


class _Contender:
    """A row's step, its first call (compiling included) and its steady step time, timed apart."""

    def __init__(self, name: str, step: Callable[[], None], what: str, precision: str = "fp32"):
        import time

        self.name, self.step, self.what, self.precision = name, step, what, precision
        t0 = time.perf_counter()
        step()
        self.first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        step()
        self.step_s = time.perf_counter() - t0  # one steady call, for fitting the rounds into the budget


def run(quick: bool, progress: bool | Callable[[str], Any] = False, budget_s: float | None = None) -> dict[str, Any]:
    suite = _GPTSuite(quick, progress, budget_s)
    suite.prepare()
    suite.first_rows()
    suite.later_rows()
    return suite.finish()


class _GPTSuite:
    """One run of the suite: the model, the batches, the budget, the rows and the JSON its stages share."""

    def __init__(self, quick: bool, progress: bool | Callable[[str], Any], budget_s: float | None):
        import torch

        self.quick = quick
        self.budget = Budget.of("gpt", quick, budget_s)
        self.say = Phases(progress)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # rows name their ceiling
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.results: dict[str, Any] = {}

    # ---------------------------------------------------------------- shared pieces

    def fresh(self, fused: bool) -> tuple[Any, Any]:
        """A copy of the untrained model on the device with its AdamW (fused, or torch's default)."""
        import torch

        m = copy.deepcopy(self.base).to(self.device)
        return m, torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, **({"fused": True} if fused else {}))

    def columns(self, name: str, precision: str) -> dict[str, Any]:
        from torchspeed.bench.ceilings import PRECISION_CEILING

        return {"headline": name == "torchspeed auto", "ceiling": PRECISION_CEILING.get(precision, "fp32"),
                "flops_per_item": self.flops}

    def rounds(self, contenders: list[_Contender], seconds: float) -> int:
        """Interleaved rounds that fit `seconds` (between MIN_REPEATS and MAX_REPEATS)."""
        per_round = sum(c.step_s for c in contenders) + 0.1 * len(contenders)
        return int(max(MIN_REPEATS, min(MAX_REPEATS, seconds // max(per_round, 1e-6))))

    def timed(self, contenders: list[_Contender], seconds: float) -> Any:
        """The contenders timed interleaved (`measure.compare`), one step per call, tokens as items."""
        from torchspeed.measure import compare

        repeats = self.rounds(contenders, seconds)
        self.say(f"timing {', '.join(c.name for c in contenders)} interleaved ({repeats} rounds)")
        return compare({c.name: c.step for c in contenders}, warmup=0, repeats=repeats, items=self.tokens,
                       unit="tokens", cooldown_s=0.1, device=self.device)

    def row(self, c: _Contender, cmp: Any, what: str) -> Row:
        t = cmp[c.name]
        t.extra["first_s"] = c.first_s
        others = cmp.others_cores
        return Row.rate(c.name, t, what, "tokens/s", others_cores=round(others, 2) if others is not None else None,
                        **self.columns(c.name, c.precision))

    def not_run(self, name: str, why: str, precision: str = "fp32") -> None:
        self.rows.append(Row.not_run(name, why, "tokens/s", **self.columns(name, precision)))

    # ---------------------------------------------------------------- stages

    def prepare(self) -> None:
        """The model (random init), the generated batches and the FLOPs per token."""
        import torch

        from torchspeed.bench.gpt_model import GPTConfig, GPT, random_tokens

        torch.manual_seed(0)
        self.config = GPTConfig(**CONFIG)
        self.base = GPT(self.config)
        self.batches = [random_tokens(BATCH, self.config, seed=i, device=self.device) for i in range(BATCHES)]
        self.tokens = BATCH * self.config.block_size
        self.say("counting FLOPs per token (torch.utils.flop_counter)")
        self.flops = flops_per_token(self.base.to(self.device), self.batches)
        params = sum(p.numel() for p in self.base.parameters())
        self.results.update(config=dict(CONFIG), batch_size=BATCH, tokens_per_step=self.tokens,
                            parameters=params, flops_per_token=self.flops, device=str(self.device),
                            expected_steps=EXPECTED_STEPS, budget_s=self.budget.seconds)

    def first_rows(self) -> None:
        """Plain eager, + fused AdamW, + compile regional / whole, timed interleaved; the compile kept."""
        import torch

        from torchspeed.train.compile_choice import Horizon, weigh
        from torchspeed.train.compiling import compile_regions

        self.say("plain eager and fused AdamW: first steps")
        m, o = self.fresh(fused=False)
        plain = _Contender("plain eager", training_step(m, o, self.batches, "fp32", self.device),
                           "fp32, AdamW's defaults, a hand-written loop: model(idx, targets) -> (logits, loss)")
        m, o = self.fresh(fused=True)
        fused = _Contender("+ fused AdamW", training_step(m, o, self.batches, "fp32", self.device),
                           "AdamW(fused=True): one kernel over all parameters")
        contenders = [plain, fused]
        self.say("compiling the repeated blocks (regional: train.compiling.compile_regions)")
        m, o = self.fresh(fused=True)
        regional = training_step(compile_regions(m), o, self.batches, "fp32", self.device)
        contenders.append(_Contender("+ compile, regional", regional, f"each of the {self.config.n_layer} blocks "
                                     "compiled in place, one compile for all"))
        if self.quick:
            whole = None
        else:
            self.say("compiling the whole model (torch.compile)")
            m, o = self.fresh(fused=True)
            whole = _Contender("+ compile, whole", training_step(torch.compile(m), o, self.batches, "fp32",
                                                                 self.device),
                               "torch.compile(model): forward and backward of the whole model")
            contenders.append(whole)
        cmp = self.timed(contenders, self.budget.left() * FIRST_SHARE)
        steady = {c.name: cmp[c.name].median_s for c in contenders}
        compiled = contenders[2:]
        one_off = {c.name: max(0.0, c.first_s - steady[c.name]) for c in compiled}
        # accelerate()'s own rule: the compile that makes the run shortest, if MARGIN faster and repaid within it
        kept, verdicts = weigh(steady[fused.name], {c.name: (steady[c.name], one_off[c.name]) for c in compiled},
                               Horizon(EXPECTED_STEPS, "the suite's run"), MARGIN)
        self.kept = next((c for c in compiled if c.name == kept), fused)
        for c in contenders:
            what = c.what
            if c.name in verdicts:
                what += f"; compile {one_off[c.name]:.0f} s; against fused AdamW: {verdicts[c.name].decision}"
            self.rows.append(self.row(c, cmp, what))
        if whole is None:
            self.not_run("+ compile, whole", "--quick (torchspeed auto below tries it)")
        plain_rate = cmp[plain.name].throughput
        for r in self.rows:
            if r.median is not None:
                r.ratio = r.cumulative = r.median / plain_rate
        self.results["compile"] = {c.name: {"compile_s": round(one_off[c.name], 1), "step_s": steady[c.name],
                                            "kept": c is self.kept, "decision": verdicts[c.name].decision}
                                   for c in compiled}

    def later_rows(self) -> None:
        """torchspeed auto and + mixed precision (where native), timed interleaved with the row they build on."""
        import time

        import torch

        import torchspeed as ts
        from torchspeed.runtime import default_precision
        from torchspeed.train.compiling import compile_regions

        self.say("torchspeed auto: accelerate() measuring its candidates")
        torch._dynamo.reset()  # its compile trials pay their own compiling, as in a user's process
        m, o = self.fresh(fused=False)
        akw: dict[str, Any] = {"trial_steps": 2} if self.quick else {}
        t0 = time.perf_counter()
        acc = ts.train.accelerate(m, o, example_batch=self.batches[0], expected_steps=EXPECTED_STEPS, refresh=True,
                                  **akw)
        setup_s = time.perf_counter() - t0
        rep = acc.report
        auto = _Contender("torchspeed auto", accelerated_step(acc, self.batches),
                          f"ts.train.accelerate(model, optimizer, example_batch=..., expected_steps={EXPECTED_STEPS}) "
                          f"chose {rep.precision}, compile {getattr(rep, 'compile_mode', None) or 'off'}, "
                          f"{rep.optimizer} optimizer (setup {setup_s:.0f} s: its trials and compiling)", rep.precision)
        self.results.update(accelerate=rep.to_dict(), accelerate_setup_s=round(setup_s, 1))
        base = self.kept
        self.say(f"{base.name}: again, beside the rows below (compiled again after the reset)")
        contenders = [_Contender(base.name, base.step, base.what)]
        choice = default_precision(self.device)
        mixed = choice.name
        if mixed == "fp32":
            self.not_run("+ bf16 autocast", choice.reason, "bf16")
            self.results["mixed_precision"] = {"tried": False, "reason": choice.reason}
        else:
            self.say(f"{mixed} autocast on {base.name}")
            m, o = self.fresh(fused=True)
            if base.name != "+ fused AdamW":  # the same compile as the row it builds on
                m = compile_regions(m) if base.name == "+ compile, regional" else torch.compile(m)
            contenders.append(_Contender(f"+ {mixed} autocast", training_step(m, o, self.batches, mixed, self.device),
                                         f"torch.autocast({mixed}) on {base.name.lstrip('+ ')}, fp32 weights"
                                         + (", GradScaler" if mixed == "fp16" else ""), mixed))
        contenders.append(auto)
        cmp = self.timed(contenders, self.budget.left())
        above = next(r for r in self.rows if r.technique == base.name)
        anchor = cmp[base.name].median_s
        for c in contenders[1:]:
            r = self.row(c, cmp, c.what)
            # the row above's speed-up times the ratio the two had in the same rounds, under the same load
            r.ratio = r.cumulative = above.cumulative * anchor / cmp[c.name].median_s
            self.rows.append(r)
        self.results["later_rounds"] = {"anchor": base.name, "anchor_tokens_s": cmp[base.name].throughput,
                                        "others_cores": cmp.others_cores}

    def finish(self) -> dict[str, Any]:
        """The headline figures, the notes and the goal against the hand-built rows."""
        results = self.results
        rows = {r.technique: r for r in self.rows}
        auto, plain = rows["torchspeed auto"], rows["plain eager"]
        # the hand-built chain: the row the later rows build on (a compile kept only where it pays within the
        # run) and those later rows; a compile too costly for the run is no target for auto
        chain = [rows[self.kept.name]] + [r for r in self.rows[self.rows.index(rows[self.kept.name]) + 1:]
                                          if r.technique.startswith("+ ") and "compile" not in r.technique]
        hand = max((r for r in chain if r.cumulative is not None), key=lambda r: r.cumulative)
        results.update(rows=to_json(self.rows), plain_tokens_s=plain.median, torchspeed_tokens_s=auto.median,
                       ratio=auto.cumulative, best_hand=hand.technique, best_hand_ratio=hand.cumulative)
        results["limits"] = [{
            "goal": f"torchspeed auto >= the best row built by hand for a {EXPECTED_STEPS}-step run (the product "
                    "of its parts' gains)",
            "measured": f"auto {auto.cumulative:.2f}x vs {hand.technique} {hand.cumulative:.2f}x plain eager",
            "met": auto.cumulative >= hand.cumulative * (1 - TOLERANCE),
            "why": "" if auto.cumulative >= hand.cumulative * (1 - TOLERANCE) else
                   f"accelerate() chose: {auto.what.split(' chose ', 1)[-1]}"}]
        self.notes.insert(0, f"ratio {auto.cumulative:.2f}x (torchspeed auto vs plain eager); {BATCH} x "
                             f"{self.config.block_size} tokens a step, one step a call, rows timed interleaved "
                             f"within the suite's {self.budget.seconds:.0f} s budget")
        self.notes.append(f"training FLOPs per token (forward + backward, torch.utils.flop_counter): "
                          f"{self.flops / 1e6:.1f} M; {results['parameters']:,} parameters")
        self.say("done")
        results["notes"] = self.notes
        results["phase_s"] = self.say.seconds
        results["seconds_used"] = round(self.budget.elapsed(), 1)
        return results
