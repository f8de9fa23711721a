"""The CUDA paths whose choices tests/test_gpu_static.py checks on the CPU, run on a GPU (`pytest -m gpu`):
a fused optimizer's fp16 steps without a host wait, the decoder race against nvjpeg ending on the device,
and (with two GPUs) a loader built before the rank's GPU was set making its batches on that GPU."""
import io

import numpy as np
import pytest
import torch
from helpers import separable_loader
from PIL import Image
from torch import nn

from torchspeed.data import fast_loader, threads
from torchspeed.data.augment import RandomResizedCropFlip, sample_rng
from torchspeed.data.decoder_choice import CropWork, copied_to, measure_decoders
from torchspeed.train import Callback, Trainer, accelerate

pytestmark = [pytest.mark.gpu,  # without a usable CUDA device the GPU suite fails (conftest.py), never skips
              pytest.mark.filterwarnings("error:nvjpeg could not decode:RuntimeWarning")]


def _photos(n=6):
    out = []
    for i in range(n):
        yy, xx = np.mgrid[0:120, 0:160]
        img = np.clip(90 + 60 * np.sin(xx[..., None] / (7 + i)) + 40 * np.cos(yy[..., None] / 9), 0, 255)
        buf = io.BytesIO()
        Image.fromarray(np.repeat(img, 3, axis=2).astype(np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 2))


def test_fused_fp16_steps_wait_for_nothing_and_skipped_steps_are_still_counted():
    """fp16 with fused AdamW: from the end of step 1 to the end of step 6 any host sync raises; an inf
    injected into step 3's gradients is skipped on the device and counted at the next reading point."""
    first = torch.tensor([0], device="cuda")  # made here: a copy from the host inside the window would sync

    class Watch(Callback):
        def on_step_end(self, trainer, step, metrics):
            torch.cuda.set_sync_debug_mode("error" if 1 <= step < 6 else 0)
            if step == 2:
                p = next(trainer.module.parameters())
                p.register_hook(lambda g: g.index_fill(0, first, float("inf"))
                                if trainer.global_step == 2 else g)

    model = _mlp(4)
    tr = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
                 callbacks=[Watch()], log_every_n_steps=1000, precision="fp16", channels_last=False, compile=False,
                 progress=False, device="cuda", accelerate_kwargs={"fused_optimizer": True})
    try:
        res = tr.fit(separable_loader(128, 16, size=4, device="cuda"), epochs=1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tr.report.optimizer == "fused" and res["step"] == 8
    assert res["skipped_steps"] >= 1  # the injected inf, read with the losses at the epoch's end
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_queue_step_hands_back_the_finding_on_the_device():
    model = _mlp(5).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = accelerate(model, opt, precision="fp16", channels_last=False, compile=False, device="cuda")
    x, y = torch.randn(16, 3, 4, 4, device="cuda"), torch.randint(0, 2, (16,), device="cuda")
    with acc.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    taken = acc.queue_step(opt)
    assert isinstance(taken, torch.Tensor) and taken.is_cuda and bool(taken)


def test_the_decoder_race_on_the_gpu_ends_with_each_contenders_batch_on_the_device():
    samples = _photos()
    transform = RandomResizedCropFlip(32)
    crops = CropWork([120] * 6, [160] * 6, [transform.box(120, 160, sample_rng(0, 0, i)) for i in range(6)], 32)
    on_device = crops.render_on_device([torch.zeros(3, 120, 160, dtype=torch.uint8, device="cuda")] * 6, "cuda")
    assert on_device.is_cuda and tuple(on_device.shape) == (6, 3, 32, 32)
    host = [np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)]
    (copied,) = copied_to("cuda", host)
    assert copied.is_cuda and torch.equal(copied.cpu(), torch.from_numpy(host[0]))
    rows = measure_decoders(samples, decoders=["pil", "nvjpeg"], repeats=2, device="cuda", crops=crops)
    assert all(r["us_per_image"] for r in rows), rows


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs (a rank's GPU other than GPU 0)")
def test_a_loader_built_before_the_ranks_gpu_was_set_makes_its_batches_there(photo_store):
    """As under torchrun with the Trainer: the loader is built while GPU 0 is current, then the rank's GPU
    is set (here GPU 1); the nvjpeg threads and the prefetcher work on GPU 1."""
    loader = fast_loader(photo_store, 8, crop=32, device="cuda", num_workers=0, threads=2, decoder="nvjpeg")
    seen = []
    try:
        torch.cuda.set_device(1)
        made = list(threads.ThreadedBatches(lambda keys: seen.append(torch.cuda.current_device()) or keys,
                                            [[0], [1], [2]], 2))
        assert made == [[0], [1], [2]] and seen == [1, 1, 1]
        x, y = next(iter(loader))
        assert x.device == torch.device("cuda", 1) and y.device == torch.device("cuda", 1)
    finally:
        torch.cuda.set_device(0)
