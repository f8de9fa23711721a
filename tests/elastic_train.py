"""The training script the torchrun tests launch (tests/test_train_elastic.py): one script for the first
attempt and every restart (resume="auto"), deterministic, on the CPU.

    python -m torch.distributed.run ... elastic_train.py OUT [--kill step:K | write:K | hang:K]
        [--strategy ddp|fsdp] [--max-steps N] [--epochs E] [--fast]

`--kill step:K`: on the first attempt rank 1 (rank 0 when alone) SIGKILLs itself after optimizer step K.
`--kill write:K`: on the first attempt rank 0 SIGKILLs itself half-way through writing the checkpoint of
step K. `--kill hang:K`: on the first attempt rank 1 stops (sleeps) after step K. What happened is
written to OUT/events.jsonl (one line per event, every rank and attempt); rank 0 writes the final
weights to OUT/final.pt.
"""
import argparse
import json
import logging
import os
import signal
import time

import torch
from torch import nn

from torchspeed.runtime import deterministic, seed_everything
from torchspeed.train import Callback, Checkpoint, Trainer
from torchspeed.train import checkpoint as ckpt

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--kill", default="")
p.add_argument("--strategy", default="auto")
p.add_argument("--max-steps", type=int, default=None)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--every", type=int, default=2)
p.add_argument("--fast", action="store_true", help="a FastLoader (its own shard of each epoch) instead of a DataLoader")
args = p.parse_args()

rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
kind, _, at = args.kill.partition(":")
kill_at = int(at) if at else -1


def event(**what):
    with open(os.path.join(args.out, "events.jsonl"), "a") as f:
        f.write(json.dumps({"rank": rank, "world": world, "attempt": attempt, "t": time.time(), **what}) + "\n")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Linear(16, 3))


class Logged(torch.utils.data.TensorDataset):
    """Records which samples this process reads (num_workers=0: in this process)."""

    read: list[int] = []

    def __getitem__(self, i):
        Logged.read.append(int(i))
        return super().__getitem__(i)


def data(n=128, batch=8):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(Logged(x, y), batch_size=batch, shuffle=True,
                                       generator=torch.Generator().manual_seed(2))


class Constant(torch.utils.data.Dataset):
    """Sample i is an image of the value i (whatever crop or flip), so the batch says which samples it holds."""

    classes = ["a", "b", "c"]

    def __len__(self):
        return 128

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i, dtype=torch.uint8), i % 3


def fast_data(batch=8):
    from torchspeed.data import fast_loader

    return fast_loader(Constant(), batch_size=batch, crop=8, device="cpu", num_workers=0, threads=1,
                       channels_last=False, scale=(1.0, 1.0), seed=3)


def log_inputs(module, inputs):
    """A FastLoader reads ahead, so what is trained on is read from the model's inputs (ImageNet-normalised)."""
    if module.training:
        Logged.read.extend(torch.round((inputs[0][:, 0, 0, 0] * 0.229 + 0.485) * 255).int().tolist())


def samples(trainer):
    """The samples read since the last report, as read in epoch `trainer.epoch` (0-based)."""
    event(what="samples", epoch=trainer.epoch, indices=Logged.read)
    Logged.read = []


class Faults(Callback):
    """Records where each attempt starts; kills a rank at the asked step (after that step's checkpoint)."""

    step = 0

    def on_train_start(self, trainer):
        event(what="start", step=trainer.global_step)
        Logged.read = []

    def on_epoch_end(self, trainer):
        samples(trainer)

    def on_train_end(self, trainer):
        if Logged.read:
            samples(trainer)

    def on_step_end(self, trainer, step, metrics):
        Faults.step = step
        if kind == "step" and attempt == 0 and step == kill_at and rank == min(1, world - 1):
            event(what="kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang" and attempt == 0 and step == kill_at and rank == min(1, world - 1):
            event(what="kill", step=step)  # alive, but never at the next collective
            time.sleep(3600)


if kind == "write":
    real_write = ckpt._HashingWriter.write

    def write(self, b):  # half-way through the checkpoint of step K: rank 0 dies mid-write
        if attempt == 0 and rank == 0 and Faults.step == kill_at and self.size > 4096:
            event(what="kill", step=kill_at)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, b)

    ckpt._HashingWriter.write = write

logging.basicConfig(level=logging.WARNING)
logging.getLogger("torchspeed").setLevel(logging.INFO)  # the resume='auto' line
deterministic(True)
seed_everything(0)
model = net()
if args.fast:
    model.register_forward_pre_hook(log_inputs)
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.functional.cross_entropy,
                  precision="fp32", channels_last=False, compile=False, strategy=args.strategy, device="cpu",
                  progress=False, callbacks=[Faults(), Checkpoint(os.path.join(args.out, "ck"),
                                                                  every_n_steps=args.every)])
result = trainer.fit(fast_data() if args.fast else data(), epochs=args.epochs, max_steps=args.max_steps, resume="auto")
if args.strategy == "fsdp":
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
else:
    weights = trainer.module.state_dict()
if rank == 0:
    torch.save({k: v.detach().clone() for k, v in weights.items()}, os.path.join(args.out, "final.pt"))
event(what="done", step=result["step"])
