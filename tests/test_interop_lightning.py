"""FastLoader under Lightning: returned from a LightningDataModule and trained by `lightning.Trainer`
(one process; and two CPU processes under DDP, each rank reading its own shard with the same number
of steps), accelerate()'s choices applied by `AcceleratedCallback`, and Lightning's EarlyStopping
stopping where torchspeed's does. Lightning is a test-only dependency, imported only here."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import tiny_convnet
from torch import nn

L = pytest.importorskip("lightning")


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = tiny_convnet()
        self.seen = []  # (autocast dtype or None, input memory format is channels_last, weight NHWC)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.seen.append((autocast, self.net[0].weight.is_contiguous(memory_format=torch.channels_last)))
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Photos(L.LightningDataModule):
    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def train_dataloader(self):
        import torchspeed as ts

        return ts.data.fast_loader(self.folder, batch_size=4, train=True, crop=32, device="cpu", num_workers=0,
                                   threads=1)

    def val_dataloader(self):
        import torchspeed as ts

        return ts.data.fast_loader(self.folder, batch_size=4, train=False, crop=32, device="cpu", num_workers=0,
                                   threads=1)


def _trainer(**kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def test_fast_loader_from_a_datamodule_trained_by_lightning(small_photo_folder):
    module, dm = Classifier(), Photos(small_photo_folder)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = _trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 * len(dm.train_dataloader()) == 4  # 8 images, batch 4, two epochs
    assert any(not torch.equal(v, before[k]) for k, v in module.state_dict().items())  # it trained
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


def test_accelerated_callback_applies_precision_and_channels_last(small_photo_folder):
    import torchspeed as ts
    from torchspeed.train.lightning import AcceleratedCallback, lightning_precision, trainer_kwargs

    module, dm = Classifier(), Photos(small_photo_folder)
    batch = next(iter(dm.train_dataloader()))
    # what accelerate() would keep on a CPU with native bf16 (given here: this test runs anywhere)
    acc = ts.train.accelerate(module.net, precision="bf16", channels_last=True, compile=False, strategy=None,
                              device="cpu", example_batch=batch, loss_fn=nn.functional.cross_entropy)
    assert trainer_kwargs(acc) == {"precision": "bf16-mixed", "accelerator": "cpu"}
    assert [lightning_precision(p) for p in ("fp32", "bf16", "fp16")] == ["32-true", "bf16-mixed", "16-mixed"]
    module.net.to(memory_format=torch.contiguous_format)  # the callback, not accelerate, must convert it
    trainer = _trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0,
                       callbacks=[AcceleratedCallback(acc)])
    assert trainer.precision == "32-true"
    trainer.fit(module, datamodule=dm)
    assert trainer.precision == "bf16-mixed"
    assert module.seen and all(s == (torch.bfloat16, True) for s in module.seen)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # mixed: fp32 weights kept

    # a precision the user gave the Trainer is theirs: kept
    module = Classifier()
    trainer = _trainer(max_steps=1, limit_val_batches=0, precision="bf16-true", callbacks=[AcceleratedCallback(
        ts.train.accelerate(tiny_convnet(), precision="fp32", channels_last=False, compile=False, strategy=None,
                            device="cpu"))])
    trainer.fit(module, datamodule=dm)
    assert trainer.precision == "bf16-true"


def test_lightning_early_stopping_stops_where_torchspeeds_does(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping as LightningEarlyStopping

    from torchspeed.train import EarlyStopping

    losses = [1.0, 0.8, 0.79, 0.81, 0.8, 0.85, 0.9, 0.7, 0.6]

    class Scripted(Classifier):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", losses[self.current_epoch])

    x = torch.randn(4, 3, 8, 8)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tensor([0, 1, 0, 1])), batch_size=4)
    trainer = _trainer(max_epochs=len(losses), num_sanity_val_steps=0,
                       callbacks=[LightningEarlyStopping("val_loss", patience=3, min_delta=0.015)])
    trainer.fit(Scripted(), dl, dl)

    class Stub:
        should_stop = False

    ours, stub, checks = EarlyStopping("val_loss", patience=3, min_delta=0.015), Stub(), 0
    while not stub.should_stop:
        ours.on_validation_end(stub, {"val_loss": losses[checks]})
        checks += 1
    assert trainer.current_epoch == checks == 5  # the same check, the same semantics


DDP_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import lightning as L
    import torch
    from torch import nn
    import torchspeed as ts

    folder, out = sys.argv[1], sys.argv[2]


    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2))
            self.seen = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen += [round(float(v), 3) for v in x.float().sum((1, 2, 3))]  # which images this rank read
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)


    class Data(L.LightningDataModule):
        def train_dataloader(self):  # built under the process group Lightning has set up
            self.loader = ts.data.fast_loader(folder, batch_size=3, train=False, crop=32, device="cpu",
                                              num_workers=0, threads=1)
            return self.loader


    module, data = Module(), Data()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"steps": trainer.global_step, "seen": module.seen, "len": len(data.loader),
                   "world": data.loader.batch_sampler.num_replicas}, f)
''')


@pytest.mark.slow
def test_fast_loader_built_in_train_dataloader_is_sharded_under_lightning_ddp(tmp_path):
    import torchspeed as ts

    folder = ts.data.make_photo_folder(tmp_path / "photos", 7, n_classes=2, seed=0, size=(48, 36), num_workers=1)
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        proc = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path)], capture_output=True,
                              text=True, timeout=240, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"Lightning DDP hung (killed after {e.timeout} s): {e.stderr!r:.2000}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 7 images over 2 ranks: 4 each (one seen twice, wrapped around), 2 batches of 3 + 1 on every rank
    assert r0["world"] == r1["world"] == 2
    assert r0["len"] == r1["len"] == 2 and r0["steps"] == r1["steps"] == 2
    assert len(r0["seen"]) == len(r1["seen"]) == 4
    single = ts.data.fast_loader(folder, batch_size=7, train=False, crop=32, device="cpu", num_workers=0,
                                 threads=1, num_replicas=1, rank=0)
    everything = {round(float(v), 3) for x, _ in single for v in x.float().sum((1, 2, 3))}
    assert set(r0["seen"]) | set(r1["seen"]) == everything  # every image read by some rank
    assert len(set(r0["seen"]) & set(r1["seen"])) <= 1  # disjoint shards, but for the one padding sample


def test_torchspeed_train_never_imports_lightning_or_accelerate():
    code = ("import sys, torchspeed as ts; ts.train.Trainer; ts.train.accelerate; ts.train.EarlyStopping; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
