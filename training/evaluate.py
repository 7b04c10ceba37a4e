"""Evaluation on the fixed held-out set: the same samples at every evaluation, on any world size."""

from __future__ import annotations

import math

import torch

from training import collectives
from training.devices import to_device


@torch.no_grad()
def evaluate(engine, eval_set, device: torch.device) -> dict[str, float]:
    """The same held-out samples every time, whatever the world size: sums over all ranks, one collective.

    BERT: MLM and NSP loss and accuracy; GPT-NeoX: validation loss and perplexity.
    """
    if eval_set is None:
        return {}
    engine.eval()
    keys = (
        "n",
        "loss_x_n",
        "mlm_loss_x_n",
        "nsp_loss_x_n",
        "mlm_correct",
        "mlm_count",
        "nsp_correct",
        "nsp_count",
        "tokens",
        "lm_loss_x_tokens",
    )
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
    try:
        for batch in eval_set:
            batch = to_device(batch, device)
            out = engine(**batch)
            n = float(batch["input_ids"].size(0))
            pieces = {"n": n, "loss_x_n": out["loss"].double() * n}
            for k in ("mlm_loss", "nsp_loss"):
                if k in out:
                    pieces[f"{k}_x_n"] = out[k].double() * n
            for k in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens"):
                if k in out:
                    pieces[k] = out[k]
            if "tokens" in out:
                pieces["lm_loss_x_tokens"] = out["lm_loss"].double() * out["tokens"].double()
            for i, k in enumerate(keys):
                if k in pieces:
                    sums[i] += pieces[k]
    finally:
        engine.train()  # also when a batch fails (out of memory: the line the caller raises)
    sums = sums.to(collectives.comm_device())
    collectives.all_reduce_(sums, "sum")
    total = dict(zip(keys, sums.tolist()))
    if total["n"] == 0:
        return {}
    result = {"eval_loss": total["loss_x_n"] / total["n"]}
    if total["mlm_count"] > 0:
        result["eval_mlm_loss"] = total["mlm_loss_x_n"] / total["n"]
        result["eval_nsp_loss"] = total["nsp_loss_x_n"] / total["n"]
        result["eval_mlm_accuracy"] = total["mlm_correct"] / total["mlm_count"]
        result["eval_nsp_accuracy"] = total["nsp_correct"] / max(total["nsp_count"], 1.0)
    if total["tokens"] > 0:
        lm = total["lm_loss_x_tokens"] / total["tokens"]
        result["eval_loss"] = lm
        result["eval_perplexity"] = math.exp(min(lm, 50.0))
    result["eval_samples"] = total["n"]
    return result
