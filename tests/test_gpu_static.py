"""The CUDA paths' choices, checked on the CPU: what the GPU code hands to torch and torchvision (devices,
streams, DDP's arguments, the optimizer step's host reads), seen through stand-ins for the CUDA calls.
tests/test_gpu_paths.py runs the same paths on a GPU."""
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from torchspeed.bench import ceilings
from torchspeed.data import decode, decoder_choice, prefetch, threads
from torchspeed.data.augment import RandomResizedCropFlip, sample_rng
from torchspeed.infer import runners
from torchspeed.train import strategy, trainer
from torchspeed.train.choices import AccelerateOptions, AccelerateResult
from torchspeed.train.prepared import Accelerated
from torchspeed.train.step_timer import StepTimer


def _jpegs(n=4, size=(48, 64)):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _nvjpeg_on_the_cpu(data, device):
    """torchvision's batched nvjpeg call, stood in for by PIL on the CPU (CHW uint8, as nvjpeg returns)."""
    return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(t.numpy()))).convert("RGB")).copy()).permute(2, 0, 1)
            for t in data]


@pytest.fixture
def gpu_index(monkeypatch):
    """A CUDA machine whose current device (of every thread) is the one set here: 2."""
    current = {"index": 2}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    return current


# ---------------------------------------------------------------- nvjpeg: its device, no lock of ours
def test_nvjpeg_is_given_the_indexed_device_of_the_decoding_thread(gpu_index, monkeypatch):
    """torchvision makes its nvjpeg decoder again for every other device it is given ("cuda" is not
    "cuda:0"): a bare "cuda" reaches it as this thread's GPU."""
    seen = []
    monkeypatch.setattr(decode, "_nvjpeg", lambda data, device: seen.append(device) or _nvjpeg_on_the_cpu(data, device))
    out = decode.decode_jpeg_batch_cuda(_jpegs(2), "cuda")
    assert seen == [torch.device("cuda", 2)] and [tuple(t.shape) for t in out] == [(3, 48, 64)] * 2
    decode.decode_jpeg_batch_cuda(_jpegs(1), "cuda:0")
    assert seen[-1] == torch.device("cuda", 0)  # an explicit index is kept
    assert decode.indexed_cuda("cuda") == torch.device("cuda", 2)


def test_nvjpeg_batches_of_two_threads_are_not_serialised_by_torchspeed(gpu_index, monkeypatch):
    """Two decoding threads are inside the nvjpeg call at once: a barrier both must reach from inside it
    would time out if torchspeed held a lock around the call."""
    inside = threading.Barrier(2, timeout=10)

    def nvjpeg(data, device):
        inside.wait()  # BrokenBarrierError here: the other thread could not get in
        return _nvjpeg_on_the_cpu(data, device)

    monkeypatch.setattr(decode, "_nvjpeg", nvjpeg)
    errors, results = [], []

    def work():
        try:
            results.append(decode.decode_jpeg_batch_cuda(_jpegs(2), "cuda"))
        except Exception as e:  # handed to the test thread
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(30)
    assert not errors and len(results) == 2


# ---------------------------------------------------------------- the decoder race against nvjpeg
class _FakeNvjpeg(decode.Decoder):
    name = "nvjpeg"
    batched = True

    def __init__(self):
        self.calls = 0

    def decode_batch(self, buffers, names=None):
        self.calls += 1
        return _nvjpeg_on_the_cpu([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in buffers], "cuda")


