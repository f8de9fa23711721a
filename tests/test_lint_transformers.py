"""lint on transformers: the cost split by part against hand-counted FLOPs, and each transformer rule firing
on the model that breaks it (a nanoGPT-style GPT and Hugging Face models built from their configs, random
init) and staying quiet on the one that does not. No speed claims: the rules' timings only have to exist."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchspeed as ts
from torchspeed.bench.gpt_model import gpt
from torchspeed.doctor.transformer_lint import part_of, token_embedding, token_input

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 64}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def lint(model, x=None, **kw):
    torch.manual_seed(0)
    x = token_input(model) if x is None else x
    return ts.doctor.lint(model, x, quiet_wait_s=0, repeats=1, **kw)


def rules(report):
    return {f.rule: f for f in report.findings}


def hf_gpt2(**kw):
    cfg = dict(vocab_size=256, n_positions=16, n_embd=64, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **kw}))


def hf_bert(**kw):
    cfg = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
               max_position_embeddings=16)
    return transformers.BertModel(transformers.BertConfig(**{**cfg, **kw}))


def test_cost_by_part_matches_hand_counted_flops():
    """Per layer the MLP is two matmuls of T x C x 4C and a GELU over T x 4C; attention the qkv and
    projection matmuls and SDPA's two T x T x C products; the head one C x V matmul (the last position:
    the model's generation path, since lint gives no targets)."""
    L, T, C, V = 2, 16, 64, 256
    r = lint(gpt(**SMALL))
    parts = r.by_part
    assert set(parts) == {"embeddings", "attention", "mlp", "head", "other"}
    assert parts["mlp"]["flops"] == L * (2 * T * C * 4 * C * 2 + T * 4 * C)
    assert parts["attention"]["flops"] == L * (2 * T * C * 3 * C + 2 * T * C * C + 2 * 2 * T * T * C)
    assert parts["head"]["flops"] == 2 * C * V
    assert sum(p["time_share"] for p in parts.values()) == pytest.approx(1.0)
    assert sum(p["flops"] for p in parts.values()) == pytest.approx(r.totals["flops"])
    d = json.loads(json.dumps(r.to_dict()))
    assert d["by_part"]["mlp"]["ops"] == parts["mlp"]["ops"] > 0
    assert "By part" in str(r)


def test_parts_of_hugging_face_module_paths():
    bert = hf_bert()
    mods = dict(bert.named_modules())
    assert part_of("embeddings.word_embeddings", mods, None) == "embeddings"
    assert part_of("encoder.layer.0.attention.self.query", mods, None) == "attention"
    assert part_of("encoder.layer.0.attention.output.LayerNorm", mods, None) == "attention"
    assert part_of("encoder.layer.0.intermediate.dense", mods, None) == "mlp"
    assert part_of("encoder.layer.0.output.dense", mods, None) == "mlp"
    assert part_of("pooler.dense", mods, None) == "head"
    gpt2 = hf_gpt2()
    mods = dict(gpt2.named_modules())
    assert [part_of(n, mods, "lm_head") for n in ("transformer.wte", "transformer.h.1.attn.c_attn",
                                                   "transformer.h.1.mlp.c_fc", "transformer.ln_f", "lm_head")] \
        == ["embeddings", "attention", "mlp", "other", "head"]


def test_hand_written_attention_is_named_with_its_line_and_sdpa_is_not():
    r = lint(gpt(**SMALL, attention="manual"))
    found = rules(r)["hand-written-attention"]
    assert found.where == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert "CausalSelfAttention, gpt_model.py:" in found.message and "measured" in found.message
    assert "causal" in found.message and 0 <= found.expected_gain < 1
    assert "hand-written-attention" not in rules(lint(gpt(**SMALL)))


def test_hugging_face_eager_attention_is_hand_written_and_sdpa_is_not():
    eager = rules(lint(hf_gpt2(attn_implementation="eager")))
    assert eager["hand-written-attention"].where == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert "modeling_gpt2.py:" in eager["hand-written-attention"].message
    assert "hand-written-attention" not in rules(lint(hf_gpt2(attn_implementation="sdpa")))
    bert = rules(lint(hf_bert(attn_implementation="eager")))
    assert bert["hand-written-attention"].where == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert "hand-written-attention" not in rules(lint(hf_bert(attn_implementation="sdpa")))


def test_sdpa_math_fallback_is_not_taken_for_hand_written_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # SDPA decomposes into matmul, softmax, matmul
        r = lint(gpt(**SMALL))
    assert "hand-written-attention" not in rules(r)


