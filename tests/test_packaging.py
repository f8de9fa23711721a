"""Installing torchspeed into an environment that already has torch keeps that torch.

The wheel is built from this checkout and installed with its dependencies into a fresh virtual
environment whose only packages are torch and torchvision (with what they need), the situation of a
user with their own CUDA or CPU build. pip resolves against the real package index; the test fails if
it would install any torch or torchvision. With every extra installed (`[all]`, and `turbojpeg`) there, the
installed command runs doctor on a script, and `optimize` (torch and ONNX Runtime) and `fast_loader` run, the
latter also through the wheel's compiled crop renderer.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _closure(names: list[str]) -> list[md.Distribution]:
    """The installed distributions `names` need, transitively (markers for this interpreter only)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist
        for req in dist.requires or []:
            if ";" in req:
                marker = req.split(";", 1)[1]
                if "extra" in marker or not _marker_holds(marker):
                    continue
            todo.append(req)
    return list(seen.values())


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def _shadow_site(dists: list[md.Distribution], into: Path) -> None:
    """Link each distribution's top-level files (and its metadata) into `into`, so a fresh venv sees
    exactly these packages as installed without copying gigabytes."""
    into.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for dist in dists:
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src, dst = site / top, into / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)


@pytest.mark.install
@pytest.mark.timeout(900)
def test_wheel_installs_into_an_environment_with_torch_and_keeps_it(tmp_path):
    import torch

    dist_dir = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist_dir), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = dist_dir.glob("torchspeed-*.whl")
    with zipfile.ZipFile(wheel) as whl:  # the loader's native crop renderer, compiled into the wheel
        assert any(n.startswith("torchspeed/data/_crops") and n.endswith(".so") for n in whl.namelist())

    _shadow_site(_closure(["torch", "torchvision"]), tmp_path / "user-site")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "user_torch.pth").write_text(str(tmp_path / "user-site") + "\n")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)

    # What pip would do, resolved against the index, with every extra a user installs: nothing of torch.
    report = tmp_path / "report.json"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report),
                    f"{wheel}[all]"], check=True, env=env, capture_output=True, text=True)
    planned = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"torchspeed", "onnxruntime", "lmdb", "openvino", "timm"} <= planned
    assert not planned & {"torch", "torchvision"}, f"pip would replace the user's torch: {sorted(planned)}"

    subprocess.run([str(py), "-m", "pip", "install", "--quiet", f"{wheel}[all,turbojpeg]"], check=True, env=env,
                   capture_output=True, text=True)
    where = subprocess.run([str(py), "-c", "import torch, torchspeed; print(torch.__version__, torch.__file__)"],
                           check=True, env=env, capture_output=True, text=True).stdout.split()
    assert where[0] == torch.__version__
    assert Path(where[1]).resolve() == Path(torch.__file__).resolve()

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(12):
            x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    """))
    out = tmp_path / "doctor"
    run = subprocess.run([str(venv / "bin" / "torchspeed"), "doctor", "--out", str(out), "--",
                          str(py), str(script)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (out / "doctor.json").exists()

    # The extras work there: optimize (torch and ONNX Runtime) and fast_loader, each on its own data.
    use = tmp_path / "use.py"
    use.write_text(textwrap.dedent("""
        import json, sys
        import torch
        import torchspeed as ts

        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                    torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
        result = ts.infer.optimize(model, torch.randn(1, 3, 16, 16), runtimes="torch,onnxruntime",
                                   precisions="fp32", batch_sizes=(1,), repeats=1)
        ran = sorted(r.runtime for r in result.table if r.passed)
        result.best.save("best")
        back = ts.infer.load("best")(torch.randn(3, 3, 16, 16))
        ts.data.make_photo_folder("photos", 8, n_classes=2, size=(48, 36))
        loader = ts.data.fast_loader("photos", batch_size=4, train=True, crop=32)
        images, labels = next(iter(loader))
        native = ts.data.fast_loader("photos", batch_size=4, train=True, crop=32, decoder="turbojpeg")
        from torchspeed.data.decode import get_decoder
        crops = get_decoder("turbojpeg").crops is not None  # the wheel's compiled renderer loads there
        json.dump({"ran": ran, "best": list(back.shape), "batch": list(images.shape),
                   "native": [crops, list(next(iter(native))[0].shape)]}, sys.stdout)
    """))
    run = subprocess.run([str(py), str(use)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"torch", "onnxruntime"} <= set(got["ran"]), got
    assert got["best"] == [3, 2] and got["batch"] == [4, 3, 32, 32]
    assert got["native"] == [True, [4, 3, 32, 32]], got


def test_every_install_hint_names_an_extra_that_exists():
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    hinted = {m for path in (ROOT / "torchspeed").rglob("*.py")
              for m in re.findall(r"torchspeed\[([a-z-]+)\]", path.read_text())}
    assert hinted, "no install hints found: the pattern is out of date"
    assert hinted <= extras, f"hints name extras that pyproject.toml lacks: {sorted(hinted - extras)}"
    assert "pytest" not in json.dumps(tomllib.loads((ROOT / "pyproject.toml").read_text())
                                      ["project"]["optional-dependencies"]["all"])
