"""Token batches in the script's process: how long each sample of a batch really is (its attention
mask, or the ids that are not the model's pad id), and the length-grouped order `doctor --try
length_grouped` feeds a DataLoader: the samples shuffled, cut into windows of 50 batches, each window
sorted by length, so a batch holds samples of similar length and pads less. It is the order of
transformers' `LengthGroupedSampler` (the code doctor prints uses that one), written here so the fix
needs no transformers. The share of padding and what grouping or packing would save are computed in the
parent (`padding`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["MEGA_BATCHES", "LengthGrouped", "sample_lengths", "token_tensors", "token_lengths"]

MEGA_BATCHES = 50  # batches per sorted window (transformers' default)
MAX_SAMPLES = 200_000  # datasets read for their lengths at most this long (one pass over the samples)


def token_tensors(batch: Any) -> tuple[Any, Any] | None:
    """(attention mask or None, token ids or None) of a token batch: a dict with `attention_mask` /
    `input_ids`, or a tuple whose first tensor holds 2-D integer ids. None for other batches."""
    if isinstance(batch, Mapping):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        mask, ids = None, batch[0]
    else:
        return None
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() else None
    return (mask, ids) if mask is not None or ids is not None else None


def token_lengths(tensors: tuple[Any, Any], pad_id: int | None) -> tuple[list[int], int, str] | None:
    """(each row's real length, the padded length, what said so) from `token_tensors`' pair: the mask's
    ones, or the ids that are not `pad_id`; None when neither can tell."""
    mask, ids = tensors
    read = torch._C.TensorBase  # unpatched reads: doctor's own, not the loop's host syncs
    if mask is not None:
        return read.tolist(read.cpu(mask.ne(0).sum(-1))), int(mask.shape[-1]), "attention_mask"
    if ids is not None and pad_id is not None:
        return read.tolist(read.cpu(ids.ne(pad_id).sum(-1))), int(ids.shape[-1]), f"pad id {pad_id}"
    return None


def sample_lengths(dataset: Any) -> list[int] | None:
    """The length of every sample of a map-style token Dataset (`input_ids`, or the first element's), or
    None where the Dataset is not one (no length, too long to read once, not token samples)."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    if not 0 < n <= MAX_SAMPLES:
        return None
    out = []
    try:
        for i in range(n):
            item = dataset[i]
            ids = item.get("input_ids") if isinstance(item, Mapping) else \
                item[0] if isinstance(item, (list, tuple)) else None
            if ids is None or isinstance(ids, (str, bytes)):
                return None
            mask = item.get("attention_mask") if isinstance(item, Mapping) else None
            out.append(int(sum(mask)) if mask is not None and len(mask) == len(ids) else len(ids))
    except (TypeError, KeyError, IndexError):
        return None
    return out


class LengthGrouped:
    """A sampler of a Dataset's indices, each once per epoch, in length-grouped order: a random
    permutation (torch's generator, so the script's seed holds) cut into windows of MEGA_BATCHES
    batches, each sorted by length, longest first; the longest sample's batch leads, so memory peaks
    at once."""

    def __init__(self, lengths: list[int], batch_size: int, generator: Any = None):
        self.lengths, self.batch_size, self.generator = list(lengths), int(batch_size), generator

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        n = len(self.lengths)
        window = max(1, min(n // (self.batch_size * 4), MEGA_BATCHES)) * self.batch_size
        order = torch.randperm(n, generator=self.generator).tolist()
        groups = [sorted(order[i:i + window], key=lambda j: -self.lengths[j]) for i in range(0, n, window)]
        longest = max(range(len(groups)), key=lambda g: self.lengths[groups[g][0]])
        groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
        return iter([j for g in groups for j in g])
