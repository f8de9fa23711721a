"""`make gpu-check` rehearsed here: an interpreter with its own torch and no package index.

The environment is a fresh venv that sees only this machine's torch, torchvision, numpy, pillow, rich,
opencv and pytest (linked in, as a GPU machine's image holds them) and none of lmdb, simplejpeg,
torch-pruning or turbojpeg. `scripts/gpu-check.sh` must take those four from the wheel folder alone
(`make gpu-wheels` fills it where an index is reachable; pip is denied any index), leave the interpreter's
own packages as they were, and stop at the CUDA tests naming why (no CUDA device here), not pass.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_packaging import _closure, _shadow_site

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.install
@pytest.mark.timeout(900)
def test_gpu_check_installs_from_the_wheel_folder_alone_and_names_the_missing_device(tmp_path):
    wheels = tmp_path / "checkout" / ".whl"
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".venv", ".git", "*.so", ".whl", ".gpu-site",
                                                                  "gpu-check", "__pycache__", "torchspeed-report"))
    subprocess.run([str(checkout / "scripts" / "gpu-wheels.sh"), f"{sys.version_info[0]}.{sys.version_info[1]}"],
                   check=True, capture_output=True, cwd=checkout)
    assert sorted(w.name.split("-")[0] for w in wheels.glob("*.whl")) == ["lmdb", "simplejpeg", "torch_pruning",
                                                                        "turbojpeg"]
    names = ["torch", "torchvision", "numpy", "pillow", "rich", "opencv-python-headless", "pytest", "pytest-timeout"]
    _shadow_site(_closure(names), tmp_path / "own-site")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "own_torch.pth").write_text(str(tmp_path / "own-site") + "\n")
    before = sorted(os.listdir(purelib))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/simple", GPU_TEST_S="300", GPU_BENCH_S="1")  # no index can answer

    run = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PYTHON={py}"], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=800)
    verdict = (checkout / "gpu-check" / "verdict.txt").read_text()
    assert run.returncode != 0, "the GPU check passed on a machine without CUDA"
    for package in ("lmdb", "simplejpeg", "torch-pruning", "turbojpeg"):
        assert f"installed {package} from .whl/" in verdict, verdict
    assert "the GPU suite cannot run: no usable CUDA device" in verdict, verdict
    assert "FAILED" in verdict.splitlines()[-1]
    assert sorted(os.listdir(purelib)) == before  # the interpreter's own environment is left as it was
    assert (checkout / "gpu-check" / "info.txt").read_text().strip()
