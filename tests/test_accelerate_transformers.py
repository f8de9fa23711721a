"""accelerate() for transformers: the trials run the loop's own step (a GPT's `model(idx, targets) ->
(logits, loss)` timed as `model(x, y)` with the loss it returns, a Hugging Face model as `model(**batch)`
with its labels), a step that cannot be read is said once with what to pass, tuple / dict outputs carrying
a loss come back in fp32, regional compilation finds the repeated blocks (compiled once, outputs as eager),
and compile is kept only when it repays its measured cost within the run, then remembered."""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict

import pytest
import torch
from helpers import separable_images, tiny_convnet
from torch import nn
from torch.nn import functional as F

from torchspeed.batches import BatchFormat, output_loss
from torchspeed.train import accelerate
from torchspeed.train.choices import AccelerateOptions, AccelerateResult
from torchspeed.train.compile_choice import DEFAULT_HORIZON_STEPS, Horizon, choose_compile, horizon_of, weigh
from torchspeed.train.compiling import (
    compile_regions,
    compiled_regions,
    decompile_regions,
    eager_regions,
    repeated_blocks,
)
from torchspeed.train.step_call import StepCall
from torchspeed.train.step_timer import StepTimer

CPU = torch.device("cpu")


# ------------------------------------------------------------------ a small GPT, nanoGPT's shape
class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` blocks, a head tied to the token embedding; `forward(idx,
    targets=None) -> (logits, loss)`: the full head and cross-entropy with targets, the last position's
    logits alone without (the inference path). Records whether each call got targets."""

    def __init__(self, vocab: int = 61, block: int = 16, layers: int = 3, width: int = 32, heads: int = 2,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.calls: list[bool] = []  # per call: targets given

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if not torch.compiler.is_compiling():
            self.calls.append(targets is not None)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tokens(batch: int = 4, block: int = 16, vocab: int = 61, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): random token windows and the same windows shifted by one, as a GPT's get_batch makes them."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, block + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class ModelOutput(OrderedDict):
    """What a Hugging Face model returns: a mapping with attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFStyle(nn.Module):
    """A Hugging Face-style classifier: keyword inputs, `labels=` computes the loss, a ModelOutput back."""

    def __init__(self, vocab: int = 61, width: int = 16, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, classes)
        self.calls: list[set[str]] = []

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        self.calls.append({k for k, v in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                          ("labels", labels)) if v is not None})
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        logits = self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))
        out = ModelOutput(logits=logits)
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def hf_batch(n: int = 8) -> dict[str, torch.Tensor]:
    x, _ = tokens(n)
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.arange(n) % 3}


def _quiet(monkeypatch):
    monkeypatch.setattr(AccelerateResult, "busy_warning", property(lambda self: None))


NO_COMPILE_TRIAL = dict(precision="fp32", channels_last=False, min_compile_cost_s=1e9, trial_steps=1)


# ------------------------------------------------------------------ the loop's own step
def test_a_gpt_is_timed_as_model_x_y_with_the_loss_it_returns():
    model, (x, y) = TinyGPT(), tokens()
    acc = accelerate(model, torch.optim.AdamW(model.parameters()), example_batch=(x, y), **NO_COMPILE_TRIAL)
    assert model.calls and all(model.calls)  # every call of the trials got the targets: model(x, y)
    assert acc.report.timed_step == "model(x, y), the loss it returns"
    base = [r for r in acc.report.candidates if r.setting == "compile" and r.value == "False"][0]
    assert base.step_s > 0  # a real step was timed (eager), and compile judged too short a run to try


def test_the_timed_steps_loss_is_the_loops_loss_for_the_same_batch():
    model, (x, y) = TinyGPT(), tokens()
    timer = StepTimer((x, y), None, CPU, 1, model=model)
    _, loop_loss = model(x, y)  # what the user's loop backpropagates
    torch.testing.assert_close(timer.loss_value(model), loop_loss.detach())
    net = tiny_convnet()
    xi, yi = separable_images(16)
    timer = StepTimer((xi, yi), nn.functional.cross_entropy, CPU, 1, model=net)
    torch.testing.assert_close(timer.loss_value(net), F.cross_entropy(net(xi), yi).detach())
    hf = HFStyle()
    batch = hf_batch()
    timer = StepTimer(batch, None, CPU, 1, model=hf)
    torch.testing.assert_close(timer.loss_value(hf), hf(**batch).loss.detach())
    assert hf.calls[-2] == {"input_ids", "attention_mask", "labels"}  # the timed call got the labels


def test_a_hugging_face_style_model_gets_its_labels_and_its_loss_is_used():
    call = StepCall.of(HFStyle(), hf_batch())
    assert (call.targets_in, call.targets_keyword) == (True, "labels")
    assert call.describe() == "model(**inputs, labels=y), the loss it returns"
    given = StepCall.of(HFStyle(), hf_batch(), loss_fn=F.cross_entropy)  # the loop computes the loss itself
    assert not given.targets_in and given.describe() == "model(**inputs), cross_entropy(logits, y)"


def test_a_forward_without_a_targets_parameter_is_called_with_the_inputs_alone():
    assert not StepCall.of(tiny_convnet(), separable_images(8)).targets_in

    class TwoInputs(nn.Module):
        def forward(self, x, mask=None):  # a second parameter that is not the targets
            return x.sum(1)
    assert not StepCall.of(TwoInputs(), (torch.zeros(2, 3), torch.zeros(2))).targets_in


def test_output_loss_reads_tuples_mappings_attributes():
    loss, logits = torch.tensor(1.5), torch.zeros(2, 3)
    assert output_loss((logits, loss)) is loss and output_loss((loss, logits)) is loss
    assert output_loss((logits, None)) is None and output_loss(logits) is None
    assert output_loss({"logits": logits, "loss": loss}) is loss and output_loss(ModelOutput(loss=loss)) is loss
    assert output_loss(loss) is loss


def test_a_batch_of_three_parts_is_said_once_with_what_to_pass(caplog, monkeypatch):
    _quiet(monkeypatch)
    net = tiny_convnet()
    x, y = separable_images(16)
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        acc = accelerate(net, None, example_batch=(x, y, torch.ones(16)), loss_fn=F.cross_entropy,
                         **NO_COMPILE_TRIAL)
    said = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "3 parts" in said[0] and "batch_format=BatchFormat(" in said[0], said
    assert acc.report.timed_step == "model(x), cross_entropy(logits, y)"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchspeed"):  # said: nothing to doubt
        accelerate(tiny_convnet(), None, example_batch=(x, y, torch.ones(16)), loss_fn=F.cross_entropy,
                   batch_format=BatchFormat(inputs=0, target=1), **NO_COMPILE_TRIAL)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_loss_neither_given_nor_returned_is_said_once_also_when_recalled(caplog, monkeypatch):
    _quiet(monkeypatch)
    regressor = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    for _ in range(2):  # measured, then remembered: said both times
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchspeed"):
            accelerate(regressor, None, example_batch=batch, precision="fp32", channels_last=False,
                       min_compile_cost_s=1e9, trial_steps=1)
        said = [r.message for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1 and "stand-in loss" in said[0] and "loss_fn=" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchspeed"):  # the loss given: nothing to say
        accelerate(regressor, None, example_batch=batch, loss_fn=F.mse_loss, **NO_COMPILE_TRIAL)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_loop_that_calls_another_step_than_the_one_timed_is_told_once(caplog, monkeypatch):
    _quiet(monkeypatch)
    model, (x, y) = TinyGPT(), tokens()
    acc = accelerate(model, None, example_batch=(x, y), loss_fn=lambda out, t: out[0].float().mean(),
                     **NO_COMPILE_TRIAL)  # a loss_fn given: the trials timed model(x)
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        acc.model(x, y)  # the loop runs model(x, y)
        acc.model(x, y)
    said = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "another step" in said[0] and "got 2" in said[0], said
    caplog.clear()
    model = TinyGPT()
    acc = accelerate(model, None, example_batch=(x, y), **NO_COMPILE_TRIAL)
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        acc.model(x, y)
        with torch.no_grad():
            acc.model(x)  # generation, outside training: not the step
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# ------------------------------------------------------------------ outputs carrying a loss
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DictGPT(TinyGPT):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return {"logits": logits, "loss": loss} if self.kind == "dict" else (
            ModelOutput(logits=logits, loss=loss) if self.kind == "mapping" else Out(logits, loss))


@pytest.mark.parametrize("kind", ["tuple", "dict", "mapping", "dataclass"])
def test_outputs_carrying_a_loss_train_end_to_end_and_come_back_in_fp32(kind):
    model = TinyGPT() if kind == "tuple" else DictGPT(kind)
    x, y = tokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerate(model, optimizer, example_batch=(x, y), precision="bf16", channels_last=False,
                                  compile=False)
    losses = []
    for _ in range(8):  # the user's loop, unchanged: the model computes its loss
        out = model(x, y)
        logits, loss = (out if kind == "tuple" else (out["logits"], out["loss"]) if kind == "dict"
                        else (out.logits, out.loss))
        assert logits.dtype == torch.float32 and loss.dtype == torch.float32 and loss.dim() == 0
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]  # it trains


# ------------------------------------------------------------------ regional compilation
def test_repeated_blocks_are_found_generically():
    assert repeated_blocks(TinyGPT(layers=3)) == ["h.0", "h.1", "h.2"]
    nested = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Block(8, 2), Block(8, 2)]), nn.Linear(4, 4))
    assert repeated_blocks(nested) == ["1.0", "1.1"]  # the lone Linears are not blocks
    stack = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 2))
    assert repeated_blocks(stack) == ["0", "1", "2"]  # Sequential blocks inside a Sequential: outermost
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())) == []
    with pytest.raises(ValueError, match="no repeated blocks.*torch.compile\\(model\\)"):
        compile_regions(tiny_convnet())


def test_each_repeated_block_class_is_compiled_once_and_reused():
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TinyGPT(layers=4)
    keys = list(model.state_dict())
    assert compile_regions(model, backend=counting) is model  # in place
    assert compiled_regions(model) == ["h.0", "h.1", "h.2", "h.3"] and list(model.state_dict()) == keys
    x, y = tokens()
    with torch.no_grad():
        model(x, y)
    assert len(graphs) == 1  # one trace for the four blocks
    with eager_regions(model):
        assert compiled_regions(model) == []
    assert len(compiled_regions(model)) == 4
    decompile_regions(model)
    assert compiled_regions(model) == []
    torch._dynamo.reset()


def test_regional_compilation_matches_eager():
    torch._dynamo.reset()
    x, y = tokens()
    eager, compiled = TinyGPT(), compile_regions(TinyGPT(), backend="aot_eager")
    for m in (eager, compiled):
        m(x, y)[1].backward()
    torch.testing.assert_close(compiled(x, y)[1], eager(x, y)[1], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)
    torch._dynamo.reset()


@pytest.mark.slow
def test_regional_compilation_with_inductor_matches_eager():
    torch._dynamo.reset()
    x, y = tokens()
    eager, compiled = TinyGPT(), compile_regions(TinyGPT())
    torch.testing.assert_close(compiled(x, y)[1], eager(x, y)[1], atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


# ------------------------------------------------------------------ the compile decision
def test_compile_is_kept_only_when_it_repays_its_cost_within_the_run():
    eager = 0.100
    options = {"regional": (0.090, 5.0), "True": (0.085, 30.0)}  # (steady step s, compile s)
    kept, v = weigh(eager, options, Horizon(1000, "the default horizon"), 0.05)
    assert kept == "regional" and v["regional"].decision.startswith("kept: 1.11x")
    assert v["regional"].break_even_steps == 500  # 5 s / 10 ms saved per step
    assert v["True"].decision.startswith("rejected") and v["True"].break_even_steps == 2000
    kept, v = weigh(eager, options, Horizon(10_000, "expected_steps"), 0.05)  # a long run repays the whole compile
    assert kept == "True" and v["regional"].decision.startswith("rejected: saves")
    kept, v = weigh(eager, {"True": (0.110, 0.0), "regional": (0.098, 0.0)}, Horizon(10**9, "x"), 0.05)
    assert kept is None  # never kept when slower, nor within the margin, however long the run
    assert "not 5% faster" in v["True"].decision and v["True"].gain < 1
    kept, _ = weigh(eager, {"True": (0.050, 60.0)}, Horizon(1000, "x"), 0.05)
    assert kept is None  # 2x faster, but 60 s of compile need 1200 steps


def test_the_runs_length_comes_from_expected_steps_the_loader_and_epochs_or_the_default():
    assert horizon_of(300, 50, 2) == Horizon(300, "expected_steps")
    assert horizon_of(None, 50, 4) == Horizon(200, "len(loader) x 4 epochs")
    assert horizon_of(None, 5000) == Horizon(5000, "one epoch, len(loader)")
    assert horizon_of(None, 50) == horizon_of(None) == Horizon(DEFAULT_HORIZON_STEPS, "the default horizon")


class FakeTimer:
    """A StepTimer whose timings are given: no step runs, so nothing is compiled (torch.compile is lazy)."""

    def __init__(self, steady: dict[str, float], first: dict[str, float]):
        self.steady, self.first = steady, first
        self.firsts: list[float] = []
        self.compared: list[list[str]] = []

    def step_fn(self, model, precision, channels_last):
        return lambda: None

    def measure(self, step):
        return self.steady["False"], self.steady["False"]

    def first_call(self, step):
        self.firsts.append(1)
        return self.first[["True", "regional"][len(self.firsts) - 1]]

    def compare(self, steps):
        self.compared.append(sorted(steps))
        return {n: self.steady[n] for n in steps}


@pytest.mark.parametrize("horizon, kept", [(100, None), (1000, "regional"), (100_000, "True")])
def test_the_compile_trial_reports_compile_seconds_gain_and_break_even(horizon, kept):
    model = TinyGPT()
    timer = FakeTimer({"False": 0.1, "regional": 0.09, "True": 0.085}, {"regional": 5.09, "True": 30.085})
    report = AccelerateResult("cpu")
    out = choose_compile(model, timer, AccelerateOptions(min_compile_cost_s=0.0), report, 0.1,
                         Horizon(horizon, "expected_steps"))
    assert timer.compared == [["False", "True", "regional"]]  # steady steps timed interleaved
    rows = {r.value: r for r in report.candidates if r.setting == "compile"}
    assert math.isclose(rows["regional"].one_off_s, 5.0) and math.isclose(rows["True"].one_off_s, 30.0)
    assert math.isclose(rows["regional"].gain, 0.1 / 0.09) and rows["regional"].break_even_steps == 500
    assert rows["True"].break_even_steps == 2000
    assert [v for v, r in rows.items() if r.decision.startswith("kept")] == [kept or "False"]
    assert report.compile_setting == {"True": True, "regional": "regional", None: False}[kept]
    assert bool(compiled_regions(model)) == (kept == "regional")  # the regions undone unless kept
    assert (out is model) if kept == "regional" else (out is None) if kept is None else hasattr(out, "_orig_mod")


def test_a_run_too_short_does_not_try_and_a_cnn_keeps_working(monkeypatch):
    monkeypatch.setattr(StepTimer, "measure", lambda self, step: (0.002, 0.002))  # 2 ms a step: 2 s in 1000
    net = tiny_convnet()
    rep = accelerate(net, None, precision="fp32", channels_last=False, example_batch=separable_images(16),
                     trial_steps=1).report  # compile left on "auto", no expected_steps: the default horizon
    row = [r for r in rep.candidates if r.setting == "compile" and r.value == "True"][0]
    assert row.decision.startswith("not tried: expected run ~") and "the default horizon" in row.decision
    assert rep.compile is False and rep.compile_setting is False


def test_compile_auto_without_a_batch_is_not_tried_not_an_error():
    rep = accelerate(tiny_convnet(), None, precision="fp32", channels_last=False).report
    row = [r for r in rep.candidates if r.setting == "compile"][0]
    assert row.decision.startswith("not tried: no example batch") and rep.compile is False


def test_compile_regional_given_compiles_the_blocks_in_place():
    model = TinyGPT()
    acc = accelerate(model, None, precision="fp32", channels_last=False, compile="regional")
    assert acc.report.compile_setting == "regional" and compiled_regions(model) == ["h.0", "h.1", "h.2"]
    assert acc.wrapped is model and list(acc.model.state_dict()) == list(TinyGPT().state_dict())
    with pytest.raises(ValueError, match="no repeated blocks"):
        accelerate(tiny_convnet(), None, precision="fp32", channels_last=False, compile="regional")
    with pytest.raises(ValueError, match="compile must be"):
        accelerate(model, None, compile="yes")
    decompile_regions(model)


def test_the_compile_decision_is_remembered_and_the_second_run_pays_no_trial(monkeypatch):
    _quiet(monkeypatch)
    timings = {"False": 0.1, "regional": 0.09, "True": 0.099}
    trials = []
    monkeypatch.setattr(StepTimer, "measure", lambda self, step: (0.1, 0.1))
    monkeypatch.setattr(StepTimer, "first_call", lambda self, step: trials.append(1) or 1.0)
    monkeypatch.setattr(StepTimer, "compare", lambda self, steps: {n: timings[n] for n in steps})
    kw = dict(example_batch=tokens(), precision="fp32", channels_last=False, min_compile_cost_s=0.0,
              expected_steps=5000)
    first = accelerate(TinyGPT(), None, **kw)
    assert first.report.compile_setting == "regional" and len(trials) == 2  # regional and whole compiled, timed
    again_model = TinyGPT()
    again = accelerate(again_model, None, **kw)  # a fresh model of the same kind: recalled, nothing timed
    assert len(trials) == 2
    assert again.report.compile_setting == "regional" and compiled_regions(again_model) == ["h.0", "h.1", "h.2"]
    row = [r for r in again.report.candidates if r.setting == "compile"][0]
    assert row.value == "regional" and row.decision.startswith("remembered from ")
    other = accelerate(TinyGPT(), None, **{**kw, "expected_steps": 20})  # another run length: weighed again
    assert len(trials) == 4 and other.report.compile is False
    for m in (first.module, again_model):
        decompile_regions(m)


@pytest.mark.slow
def test_the_real_compile_trial_times_regional_and_whole_and_the_model_trains_as_eager():
    torch._dynamo.reset()
    model, (x, y) = TinyGPT(), tokens()
    reference = TinyGPT()(x, y)[1].detach()
    acc = accelerate(model, torch.optim.SGD(model.parameters(), lr=0.0), example_batch=(x, y), precision="fp32",
                     expected_steps=10**6, min_compile_cost_s=0.0, trial_steps=2)
    rows = {r.value: r for r in acc.report.candidates if r.setting == "compile"}
    for name in ("regional", "True"):
        assert rows[name].step_s > 0 and rows[name].one_off_s > 0 and rows[name].gain > 0, rows[name]
        assert rows[name].decision.startswith(("kept", "rejected"))
    assert sum(r.decision.startswith("kept") for r in rows.values()) == 1
    assert bool(compiled_regions(model)) == (acc.report.compile_mode == "regional")
    _, loss = acc.model(x, y)
    torch.testing.assert_close(loss.detach(), reference, atol=1e-4, rtol=1e-4)
    decompile_regions(model)
    torch._dynamo.reset()
