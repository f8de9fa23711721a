"""Activation checkpointing per block: same gradients, less memory held, and the model left as found."""
from __future__ import annotations

import copy

import pytest
import torch

from torchspeed.bench.gpt_model import GPT, GPTConfig, random_tokens
from torchspeed.memory import peak_of
from torchspeed.train.checkpointing import (
    blocks_checkpointed,
    checkpoint_blocks,
    checkpointed_blocks,
    uncheckpoint_blocks,
)

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64)


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_the_same_gradients_with_less_memory_held():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = random_tokens(8, CFG)
    plain = _grads(model, x, y)
    _, before = peak_of(lambda: model(x, y)[1], held=(model,))
    names = checkpoint_blocks(model, 2)
    assert names == ["transformer.h.0", "transformer.h.1"]
    _, after = peak_of(lambda: model(x, y)[1], held=(model,))  # the forward's activations still held at its end
    assert after.end_bytes < before.end_bytes
    for a, b in zip(plain, _grads(model, x, y)):
        torch.testing.assert_close(a, b)


def test_removable_and_the_state_dict_and_copies_unchanged():
    model = GPT(CFG)
    keys = list(model.state_dict())
    with blocks_checkpointed(model) as names:
        assert len(names) == CFG.n_layer and list(model.state_dict()) == keys
        twin = copy.deepcopy(model)
        assert checkpointed_blocks(twin) == names
        assert twin.transformer.h[0].forward.__self__ is twin.transformer.h[0]  # its own block, not the original's
    assert checkpointed_blocks(model) == [] and "forward" not in model.transformer.h[0].__dict__
    checkpoint_blocks(model, 1)
    with blocks_checkpointed(model, 3):
        pass
    assert checkpointed_blocks(model) == ["transformer.h.0"]  # what was checkpointed before stays so
    uncheckpoint_blocks(model)
    assert checkpointed_blocks(model) == []


def test_no_grad_runs_the_block_plainly():
    model = GPT(CFG).eval()
    x, _ = random_tokens(2, CFG)
    with torch.no_grad():
        ref = model(x)[0]
        checkpoint_blocks(model)
        torch.testing.assert_close(model(x)[0], ref)


def test_bad_requests_are_one_clear_error():
    with pytest.raises(ValueError, match="no repeated blocks"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has 3 repeated blocks"):
        checkpoint_blocks(GPT(CFG), 5)
