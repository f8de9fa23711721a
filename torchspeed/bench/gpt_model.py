"""A small GPT of the nanoGPT kind, built from a config: the transformer the GPT suite trains and lint's
transformer rules are tried on (random init, generated tokens: nothing is downloaded).

Token + position embedding, `n_layer` blocks of causal self-attention (`F.scaled_dot_product_attention`, or
matmul-softmax-matmul written out with `attention="manual"`, as nanoGPT does without SDPA) and an MLP, a
final LayerNorm and a head tied to the token embedding. `forward(idx, targets=None) -> (logits, loss)`
like nanoGPT's: with targets, the logits of every position and the cross-entropy; without, the logits of
the last position only (its generation path) and no loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "gpt", "random_tokens"]


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes. The defaults are the GPT suite's: 4 layers of width 256, a 128-token context."""

    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    attention: str = "sdpa"  # "sdpa": F.scaled_dot_product_attention; "manual": matmul, softmax, matmul

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.attention not in ("sdpa", "manual"):
            raise ValueError(f"attention must be 'sdpa' or 'manual', got {self.attention!r}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout, self.manual = cfg.n_head, cfg.dropout, cfg.attention == "manual"
        if self.manual:
            mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block (pre-norm): the unit regional compilation compiles once for all."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: `forward(idx, targets=None) -> (logits, loss)`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
            "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
            "drop": nn.Dropout(cfg.dropout),
            "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        })
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block_size "
                             f"({self.config.block_size})")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # generation: the next token's logits only
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(**config: Any) -> GPT:
    """The model from keyword sizes (`GPTConfig`'s fields): the factory a model spec names,
    `torchspeed.bench.gpt_model:gpt`, e.g. `torchspeed lint torchspeed.bench.gpt_model:gpt`."""
    return GPT(GPTConfig(**config))


def random_tokens(batch: int, cfg: GPTConfig, seed: int = 0, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of generated token ids and its next-token targets, (batch, block_size) each."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)
