"""doctor's phases on every common kind of training loop (in this process, Recorder installed): a
closure step (as Lightning's automatic optimisation runs it), manual updates on p.data without
torch.optim, gradient accumulation, dict batches, Lightning's Trainer.fit, DDP under torchrun."""
import json
import sys
import textwrap

import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchspeed.doctor import patches
from torchspeed.doctor.recorder import Recorder
from torchspeed.doctor.launch import build_payload


def _recorded(loop, max_steps=None):
    torch.manual_seed(0)
    rec = Recorder(max_steps=max_steps)
    rec.install()
    try:
        loop()
    except SystemExit:
        pass
    finally:
        rec.uninstall()
    return rec


def _assert_phases(rec, steps, source="optimizer"):
    """`steps` steps, forward and backward both measured in the steady steps, phases <= wall."""
    d = build_payload(rec.results(), ["python", "t.py"], 0)
    assert d["steps"] >= steps and d["settings"]["step_source"] == source
    ph = d["steady"]["phases"]
    assert ph["forward"] > 0 and ph["backward"] > 0, ph
    assert sum(v for k, v in ph.items() if k != "other") <= d["steady"]["wall_s"] * 1.001
    return d


def test_closure_step_counts_forward_and_backward_not_optimizer():
    loader, model = separable_loader(24, 4), tiny_convnet()

    def loop():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)

    d = _assert_phases(_recorded(loop), 6)
    ph = d["steady"]["phases"]
    # the forward and backward its closure runs are theirs, not the step's (whose own work is small: a bound
    # with room for a busy machine's preemptions, far under what the step would hold with the closure's work)
    assert ph["optimizer"] < 2 * (ph["forward"] + ph["backward"])
    assert d["steps"] == 6 and d["settings"]["backward_calls"] == 6


def test_lbfgs_closure_several_evaluations_are_one_step():
    loader, model = separable_loader(24, 4), tiny_convnet()

    def loop():
        opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
        for x, y in loader:
            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)

    rec = _recorded(loop)
    d = _assert_phases(rec, 6)
    assert d["steps"] == 6 and rec.s["backward_calls"] > 6


def test_manual_sgd_without_torch_optim_steps_at_each_backward():
    loader, model = separable_loader(24, 4), tiny_convnet()

    def loop():
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data -= 0.1 * p.grad

    rec = _recorded(loop, max_steps=4)
    d = _assert_phases(rec, 4, source="backward")
    assert d["steps"] == 4 and rec.s["backward_calls"] == 4  # --steps stops after 4 backward calls


def test_gradient_accumulation_is_one_step_per_optimizer_step():
    loader, model = separable_loader(32, 4), tiny_convnet()

    def loop():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            (nn.functional.cross_entropy(model(x), y) / 4).backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()

    rec = _recorded(loop)
    d = _assert_phases(rec, 2)
    assert d["steps"] == 2 and rec.s["backward_calls"] == 8
    assert all(w["samples"] == 16 for w in rec.windows)  # four micro-batches of 4 per step


class _DictData(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(6, generator=g), "labels": torch.tensor(i % 3)}


class _HFLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 3)

    def forward(self, pixel_values, labels=None):
        logits = self.body(pixel_values)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def test_dict_batches_model_called_with_keywords():
    loader, model = DataLoader(_DictData(), batch_size=4), _HFLike()

    def loop():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in loader:
            out = model(**batch)
            out["loss"].backward()
            opt.step()
            opt.zero_grad()

    rec = _recorded(loop, max_steps=5)
    d = _assert_phases(rec, 5)
    assert d["steps"] == 5 and d["settings"]["loaders"][0]["batches"] == 5
    assert rec.batch_prints[0] == [[4, 6], [0, 1, 2, 0]]  # labels seen, images by shape
    # model(**batch) passes no positional tensor: its batch is read from the keywords
    assert d["settings"]["input"]["shape"] == [4, 6]
    assert d["throughput"] == pytest.approx(4 * d["steady"]["steps"] / d["steady"]["wall_s"], rel=1e-6)


def test_autocast_around_a_model_called_with_keywords_is_seen():
    loader, model = DataLoader(_DictData(), batch_size=4), _HFLike()

    def loop():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(**batch)
            out["loss"].float().backward()
            opt.step()
            opt.zero_grad()

    d = build_payload(_recorded(loop, max_steps=4).results(), ["python", "t.py"], 0)
    assert d["settings"]["autocast"] is True and d["settings"]["autocast_precision"] == "bf16"


