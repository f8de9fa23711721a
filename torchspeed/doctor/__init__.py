"""Doctor: where a training run loses time (profile, doctor), what the model costs (lint), and the
ranked fixes with the command that measures each."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchspeed._lazy import lazy_getattr

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name loads on first use
    from torchspeed.doctor.advice import Finding, rank
    from torchspeed.doctor.launch import run_doctor
    from torchspeed.doctor.linting import LintResult, lint, loss_pairing
    from torchspeed.doctor.phases import PhaseClock, verdict
    from torchspeed.doctor.profiling import ProfileResult, profile
    from torchspeed.doctor.rules import loop_findings

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "profile": "profiling",
    "ProfileResult": "profiling",
    "lint": "linting",
    "LintResult": "linting",
    "loss_pairing": "linting",
    "Finding": "advice",
    "rank": "advice",
    "loop_findings": "rules",
    "verdict": "phases",
    "PhaseClock": "phases",
    "run_doctor": "launch",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
