"""A Hugging Face Trainer script: a BERT classifier built from its config (random init, nothing
downloaded) trained on generated token ids of varied lengths, each batch padded to its longest sample
(what DataCollatorWithPadding does) with an attention mask. docs/doctor.md runs `torchspeed doctor
--try` on it unchanged.

    python docs/examples/train_bert_hf.py [--samples 2000 --hidden 128 --layers 4 ...] [--attn eager]
"""
import argparse
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

PAD_ID = 0


class TokenSamples(torch.utils.data.Dataset):
    """`n` samples of random token ids, lengths drawn between `min_len` and `max_len`, and a label."""

    def __init__(self, n, vocab_size, min_len, max_len, num_labels, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
        self.ids = [torch.randint(1, vocab_size, (n_tokens,), generator=g).tolist() for n_tokens in lengths]
        self.labels = torch.randint(0, num_labels, (n,), generator=g).tolist()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def pad_per_batch(samples):
    """Pad each batch to its longest sample, with the attention mask (DataCollatorWithPadding, tokenizer-free)."""
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, s in enumerate(samples):
        input_ids[row, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
        attention_mask[row, :len(s["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": torch.tensor([s["labels"] for s in samples])}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="the model's attention implementation")
    args = p.parse_args()

    config = BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(512, args.max_len), num_labels=2, pad_token_id=PAD_ID,
                        attn_implementation=args.attn)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    train = TokenSamples(args.samples, args.vocab_size, args.min_len, args.max_len, num_labels=2)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=5e-5, logging_steps=20, save_strategy="no", report_to="none", seed=0,
            use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=pad_per_batch)
        trainer.train()


if __name__ == "__main__":
    main()
