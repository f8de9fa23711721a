"""Shared test data: small photo folders and stores, built once per session (generated, no downloads).

Tests that change what they read (corrupting a file, adding a class) copy these or make their own.
"""
from __future__ import annotations

import os
import shutil
import time
import types

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """The tests' own torchspeed cache: the user's ~/.cache/torchspeed is never read or written by a test."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHSPEED_CACHE", str(tmp_path_factory.mktemp("torchspeed-cache")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _nothing_remembered(_session_cache):
    """Each test measures afresh: decisions remembered by an earlier test (torchspeed.remembered) are removed."""
    shutil.rmtree(os.path.join(os.environ["TORCHSPEED_CACHE"], "decisions"), ignore_errors=True)


class _ShortPauses(types.ModuleType):
    """`time` for torchspeed.measure with its sleeps cut to 10 ms: the cool-downs between timed runs and the
    windows of waiting for a quiet machine buy measurement quality, which no test judges (a test of the
    waiting passes its own fakes), while every measuring call in the suite paid them, on a busy machine the
    whole wait."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, 0.01))


@pytest.fixture(autouse=True)
def _short_measuring_pauses(monkeypatch):
    from torchspeed import measure

    monkeypatch.setattr(measure, "time", _ShortPauses("time"))


@pytest.fixture(autouse=True)
def _a_quiet_machine(request, monkeypatch):
    """Other processes read as using no cores (`OthersLoad`, through which every measuring call and every
    wait for a quiet machine reads the load): what a test asserts must not depend on whether the machine
    running the suite is busy (a CI runner shares its cores; `make test-busy` runs the suite beside two
    spinning processes). A choice timed "on a busy machine" is not remembered, so on a busy machine
    every test of remembering would measure again. A test of the load reading itself is marked
    `real_load` (it starts its own spinning process: tests/helpers.py `another_process_spinning`)."""
    if request.node.get_closest_marker("real_load") is None:
        from torchspeed.measure import OthersLoad

        monkeypatch.setattr(OthersLoad, "cores", lambda self: 0.0)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_load: reads the real load of other processes (conftest's "
                                       "_a_quiet_machine leaves OthersLoad alone)")


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """24 photo-like JPEGs, 3 classes, 96x72: an ImageFolder (ROOT/CLASS/IMAGE.jpg). Read only."""
    from torchspeed.data import make_photo_folder

    return make_photo_folder(tmp_path_factory.mktemp("photos"), 24, n_classes=3, seed=0, size=(96, 72), num_workers=1)


@pytest.fixture(scope="session")
def small_photo_folder(tmp_path_factory):
    """8 photo-like JPEGs, 2 classes, 48x36: for tests that only need a few images. Read only."""
    from torchspeed.data import make_photo_folder

    return make_photo_folder(tmp_path_factory.mktemp("small_photos"), 8, n_classes=2, seed=0, size=(48, 36), num_workers=1)


@pytest.fixture(scope="session")
def photo_store(photo_folder, tmp_path_factory):
    """`photo_folder` packed into a JPEG store, short side 64. Read only."""
    from torchspeed.data import pack

    dst = tmp_path_factory.mktemp("stores") / "photos.store"
    pack(photo_folder, dst, short_side=64, progress=False)
    return str(dst)


@pytest.fixture(autouse=True)
def _torch_flags_restored():
    """cudnn.deterministic / benchmark, TF32 and the matmul precision a test sets are put back after it:
    a flag left set changes what the next tests measure (tests/gpu_suite.py)."""
    from gpu_suite import torch_flags

    with torch_flags():
        yield


def pytest_report_header(config):
    """The GPU suite names what it ran on: GPU, driver, CUDA, cuDNN, ONNX Runtime and TensorRT."""
    if _selects_gpu_tests(config):
        from gpu_suite import usable_cuda_problem, versions

        return versions() if usable_cuda_problem() is None else None
    return None


def _selects_gpu_tests(config) -> bool:
    """Whether the -m expression selects tests marked gpu (`make test-gpu` runs `-m gpu`)."""
    from _pytest.mark.expression import Expression

    expr = config.getoption("markexpr") or ""
    return not expr or Expression.compile(expr).evaluate(lambda name, **kw: name == "gpu")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """A GPU suite run without a usable CUDA device fails, naming why, instead of passing with every
    test skipped (a green run that tested nothing)."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from gpu_suite import usable_cuda_problem

    problem = usable_cuda_problem()
    if problem:
        pytest.exit(f"the GPU suite cannot run: {problem}", returncode=3)
