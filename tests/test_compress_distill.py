"""Knowledge distillation: kd_loss equals Hinton et al.'s formula computed by hand, KDLoss runs the teacher
without gradient, and distill / finetune train through the Trainer (early stopping, max_steps)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.compress import KDLoss, distill, finetune, kd_loss

S = [[1.0, 2.0, 3.0], [0.5, 0.0, -0.5]]
T = [[3.0, 2.0, 1.0], [0.0, 1.0, 0.0]]
Y = [2, 0]


def _softmax(row, temp):
    e = [math.exp(v / temp) for v in row]
    return [v / sum(e) for v in e]


def _hand_kd(s, t, y, temp, alpha):
    """Hinton et al.: alpha * T^2 * KL(p_teacher || p_student) + (1 - alpha) * CE, averaged over the batch."""
    kl = ce = 0.0
    for srow, trow, label in zip(s, t, y):
        ps, pt = _softmax(srow, temp), _softmax(trow, temp)
        kl += sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, ps))
        ce += -math.log(_softmax(srow, 1.0)[label])
    n = len(s)
    return alpha * temp * temp * kl / n + (1 - alpha) * ce / n


@pytest.mark.parametrize("temp, alpha", [(4.0, 0.5), (1.0, 0.9), (2.5, 0.0), (10.0, 1.0)])
def test_kd_loss_equals_hand_computation(temp, alpha):
    got = kd_loss(torch.tensor(S), torch.tensor(T), torch.tensor(Y), temperature=temp, alpha=alpha)
    assert float(got) == pytest.approx(_hand_kd(S, T, Y, temp, alpha), rel=1e-5)


def test_kd_loss_is_zero_for_equal_logits_cross_entropy_at_alpha_0_and_computed_in_fp32():
    s, y = torch.tensor(S), torch.tensor(Y)
    assert float(kd_loss(s, s.clone(), y, 4.0, 1.0)) == pytest.approx(0.0, abs=1e-6)  # same logits: no soft loss
    assert float(kd_loss(s, torch.tensor(T), y, 3.0, 0.0)) == pytest.approx(float(F.cross_entropy(s, y)))
    assert float(kd_loss(s.bfloat16(), torch.tensor(T).bfloat16(), None, 4.0, 1.0)) == pytest.approx(
        _hand_kd([[float(v) for v in r] for r in s.bfloat16().float()], [[float(v) for v in r] for r in
                 torch.tensor(T).bfloat16().float()], Y, 4.0, 1.0), rel=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, "temperature"), ({"alpha": 1.5}, "alpha"), ({"alpha": 0.5, "targets": None}, "alpha=1.0"),
])
def test_kd_loss_bad_arguments(kwargs, message):
    args = {"student_logits": torch.tensor(S), "teacher_logits": torch.tensor(T), "targets": torch.tensor(Y)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        kd_loss(**args)


def test_kd_loss_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="same classes"):
        kd_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor(Y))


def test_kdloss_runs_teacher_without_gradient_and_trains_student():
    torch.manual_seed(0)
    teacher, student = nn.Linear(6, 3), nn.Linear(6, 3)
    loss_fn = KDLoss(teacher, temperature=2.0, alpha=0.7)
    assert loss_fn.needs_inputs and not teacher.training
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    loss = loss_fn(student(x), y, x)
    with torch.no_grad():
        expected = kd_loss(student(x), teacher(x), y, 2.0, 0.7)
    torch.testing.assert_close(loss, expected)
    loss.backward()  # the teacher's inference-mode output must not break autograd
    assert student.weight.grad is not None and student.weight.grad.abs().sum() > 0
    assert teacher.weight.grad is None and teacher.weight.requires_grad  # the caller's flags untouched


def _kl_to_teacher(teacher, student, x):
    with torch.no_grad():
        return float(kd_loss(student(x), teacher(x), None, 1.0, 1.0))


def _batches(n, seed, batch=32):
    """Vectors of 8 features with random labels of 4 classes: the distillation target is the teacher."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def _mlp(seed, hidden):
    """8 -> hidden -> 4 classes: teachers and students of any width on `_batches`' vectors."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


FAST = dict(precision="fp32", channels_last=False, compile=False, progress=False)


def test_distill_through_trainer_moves_student_toward_teacher():
    teacher, student = _mlp(0, 64), _mlp(1, 16)
    with torch.no_grad():
        teacher[2].weight.mul_(4)  # confident teacher: a clear target
    held = torch.randn(256, 8, generator=torch.Generator().manual_seed(9))
    before = _kl_to_teacher(teacher, student, held)
    train, val = _batches(30, 0), _batches(2, 1)
    model, metrics = distill(teacher, student, train, val, temperature=2.0, alpha=1.0, epochs=3, lr=0.05, **FAST)
    after = _kl_to_teacher(teacher, model, held)
    assert model is student and after < 0.5 * before
    assert metrics["step"] == 90 and "val_acc" in metrics and "val_loss" in metrics
    assert metrics["setup"] == {"precision": "fp32", "channels_last": False, "compile": False}
    assert all(p.grad is None for p in teacher.parameters())


def test_distill_with_early_stopping_and_max_steps():
    from torchspeed.train import EarlyStopping

    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9)  # nothing counts as improvement
    result = distill(_mlp(0, 32), _mlp(1, 8), _batches(5, 0), _batches(1, 1), epochs=10, callbacks=[stopper], **FAST)
    assert result.metrics["stopped_early"] and result.metrics["epochs"] == 2
    result = distill(_mlp(0, 32), _mlp(1, 8), _batches(5, 0), epochs=10, max_steps=7, **FAST)
    assert result.metrics["step"] == 7


def test_finetune_cross_entropy_learns_labels():
    torch.manual_seed(0)
    w = torch.randn(8, 4)
    data = [(x, (x @ w).argmax(1)) for x, _ in _batches(40, 3)]  # a learnable rule
    model = _mlp(2, 32)
    acc = lambda m: float(torch.cat([(m(x).argmax(1) == y).float() for x, y in data[:5]]).mean())  # noqa: E731
    before = acc(model)
    metrics = finetune(model, data, epochs=2, lr=0.1, **FAST)
    assert acc(model) > max(0.8, before + 0.2) and metrics["step"] == 80


def test_bad_student_is_clear():
    with pytest.raises(ValueError, match="student must be an nn.Module"):
        distill(_mlp(0, 8), "resnet18", _batches(1, 0))
    with pytest.raises(ValueError, match="teacher must be"):
        KDLoss(42)
