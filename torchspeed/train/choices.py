"""accelerate()'s settings and what it chose: `AccelerateOptions` in, `AccelerateResult` of `TrialRow`s out.

The settings are one typed value checked once when it is made (accelerate() builds it from its
keywords; the Trainer holds one); the result lists every option of every setting with its figures and
decision, so a reader sees why each was kept.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchspeed.args import byte_size
from torchspeed.measure import busy_warning
from torchspeed.runtime import FLOAT_PRECISIONS

if TYPE_CHECKING:
    from torchspeed.train.loader_choice import LoaderStepResult
    from torchspeed.train.memory_plan import MemoryPlanResult

__all__ = ["AccelerateOptions", "AccelerateResult", "TrialRow", "DECIDED"]

_AUTO_OR_BOOL = ("auto", True, False)
_COMPILE = ("auto", True, False, "regional")  # True: the whole model; "regional": its repeated blocks
_COMPILE_MODES = (None, "whole", "regional")
_STRATEGIES = ("auto", "ddp", "fsdp", None)
DECIDED = ("precision", "channels_last", "compile", "tf32", "cudnn_benchmark")  # the step settings chosen
_CUDA = ("tf32", "cudnn_benchmark")  # None where they do not apply (not on CUDA)


@dataclass(frozen=True)
class AccelerateOptions:
    """accelerate()'s settings, checked once here: "auto" is measured, anything else is used as given.

    `strategy` "none" is read as None. `untried` maps a setting to the reason it is deliberately not
    tried. The fields are accelerate()'s keywords of the same names (see its docstring)."""

    precision: str = "auto"
    channels_last: bool | str = "auto"
    compile: bool | str = "auto"  # noqa: A003 (the public name of the setting); True: whole model; "regional"
    strategy: str | None = "auto"
    device: str | torch.device = "auto"
    tf32: bool | str = "auto"
    cudnn_benchmark: bool | str = "auto"
    expected_steps: int | None = None
    epochs: int | None = None  # with the loader's length, the run's length compile is weighed against
    trial_steps: int = 3
    margin: float = 0.05
    min_compile_cost_s: float = 20.0
    untried: Mapping[str, str] = field(default_factory=dict)
    fused_optimizer: bool = True
    refresh: bool = False  # measure again instead of recalling what an earlier run measured
    memory_budget: int | str | None = None  # bytes or "8GiB": the micro-batch and accumulation planned to fit

    def __post_init__(self) -> None:
        if self.precision not in ("auto", *FLOAT_PRECISIONS):
            raise ValueError(f"precision must be 'auto' or one of {', '.join(repr(p) for p in FLOAT_PRECISIONS)}, "
                             f"got {self.precision!r}")
        for name in ("channels_last", "tf32", "cudnn_benchmark"):
            value = getattr(self, name)
            if value not in _AUTO_OR_BOOL:
                raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
        if self.compile not in _COMPILE:
            raise ValueError(f"compile must be 'auto', True (the whole model), 'regional' (its repeated blocks) or "
                             f"False, got {self.compile!r}")
        if self.epochs is not None and not (type(self.epochs) is int and self.epochs > 0):
            raise ValueError(f"epochs must be a positive int or None, got {self.epochs!r}")
        strategy = None if self.strategy == "none" else self.strategy
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be 'auto', 'ddp', 'fsdp' or None, got {self.strategy!r}")
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "untried", dict(self.untried or {}))
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", byte_size(self.memory_budget, "memory_budget"))

    @property
    def measures_step(self) -> bool:
        """Whether precision, memory format or compile is left to measurement (an example batch is used)."""
        return self.needs_batch or self.compile_may_be_tried

    @property
    def needs_batch(self) -> bool:
        """Whether precision or memory format is left to measurement: without a batch that is an error
        (compile left on "auto" without one is only not tried)."""
        return "auto" in (self.precision, self.channels_last)

    @property
    def compile_may_be_tried(self) -> bool:
        """Whether the compile trial can run: on "auto" and not untried (its cost is weighed against the
        run's length, see compile_choice.horizon_of)."""
        return self.compile == "auto" and "compile" not in self.untried

    def measures_cuda_switches(self, device: torch.device) -> bool:
        """Whether TF32 or cudnn.benchmark is left to measurement on `device` (CUDA only)."""
        return device.type == "cuda" and "auto" in (self.tf32, self.cudnn_benchmark)


