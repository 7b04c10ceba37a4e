"""Training FLOPs per token: MFU's numerator (the device peak is ``training.devices.peak_flops``).

Convention (PaLM appendix B; torchtitan and llm.c use the same):

    training FLOPs per token = 6 * N_matmul + 12 * L * d_model * S

* ``N_matmul`` counts the weights a token is multiplied by: every transformer-layer weight and the output
  projection. Embedding *lookups* (token, position, token-type) cost no matmul FLOPs and are left out.
  6 = 2 (multiply-add) x 3 (forward + backward, backward being twice the forward).
* ``12 * L * d_model * S`` is attention's QK^T and AV (2 matmuls x 2 FLOPs x d_model x S per layer per token,
  x 3 for training). Causal models are *not* halved (PaLM's convention), so MFU is comparable across
  families.
* BERT's heads follow what the sparse model computes: the MLM head (transform + vocabulary decoder) runs at
  ``max_pred`` gathered positions per sequence, so it counts ``max_pred / S`` of a token's share; the pooler
  and NSP classifier run once per sequence (1 / S).
* Activation recomputation is not counted: these are *model* FLOPs, not hardware FLOPs.

Unpadded BERT (``model.unpad``) computes only the real tokens, so :func:`training_flops_of_lengths` counts a
batch by its sequences' real lengths n_i: ``6 * N_matmul`` per real token, attention ``12 * L * d_model * n_i``
per real token of sequence i (``12 * L * d_model * sum(n_i**2)`` in all), the heads per sequence as above.
With every n_i = S it equals ``B * S * training_flops_per_token``.

What a run counts (:class:`WorkCounter`, per micro-batch on the host): the positions the model *computes*.
Unpadded BERT computes its real tokens, so tokens/s counts real tokens and the FLOPs use the real lengths; a
padded run (``model.unpad=false``) computes every position and counts them all, padding included, at
``training_flops_per_token``; a packed GPT-NeoX window has no padding. Each counts the positions its linears
and heads compute, so one MFU convention serves both paths. One exception, counted low, never high: the
unpadded model's ``padded`` attention kernel (its default on accelerators, ``model.unpad``) runs attention
over ``B * max_seqlen**2`` positions and is credited ``sum(n_i**2)``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import astuple, dataclass

import torch

from model.build import build_model
from model.registry import ModelSpec, family_of


@functools.cache
def _layer_and_head_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(weights in transformer layers + final norm, per-prediction head weights, per-sequence head
    weights), by the family's ``Family.param_role``. A tied output embedding (BERT's decoder) is the embedding
    matrix under a second name: looked up once, multiplied once."""
    family = family_of(spec)
    model = build_model(spec, device="meta")
    counts = {"layer": 0, "prediction": 0, "sequence": 0}
    bucket = {
        "layer": "layer",
        "prediction_head": "prediction",
        "output_embedding": "prediction",
        "sequence_head": "sequence",
    }  # embedding lookups are no matmul
    seen: set[tuple[int, str]] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        where = bucket.get(family.param_role(name))
        if where is not None and (id(p), where) not in seen:  # each weight once per use
            seen.add((id(p), where))
            counts[where] += p.numel()
    return counts["layer"], counts["prediction"], counts["sequence"]


def _head_weights(spec: ModelSpec, max_pred: int | None) -> tuple[int, int, int]:
    """(matmul weights every token is multiplied by, head weights multiplied once per sequence, layers)."""
    layers, pred_head, seq_head = _layer_and_head_params(spec)
    per_token, per_sequence = family_of(spec).head_weights(pred_head, seq_head, max_pred)
    return layers + per_token, per_sequence, spec.layers * spec.hidden


def _flops(per_token: int, per_sequence: int, attention: int, tokens: float, squares: float, sequences: float) -> float:
    """``6 * (per_token * tokens + per_sequence * sequences) + 12 * L * d * squares`` (``attention`` = L * d); exact
    integers from integers."""
    return 6 * (per_token * tokens + per_sequence * sequences) + 12 * attention * squares


@functools.cache
def training_flops_per_token(spec: ModelSpec, seq_len: int, max_pred: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of full ``seq_len`` rows, under this module's convention."""
    return _flops(*_head_weights(spec, max_pred), seq_len, seq_len * seq_len, 1) / seq_len


def training_flops_of_lengths(spec: ModelSpec, lengths: Iterable[int], max_pred: int | None = None) -> int:
    """Training FLOPs of a batch whose sequences have these real lengths, as the unpadded model computes it.

    Per sequence of n real tokens: ``6 * (N_matmul * n + per-sequence head weights) + 12 * L * d_model *
    n**2``; an empty row costs nothing. Exact integers.
    """
    real = [int(n) for n in lengths if n > 0]
    return int(_flops(*_head_weights(spec, max_pred), sum(real), sum(n * n for n in real), len(real)))


def training_flops_of_sums(
    spec: ModelSpec, tokens: float, squares: float, sequences: float, max_pred: int | None = None
) -> float:
    """:func:`training_flops_of_lengths` from the sums it needs: real tokens, their lengths squared, and the
    non-empty sequences (means per sequence give the FLOPs of an average sequence)."""
    return _flops(*_head_weights(spec, max_pred), tokens, squares, sequences)


@dataclass(frozen=True)
class Work:
    """What a micro-batch (or a sum of them) cost, counted on the host (:class:`WorkCounter`)."""

    positions: int
    """Every position read: rows x ``seq_len``, padding included."""
    real: int
    """The real tokens among them (BERT: its attention mask; a packed GPT window has no padding)."""
    computed: int
    """The positions the model computed: the real tokens when it unpads (``model.unpad``), else every position.
    Tokens/s, TFLOP/s and MFU count these (``training.metrics``)."""
    flops: int
    """Training FLOPs of the computed positions (this module's convention): exact for a micro-batch; a job's
    totals travel in float64 (``training.trainer.StepReduction``), exact below 2**53, then to 1e-16."""

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    @property
    def padding_fraction(self) -> float | None:
        """Padded positions over all positions read; None before any."""
        return 1.0 - self.real / self.positions if self.positions else None


NO_WORK = Work(0, 0, 0, 0)


class WorkCounter:
    """Counts each micro-batch on the host, from what the loader gives it: the unpadding keys' ``cu_seqlens``
    (CPU tensor), else the attention mask, else full rows. No device value is read."""

    def __init__(self, spec: ModelSpec, seq_len: int, max_pred: int | None, unpadded: bool) -> None:
        self.seq_len, self.unpadded = seq_len, unpadded
        self._weights = _head_weights(spec, max_pred)

    def lengths(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The real length of each row (int64, on the host)."""
        if "cu_seqlens" in batch:
            return batch["cu_seqlens"].to("cpu", torch.int64).diff()
        if "attention_mask" in batch:
            return (batch["attention_mask"].to("cpu") != 0).sum(1)
        rows = batch["input_ids"].shape[0]
        return torch.full((rows,), self.seq_len, dtype=torch.int64)

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> Work:
        n = self.lengths(batch)
        rows, positions, real = len(n), len(n) * self.seq_len, int(n.sum())
        if self.unpadded:
            flops = _flops(*self._weights, real, int((n * n).sum()), int((n > 0).sum()))
            return Work(positions, real, real, int(flops))
        flops = _flops(*self._weights, positions, rows * self.seq_len**2, rows)
        return Work(positions, real, positions, int(flops))