def test_the_decoder_race_against_nvjpeg_ends_with_the_same_pixels_on_the_device(monkeypatch):
    """With nvjpeg competing: the same samples; nvjpeg crops and resizes on the device, the CPU decoders'
    crops are copied there (pinned), and every timing waits for the device."""
    samples = _jpegs(6)
    transform = RandomResizedCropFlip(24)
    crops = decoder_choice.CropWork([48] * 6, [64] * 6, [transform.box(48, 64, sample_rng(0, 0, i)) for i in range(6)],
                                    24)
    fake = _FakeNvjpeg()
    real_get = decoder_choice.get_decoder
    monkeypatch.setattr(decoder_choice, "get_decoder", lambda name: fake if name == "nvjpeg" else real_get(name))
    copies, on_device, timed_on = [], [], []
    monkeypatch.setattr(decoder_choice, "copied_to", lambda device, pixels: copies.append((device, pixels)) or pixels)
    real_render = decoder_choice.CropWork.render_on_device
    monkeypatch.setattr(decoder_choice.CropWork, "render_on_device",
                        lambda self, images, device: on_device.append((device, len(images)))
                        or real_render(self, images, "cpu"))
    real_compare = decoder_choice.compare

    def compare(contenders, **kw):
        timed_on.append(kw.get("device"))
        return real_compare(contenders, **{**kw, "device": None})

    monkeypatch.setattr(decoder_choice, "compare", compare)
    rows = decoder_choice.measure_decoders(samples, decoders=["pil", "nvjpeg"], repeats=2, device="cuda",
                                           cpu_threads=1, crops=crops)
    assert [r["decoder"] for r in rows] == ["pil", "nvjpeg"] and all(r["us_per_image"] for r in rows)
    assert timed_on == ["cuda"]  # each timing synchronised on the device
    runs = len(copies)  # the check run, the warm-up and the timed runs, as many for each contender
    assert runs >= 4 and all(d == "cuda" for d, _ in copies)
    # the CPU decoder's pixels copied are the crops of the batch, one per sample
    assert sum(p.shape[0] if p.ndim == 4 else 1 for p in copies[0][1]) == 6
    assert all(p.shape[-3:] == (3, 24, 24) for p in copies[0][1])
    assert on_device == [("cuda", 6)] * runs and fake.calls == 1 + runs  # + the whole decode for the PSNR


# ---------------------------------------------------------------- every rank's helper threads on its GPU
def test_helper_threads_take_the_consumers_cuda_device(gpu_index, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    gpu_index["index"] = 3  # as torchrun's rank 3 set it in its main thread before iterating
    made = list(threads.ThreadedBatches(lambda keys: keys, [[0], [1], [2], [3]], 2))
    assert made == [[0], [1], [2], [3]]
    assert sorted(calls) == [("torchspeed-decode-0", 3), ("torchspeed-decode-1", 3)]  # helpers only


def test_helper_threads_leave_cuda_alone_when_the_consumer_never_used_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("CUDA initialised by a CPU loader"))
    assert threads.consumer_cuda_device() is None
    assert list(threads.ThreadedBatches(lambda keys: keys, [[0], [1]], 2)) == [[0], [1]]


def test_prefetcher_reads_its_gpu_when_a_pass_starts_not_when_built(gpu_index):
    """A loader is built before the Trainer sets this rank's GPU: its bare "cuda" is read per pass."""
    gpu_index["index"] = 0
    p = prefetch.DevicePrefetcher([], device="cuda")
    gpu_index["index"] = 1  # torch.cuda.set_device(LOCAL_RANK) after the loader was built
    assert p.device == torch.device("cuda") and p.device_now() == torch.device("cuda", 1)
    assert prefetch.DevicePrefetcher([], device="cuda:0").device_now() == torch.device("cuda", 0)


def test_trainer_sets_the_ranks_device_before_reading_the_example_batch(monkeypatch):
    order = []
    real_resolve, real_example = trainer.resolve_strategy, trainer.example_batch_of
    monkeypatch.setattr(trainer, "resolve_strategy", lambda *a: order.append("set_device") or real_resolve(*a))
    monkeypatch.setattr(trainer, "example_batch_of", lambda loader: order.append("example") or real_example(loader))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 2, (4,))) for _ in range(2)]
    tr = trainer.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                         device="cpu", precision="auto", compile=False, channels_last=False, progress=False)
    tr.prepare(data)
    assert order[:2] == ["set_device", "example"]


# ---------------------------------------------------------------- fp16 steps of a fused optimizer
def _scaled_step_setup(fused, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = optimizer(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    acc = Accelerated(model=model, optimizer=opt, report=AccelerateResult(device="cpu", precision="fp16"),
                      device=torch.device("cpu"), module=model, scaler=torch.amp.GradScaler("cpu"))
    acc.backward(nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)))
    return model, acc


@pytest.fixture
def host_reads(monkeypatch):
    """Every read of a tensor's value by the host (bool(), .item(), .tolist()), counted."""
    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: reads.append(_name)
                            or _real(self, *a))
    return reads


