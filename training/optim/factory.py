"""The optimizer a run config names, its parameter groups, and LANS/LAMB's per-tensor layouts under ZeRO.

``build_optimizer`` gives ``lans`` and ``lamb`` (``training.optim.lans``) or torch's AdamW; ``param_groups``
splits the weights that decay from those that do not; ``attach_zero`` hands LANS/LAMB inside a DeepSpeed
engine the layout of its flat partitions (``training.optim.zero_map``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from common.errors import UserError
from training.optim.lans import LAMB, LANS, LayerwiseAdaptive
from training.optim.zero_map import build_layouts

NO_DECAY_MARKERS = ("bias", "LayerNorm", "layer_norm", "norm")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases / norm parameters / 1-D tensors without weight decay.

    BERT's recipes (NVIDIA, Gaudi) exempt biases and LayerNorm gamma/beta from weight decay; empty groups are
    dropped so that DeepSpeed does not see a group without parameters.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or any(marker in name for marker in NO_DECAY_MARKERS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    name: str,
    params: Iterable,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    trust_no_decay: bool = True,
) -> torch.optim.Optimizer:
    """The optimizer named in the run config: ``lans`` | ``lamb`` | ``adamw`` (torch AdamW, foreach).

    ``trust_no_decay`` (``optimizer.trust_no_decay``): LANS/LAMB apply the trust ratio to parameter groups
    without weight decay too; False gives them ratio 1, as NVIDIA's FusedLAMB does. AdamW has no trust ratio.
    """
    key = name.lower()
    if key in ("lans", "lamb"):
        cls = LANS if key == "lans" else LAMB
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_no_decay=trust_no_decay)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
    raise UserError(f"optimizer.name must be one of lans, lamb, adamw (got {name!r})")


def attach_zero(engine: Any) -> None:
    """Make the LANS/LAMB inside a DeepSpeed engine use per-tensor norms; call after deepspeed.initialize.

    Also call it again after ``engine.load_checkpoint`` (cheap; the layout is rebuilt from DeepSpeed's links).
    Raises RuntimeError for a DeepSpeed path whose partitioning is not covered (ZeRO-3).
    """
    opt = getattr(engine, "basic_optimizer", None)
    if not isinstance(opt, LayerwiseAdaptive):
        return  # AdamW or another element-wise optimizer: partitioning does not change its result
    opt.set_layouts(build_layouts(engine, opt))