def test_float_bool_int_of_tensors_are_host_reads(monkeypatch):
    """float(t), int(t), bool(t) and .item() in the loop read a value on the host: free on CPU (not
    counted), a host sync on CUDA (faked here: the device check says every read waits)."""
    loader, model = separable_loader(8, 4), tiny_convnet()

    def loop():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            float(loss), int(y[0]), bool(loss > 0), loss.item()

    assert _recorded(loop).s["host_syncs"] == 0  # on CPU a read waits for nothing
    monkeypatch.setattr(patches, "_waits_for_device", lambda t: True)
    rec = _recorded(loop)
    assert rec.s["host_syncs"] >= 2 * 4  # four reads per step, two steps (torch's own reads may add)
    base = rec.s["host_syncs"]
    float(torch.ones(()))  # uninstalled: not counted
    assert rec.s["host_syncs"] == base


def test_losses_kept_without_sync_and_read_at_the_end():
    loader, model = separable_loader(8, 4), tiny_convnet()
    seen = []

    def loop():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(float(loss))

    raw = _recorded(loop).results()
    assert raw["losses"] == pytest.approx(seen)


@pytest.mark.timeout(120)
def test_lightning_trainer_fit():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_convnet()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def loop():
        trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Module(), separable_loader(24, 4))

    rec = _recorded(loop)
    d = _assert_phases(rec, 6)
    assert d["steps"] == 6 and d["settings"]["optimizers"] == ["SGD"]
    assert d["settings"]["loaders"][0]["batches"] >= 6


DDP_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    loader = DataLoader(data, batch_size=4, sampler=torch.utils.data.distributed.DistributedSampler(data))
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
""")


def _doctor_under_torchrun(tmp_path, script_text: str) -> dict:
    """`torchspeed doctor --steps 4 -- torchrun --standalone --nproc-per-node 2 SCRIPT`: its JSON report."""
    from torchspeed.cli import main

    script = tmp_path / "train.py"
    script.write_text(script_text)
    code = main(["doctor", "--steps", "4", "--json", str(tmp_path / "d.json"), "--", "torchrun", "--standalone",
                 "--nproc-per-node", "2", str(script)])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["steps"] == 4 and d["ranks"] == 2
    assert d["steady"]["phases"]["forward"] > 0 and d["steady"]["phases"]["backward"] > 0
    return d


@pytest.mark.slow  # two torch processes start: ~25 s on 2 busy cores
@pytest.mark.timeout(180)
def test_ddp_under_torchrun_gloo_cpu(tmp_path):
    assert _doctor_under_torchrun(tmp_path, DDP_SCRIPT)["settings"]["parallel"] == "DistributedDataParallel"


FSDP_SCRIPT = DDP_SCRIPT.replace(
    "model = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))",
    "from torch.distributed.fsdp import fully_shard\n"
    "model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))\n"
    "fully_shard(model)")


@pytest.mark.slow  # two torch processes start: ~25 s on 2 busy cores
@pytest.mark.timeout(180)
def test_fsdp_under_torchrun_gloo_cpu(tmp_path):
    assert _doctor_under_torchrun(tmp_path, FSDP_SCRIPT)["settings"]["parallel"] == "FSDP"


def test_torchrun_command_starts_every_worker_through_the_bootstrap(tmp_path):
    from torchspeed.doctor.launch import child_command

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cmd = child_command(["torchrun", "--standalone", "--nproc-per-node", "2", str(script), "--lr", "1"])
    i = cmd.index("--no-python")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[3:i] == ["--standalone", "--nproc-per-node", "2"]
    assert cmd[i + 2] == "-c" and cmd[i + 4:] == ["script", str(script), "--lr", "1"]
    same = child_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(script)])
    assert same[same.index("--no-python") + 1] == sys.executable
    with pytest.raises(ValueError, match="torchrun"):
        child_command(["torchrun", "--nproc-per-node", "2", "-m", "pkg.train"])


def test_the_input_is_read_from_a_batch_dict_but_not_from_a_list_of_images():
    from torchspeed.doctor.recorder import _first_tensor

    x = torch.zeros(4, 6)
    assert _first_tensor(({"pixel_values": x, "labels": torch.zeros(4)},)) is x  # model(batch)
    assert _first_tensor(({"pixel_values": x}.values())) is x  # model(**batch): the keywords' values
    assert _first_tensor(([torch.zeros(3, 8, 8), torch.zeros(3, 8, 8)],)) is None  # a detection model's images
