"""Evaluation on the fixed held-out set: the same samples at every evaluation, on any world size."""

from __future__ import annotations

import torch

from model.family import Evaluation
from training import collectives
from training.devices import to_device


@torch.no_grad()
def evaluate(engine, eval_set, device: torch.device, evaluation: Evaluation) -> dict[str, float]:
    """The same held-out samples every time, whatever the world size: sums over all ranks, one collective.

    Every family: the mean loss per row (``eval_loss``) and the rows (``eval_samples``); the family's record
    (``Family.evaluation``) adds its own sums and metrics (BERT: MLM and NSP loss and accuracy; GPT-NeoX: the
    loss per token and perplexity).
    """
    if eval_set is None:
        return {}
    engine.eval()
    keys = ("n", "loss_x_n", *evaluation.sums)
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
    try:
        for batch in eval_set:
            batch = to_device(batch, device)
            out = engine(**batch)
            n = float(batch["input_ids"].size(0))
            pieces = {"n": n, "loss_x_n": out["loss"].double() * n, **evaluation.pieces(out, n)}
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
    result = {"eval_loss": total["loss_x_n"] / total["n"], **evaluation.metrics(total)}
    result["eval_samples"] = total["n"]
    return result
