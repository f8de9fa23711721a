"""The memory planner's choices where its predictions miss, on a stand-in prober whose steps have known
peaks: the configuration kept is always one whose own step was measured under the budget, at most 3 probe
steps are recorded, and where nothing measured fits the error names what was measured."""
import pytest
import torch

from torchspeed.bench.gpt_model import GPT, GPTConfig
from torchspeed.train.memory_plan import _FB, NothingFits, ProbeRow, _plan

BUDGET, MARGIN = 100_000, 0.1
USABLE = BUDGET * (1 - MARGIN)


class _Counted:
    def __init__(self, micro, freed):
        self.micro, self.counted = micro, freed

    def freed(self, k):
        return self.counted(self.micro, k)


class _Prober:
    """Steps whose peak is `peak(micro, blocks checkpointed)` (None: out of memory); what checkpointing
    frees counted as `freed(micro, k)`."""

    def __init__(self, peak, freed):
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=1, n_embd=8))  # 2 blocks
        self.optimizer, self.device, self.source = None, torch.device("cpu"), "stand-in"
        self.rows, self.saved, self.checked, self.steps = [], {}, {}, []
        self.peak, self.counted = peak, freed

    def step(self, micro):
        return lambda: None

    def probe(self, micro, checkpointed=0, predicted=None, count=(), record=True):
        self.steps.append((micro, checkpointed))
        p = self.peak(micro, checkpointed)
        phases = None if p is None else {_FB: p, "optimizer step": 1000, "step": p}
        if count:
            self.saved[micro] = _Counted(micro, self.counted)
        self.checked[(micro, checkpointed)] = phases
        if record:
            self.rows.append(ProbeRow(micro, p, checkpointed, predicted))
        return phases


def _planned(peak, freed=lambda m, k: 0, effective=32, checkpointing="auto"):
    prober = _Prober(peak, freed)
    plan = _plan(prober, 16, effective, BUDGET, USABLE, MARGIN, checkpointing, lambda s: None)
    assert len(plan.probes) <= 3 and plan.micro_batch * plan.accumulation == effective
    assert (plan.micro_batch, plan.checkpointed) in prober.steps  # the configuration kept was run
    assert peak(plan.micro_batch, plan.checkpointed) <= USABLE
    assert plan.predicted_peak_bytes >= peak(plan.micro_batch, plan.checkpointed)
    return plan, prober


def test_a_choice_made_after_the_third_probe_missed_is_run_and_stepped_down():
    step = lambda m, k: 20_000 + 4_000 * m + (30_000 if m >= 10 else 0)  # memory jumps above 9 samples
    plan, _ = _planned(step, effective=60, checkpointing=False)
    notes = " ".join(plan.notes)
    assert plan.micro_batch == 10 and "micro-batch 12 run to check" in notes and "micro-batch 10 run to check" in notes
    assert not plan.linear


def test_where_every_configuration_measured_over_the_budget_a_smaller_one_is_measured():
    # checkpointing frees far less than counted: the configurations weighed all measure over the budget
    peak = lambda m, k: 81_000 + 10_000 * m - (0 if k == 0 else 4_000 * m - 1_000)
    plan, prober = _planned(peak, freed=lambda m, k: 0 if k == 0 else 6_000 * m)
    assert plan.micro_batch == 1 and plan.checkpointed == 1
    assert all(r.decision.startswith("over the budget") for r in plan.table)


def test_a_step_measured_as_a_configuration_is_not_run_again_as_the_third_probe():
    convex = lambda m, k: 20_000 + 2_500 * m + 150 * m * m - (0 if k == 0 else 300 * m)
    plan, prober = _planned(convex, freed=lambda m, k: 3_000 * k * m)
    assert len(prober.steps) == len(set(prober.steps))  # no step run twice
    assert plan.micro_batch == 8 and not plan.linear


def test_where_nothing_measured_fits_the_error_names_what_was_measured():
    peak = lambda m, k: 95_000 + 100 * m - (0 if k == 0 else 50)
    with pytest.raises(NothingFits, match=r"no micro-batch measured under it \(.*measured .*KiB.*run to check"):
        _plan(_Prober(peak, lambda m, k: 20_000 * k), 16, 32, BUDGET, USABLE, MARGIN, "auto", lambda s: None)
