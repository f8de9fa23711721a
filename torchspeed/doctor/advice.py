"""Findings and the fixes they map to: every finding names the torchspeed feature or setting that
fixes it, an estimate of what it saves, and the command that measures the fix on this machine.

The fix text and the measuring command live in one registry (`FIXES`), keyed by the stable rule
id, so rules only say what they saw and how much it costs. Loop rules' commands run on the user's own
script (`torchspeed doctor --try FIX -- python your_train.py`; doctor puts the real command in).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Finding", "FIXES", "finding", "rank"]

SEVERITY_ORDER = {"bug": 0, "speed": 1, "info": 2}


@dataclass
class Finding:
    """One thing worth changing. `expected_gain` is the estimated fraction of step time (doctor,
    profile) or forward time (lint) it saves, 0..1; bugs carry 0 and rank first regardless."""

    rule: str
    message: str
    fix: str
    expected_gain: float
    gain_basis: str
    command: str
    severity: str = "speed"
    where: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["expected_gain"] = round(float(self.expected_gain), 4)
        return d


@dataclass(frozen=True)
class Fix:
    fix: str
    command: str
    severity: str = "speed"


FIXES: dict[str, Fix] = {
    # loop / settings rules (doctor, profile)
    "loader-no-workers": Fix(
        "load batches in worker processes so loading overlaps the step: DataLoader(num_workers=N, "
        "persistent_workers=True)",
        "torchspeed doctor --try workers -- python your_train.py"),
    "loader-not-persistent": Fix(
        "keep workers alive across epochs: DataLoader(..., persistent_workers=True) (fast_loader does)",
        "torchspeed doctor --try persistent_workers -- python your_train.py"),
    "data-bound": Fix(
        "feed the model faster: ts.data.pack (one LMDB file instead of many JPEGs, resized once), "
        "ts.data.fast_loader (tuned workers, device-side normalisation), ts.data.DevicePrefetcher",
        "torchspeed doctor --try workers,persistent_workers,pin_memory -- python your_train.py"),
    "no-autocast": Fix(
        "train in mixed precision: ts.train.accelerate(model, optimizer, precision='auto') or "
        "`with torch.autocast(device_type, dtype=torch.bfloat16)` around forward and loss",
        "torchspeed doctor --try bf16,fp16 -- python your_train.py"),
    "bf16-emulated": Fix(
        "keep fp32: without native bf16 instructions this CPU emulates bf16; on a machine with them "
        "(avx512_bf16, amx_bf16) or a tensor-core GPU, `doctor --try bf16` measures it",
        "torchspeed info", "info"),
    "pin-memory-without-cuda": Fix(
        "drop pin_memory=True: there is no CUDA device, so pinning only costs host memory and a copy",
        "torchspeed doctor -- python your_train.py", "info"),
    "no-pin-memory": Fix(
        "pin host batches and copy asynchronously: DataLoader(pin_memory=True) + .to(device, non_blocking=True), "
        "or ts.data.DevicePrefetcher (copies the next batch on a side stream)",
        "torchspeed doctor --try pin_memory -- python your_train.py"),
    "host-syncs": Fix(
        "keep the loss on the device; read it every N steps: accumulate `total += loss.detach()` and call "
        ".item() only when logging (the Trainer logs this way)",
        "torchspeed doctor --steps 50 -- python your_train.py"),
    "cudnn-benchmark-off": Fix(
        "let cuDNN pick the fastest kernels for static shapes: torch.backends.cudnn.benchmark = True "
        "(ts.train.accelerate does this when input shapes are fixed)",
        "torchspeed doctor --try cudnn_benchmark -- python your_train.py"),
    "data-parallel": Fix(
        "use DistributedDataParallel, one process per GPU (torchrun; ts.train.accelerate(strategy='ddp'))",
        "torchspeed doctor -- torchrun --nproc-per-node N your_train.py"),
    "eval-without-no-grad": Fix(
        "evaluate under torch.no_grad() / torch.inference_mode() (Trainer.evaluate does): no autograd graph "
        "is built, memory and time drop",
        "torchspeed doctor -- python your_train.py"),
    "train-mode-eval": Fix(
        "call model.eval() before evaluating (and model.train() after): Dropout and BatchNorm behave "
        "differently in train mode, so the metrics are wrong",
        "torchspeed doctor -- python your_train.py", "bug"),
    "cpu-oversubscribed": Fix(
        "keep loader workers/threads + intra-op threads within the cores: lower num_workers / threads "
        "(fast_loader(..., num_workers=N, threads=M) fixes them instead of timing the loader alone) or "
        "torch.set_num_threads(cores - num_workers)",
        "torchspeed doctor --try threads,workers -- python your_train.py"),
    "python-overhead": Fix(
        "cut Python and launch overhead: ts.train.accelerate(compile='auto') (torch.compile, measured), "
        "larger batches, fewer host syncs",
        "torchspeed doctor --try compile -- python your_train.py"),
    "no-channels-last": Fix(
        "use channels_last memory format for conv models: ts.train.accelerate(channels_last='auto') keeps it "
        "only where it measures faster (it can be slower in fp32)",
        "torchspeed doctor --try channels_last -- python your_train.py"),
    # transformer loops (doctor): attention and token padding (`transformer_rules`)
    "sdpa-backend": Fix(
        "run scaled_dot_product_attention with the backend measured fastest on the model's shapes: "
        "`with torch.nn.attention.sdpa_kernel(SDPBackend.NAME):` around the training loop",
        "torchspeed doctor --try sdpa -- python your_train.py"),
    "sdpa-backends": Fix(
        "nothing to change: torch's default SDPA backend is the fastest measured on the model's shapes",
        "torchspeed doctor --try sdpa -- python your_train.py", "info"),
    "hand-written-attention": Fix(
        "compute attention with torch.nn.functional.scaled_dot_product_attention (fused kernels; no T x S "
        "score matrix kept for the backward); a transformers model: attn_implementation=\"sdpa\"",
        "torchspeed doctor --try -- python your_train.py"),
    "token-padding": Fix(
        "batch samples of similar length together and pad each batch to its longest: a length-grouped sampler "
        "(transformers' LengthGroupedSampler; a Trainer's train_sampling_strategy=\"group_by_length\"), or pack "
        "samples into full rows",
        "torchspeed doctor --try length_grouped -- python your_train.py"),
    # loss / activation pairing (doctor, profile, lint)
    "double-softmax": Fix(
        "feed raw logits to CrossEntropyLoss (it applies log_softmax itself): remove the final softmax, "
        "apply softmax only at inference if you need probabilities",
        "torchspeed lint MODEL --loss ce", "bug"),
    "softmax-nll": Fix(
        "NLLLoss expects log-probabilities: end the model with log_softmax (LogSoftmax + NLLLoss == "
        "CrossEntropyLoss on logits), not softmax or log(softmax(x))",
        "torchspeed lint MODEL --loss nll", "bug"),
    # model rules (lint), ShuffleNet V2 guidelines and inference rules
    "g1-channel-ratio": Fix(
        "G1: give 1x1 convs equal input and output widths (memory access is smallest at c1 = c2 for the "
        "same FLOPs); or prune/shrink the wide side with ts.compress.prune",
        "torchspeed bench design"),
    "g2-groups": Fix(
        "G2: use fewer groups (grouped convs read and write as much memory as dense ones for a fraction of "
        "the FLOPs); pick the backbone by measured latency: ts.compress.select_backbone",
        "torchspeed bench design"),
    "g3-fragmentation": Fix(
        "G3: merge small parallel branches into fewer, wider ops (one conv of the summed width); on "
        "inference, let a graph runtime fuse them: torchspeed optimize MODEL",
        "torchspeed bench design"),
    "g4-elementwise": Fix(
        "G4: fuse element-wise ops into their producers: torchspeed optimize MODEL (Conv+BN+ReLU fusion, "
        "ONNX Runtime / OpenVINO) or torch.compile via ts.train.accelerate(compile='auto')",
        "torchspeed optimize MODEL"),
    "unfused-bn": Fix(
        "fold BatchNorm into the preceding conv for inference: ts.infer.fuse_conv_bn(model) (exact up to "
        "float rounding; checked against the original)",
        "torchspeed optimize MODEL"),
    "channels-not-multiple-of-8": Fix(
        "round channel counts to multiples of 8 (vector units and tensor cores work in blocks of 8/16); "
        "ts.compress.prune can prune to rounded widths",
        "torchspeed bench design"),
    # transformer rules of lint (`transformer_lint`, which reports hand-written-attention too)
    "size-not-multiple-of-64": Fix(
        "pad the vocabulary to a multiple of 64 (nanoGPT: 50,257 -> 50,304; the extra logits are never targets; "
        "Hugging Face: model.resize_token_embeddings(n, pad_to_multiple_of=64)) and keep hidden sizes multiples of "
        "64: matmul kernels work in blocks, and a ragged edge runs a slower path",
        "torchspeed lint MODEL"),
    "dropout-at-inference": Fix(
        "run dropout in training only: F.dropout(x, p, training=self.training) (its default is training=True) "
        "and F.scaled_dot_product_attention(..., dropout_p=p if self.training else 0.0); nn.Dropout modules "
        "follow model.eval() by themselves",
        "torchspeed lint MODEL", "bug"),
    "untied-head": Fix(
        "tie the output head to the token embedding (GPT-2, BERT and nanoGPT do): model.lm_head.weight = "
        "model.<token embedding>.weight, or tie_word_embeddings=True in a Hugging Face config; it changes the "
        "model, so compare the loss it trains to",
        "torchspeed lint MODEL", "info"),
    "depthwise-heavy": Fix(
        "depthwise convs have low FLOPs but high memory access (G2/G4); check the backbone's measured "
        "latency, not its FLOPs: ts.compress.select_backbone",
        "torchspeed select --candidates a,b,c --input-shape 1,3,224,224", "info"),
}


def finding(rule: str, message: str, expected_gain: float, gain_basis: str, where: list[str] | None = None) -> Finding:
    """Build a Finding with the registered fix and command for `rule`."""
    fx = FIXES[rule]
    gain = 0.0 if fx.severity == "bug" else max(0.0, min(1.0, float(expected_gain)))
    return Finding(rule=rule, message=message, fix=fx.fix, expected_gain=gain, gain_basis=gain_basis,
                   command=fx.command, severity=fx.severity, where=list(where or []))


def rank(findings: list[Finding]) -> list[Finding]:
    """Bugs first, then by expected gain (largest first), then info."""
    return sorted(findings, key=lambda f: (SEVERITY_ORDER.get(f.severity, 3), -f.expected_gain, f.rule))
