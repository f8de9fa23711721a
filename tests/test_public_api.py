import importlib

import pytest


@pytest.mark.parametrize("area", ["data", "train", "infer", "compress", "doctor"])
def test_every_public_name_resolves_to_the_object_not_a_module(area):
    import types

    pkg = importlib.import_module(f"torchspeed.{area}")
    assert pkg.__all__, area
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        assert not isinstance(obj, types.ModuleType), f"ts.{area}.{name} is a module (shadowed by a submodule?)"
    with pytest.raises(AttributeError, match="no attribute 'does_not_exist'"):
        getattr(pkg, "does_not_exist")


def test_design_contract_names_exist():
    import torchspeed as ts

    for path in ["runtime.seed_everything", "runtime.rng_state", "runtime.set_rng_state", "runtime.deterministic",
                 "runtime.describe", "data.make_photo_folder", "data.pack", "data.PackedDataset", "data.fast_loader",
                 "data.tune_loader", "data.DevicePrefetcher", "train.accelerate", "train.Trainer",
                 "train.EarlyStopping", "train.Checkpoint", "infer.fuse_conv_bn", "infer.export_onnx",
                 "infer.optimize", "infer.load", "compress.prune", "compress.distill", "compress.select_backbone",
                 "doctor.profile", "doctor.lint", "models.create", "measure.compare"]:
        area, name = path.split(".")
        assert callable(getattr(getattr(ts, area), name)), path


def test_import_torchspeed_changes_no_logger():
    """The package only adds a NullHandler to its own logger: no level or handler change elsewhere."""
    import logging
    import subprocess
    import sys

    code = ("import logging; root = logging.getLogger(); before = (root.level, list(root.handlers)); "
            "import torchspeed, torchspeed.data, torchspeed.train, torchspeed.infer; "
            "assert (root.level, list(root.handlers)) == before; "
            "h = logging.getLogger('torchspeed').handlers; "
            "assert len(h) == 1 and isinstance(h[0], logging.NullHandler), h; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    assert logging.getLogger("torchspeed").level == logging.NOTSET