@dataclass
class TrialRow:
    """One row of the result: one option of one setting, measured (or deliberately not tried)."""

    setting: str                  # "precision" | "channels_last" | "precision+channels_last" | "compile" | ...
    value: str                    # compile: "False" (eager), "regional" (repeated blocks), "True" (whole model)
    step_s: float | None = None   # median measured step (forward + loss + backward), seconds
    one_off_s: float = 0.0        # one-off cost, e.g. compile time
    decision: str = ""            # "kept", "baseline", "rejected: ...", "not tried: ...", "given", ...
    gain: float | None = None     # steady speed-up against the baseline's step (1.08: 8% more steps per second)
    break_even_steps: int | None = None  # steps after which the one-off cost is repaid by the gain

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AccelerateResult:
    """What accelerate() chose, and every option it considered (`candidates`, a list of `TrialRow`s)."""

    device: str
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    compile_mode: str | None = None       # "whole" (torch.compile of the model) | "regional" (its repeated blocks)
    strategy: str | None = None
    optimizer: str = "unchanged"
    tf32: bool | None = None              # TF32 for fp32 matrix multiplies (CUDA); None: not applicable here
    cudnn_benchmark: bool | None = None   # cuDNN autotuning (CUDA); None: not applicable here
    candidates: list[TrialRow] = field(default_factory=list)
    others_cores: float | None = None     # most cores other processes used during a trial (None: not measured)
    loader: LoaderStepResult | None = None  # the loader's counts chosen with the step in the loop (FastLoader)
    timed_step: str | None = None         # the step the trials ran: "model(x, y), the loss it returns", ...
    memory_plan: MemoryPlanResult | None = None  # with memory_budget: the micro-batch and accumulation to train with

    @property
    def busy_warning(self) -> str | None:
        """A sentence saying the trials ran on a busy machine (their choices may be noise), else None."""
        return busy_warning(self.others_cores)

    @property
    def compile_setting(self) -> bool | str:
        """The compile chosen as accelerate()'s `compile=` says it: False, True (the whole model) or "regional"."""
        return "regional" if self.compile and self.compile_mode == "regional" else self.compile

    def decided(self) -> dict[str, Any]:
        """The step settings chosen, plain JSON: what is remembered, what every rank takes from rank 0."""
        return {**{name: getattr(self, name) for name in DECIDED}, "compile_mode": self.compile_mode}

    def take(self, decided: Mapping[str, Any]) -> AccelerateResult:
        """Take the step settings `decided` (remembered, or rank 0's), all checked first: a KeyError or
        ValueError for one missing or edited into a value accelerate() never chooses."""
        values = {name: decided[name] for name in DECIDED}
        for name, v in values.items():
            if not (v in FLOAT_PRECISIONS if name == "precision" else type(v) is bool or v is None and name in _CUDA):
                raise ValueError(f"{name}={v!r} is not a choice accelerate() makes")
        mode = decided.get("compile_mode", "whole" if values["compile"] else None)  # older decisions: whole
        if mode not in _COMPILE_MODES or (mode is None) == values["compile"]:
            raise ValueError(f"compile_mode={mode!r} does not go with compile={values['compile']!r}")
        for name, v in values.items():
            setattr(self, name, v)
        self.compile_mode = mode
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [c.to_dict() for c in self.candidates]
        d["loader"] = self.loader.to_dict() if self.loader is not None else None
        d["memory_plan"] = self.memory_plan.to_dict() if self.memory_plan is not None else None
        return d

    def record_loader(self, choice: LoaderStepResult) -> None:
        """Keep the loader's counts chosen with the step in the loop: `loader`, and one "loader" row
        per setting timed (or the remembered one), as the other settings are reported."""
        self.loader = choice
        if choice.remembered:
            self.candidates.append(TrialRow("loader", choice.setting, decision=choice.remembered))
            return
        for r in choice.table:
            decision = "kept" if r.decision.startswith("chosen") else f"rejected: {r.decision}"
            self.candidates.append(TrialRow("loader", r.setting, r.step_s, decision=decision))

    def __str__(self) -> str:
        cuda = "" if self.tf32 is None and self.cudnn_benchmark is None else (
            f" tf32={self.tf32} cudnn_benchmark={self.cudnn_benchmark}")
        lines = [f"accelerate on {self.device}: precision={self.precision} channels_last={self.channels_last} "
                 f"compile={self.compile_setting} strategy={self.strategy} optimizer={self.optimizer}{cuda}"]
        if self.timed_step:
            lines.append(f"  timed step: {self.timed_step}")
        if self.memory_plan is not None:
            lines.append(f"  memory: {self.memory_plan.describe()} (measured {self.memory_plan.measured})")
        for c in self.candidates:
            step = "-" if c.step_s is None else f"{c.step_s * 1e3:.1f} ms"
            lines.append(f"  {c.setting:13s} {c.value:8s} step {step:>10s}  one-off {c.one_off_s:.1f} s  {c.decision}")
        if self.busy_warning:
            lines.append(f"  note: {self.busy_warning}")
        return "\n".join(lines)

