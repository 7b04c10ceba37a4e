"""Under the DeepSpeed launcher: build models with ``training.zero_init.build_partitioned`` (ZeRO-3) and
compare the gathered weights with the same model built whole, without ZeRO.

The reference is built the way ``build_partitioned`` initialises: no ``torch.nn`` init at construction, then
``transformers``' ``initialize_weights`` and ``tie_weights``, from the same seed, cast to the training dtype.
First, before anything else grows the process, the peak RSS growth of building neox-125m partitioned.
Writes ``OUT/rank<R>.json`` with that, and per model the elements this rank holds, the model's total, the
names of mismatching tensors and the largest difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
from transformers.initialization import no_init_weights

from common.process import end_process_group, exit_fast
from model.build import build_model
from training.engine import no_shm_all_reduce
from training.zero_init import build_partitioned, local_numel

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True},
}


def reference(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    with no_init_weights():
        model = build_model(name)
    model.hf.initialize_weights()
    model.hf.tie_weights()
    out = {k: v.to(torch.bfloat16) for k, v in model.named_parameters()}
    out.update({f"buffer:{k}": v for k, v in model.named_buffers()})
    out["tied"] = torch.tensor(len({id(p) for p in model.parameters()}))
    return out


def partitioned(name: str) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    torch.manual_seed(1234)
    model = build_partitioned(name, DS_CONFIG)
    held = local_numel(model)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({f"buffer:{k}": v for k, v in model.named_buffers()})
    out["tied"] = torch.tensor(len({id(p) for p in model.parameters()}))
    return out, held


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory() -> dict[str, int]:
    before = peak_rss()
    model = build_partitioned("neox-125m", DS_CONFIG)
    growth = peak_rss() - before
    held, whole = local_numel(model)
    largest = max(p.ds_numel for p in model.parameters())
    return {"peak_growth": growth, "held": held, "whole": whole, "largest": largest}


def main() -> None:
    out = Path(sys.argv[-1])  # the launcher puts --local_rank first
    no_shm_all_reduce()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    try:
        rank = deepspeed.comm.get_rank()
        result: dict = {"rank": rank, "memory": memory()}
        for name in ("bert-debug", "neox-debug"):
            want = reference(name)
            got, (held, whole) = partitioned(name)
            bad = sorted(k for k in want if k not in got or got[k].shape != want[k].shape)
            diffs = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want if k not in bad}
            result[name] = {
                "held": held,
                "whole": whole,
                "missing_or_reshaped": bad,
                "mismatched": sorted(k for k, d in diffs.items() if d != 0),
                "max_diff": max(diffs.values()),
                "compared": len(diffs),
                "std": {k: want[k].float().std().item() for k in want if want[k].numel() > 1 and "weight" in k},
            }
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        end_process_group()


if __name__ == "__main__":
    exit_fast(main())
