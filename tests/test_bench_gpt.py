"""The GPT suite on a tiny GPT and budget: its rows in cumulative order, their speed-ups tied to plain eager
(the later rows through the row they build on, timed again beside them), its FLOPs per token against a
hand count, and its registration in the report. No speed claims: the figures of such a run mean nothing,
and torch.compile is replaced by the identity (compiling is torch's, not what is tested here)."""
import json

import pytest
import torch

import torchspeed.runtime
from torchspeed.bench import budget, suites
from torchspeed.bench.gpt_model import GPT, GPTConfig, gpt, random_tokens
from torchspeed.bench.suites import gpt as suite

TINY = {"vocab_size": 96, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 32}


def hand_count(cfg: GPTConfig) -> int:
    """Training matmul FLOPs of one token, a multiply-add counting 2, backward twice the forward: per layer
    the qkv (3 C^2), projection (C^2) and MLP (8 C^2) weights, attention's scores and weighted sum over the
    whole context (2 T C each); the head (C V)."""
    c, t = cfg.n_embd, cfg.block_size
    forward = cfg.n_layer * (2 * (3 * c * c + c * c + 8 * c * c) + 2 * 2 * t * c) + 2 * c * cfg.vocab_size
    return 3 * forward


@pytest.mark.parametrize("config", [TINY, {"vocab_size": 100, "block_size": 12, "n_layer": 3, "n_head": 3,
                                           "n_embd": 48, "bias": False, "tie_weights": False}])
def test_flops_per_token_match_a_hand_count(config):
    cfg = GPTConfig(**config)
    torch.manual_seed(0)
    assert suite.flops_per_token(GPT(cfg), [random_tokens(2, cfg)]) == hand_count(cfg)


def test_the_gpt_trains_and_its_generation_path_gives_the_last_logits():
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    m = gpt(**TINY)
    idx, y = random_tokens(3, cfg, seed=1)
    assert torch.equal(idx[:, 1:], y[:, :-1])  # the targets are the next tokens
    logits, loss = m(idx, y)
    assert logits.shape == (3, 8, 96) and abs(loss.item() - torch.log(torch.tensor(96.0)).item()) < 0.5
    last, none = m(idx)
    assert none is None and torch.allclose(last[:, 0], logits[:, -1], atol=1e-5)
    assert m.lm_head.weight is m.transformer.wte.weight
    manual = gpt(**TINY, attention="manual")
    manual.load_state_dict(m.state_dict())
    assert torch.allclose(manual(idx, y)[1], loss, atol=1e-5)  # the same attention written out
    with pytest.raises(ValueError, match="longer than the model's block_size"):
        m(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=30, n_head=4)


@pytest.fixture
def tiny_suite(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(suite, "CONFIG", TINY)
    monkeypatch.setattr(suite, "BATCH", 2)
    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: model)
    return suite


def rows_of(result):
    return {r["technique"]: r for r in result["rows"]}


@pytest.mark.slow
def test_rows_are_cumulative_and_tied_to_plain_eager(tiny_suite, monkeypatch):
    monkeypatch.setattr(torchspeed.runtime, "default_precision",
                        lambda device: torchspeed.runtime.PrecisionChoice("fp32", "no native bf16 (test)"))
    said = []
    result = suite.run(quick=False, progress=said.append, budget_s=1.0)
    json.dumps(result)
    rows = rows_of(result)
    assert list(rows) == ["plain eager", "+ fused AdamW", "+ compile, regional", "+ compile, whole",
                          "+ bf16 autocast", "torchspeed auto"]
    assert rows["+ bf16 autocast"]["what"] == "not run: no native bf16 (test)"
    plain = rows["plain eager"]["median"]
    for name in ("plain eager", "+ fused AdamW", "+ compile, regional", "+ compile, whole"):
        assert rows[name]["cumulative"] == pytest.approx(rows[name]["median"] / plain)
        assert rows[name]["calls"] >= suite.MIN_REPEATS
        assert rows[name]["min"] <= rows[name]["median"] <= rows[name]["max"]
    later = result["later_rounds"]
    above = rows[later["anchor"]]
    auto = rows["torchspeed auto"]
    assert auto["cumulative"] == pytest.approx(above["cumulative"] * auto["median"] / later["anchor_tokens_s"])
    assert result["ratio"] == auto["cumulative"] and auto["headline"] is True
    assert [r["headline"] for r in result["rows"]].count(True) == 1
    hand = hand_count(GPTConfig(**TINY))
    assert all(r["unit"] == "tokens/s" and r["flops_per_item"] == hand and r["ceiling"] == "fp32"
               for r in result["rows"] if r["technique"] != "+ bf16 autocast")
    kept = [name for name, c in result["compile"].items() if c["kept"]]
    assert set(result["compile"]) == {"+ compile, regional", "+ compile, whole"} and len(kept) <= 1
    assert later["anchor"] == (kept[0] if kept else "+ fused AdamW")
    assert "accelerate" in result and result["limits"][0]["goal"].startswith("torchspeed auto >=")
    assert result["best_hand"] == later["anchor"]  # no bf16 row here: the chain is the row kept
    assert result["tokens_per_step"] == 2 * 8 and said[-1] == "done"


def test_quick_leaves_out_the_whole_compile_and_a_native_bf16_machine_gets_its_row(tiny_suite, monkeypatch):
    monkeypatch.setattr(torchspeed.runtime, "default_precision",
                        lambda device: torchspeed.runtime.PrecisionChoice("bf16", "native here (test)"))
    result = suite.run(quick=True, budget_s=1.0)
    rows = rows_of(result)
    assert rows["+ compile, whole"]["what"].startswith("not run: --quick")
    bf16 = rows["+ bf16 autocast"]
    assert bf16["ceiling"] == "bf16" and bf16["median"] > 0 and "torch.autocast(bf16)" in bf16["what"]
    later = result["later_rounds"]
    above = rows[later["anchor"]]
    assert bf16["cumulative"] == pytest.approx(above["cumulative"] * bf16["median"] / later["anchor_tokens_s"])
    assert list(rows) == ["plain eager", "+ fused AdamW", "+ compile, regional", "+ compile, whole",
                          "+ bf16 autocast", "torchspeed auto"]
    assert rows["torchspeed auto"]["headline"] and "chose " in rows["torchspeed auto"]["what"]


def test_the_suite_is_registered_under_the_ceilings_and_the_quick_budget():
    assert "gpt" in suites.SUITE_NAMES and "gpt" in suites.UNDER_CEILINGS and suites.load("gpt") is suite
    assert suite.TITLE and 0 < budget.QUICK_S["gpt"] < budget.FULL_S["gpt"]  # the sum: test_bench_ceilings
