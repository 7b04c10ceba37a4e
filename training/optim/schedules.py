"""Learning-rate schedules of the BERT (NVIDIA, Gaudi) and GPT-NeoX recipes, as pure functions of the step.

Convention: ``step`` is the 1-based number of the optimizer step about to be taken (the first update uses
``step=1``), which is NVIDIA's ``PolyWarmUpScheduler`` (it sets ``last_epoch = optimizer step + 1`` before
the update). ``warmup`` (and ``constant``) are fractions of ``total_steps``, as in NVIDIA's and Gaudi's
configs; warmup is linear from 0. Each function returns the multiplier of the peak learning rate.
``build_scheduler`` wraps one in a ``LambdaLR`` (so DeepSpeed can save/load it with the checkpoint) whose
k-th ``step()`` prepares the multiplier of optimizer step k+1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from common.errors import UserError


def _check(total_steps: int, warmup: float, **fractions: float) -> None:
    if total_steps <= 0:
        raise UserError(f"schedule total_steps must be > 0 (got {total_steps})")
    if not 0.0 <= warmup < 1.0:
        raise UserError(f"schedule warmup must be a fraction of total_steps in [0, 1) (got {warmup})")
    for key, value in fractions.items():
        if not 0.0 <= value <= 1.0:
            raise UserError(f"schedule {key} must lie in [0, 1] (got {value})")


def poly_warmup(step: int, *, total_steps: int, warmup: float, degree: float = 0.5) -> float:
    """NVIDIA BERT: linear warmup while step/total < warmup, then (1 - step/total)^degree.

    As in NVIDIA's scheduler the decay's progress counts from step 0, not from the end of warmup, so the
    multiplier drops from ~1 to (1 - warmup)^degree when warmup ends.
    """
    _check(total_steps, warmup)
    progress = min(step / total_steps, 1.0)
    if progress < warmup:
        return progress / warmup
    return (1.0 - progress) ** degree


def warmup_constant_decay(
    step: int, *, total_steps: int, warmup: float = 0.05, constant: float = 0.25, min_ratio: float = 0.0
) -> float:
    """Gaudi BERT 1.5B/5B: linear warmup (5%), constant (25%), then linear decay to ``min_ratio`` at the
    end."""
    _check(total_steps, warmup, constant=constant, min_ratio=min_ratio)
    if warmup + constant > 1.0:
        raise UserError(f"schedule warmup + constant must be <= 1 (got {warmup} + {constant})")
    w, c = warmup * total_steps, constant * total_steps
    if step < w:
        return step / w
    if step <= w + c:
        return 1.0
    decay = total_steps - w - c
    frac = min((step - w - c) / decay, 1.0) if decay > 0 else 1.0
    return 1.0 - (1.0 - min_ratio) * frac


def cosine_warmup(step: int, *, total_steps: int, warmup: float, min_ratio: float = 0.1) -> float:
    """GPT-NeoX: linear warmup, then half a cosine from 1 down to ``min_ratio`` (min_lr = min_ratio * lr)."""
    _check(total_steps, warmup, min_ratio=min_ratio)
    w = warmup * total_steps
    if step <= w:
        return step / w
    frac = min((step - w) / (total_steps - w), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


SCHEDULES: dict[str, Callable[..., float]] = {
    "poly_warmup": poly_warmup,
    "warmup_constant_decay": warmup_constant_decay,
    "cosine_warmup": cosine_warmup,
}


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, **kw: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR for ``kind`` (one of SCHEDULES); pass it to ``deepspeed.initialize(lr_scheduler=...)``."""
    if kind not in SCHEDULES:
        raise UserError(f"schedule kind must be one of {', '.join(SCHEDULES)} (got {kind!r})")
    fn = SCHEDULES[kind]
    try:
        fn(1, **kw)  # validate the arguments now, with a one-line error, not at the first step
    except TypeError as e:
        raise UserError(f"schedule {kind}: {e}") from None

    def multiplier(i: int) -> float:
        return fn(i + 1, **kw)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def rates_at_current_step(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Give every parameter group this schedule's rate at the scheduler's current step.

    After a resume the optimizer state holds the saved run's rates, and this run's schedule may differ (a
    longer ``train.steps``): the first resumed step must use this run's. Stepping the scheduler back and
    forward again recomputes the rates through its public API.
    """
    scheduler.last_epoch -= 1
    scheduler.step()
