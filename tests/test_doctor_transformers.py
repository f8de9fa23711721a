"""doctor on transformer loops: compile (whole and regional) injected in a real loop with the first losses
compared, and weighed against the script's planned steps; a slower verdict confirmed by a second run;
attention seen (SDPA calls, attention written by hand with its module and line) and measured on its
shapes; padding in token batches and the length-grouped sampler; the optimizer proposal editing the
script's own call; the script's own batch function timed as data; settings torch disabled reported off;
and doctor run end to end on the GPT and Hugging Face example scripts."""
import importlib.util
import json
import math
import os
import runpy
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from torchspeed.doctor import fixes as fx
from torchspeed.doctor import script_code
from torchspeed.doctor.grouping import LengthGrouped, token_lengths, token_tensors
from torchspeed.doctor.launch import build_payload
from torchspeed.doctor.recorder import Recorder
from torchspeed.doctor.transformer_rules import padding_estimate, transformer_findings
from torchspeed.doctor.trying import try_fixes

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "docs", "examples")


# ---------------------------------------------------------------------------------------- a tiny GPT
class _Attention(nn.Module):
    def __init__(self, width, heads, by_hand):
        super().__init__()
        self.qkv, self.proj, self.heads, self.by_hand = nn.Linear(width, 3 * width), nn.Linear(width, width), heads, by_hand
        self.register_buffer("keep", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        if self.by_hand:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.keep[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)  # HAND_LINE
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA_LINE
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, width, heads, by_hand):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(width), _Attention(width, heads, by_hand), nn.Linear(width, width)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(torch.nn.functional.gelu(x))


