"""Every Python snippet in the README and the docs runs as written.

The snippets of one page run top to bottom in one namespace (a page builds up its example), in a
fresh working directory, on the generated demo photos the snippets themselves make.
"""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(page: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def test_snippet_parser_finds_the_readme_snippets():
    found = snippets("README.md")
    assert len(found) >= 5 and all(code.strip() for _, code in found)


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)])
def test_page_snippets_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__snippet__"}
    for line, code in snippets(page):
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except Exception as e:  # name the page and line so the failing snippet is found at once
            raise AssertionError(f"the snippet at {page}:{line} fails: {type(e).__name__}: {e}") from e
