"""Every Python snippet in the README and the docs runs as written.

The snippets of one page run top to bottom in one namespace (a page builds up its example), in a
fresh working directory, on the generated demo photos the snippets themselves make.

The default run gives the snippets' named architectures (torchvision's resnet18, mobilenet, timm's
efficientnet...) a small stand-in of the same interface (`num_classes=`, any image size), tunes a
`fast_loader` left at its default `tune_seconds` for 0.05 s a setting and times an `optimize` left at its
defaults with 2 repeats and no minimum time: every call, argument and printed attribute of the snippets
runs, in seconds instead of minutes. `make test-slow` runs them again with the real architectures and
defaults, as a reader does.
"""
from __future__ import annotations

import glob
import os
import re

import pytest
from torch import nn

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(page: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def run_page(page: str) -> None:
    namespace: dict = {"__name__": "__snippet__"}
    for line, code in snippets(page):
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except Exception as e:  # name the page and line so the failing snippet is found at once
            raise AssertionError(f"the snippet at {page}:{line} fails: {type(e).__name__}: {e}") from e


def small_classifier(*args, num_classes: int = 1000, weights=None, pretrained: bool = False, **kwargs) -> nn.Module:
    """A stand-in for a named image classifier: two strided conv + BatchNorm + ReLU stages, pooled, linear
    head (every layer kind pruning, fusion, quantization and export work on), `num_classes` outputs."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


def test_snippet_parser_finds_the_readme_snippets():
    found = snippets("README.md")
    assert len(found) >= 5 and all(code.strip() for _, code in found)


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)])
def test_page_snippets_run_as_written(page, tmp_path, monkeypatch):
    import timm
    import torchvision

    from torchspeed.data.loader import fast_loader
    from torchspeed.infer.search import optimize

    monkeypatch.chdir(tmp_path)
    for name in torchvision.models.list_models(module=torchvision.models):
        monkeypatch.setattr(torchvision.models, name, small_classifier)
    monkeypatch.setattr(torchvision.models, "get_model", small_classifier)
    monkeypatch.setattr(timm, "create_model", small_classifier)
    monkeypatch.setitem(fast_loader.__kwdefaults__, "tune_seconds", 0.05)
    monkeypatch.setitem(optimize.__kwdefaults__, "repeats", 2)
    monkeypatch.setitem(optimize.__kwdefaults__, "min_time_s", 0.0)
    run_page(page)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)])
def test_page_snippets_run_as_written_with_the_real_architectures(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)