class TinyGPT(nn.Module):
    """Two blocks of width 32: token embedding, causal attention (SDPA or by hand), a head and the loss."""

    def __init__(self, by_hand=False, vocab=64, width=32, heads=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList([_Block(width, heads, by_hand) for _ in range(2)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _line(marker):
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(marker))


def _train(rec, model, steps=4, lr=1e-2, fixes=None):
    """A plain loop under `rec`, with `fixes` injected as the bootstrap does: the first losses."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(steps)]
    rec.install()
    if fixes:
        rec.inject(fixes)
    try:
        for x, y in batches:
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        rec.uninstall()
    return [float(t) for t in rec.losses]


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile with the eager backend: dynamo traces the model as doctor's fix asks (graph breaks and
    all), without inductor's minutes of code generation a unit test has no use for."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["whole", "regional"])
def test_compile_fix_compiles_in_the_loop_with_the_same_losses(eager_compile, how):
    torch.manual_seed(0)
    reference = _train(Recorder(), TinyGPT())
    torch.manual_seed(0)
    model = TinyGPT()
    rec = Recorder()
    rec_losses = _train(rec, model, fixes={"compile": how})
    assert rec.fix.compile_window == 0  # applied at the first training forward, landing in the next step
    notes = rec.fix.notes["compile"]
    assert notes["applied"] is True
    if how == "regional":
        assert notes["blocks"] == 2 and notes["first"] == "h.0"  # each repeated block compiled in place
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.h)
    else:
        assert notes["compiled"] == "TinyGPT"
    # doctor's hooks and patches stay out of the compiled code: no graph break at every module
    assert not torch._dynamo.utils.counters["graph_break"]
    # the fix's numerics check: the first losses (before and after the first update) as the baseline's
    check = fx.numerics("compile", {"losses": reference}, {"losses": rec_losses})
    assert check["ok"] is True and check["steps_compared"] == 2
    assert len(rec.windows) == 4 and all(w["phases"]["forward"] > 0 for w in rec.windows)


# ---------------------------------------------------------------------------------------- judging compile
def _raw(step_s, first=1.0, steps=6, compile_window=None, compile_s=0.0, losses=(2.3, 2.1)):
    windows = [{"wall": first}] + [{"wall": step_s}] * (steps - 1)
    if compile_window is not None:
        windows[compile_window + 1] = {"wall": first + compile_s}  # a baseline step plus the compile
    return {"status": "stopped", "windows": windows, "losses": list(losses), "compile_window": compile_window,
            "fix_notes": {"compile": {"applied": True}} if compile_window is not None else {}}


def _payload(planned=None, verdict="compute-bound", **settings):
    s = {"device": "cpu", "cores": 2, "torch_threads": 2, "loaders": [], "optimizers": ["AdamW"],
         "optimizer_options": {"AdamW": {"fused": None, "foreach": None}}, "model": {"convs": 0, "repeated_blocks": {
             "path": "transformer.h", "class": "Block", "count": 4}}, "mixed_precision": {"name": "fp32", "reason": "x"},
         "planned_steps": {"steps": planned, "source": f"max_iters = {planned} (train.py:<module>)"} if planned else None}
    s.update(settings)
    return {"settings": s, "findings": [], "verdict": verdict, "steady": {"wall_s": 5.0, "phases": {
        "forward": 1.5, "backward": 2.4, "optimizer": 1.0, "other": 0.1}}}


def _launcher(fixed):
    calls = []

    def launch(spec, title):
        calls.append(title)
        if title.startswith("combined"):
            return _raw(0.7, compile_window=0, compile_s=2.0)
        return _raw(1.0) if title == "baseline" else fixed[title]()
    return launch, calls


def test_compile_is_kept_only_where_its_compile_seconds_pay_back_within_the_planned_run():
    fixed = {"compile=whole": lambda: _raw(0.8, compile_window=0, compile_s=10.0),
             "compile=regional": lambda: _raw(0.82, compile_window=0, compile_s=2.0),
             "fused_optimizer": lambda: _raw(0.9)}
    payload = _payload(planned=100)
    launch, calls = _launcher(fixed)
    t = try_fixes(_raw(1.0), payload, launch, fx.plan(payload))
    rows = {r["fix"]: r for r in t["tried"]}
    whole = rows["compile=whole"]["compile"]
    assert whole["compile_s"] == pytest.approx(10.0) and whole["saving_s_per_step"] == pytest.approx(0.2)
    assert whole["break_even_steps"] == 50 and whole["pays_back"] is True and rows["compile=whole"]["kept"]
    assert rows["compile=regional"]["compile"]["break_even_steps"] == math.ceil(2.0 / 0.18)
    # both pay back; over 100 planned steps regional (2 + 82 s) finishes before whole (10 + 80 s)
    combined = t["tried"][-1]
    assert combined["fix"].startswith("combined") and combined["value"] == {"compile": "regional", "fused_optimizer": True}
    assert "compile_regions(model)" in combined["code"] and "block.compile()" in combined["code"]

    # a run of 20 planned steps never repays 10 s at 0.2 s a step: measured faster, not kept
    payload = _payload(planned=20)
    launch, _ = _launcher(fixed)
    rows = {r["fix"]: r for r in try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["compile"]))["tried"]}
    assert rows["compile=whole"]["verdict"] == "does not pay back" and not rows["compile=whole"]["kept"]
    assert rows["compile=regional"]["kept"]  # 12 steps to repay 2 s
    from torchspeed.doctor.trying import _compile_note

    assert "after 50 steps of 20 planned (max_iters = 20" in _compile_note(rows["compile=whole"]["compile"])

    # planned steps unknown: kept on speed, the note says the run's length could not be read
    payload = _payload(planned=None)
    launch, _ = _launcher(fixed)
    rows = {r["fix"]: r for r in try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["compile"]))["tried"]}
    assert rows["compile=whole"]["kept"] and rows["compile=whole"]["compile"]["pays_back"] is None
    assert "planned steps could not be read" in _compile_note(rows["compile=whole"]["compile"])


def test_compile_is_planned_on_compute_bound_loops_whole_and_regional():
    run, _ = fx.plan(_payload())
    assert ("compile", "whole") in run and ("compile", "regional") in run
    run, skipped = fx.plan(_payload(verdict="data-bound"))
    assert not any(n == "compile" for n, _ in run)
    assert {s["fix"]: s["reason"] for s in skipped}["compile"].startswith("the loop is data-bound")
    run, _ = fx.plan(_payload(model={"convs": 0, "repeated_blocks": None}))
    assert [v for n, v in run if n == "compile"] == ["whole"]  # nothing repeats: no regional candidate
    _, skipped = fx.plan(_payload(compiled=True))
    assert "already compiles" in {s["fix"]: s["reason"] for s in skipped}["compile"]
    assert fx.code_for("compile", "whole", _payload(driver="transformers.Trainer")) == \
        "TrainingArguments(..., torch_compile=True)"


def test_a_slower_verdict_is_confirmed_by_a_second_run():
    """Measured slower once (a busy minute), then not: within the spread. Slower twice: slower."""
    payload = _payload(verdict="data-bound")
    base = iter([1.0, 1.05, 1.0, 1.02, 1.0])
    runs = iter([1.3, 0.75])

    def launch(spec, title):
        return _raw(next(base)) if title == "baseline" else _raw(next(runs))

    (row,) = try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["fused_optimizer"]))["tried"]
    assert row["runs"] == 2 and row["verdict"] == "within the spread" and not row["kept"]
    runs = iter([1.3, 1.3])
    base = iter([1.0, 1.05, 1.0, 1.02, 1.0])
    (row,) = try_fixes(_raw(1.0), payload, launch, fx.plan(payload, ["fused_optimizer"]))["tried"]
    assert row["runs"] == 2 and row["verdict"] == "slower"


# ---------------------------------------------------------------------------------------- the optimizer call
OPT_MODULE = '''
import torch


def make(model, extra_args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim_groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        optim_groups, lr=1e-3,
        betas=(0.9, 0.95), **extra_args,
    )
    return optimizer
'''


def test_the_optimizer_proposal_edits_the_scripts_own_call_and_keeps_its_parameter_groups(tmp_path):
    path = tmp_path / "opt_script.py"
    path.write_text(OPT_MODULE)
    spec = importlib.util.spec_from_file_location("opt_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rec = Recorder()
    rec.install()
    try:
        module.make(nn.Linear(3, 3), {})
    finally:
        rec.uninstall()
    site = rec.s["optimizer_calls"]["AdamW"]
    assert site["file"] == str(path) and 9 <= site["line"] <= 12 and site["function"] == "make"
    code = fx.code_for("fused_optimizer", True, {"settings": {"optimizers": ["AdamW"], "optimizer_calls": rec.s[
        "optimizer_calls"], "loaders": []}})
    assert code.splitlines()[0] == f"# opt_script.py:{site['line']}, the script's own call with fused=True added"
    assert code.splitlines()[1:] == ["optimizer = torch.optim.AdamW(", "    optim_groups, lr=1e-3,",
                                     "    betas=(0.9, 0.95), **extra_args, fused=True,", ")"]
    # a value the call already passes is replaced, nothing else
    path.write_text("import torch\nopt = torch.optim.SGD(groups, lr=0.1, fused=False)  # mine\n")
    assert script_code.with_keyword(str(path), 2, "SGD", "fused", "True") == \
        "opt = torch.optim.SGD(groups, lr=0.1, fused=True)"
    # a Hugging Face Trainer made the optimizer: its option, not a line of transformers
    hf = {"settings": {"optimizers": ["AdamW"], "optimizer_calls": {"AdamW": {**site, "package": "transformers"}}}}
    assert fx.code_for("fused_optimizer", True, hf) == 'TrainingArguments(..., optim="adamw_torch_fused")'
    # the call cannot be read: a generic line that says to keep the groups
    assert "<its parameters or parameter groups, as now>" in fx.code_for(
        "fused_optimizer", True, {"settings": {"optimizers": ["AdamW"], "optimizer_calls": {}}})


# ---------------------------------------------------------------------------------------- the script's batches
GET_BATCH_SCRIPT = '''
import time
import numpy as np
import torch
from torch import nn

data = np.memmap({tokens!r}, dtype=np.uint16, mode="r")
max_iters = 40


def get_batch():
    ix = torch.randint(len(data) - 9, (4,))
    x = torch.stack([torch.from_numpy(data[i:i + 8].astype(np.int64)) for i in ix]).float()
    time.sleep(0.02)  # a slow disk
    return x, x.sum(1, keepdim=True)


model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-9)
scaler = torch.amp.GradScaler("cuda", enabled=False)
X, Y = get_batch()
for it in range(5):
    loss = ((model(X) - Y) ** 2).mean()
    X, Y = get_batch()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_the_scripts_own_batch_function_is_timed_as_data(tmp_path):
    tokens = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(tokens)
    script = tmp_path / "train.py"
    script.write_text(GET_BATCH_SCRIPT.format(tokens=str(tokens)))
    rec = Recorder()
    rec.install()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        rec.uninstall()
    raw = rec.results()
    (source,) = raw["settings"]["loaders"]
    assert source["kind"] == "batch function" and source["name"].startswith("get_batch() (train.py:")
    assert source["batches"] == 5 and source["training"]  # every call after the first training forward
    assert all(w["phases"]["data"] >= 0.02 for w in raw["windows"])  # the sleep is in `data`, not `other`
    assert raw["settings"]["planned_steps"] == {"steps": 40, "source": "max_iters = 40 (train.py:<module>)"}
    assert raw["settings"]["grad_scaler"] is False and raw["settings"]["grad_scaler_off"] == "made with enabled=False"
    payload = build_payload(raw, ["python", "train.py"], 0)
    evidence = " ".join(payload["evidence"])
    assert "making batches in get_batch() (train.py:" in evidence and "GradScaler off: made with enabled=False" in evidence


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a CUDA GradScaler only without CUDA")
def test_a_grad_scaler_torch_disabled_is_reported_off():
    rec = Recorder()
    rec.install()
    try:
        with pytest.warns(UserWarning):
            torch.amp.GradScaler("cuda")
    finally:
        rec.uninstall()
    assert rec.s["grad_scaler"] is False and rec.s["grad_scaler_off"] == "torch disabled it: cuda is not available"


# ---------------------------------------------------------------------------------------- attention
def test_hand_written_attention_is_named_and_measured_against_sdpa(monkeypatch):
    torch.manual_seed(0)
    rec = Recorder()
    compared, equal = [], torch.equal
    monkeypatch.setattr(torch, "equal", lambda *a: compared.append(a) or equal(*a))
    _train(rec, TinyGPT(by_hand=True), steps=2)
    assert not compared  # the mask's values are read after the run: no device sync inside the loop
    (site,) = rec.attention.hand.values()
    assert site["site"]["line"] == _line("# HAND_LINE") and site["site"]["file"] == __file__
    assert site["module"] == {"class": "_Attention", "name": "h.0.attn"}  # the first block's; h.1 reuses the line
    assert site["scores"] == [4, 2, 16, 16] and site["head_dim"] == 16
    assert site["calls"] == 4  # two blocks, two steps
    summary = rec.attention.summary(measure=True)
    assert site["mask"] == "causal" and len(compared) == 1
    m = summary["hand"][0]["measured"]
    assert m["same_output"] is True and m["is_causal"] is True and m["hand_ms"] > 0 and m["sdpa_ms"] > 0
    facts = {"steps": 2, "all_steps": 2, "wall_s": 1.0, "phases": {}, "settings": {"attention": summary}}
    (f,) = transformer_findings(facts)
    assert f.rule == "hand-written-attention" and f.where[0] == f"test_doctor_transformers.py:{_line('# HAND_LINE')}"
    assert "scaled_dot_product_attention(q, k, v, is_causal=True" in f.message and "h.0.attn (_Attention)" in f.message
    assert "the same output" in f.message and "2 calls per step" in f.message


def test_sdpa_calls_are_recorded_and_their_backends_measured():
    torch.manual_seed(0)
    rec = Recorder()
    _train(rec, TinyGPT(), steps=2)
    assert not rec.attention.hand  # no softmax of scores: nothing by hand
    (site,) = rec.attention.sdpa.values()
    assert site["site"]["line"] == _line("# SDPA_LINE") and site["module"]["name"] == "h.0.attn"
    assert site["q"] == [4, 2, 16, 16] and site["is_causal"] is True and site["mask"] is None
    m = rec.attention.summary(measure=True)["sdpa"][0]["measured"]
    assert "math" in m["backends"] and m["backends"][m["baseline"]]["speedup"] == pytest.approx(1.0)
    assert m["default"] in m["backends"] and m["baseline"] == m["default"]  # torch's own choice is the reference
    if not torch.cuda.is_available():
        assert m["refused"]["efficient"] == "CUDA only" and m["refused"]["cudnn"] == "CUDA only"


def _sdpa_site(default, flash_ms, math_ms):
    backends = {"flash": {"ms": flash_ms, "spread": 0.05, "speedup": {"flash": 1.0, "math": math_ms / flash_ms}[default]},
                "math": {"ms": math_ms, "spread": 0.05, "speedup": {"flash": flash_ms / math_ms, "math": 1.0}[default]}}
    return {"site": {"file": "/x/model.py", "line": 57}, "module": {"class": "Attn", "name": "h.0.attn"}, "calls": 8,
            "q": [4, 2, 16, 16], "k": [4, 2, 16, 16], "dtype": "float32", "is_causal": True, "mask": None,
            "measured": {"default": default, "baseline": default, "refused": {"cudnn": "CUDA only"}, "backends": backends}}


def test_sdpa_findings_and_the_fix_planned_from_the_measured_backends():
    facts = {"steps": 3, "all_steps": 4, "wall_s": 3.0, "phases": {}, "settings": {"attention": {
        "sdpa": [_sdpa_site("math", flash_ms=10.0, math_ms=30.0)], "hand": []}}}
    (f,) = transformer_findings(facts)
    assert f.rule == "sdpa-backend" and "flash is 3.00x math here" in f.message and f.where[0] == "model.py:57"
    assert f.expected_gain == pytest.approx(2 * 0.020)  # 2 calls a step x 20 ms saved, over 1 s steps
    run, _ = fx.plan(_payload(attention=facts["settings"]["attention"]))
    assert ("sdpa", "flash") in run
    facts["settings"]["attention"]["sdpa"] = [_sdpa_site("flash", flash_ms=10.0, math_ms=30.0)]
    (f,) = transformer_findings(facts)
    assert f.rule == "sdpa-backends" and f.severity == "info" and "none beats flash" in f.message
    run, skipped = fx.plan(_payload(attention=facts["settings"]["attention"]))
    assert not any(n == "sdpa" for n, _ in run)
    run, _ = fx.plan(_payload(attention=facts["settings"]["attention"]), ["sdpa"])
    assert run == [("sdpa", "math")]  # listed: every other backend that runs here


def test_the_sdpa_fix_chooses_the_backend_for_the_whole_run():
    rec = Recorder()
    rec.install()
    rec.inject({"sdpa": "math"})
    try:
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    finally:
        rec.uninstall()
    assert torch.backends.cuda.flash_sdp_enabled()  # put back
    assert "SDPBackend.MATH" in fx.code_for("sdpa", "math", {"settings": {}})


# ---------------------------------------------------------------------------------------- padding
def test_padding_share_and_the_gains_of_grouping_on_known_batches():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert token_lengths(token_tensors({"input_ids": mask * 7, "attention_mask": mask}), None) == (
        [4, 2, 1, 3], 4, "attention_mask")
    assert token_lengths(token_tensors((mask * 7, torch.zeros(4))), 0) == ([4, 2, 1, 3], 4, "pad id 0")
    assert token_tensors([torch.randn(4, 3)]) is None  # not token ids
    est = padding_estimate([{"lengths": [4, 2, 1, 3], "padded": 4}, {"lengths": [8, 1, 1, 2], "padded": 8}])
    assert est["tokens"] == 48 and est["real_tokens"] == 22 and est["share"] == pytest.approx(1 - 22 / 48)
    # grouped: [8, 4, 3, 2] -> 4 x 8, [2, 1, 1, 1] -> 4 x 2: 40 tokens
    assert est["grouped_gain"] == pytest.approx(48 / 40) and est["packed_gain"] == pytest.approx(48 / 22)
    assert est["per_batch_gain"] == pytest.approx(1.0) and not est["fixed_length"]
    fixed = padding_estimate([{"lengths": [4, 2], "padded": 16}, {"lengths": [8, 1], "padded": 16}])
    assert fixed["fixed_length"] and fixed["per_batch_gain"] == pytest.approx(64 / (8 + 16))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, 33, (n,), generator=g).tolist()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": [i % 50 + 1] * self.lengths[i], "labels": i % 2}


def _pad(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([s["labels"] for s in samples])}


def test_padding_is_read_from_the_training_batches_and_length_grouping_injected():
    ds = _Tokens()
    rec = Recorder()
    rec.install()
    rec.inject({"length_grouped": True})
    seen = []
    try:
        loader = DataLoader(ds, batch_size=4, shuffle=True, collate_fn=_pad)
        plain = DataLoader(ds, batch_size=4, shuffle=False, collate_fn=_pad)  # not shuffled: left alone
        model = nn.EmbeddingBag(64, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in loader:
            seen.append(batch["attention_mask"].sum(1).tolist())
            F.cross_entropy(model(batch["input_ids"]), batch["labels"]).backward()
            opt.step()
    finally:
        rec.uninstall()
    assert isinstance(loader.sampler, LengthGrouped) and not isinstance(plain.sampler, LengthGrouped)
    assert rec.fix.notes["length_grouped"] == {"applied": True, "reason": None, "samples": 64, "batch_size": 4}
    order = list(loader.sampler)  # another epoch's order
    assert sorted(order) == list(range(64))  # each sample once per epoch
    window = 16  # 64 samples // (4 x 4) batches of 4
    for i in range(0, 64, window):  # each window sorted by length, longest first (its head may be swapped)
        lengths = [ds.lengths[j] for j in order[i + 1:i + window]]
        assert lengths == sorted(lengths, reverse=True)
    tokens = rec.results()["settings"]["tokens"]
    assert tokens["source"] == "attention_mask" and len(tokens["batches"]) == 16
    assert [b["lengths"] for b in tokens["batches"]] == seen and all(b["padded"] == max(b["lengths"])
                                                                     for b in tokens["batches"])
    assert fx.numerics("length_grouped", {"losses": [1.0]}, {"losses": [2.0]})["ok"] is None  # other batches
    hf = fx.code_for("length_grouped", True, {"settings": {"driver": "transformers.Trainer", "loaders": []}})
    assert 'train_sampling_strategy="group_by_length"' in hf


def test_length_grouping_is_planned_where_padding_is_seen_in_a_dataloader():
    batches = [{"lengths": [30, 3, 5, 9], "padded": 30}] * 4
    loader = {"name": "DataLoader #1", "num_workers": 0, "batch_size": 4, "batches": 9, "training": True}
    run, _ = fx.plan(_payload(verdict="data-bound", tokens={"source": "attention_mask", "batches": batches},
                              loaders=[loader]))
    assert ("length_grouped", True) in run
    _, skipped = fx.plan(_payload(verdict="data-bound", tokens={"source": "attention_mask", "batches": batches}))
    assert "do not come from a torch DataLoader" in {s["fix"]: s["reason"] for s in skipped}["length_grouped"]
    facts = {"steps": 4, "wall_s": 4.0, "phases": {"forward": 1.0, "backward": 2.0},
             "settings": {"tokens": {"source": "attention_mask", "batches": batches}}}
    (f,) = transformer_findings(facts)
    assert f.rule == "token-padding" and f.message.startswith("61% of the tokens in the training batches are padding")
    assert "--try length_grouped" in f.command


# ---------------------------------------------------------------------------------------- end to end
def _doctor(tmp_path, args, script_args):
    from torchspeed.cli import main

    out = tmp_path / "d.json"
    assert main(["doctor", *args, "--json", str(out), "--", sys.executable, *script_args]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # three runs of the GPT script, each starting torch
@pytest.mark.timeout(600)
def test_doctor_try_on_the_gpt_example(tmp_path):
    d = _doctor(tmp_path, ["--steps", "4", "--try", "fused_optimizer"], [
        os.path.join(EXAMPLES, "train_gpt.py"), "--data", str(tmp_path / "tokens"), "--tokens", "20000",
        "--vocab-size", "512", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--eval-iters", "1"])
    s = d["settings"]
    assert [ld["kind"] for ld in s["loaders"]] == ["batch function"]
    assert any("making batches in get_batch()" in e for e in d["evidence"])
    assert s["planned_steps"]["steps"] == 2000 and s["planned_steps"]["source"].startswith("max_iters = 2000")
    assert s["grad_scaler"] is False or torch.cuda.is_available()
    assert s["attention"]["sdpa"][0]["module"]["name"] == "transformer.h.0.attn"
    assert "backends" in s["attention"]["sdpa"][0]["measured"]  # measured after the first run's steps
    (row,) = d["tried"]
    assert row["numerics_ok"] is True
    assert "torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args, fused=True)" in row["code"]


@pytest.mark.slow  # the Hugging Face Trainer starts slowly
@pytest.mark.timeout(600)
def test_doctor_on_the_hugging_face_trainer_example(tmp_path):
    d = _doctor(tmp_path, ["--steps", "4"], [
        os.path.join(EXAMPLES, "train_bert_hf.py"), "--samples", "64", "--hidden", "32", "--layers", "2",
        "--heads", "2", "--max-len", "32", "--batch-size", "8", "--vocab-size", "256", "--attn", "eager"])
    s = d["settings"]
    assert s["driver"] == "transformers.Trainer" and s["planned_steps"]["steps"] == 16  # 2 epochs x 8 batches
    assert s["tokens"]["source"] == "attention_mask" and s["tokens"]["batches"]
    rules = {f["rule"]: f for f in d["findings"]}
    assert "token-padding" in rules and "hand-written-attention" in rules
    assert 'attn_implementation="sdpa"' in rules["hand-written-attention"]["message"]
    assert rules["hand-written-attention"]["where"][1].startswith("bert.encoder.layer.0.attention")
