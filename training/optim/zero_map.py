"""Map each original tensor to its fragments in the flat fp32 partition DeepSpeed gives the optimizer.

DeepSpeed ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and its BF16 optimizer (``BF16_Optimizer``, used for bf16
with fp32 gradient accumulation at ZeRO-1) flatten each parameter group, split it evenly over the
data-parallel ranks and hand the wrapped optimizer one flat fp32 tensor per group. They also link every
low-precision model parameter that has elements in this rank's partition to its fragment there
(``param._hp_mapping.hp_fragment_address``: start and length inside the flat partition; see
``deepspeed/utils/tensor_fragment.py``). We read those links, so our numbering of tensors (the order of the
group's model parameters) is the same on every rank.

Plain fp32 (no ZeRO) and bf16 at stage 0 (``FP16_UnfusedOptimizer``: one fp32 copy per tensor) show the
optimizer real tensors, so no layout is needed. ZeRO-3 and the fused fp16 optimizer are refused.

This module knows nothing of the optimizers (``training/optim/lans.py`` imports it, never the reverse): it holds
the layout type and the all-reduce of per-tensor sums that both sides use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from training import collectives


@dataclass
class GroupLayout:
    """Where the tensors of one parameter group lie in the flat tensor the optimizer sees (ZeRO).

    ``starts``/``numels`` are fragment addresses in the flat local partition, ``tensor_index`` the index of
    the original tensor each fragment belongs to (same numbering on every rank), ``num_tensors`` the number
    of original tensors in the group, ``process_group`` the data-parallel group the per-tensor sums are
    all-reduced over.
    """

    starts: list[int]
    numels: list[int]
    tensor_index: list[int]
    num_tensors: int
    partition_numel: int
    tensor_numels: list[int]
    process_group: Any = None

    @classmethod
    def split_first(cls, numels: list[int], split: int, process_group: Any = None) -> GroupLayout:
        """One flat partition holding tensors of ``numels`` in order, the first of them in two fragments split
        at ``split`` (as at a rank boundary). For tests and benchmarks: pass a ``process_group`` (any object, on
        a world of one rank) to send the sums through the all-reduce path."""
        first, rest = numels[0], numels[1:]
        return cls(
            starts=[0, split, *(first + sum(rest[:k]) for k in range(len(rest)))],
            numels=[split, first - split, *rest],
            tensor_index=[0, *range(len(numels))],
            num_tensors=len(numels),
            partition_numel=sum(numels),
            tensor_numels=list(numels),
            process_group=process_group,
        )


def allreduce_sums(sums: torch.Tensor, pg: Any) -> torch.Tensor:
    """Sum a small vector over the data-parallel group (on the accelerator when the backend is NCCL)."""
    if pg is None or collectives.world_size() == 1:
        return sums
    return collectives.reduced(sums, "sum", group=pg)


def _zero_groups(zopt: Any) -> tuple[list, list, list] | None:
    """(lp param lists, flat hp partitions, dp groups) of a flattening DeepSpeed optimizer, else None."""
    if hasattr(zopt, "single_partition_of_fp32_groups") and hasattr(zopt, "bit16_groups"):
        return zopt.bit16_groups, zopt.single_partition_of_fp32_groups, zopt.real_dp_process_group
    if hasattr(zopt, "fp32_groups_flat_partition") and hasattr(zopt, "bf16_groups"):
        return zopt.bf16_groups, zopt.fp32_groups_flat_partition, zopt.real_dp_process_group
    return None


def build_layouts(engine: Any, opt: torch.optim.Optimizer) -> dict[int, GroupLayout]:
    """Fragment layouts keyed by ``id`` of each flat partition in ``opt.param_groups``; {} if
    unpartitioned."""
    zopt = engine.optimizer
    name = type(zopt).__name__
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    if stage == 3 or "Stage3" in name:
        raise RuntimeError(
            f"LANS/LAMB under ZeRO-3 is not supported yet ({name}); use ZeRO stage 1 or 2 "
            "(zero_optimization.stage in the DeepSpeed config)"
        )
    if zopt is opt or name == "FP16_UnfusedOptimizer":
        return {}  # the optimizer sees whole tensors
    if getattr(zopt, "cpu_offload", False):
        raise RuntimeError("LANS/LAMB with ZeRO optimizer offload is not supported yet; disable offload_optimizer")
    groups = _zero_groups(zopt)
    if groups is None:
        raise RuntimeError(
            f"LANS/LAMB: DeepSpeed optimizer wrapper {name} is not supported (it flattens parameters in a "
            "way we cannot map); use fp32, or bf16 with ZeRO stage 1/2"
        )
    lp_groups, flats, dp_groups = groups
    if len(flats) != len(opt.param_groups):
        raise RuntimeError(
            f"LANS/LAMB: {len(flats)} DeepSpeed flat groups but {len(opt.param_groups)} optimizer groups"
        )
    layouts: dict[int, GroupLayout] = {}
    for i, (lps, flat) in enumerate(zip(lp_groups, flats)):
        if not any(flat is p for p in opt.param_groups[i]["params"]):
            raise RuntimeError(f"LANS/LAMB: optimizer group {i} does not hold DeepSpeed's flat partition {i}")
        starts, numels, index = [], [], []
        covered = torch.zeros(len(lps), dtype=torch.float64)
        for t, lp in enumerate(lps):
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            addr = mapping.get_hp_fragment_address()
            if addr.numel <= 0:
                continue
            if addr.start < 0 or addr.start + addr.numel > flat.numel():
                raise RuntimeError(f"LANS/LAMB: fragment of tensor {t} in group {i} lies outside the partition")
            starts.append(int(addr.start))
            numels.append(int(addr.numel))
            index.append(t)
            covered[t] += addr.numel
        order = sorted(range(len(starts)), key=lambda k: starts[k])
        starts = [starts[k] for k in order]
        numels = [numels[k] for k in order]
        index = [index[k] for k in order]
        for a in range(1, len(starts)):
            if starts[a - 1] + numels[a - 1] > starts[a]:
                raise RuntimeError(f"LANS/LAMB: overlapping fragments in group {i}")
        pg = dp_groups[i]
        # One-time check that the ranks' fragments cover every tensor exactly once.
        total = allreduce_sums(covered.to(flat.device), pg).cpu()
        expected = torch.tensor([lp.numel() for lp in lps], dtype=torch.float64)
        if not torch.equal(total, expected):
            bad = int((total != expected).nonzero()[0])
            raise RuntimeError(
                f"LANS/LAMB: fragments of tensor {bad} in group {i} cover {int(total[bad])} of "
                f"{int(expected[bad])} elements across ranks"
            )
        layouts[id(flat)] = GroupLayout(
            starts=starts,
            numels=numels,
            tensor_index=index,
            num_tensors=len(lps),
            partition_numel=flat.numel(),
            tensor_numels=[lp.numel() for lp in lps],
            process_group=pg,
        )
    return layouts