def test_a_fused_optimizers_fp16_step_leaves_the_scalers_finding_unread(host_reads):
    model, acc = _scaled_step_setup(fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    host_reads.clear()
    taken = acc.queue_step(max_grad_norm=1.0)
    assert host_reads == []  # no host wait on the step's path
    assert isinstance(taken, torch.Tensor) and taken.dtype == torch.bool and bool(taken)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step was taken


def test_a_non_fused_fp16_step_reads_the_finding_once(host_reads):
    _, acc = _scaled_step_setup(fused=False, optimizer=torch.optim.SGD)  # (AdamW reads its CPU step count)
    host_reads.clear()
    assert acc.queue_step() is True and host_reads == ["__bool__"]


def test_a_fused_fp16_step_with_an_inf_gradient_is_skipped_on_the_device():
    model, acc = _scaled_step_setup(fused=True)
    model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    taken = acc.queue_step()
    assert not bool(taken) and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------- DDP's arguments
class _TwoHeads(nn.Module):
    def __init__(self, use_second):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 3)
        self.use_second = use_second

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.spare(h) if self.use_second else 0)


@pytest.mark.parametrize("use_second", [True, False])
def test_ddp_keeps_gradients_in_its_buckets_and_finds_unused_parameters_only_when_a_probe_finds_some(
        monkeypatch, use_second):
    made = {}
    monkeypatch.setattr(strategy, "DistributedDataParallel", lambda model, **kw: made.update(kw) or model)
    torch.manual_seed(0)
    model = _TwoHeads(use_second)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    timer = StepTimer((torch.randn(5, 6), torch.randint(0, 3, (5,))), nn.functional.cross_entropy,
                      torch.device("cpu"), steps=1, model=model)
    report = AccelerateResult(device="cpu", strategy="ddp")
    strategy.wrap_for_strategy(model, None, "ddp", AccelerateOptions(), report, torch.device("cpu"), timer=timer)
    assert made["gradient_as_bucket_view"] is True
    assert made["find_unused_parameters"] is (not use_second)
    decision = report.candidates[-1].decision
    assert ("spare.weight" in decision) is (not use_second)
    # the probe step left the model as it was: weights, no gradients
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert all(p.grad is None for p in model.parameters())


def test_ddp_without_an_example_batch_says_nothing_was_probed(monkeypatch):
    made = {}
    monkeypatch.setattr(strategy, "DistributedDataParallel", lambda model, **kw: made.update(kw) or model)
    report = AccelerateResult(device="cpu", strategy="ddp")
    strategy.wrap_for_strategy(_TwoHeads(False), None, "ddp", AccelerateOptions(), report, torch.device("cpu"))
    assert made["find_unused_parameters"] is False and "no example batch" in report.candidates[-1].decision


# ---------------------------------------------------------------- ONNX Runtime on this rank's GPU
def test_onnx_runtime_on_a_bare_cuda_device_runs_on_this_ranks_gpu(gpu_index, monkeypatch, tmp_path):
    asked = {}

    class Stream:
        cuda_stream = 1234

        def __init__(self, device):
            asked["stream_device"] = device

    class Stop(Exception):
        pass

    def providers(kind, precision, device_id, cache_dir, stream, profile):
        asked.update(kind=kind, device_id=device_id, stream=stream)
        raise Stop

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(runners, "ort_providers", providers)
    gpu_index["index"] = 1
    with pytest.raises(Stop):
        runners.OrtRunner(str(tmp_path / "model.onnx"), device="cuda")
    assert asked == {"stream_device": torch.device("cuda", 1), "kind": "cuda", "device_id": 1, "stream": 1234}


# ---------------------------------------------------------------- GPU ceilings
def test_gpu_rows_are_judged_against_the_gpu_ceiling_of_their_precision():
    assert [ceilings.gpu_ceiling(c) for c in ("fp32", "bf16", "int8", "decode", "mem_bw", "nvjpeg")] == \
        ["gpu_tf32", "gpu_bf16", "gpu_int8", "nvjpeg", "gpu_mem_bw", "nvjpeg"]
    results = {"infer": {"device": "cuda", "rows": [{"technique": "int8", "median": 2.0, "unit": "ms", "batch": 8,
                                                     "flops_per_item": 1e9, "ceiling": "int8"}]}}
    items = {"int8": {"value": 100.0}, "gpu_int8": {"value": 400_000.0}}
    ceilings.annotate(results, {"items": items})
    row = results["infer"]["rows"][0]
    assert row["ceiling"] == "gpu_int8" and row["pct_of_ceiling"] == pytest.approx(100 * 4000 / 400_000)
