"""Each measuring entry point keeps how busy the machine was while it timed, and says so when it was."""
from __future__ import annotations

import io
import logging

import pytest
import torch
from helpers import separable_images, tiny_convnet
from rich.console import Console

import torchspeed.measure as measure
from torchspeed.compress.selection import select_backbone
from torchspeed.data import tune_loader
from torchspeed.infer.search import optimize
from torchspeed.train.acceleration import accelerate

BUSY = "the machine was busy"


@pytest.fixture(params=[1.5, 0.0], ids=["busy", "quiet"])
def others(request, monkeypatch):
    """Every load sample (OthersLoad, and compare() through it) reports `others` cores of other processes."""
    cores = request.param

    class Load:
        def cores(self):
            return cores

    monkeypatch.setattr(measure, "OthersLoad", Load)
    return cores


def _printed(result):
    out = io.StringIO()
    result.print(Console(file=out, width=200))
    return out.getvalue()


def _accelerate():
    x, y = separable_images(16)
    report = accelerate(tiny_convnet(), precision="auto", channels_last="auto", compile=False,
                        example_batch=(x, y), trial_steps=1, device="cpu").report
    return report, str(report)


def _tune_loader():
    x, y = separable_images(32)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    result = tune_loader(lambda num_workers, prefetch_factor, persistent_workers, pin_memory: batches, 8,
                         num_workers=[0], tune_seconds=0.02, device="cpu")
    return result, str(result)


def _optimize():
    result = optimize(tiny_convnet(), torch.randn(1, 3, 8, 8), runtimes="torch", precisions="fp32",
                      batch_sizes=(1,), repeats=1, min_time_s=0.0)
    return result, _printed(result)


def _select_backbone():
    result = select_backbone({"wide": tiny_convnet(width=8), "narrow": tiny_convnet(width=4)}, (2, 3, 8, 8),
                             precision="fp32", repeats=2, warmup=1)
    return result, _printed(result)


@pytest.mark.parametrize("run", [_accelerate, _tune_loader, _optimize, _select_backbone],
                         ids=["accelerate", "tune_loader", "optimize", "select_backbone"])
def test_the_result_keeps_the_load_and_says_when_the_machine_was_busy(run, others, caplog):
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        result, shown = run()
    assert result.others_cores == others and result.to_dict()["others_cores"] == others
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("torchspeed") and r.levelno == logging.WARNING and BUSY in r.getMessage()]
    if others:
        assert BUSY in shown and f"{others:.1f}" in shown
        assert len(warnings) == 1, warnings
    else:
        assert BUSY not in shown and result.busy_warning is None
        assert warnings == []
