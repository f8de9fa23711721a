"""Knowledge distillation (Hinton, Vinyals & Dean 2015, arXiv 1503.02531) and fine-tuning, through the Trainer.

A small student learns from a large teacher's softened output distribution as well as from the
labels: the teacher's relative probabilities for the wrong classes ("dark knowledge") carry more
information per example than the one-hot label. The loss is

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

where T^2 keeps the soft term's gradient scale independent of the temperature (the paper, section 2).
Training runs through `ts.train.Trainer`, so it gets mixed precision, checkpoints, resume and early
stopping; the teacher runs in eval mode under `inference_mode` on the same inputs as the student.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.train import Trainer

__all__ = ["kd_loss", "KDLoss", "DistillResult", "distill", "finetune"]


def _check_kd_args(temperature: float, alpha: float) -> None:
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number (Hinton et al. use 1-20; 4 is common), got {temperature!r}")
    if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is the weight of the distillation term and must be in [0, 1], got {alpha!r}")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor | None,
            temperature: float = 4.0, alpha: float = 0.5) -> torch.Tensor:
    """The distillation loss on logits of shape (batch, classes); computed in fp32 for stable softmaxes.

    With `alpha=1` (or `targets=None`) it is the soft term alone.
    """
    _check_kd_args(temperature, alpha)
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"student and teacher logits must both be (batch, classes); got {tuple(student_logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}: do the two models predict the same classes?")
    s = student_logits.float()
    t = teacher_logits.detach().float()
    T = float(temperature)
    soft = F.kl_div(F.log_softmax(s / T, dim=1), F.log_softmax(t / T, dim=1), reduction="batchmean", log_target=True)
    loss = alpha * (T * T) * soft
    if targets is None:
        if alpha != 1.0:
            raise ValueError("kd_loss without targets is the soft term only: pass alpha=1.0")
        return loss
    if alpha < 1.0:
        loss = loss + (1.0 - alpha) * F.cross_entropy(s, targets)
    return loss


class KDLoss:
    """`loss_fn(outputs, targets, inputs)` for the Trainer: runs the teacher on `inputs` and returns kd_loss.

    `needs_inputs = True` tells the Trainer to pass the inputs. The teacher is any callable returning
    logits (an `nn.Module` is put in eval mode; no gradient ever reaches it).
    """

    needs_inputs = True

    def __init__(self, teacher: nn.Module | Callable[[torch.Tensor], torch.Tensor], temperature: float = 4.0,
                 alpha: float = 0.5):
        _check_kd_args(temperature, alpha)
        if not callable(teacher):
            raise ValueError(f"teacher must be a model (or callable) returning logits, got {type(teacher).__name__}")
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)
        if isinstance(teacher, nn.Module):
            teacher.eval()  # (its requires_grad flags are left alone: inference_mode already records nothing)

    def teacher_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        if isinstance(self.teacher, nn.Module):
            self.teacher.eval()  # a caller may have switched it back to training mode
            if _device_of(self.teacher) != inputs.device:  # follow the student to the training device
                self.teacher.to(inputs.device)
        with torch.inference_mode():
            logits = self.teacher(inputs)
        # inference tensors cannot be saved for backward; a clone outside inference mode can
        return logits.clone()

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return kd_loss(outputs, self.teacher_logits(inputs), targets, self.temperature, self.alpha)

    def __repr__(self) -> str:
        return f"KDLoss(T={self.temperature:g}, alpha={self.alpha:g})"


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32, the loss `finetune` trains with when no teacher is given."""
    return F.cross_entropy(outputs.float(), targets)


@dataclass
class DistillResult:
    """The trained student and the Trainer's final metrics; unpacks as `model, metrics = distill(...)`."""

    model: nn.Module
    metrics: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.metrics))


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _fit(model: nn.Module, loss_fn: Any, train_loader: Iterable[Any], val_loader: Iterable[Any] | None,
         optimizer: torch.optim.Optimizer | None, lr: float, weight_decay: float, epochs: int, max_steps: int | None,
         precision: str, callbacks: Sequence[Any] | None, resume: Any, device: Any, progress: Any,
         trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    trainer = Trainer(model, optimizer, loss_fn, precision=precision, callbacks=list(callbacks or []), device=device,
                      progress=progress, **trainer_kwargs)
    metrics = dict(trainer.fit(train_loader, val_loader=val_loader, epochs=epochs, max_steps=max_steps, resume=resume)
                   or {})
    report = trainer.report
    if report is not None:  # what the Trainer chose (measured where "auto"), so a caller can reuse it
        metrics["setup"] = {"precision": report.precision, "channels_last": report.channels_last,
                            "compile": report.compile}
    return metrics


def distill(
    teacher: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    student: nn.Module,
    train_loader: Iterable[Any],
    val_loader: Iterable[Any] | None = None,
    temperature: float = 4.0,
    alpha: float = 0.5,
    epochs: int = 1,
    max_steps: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 0.05,
    weight_decay: float = 5e-4,
    precision: str = "auto",
    callbacks: Sequence[Any] | None = None,
    resume: Any = None,
    device: str | torch.device = "auto",
    progress: bool | Callable[[str], Any] = True,
    **trainer_kwargs: Any,
) -> DistillResult:
    """Train `student` on `train_loader` against `teacher`'s softened outputs and the labels.

    `temperature` softens both distributions; `alpha` weighs the distillation term against
    cross-entropy. The optimizer defaults to SGD with Nesterov momentum at `lr`. Callbacks
    (`ts.train.EarlyStopping`, `ts.train.Checkpoint`), `precision`, `resume`, `progress` (the
    Trainer's: True shows its progress, False nothing, or a callable) and further keyword arguments
    go to `ts.train.Trainer` / `fit`. The teacher follows the inputs to the training device.
    """
    if not isinstance(student, nn.Module):
        raise ValueError(f"student must be an nn.Module, got {type(student).__name__}")
    loss = KDLoss(teacher, temperature=temperature, alpha=alpha)
    metrics = _fit(student, loss, train_loader, val_loader, optimizer, lr, weight_decay, epochs, max_steps,
                   precision, callbacks, resume, device, progress, trainer_kwargs)
    return DistillResult(model=student, metrics=metrics)


def finetune(
    model: nn.Module,
    train_loader: Iterable[Any],
    val_loader: Iterable[Any] | None = None,
    max_steps: int | None = None,
    epochs: int = 1,
    teacher: nn.Module | Callable[[torch.Tensor], torch.Tensor] | None = None,
    temperature: float = 4.0,
    alpha: float = 0.5,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 0.01,
    weight_decay: float = 5e-4,
    precision: str = "auto",
    callbacks: Sequence[Any] | None = None,
    device: str | torch.device = "auto",
    progress: bool | Callable[[str], Any] = True,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Recover accuracy after pruning: a short run through the Trainer, with cross-entropy on the
    labels or, given a `teacher` (e.g. the unpruned model), distillation from it. Returns the metrics.
    `progress` is the Trainer's (True shows its progress, False nothing, or a callable).

    Use between pruning steps: `prune(..., steps=3, finetune=lambda m, step: finetune(m, loader, max_steps=200))`.
    """
    if teacher is not None:
        return distill(teacher, model, train_loader, val_loader, temperature=temperature, alpha=alpha, epochs=epochs,
                       max_steps=max_steps, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                       precision=precision, callbacks=callbacks, device=device, progress=progress,
                       **trainer_kwargs).metrics
    return _fit(model, cross_entropy, train_loader, val_loader, optimizer, lr, weight_decay, epochs, max_steps,
                precision, callbacks, None, device, progress, trainer_kwargs)
