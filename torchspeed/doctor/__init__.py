"""Doctor: where a training run loses time (profile, doctor), what the model costs (lint), and the
ranked fixes with the command that measures each."""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "profile": "profiling",
    "ProfileReport": "profiling",
    "lint": "linting",
    "LintReport": "linting",
    "loss_pairing": "linting",
    "Finding": "advice",
    "rank": "advice",
    "loop_findings": "rules",
    "verdict": "phases",
    "PhaseClock": "phases",
    "run_doctor": "runner",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
