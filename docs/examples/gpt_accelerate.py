"""Plain eager training of a small GPT against the same loop after `ts.train.accelerate` (docs/train.md,
"Transformers"): the loop calls `model(x, y) -> (logits, loss)`, as nanoGPT's does.

    python docs/examples/gpt_accelerate.py                       # 4 layers, width 256, vocab 8192, batch 8 x 128
    python docs/examples/gpt_accelerate.py --layers 6 --width 384 --steps 5000

Prints accelerate()'s report (what the trials timed, every option with its step, compile seconds, gain
and break-even step), its wall time on the first call (measured) and the second (remembered), then
training steps of plain eager and of the accelerated model timed interleaved on the same batch: their
medians and the ratio. Random init and random tokens: nothing is downloaded.
"""
import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchspeed as ts


class Block(nn.Module):
    """Pre-norm causal self-attention (torch's SDPA) + a 4x MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm, a head tied to the token embedding."""

    def __init__(self, vocab: int, block: int, layers: int, width: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1]]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="expected_steps (default: accelerate's horizon)")
    p.add_argument("--repeats", type=int, default=10, help="interleaved timing repeats")
    a = p.parse_args()
    torch.manual_seed(0)
    plain = GPT(a.vocab, a.block, a.layers, a.width, a.heads)
    data = torch.randint(0, a.vocab, (a.batch, a.block + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    twin = copy.deepcopy(plain)
    t0 = time.perf_counter()
    acc = ts.train.accelerate(twin, torch.optim.AdamW(twin.parameters(), lr=3e-4), example_batch=(x, y),
                              expected_steps=a.steps, refresh=True)
    first_s = time.perf_counter() - t0
    print(acc.report)
    again = copy.deepcopy(plain)
    t0 = time.perf_counter()
    ts.train.accelerate(again, torch.optim.AdamW(again.parameters(), lr=3e-4), example_batch=(x, y),
                        expected_steps=a.steps)
    print(f"accelerate(): {first_s:.1f} s measuring, {time.perf_counter() - t0:.2f} s remembered")

    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4)

    def step(model, optimizer):
        def run():
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    accelerated = step(acc.model, acc.optimizer)
    t0 = time.perf_counter()
    accelerated()  # a kept compile compiles here (the trial's compiled code is reused where it can be)
    print(f"first accelerated step: {time.perf_counter() - t0:.1f} s")
    c = ts.measure.compare({"plain eager": step(plain, plain_opt), "torchspeed accelerate": accelerated},
                           warmup=2, repeats=a.repeats)
    tokens = a.batch * a.block
    for name in ("plain eager", "torchspeed accelerate"):
        t = c[name]
        print(f"{name:22s} {t.median_s * 1e3:8.1f} ms/step  {tokens / t.median_s:10,.0f} tokens/s  "
              f"(min..max {t.min_s * 1e3:.1f}..{t.max_s * 1e3:.1f} ms)")
    print(f"ratio (accelerate / plain, tokens/s): {c.speedup('torchspeed accelerate'):.2f}x"
          + (f"  [busy: {c.others_cores:.1f} cores used by others]" if c.others_cores and c.others_cores > 0.25
             else ""))


if __name__ == "__main__":
    main()