def test_vocabulary_off_64_is_measured_padded_and_64_is_quiet():
    r = lint(hf_gpt2(vocab_size=250))
    found = rules(r)["size-not-multiple-of-64"]
    assert "vocabulary 250" in found.message and "here padded to 64x256" in found.message
    assert found.where == ["lm_head"] and found.expected_gain >= 0
    assert "size-not-multiple-of-64" not in rules(lint(hf_gpt2()))


def test_hidden_size_off_64_is_measured_padded():
    r = lint(gpt(**{**SMALL, "n_embd": 72, "n_head": 2}))
    found = rules(r)["size-not-multiple-of-64"]
    assert "hidden size" in found.message and "72" in found.message and "vocabulary" not in found.message
    assert "channels-not-multiple-of-8" not in rules(r)  # a transformer's sizes are judged against 64 alone


class DropsAtInference(nn.Module):
    """Attention whose dropout ignores the mode: F.dropout's training=True default, or SDPA's dropout_p
    passed without `if self.training`."""

    def __init__(self, how: str):
        super().__init__()
        self.emb, self.qkv, self.how = nn.Embedding(64, 64), nn.Linear(64, 192), how

    def forward(self, idx):
        q, k, v = self.qkv(self.emb(idx)).unsqueeze(1).chunk(3, dim=-1)
        if self.how == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        att = F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), 0.1)
        return att @ v


@pytest.mark.parametrize("how", ["sdpa", "functional"])
def test_dropout_left_on_at_inference_is_a_bug(how):
    found = rules(lint(DropsAtInference(how), torch.randint(0, 64, (1, 16))))["dropout-at-inference"]
    assert found.severity == "bug" and found.where == ["DropsAtInference"]
    assert ("dropout_p=0.1" in found.message) == (how == "sdpa")
    quiet = lint(gpt(**SMALL, dropout=0.1))  # nanoGPT: dropout only `if self.training`
    assert "dropout-at-inference" not in rules(quiet)


def test_untied_head_is_counted_and_tied_is_quiet():
    found = rules(lint(gpt(**SMALL, tie_weights=False)))["untied-head"]
    assert found.severity == "info" and found.where == ["lm_head", "transformer.wte"]
    assert "256 x 64" in found.message and "removes 16,384 parameters (0.1 MiB" in found.message
    assert "untied-head" not in rules(lint(gpt(**SMALL)))
    assert "untied-head" in rules(lint(hf_gpt2(tie_word_embeddings=False)))
    assert "untied-head" not in rules(lint(hf_gpt2()))


def test_token_input_reads_the_vocabulary_and_context():
    m = gpt(**SMALL)
    x = token_input(m)
    assert x.dtype == torch.long and tuple(x.shape) == (1, 16) and 0 <= int(x.min()) and int(x.max()) < 256
    assert tuple(token_input(m, (2, 8)).shape) == (2, 8)
    assert token_embedding(hf_bert())[0] == "embeddings.word_embeddings"
    assert token_input(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())) is None  # an image model
    with pytest.raises(ValueError, match="every dimension must be >= 1"):
        token_input(m, (0, 8))


def test_an_image_model_has_no_parts_and_keeps_its_rules():
    m = nn.Sequential(nn.Conv2d(3, 36, 3), nn.Flatten(), nn.Linear(36 * 14 * 14, 10))
    r = ts.doctor.lint(m, torch.randn(1, 3, 16, 16), quiet_wait_s=0)
    assert r.by_part == {} and "By part" not in str(r)
    assert "channels-not-multiple-of-8" in rules(r)


def test_lint_command_on_the_gpt_and_a_hugging_face_model(tmp_path, capsys):
    from torchspeed.cli import main

    out = tmp_path / "gpt.json"
    kwargs = json.dumps({**SMALL, "vocab_size": 250})
    assert main(["lint", "torchspeed.bench.gpt_model:gpt", "--model-kwargs", kwargs, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["input_shape"] == [1, 16] and d["by_part"]["attention"]["ops"] > 0
    assert "size-not-multiple-of-64" in {f["rule"] for f in d["findings"]}
    factory = tmp_path / "hf.py"
    factory.write_text("import transformers\n\ndef bert(**kw):\n"
                       "    return transformers.BertModel(transformers.BertConfig(vocab_size=256, hidden_size=64, "
                       "num_hidden_layers=1, num_attention_heads=2, intermediate_size=256, max_position_embeddings=32, "
                       "attn_implementation='eager'))\n")
    assert main(["lint", f"{factory}:bert", "--input-shape", "2,8", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["input_shape"] == [2, 8] and "hand-written-attention" in {f["rule"] for f in d["findings"]}
    assert "By part" in capsys.readouterr().out
