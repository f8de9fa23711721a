"""The README's "your model and your data" commands, run as a user would: a project folder with its own
Dataset factory and model factory, every command named by spec from that folder, nothing of ours."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from torchspeed.cli import main

DATA_PY = textwrap.dedent("""
    import numpy as np
    import torch
    from PIL import Image


    class Shapes(torch.utils.data.Dataset):
        '''Bright squares (class 1) or dark ones (class 0) on noise: learnable in a few steps.'''
        classes = ["dark", "bright"]

        def __init__(self, n=48, size=40):
            self.n, self.size = n, size

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            rng = np.random.default_rng(i)
            img = rng.integers(0, 80, (self.size, self.size, 3), dtype=np.uint8)
            label = i % 2
            img[8:32, 8:32] = 230 if label else 20
            return Image.fromarray(img), label


    def build_dataset():
        return Shapes()
""")

NETS_PY = textwrap.dedent("""
    from torch import nn


    def make_net(num_classes=2, width=8):
        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width * 2, 3, stride=2, padding=1), nn.BatchNorm2d(width * 2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 2, num_classes))
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = tmp_path / "my_project"
    root.mkdir()
    (root / "data.py").write_text(DATA_PY)
    (root / "nets.py").write_text(NETS_PY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_tune_train_lint_optimize_and_prune_run_on_a_projects_own_factories(project, capsys):
    data, net = "my_project/data.py:build_dataset", "my_project/nets.py:make_net"

    assert main(["tune-loader", data, "--batch-size", "8", "--crop", "32", "--num-workers", "0",
                 "--threads", "1", "--tune-seconds", "0.3", "--json", "tune.json"]) == 0
    assert json.loads((project / "tune.json").read_text())

    assert main(["train", "--data", data, "--model", net, "--model-kwargs", '{"num_classes": 2}',
                 "--epochs", "1", "--batch-size", "8", "--crop", "32", "--precision", "fp32",
                 "--channels-last", "false", "--compile", "false", "--num-workers", "0", "--threads", "1",
                 "--out", "runs/a", "--no-progress"]) == 0
    best = project / "runs" / "a" / "model.pt"
    assert best.exists()

    assert main(["lint", net, "--input-shape", "1,3,32,32", "--json", "lint.json"]) == 0
    assert json.loads((project / "lint.json").read_text())

    assert main(["optimize", net, "--weights", str(best), "--input-shape", "1,3,32,32", "--runtimes", "torch",
                 "--precisions", "fp32", "--batch-sizes", "1", "--eval", data, "--calib", data,
                 "--out", "deploy", "--json", "opt.json"]) == 0
    assert (project / "deploy" / "manifest.json").exists()
    assert json.loads((project / "opt.json").read_text())["baseline_metric"] is not None

    assert main(["prune", net, "--weights", str(best), "--ratio", "0.5", "--input-shape", "1,3,32,32",
                 "--out", "pruned"]) == 0
    from torchspeed.compress.pruning import load_pruned

    assert load_pruned("pruned", spec=net)(torch.randn(1, 3, 32, 32)).shape == (1, 2)  # your own code: named by you
