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
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import cast

import torch

from model.build import build_model
from model.registry import ModelSpec, family_of


@functools.cache
def _layer_and_head_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(weights in transformer layers + final norm, per-prediction head weights, per-sequence head
    weights)."""
    model = build_model(spec, device="meta")
    layers = pred_head = seq_head = 0
    for name, p in model.named_parameters():  # tied decoder weight appears once, under the embedding name
        n = p.numel()
        if name.endswith(("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight")):
            continue
        if name.endswith("embed_in.weight"):
            continue
        if ".cls.predictions." in name or name.endswith(("embed_out.weight", "lm_head.weight")):
            pred_head += n
        elif ".pooler." in name or ".cls.seq_relationship." in name:
            seq_head += n
        else:
            layers += n
    out, inp = model.hf.get_output_embeddings(), model.hf.get_input_embeddings()
    if out is not None and out.weight is inp.weight:  # a tied decoder multiplies by the embedding matrix
        pred_head += cast(torch.Tensor, out.weight).numel()
    return layers, pred_head, seq_head


@functools.cache
def training_flops_per_token(spec: ModelSpec, seq_len: int, max_pred: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) under the convention in this module's docstring."""
    layers, pred_head, seq_head = _layer_and_head_params(spec)
    attention = 12 * spec.layers * spec.hidden * seq_len
    head = family_of(spec).head_weights_per_token(pred_head, seq_head, seq_len, max_pred)
    return 6.0 * (layers + head) + attention


def training_flops_of_lengths(spec: ModelSpec, lengths: Iterable[int], max_pred: int | None = None) -> int:
    """Training FLOPs of a batch whose sequences have these real lengths, as the unpadded model computes it.

    Per sequence of n real tokens: ``6 * (N_matmul * n + head weights of the sequence) + 12 * L * d_model *
    n**2``; the head weights are the family's rule (BERT: the MLM head at ``max_pred`` positions, pooler and
    NSP once) times n, a whole number of weights.
    """
    layers, pred_head, seq_head = _layer_and_head_params(spec)
    rule = family_of(spec).head_weights_per_token
    total = 0
    for n in lengths:
        if n <= 0:
            continue  # an empty row: nothing computed for it
        head = round(rule(pred_head, seq_head, n, max_pred) * n)
        total += 6 * (layers * n + head) + 12 * spec.layers * spec.hidden * n * n
    return total
