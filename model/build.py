"""Build any registry model; count its parameters on the meta device (no memory is allocated)."""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from model.bert import BertPretraining
from model.neox import NeoxPretraining
from model.registry import REGISTRY, ModelSpec, family_of, get_spec

PretrainingModel = BertPretraining | NeoxPretraining


def build_model(
    spec: ModelSpec | str,
    *,
    device: str | torch.device = "cpu",
    attention: str = "sdpa",
    activation_checkpointing: bool = False,
    unpad: bool = True,
) -> PretrainingModel:
    """Construct the pre-training model. ``device="meta"`` builds shapes only (any size, no memory).

    ``unpad``: BERT computes only the real tokens of its padded batches (``model.unpad``); GPT-NeoX's packed
    windows have no padding, it ignores it.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    with torch.device(device):
        # Family.build is declared as returning nn.Module: each family builds its own pre-training model.
        model = cast(PretrainingModel, family_of(spec).build(spec, attention))
    if isinstance(model, BertPretraining):
        model.unpad = unpad
    if activation_checkpointing:
        # Non-reentrant checkpointing: works with ZeRO-3 parameter gathering and with frozen inputs.
        model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def parameter_breakdown(model: nn.Module) -> dict[str, int]:
    """Parameter counts by role (``transformers`` names): embeddings, output embedding, the rest."""
    out = {"total": 0, "input_embedding": 0, "output_embedding": 0, "position_embedding": 0}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        n = p.numel()
        out["total"] += n
        if name.endswith(("word_embeddings.weight", "embed_in.weight")):
            out["input_embedding"] += n
        elif name.endswith(("embed_out.weight", "lm_head.weight")):
            out["output_embedding"] += n
        elif name.endswith(("position_embeddings.weight", "token_type_embeddings.weight")):
            out["position_embedding"] += n
    return out


@functools.cache
def count_parameters(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts of a spec, built on the meta device.

    ``total`` counts every parameter as built (GPT-NeoX: untied input and output embeddings, GPT-NeoX's own
    convention). ``tied`` counts the vocabulary matrix once: the convention behind GPT-3-style nominal names
    such as "125M".
    """
    counts = parameter_breakdown(build_model(spec, device="meta"))
    counts["tied"] = counts["total"] - counts["output_embedding"]
    return counts


def list_models() -> list[dict]:
    rows = []
    for name, spec in REGISTRY.items():
        c = count_parameters(spec)
        rows.append(
            {
                "name": name,
                "family": spec.family,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "heads": spec.heads,
                "ffn": spec.ffn,
                "vocab": spec.padded_vocab,
                "params": c["total"],
                "params_tied": c["tied"],
                "params_non_embedding": c["total"]
                - c["input_embedding"]
                - c["output_embedding"]
                - c["position_embedding"],
            }
        )
    return rows
