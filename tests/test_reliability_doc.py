"""docs/reliability.md names a test for every promise: each named test must exist."""
from __future__ import annotations

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_every_promise_names_an_existing_test():
    with open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8") as f:
        doc = f.read()
    refs = re.findall(r"`(test_\w+\.py)::(test_\w+)`", doc)
    assert len(refs) >= 30, "the promise table lost its tests"
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| promise")
            and not line.startswith("|---")]
    assert all("::test_" in row for row in rows), [row for row in rows if "::test_" not in row]
    missing = []
    for file, name in refs:
        path = os.path.join(ROOT, "tests", file)
        text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if not re.search(rf"^def {name}\(", text, re.M):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
