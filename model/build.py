"""Build any registry model; count its parameters on the meta device (no memory is allocated)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from common.errors import UserError
from model.compile import compile_blocks
from model.family import Family, ParamRole
from model.registry import REGISTRY, ModelSpec, family_of, get_spec


def build_model(
    spec: ModelSpec | str,
    *,
    device: str | torch.device = "cpu",
    attention: str = "sdpa",
    activation_checkpointing: bool = False,
    unpad: bool | None = None,
    unpad_kernel: str | None = None,
    compile: bool = False,
    family: Family | None = None,
) -> nn.Module:
    """Construct the family's pre-training model (``Family.build``). ``device="meta"`` builds shapes only (any
    size, no memory).

    ``unpad``: whether the model computes only the real tokens of its padded batches, as decided once for a run
    (``Family.unpadded``'s answer: BERT can; GPT-NeoX's packed windows have no padding); None: the family's
    default (what ``Family.unpadded(True)`` says). ``unpad_kernel``: then the attention kernel over the packed
    tokens (None: the device's default).
    ``compile``: ``model.compile``, its transformer blocks compiled as it is built (``model.compile``).
    ``family``: the spec's family record where the caller holds it already (a run's plan); None: looked up.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    if family is None:
        family = family_of(spec)
    with torch.device(device):
        unpadded = family.unpads if unpad is None else unpad  # Family.unpadded(True), not asked again
        model = family.build(spec, attention, unpad=unpadded, unpad_kernel=unpad_kernel)
    if activation_checkpointing:
        if family.transformers_model is None:
            raise UserError(f"model.activation_checkpointing: {family.title} models have no transformers model")
        # Non-reentrant checkpointing: works with ZeRO-3 parameter gathering and with frozen inputs.
        hf: Any = family.transformers_model(model)
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        compile_blocks(model)
    return model


def tied_names(model: nn.Module) -> list[str]:
    """Names of parameters that are another name of an earlier one (tied weights: BERT's MLM decoder is its word
    embeddings): a state dict may hold such a weight once."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append(name)
        seen.add(id(p))
    return out


def parameter_breakdown(model: nn.Module, role: Callable[[str], ParamRole]) -> dict[str, int]:
    """Parameter counts by role (the family's ``Family.param_role``): embeddings, output embedding, the rest."""
    out = {"total": 0, "input_embedding": 0, "output_embedding": 0, "position_embedding": 0}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        n = p.numel()
        out["total"] += n
        kind = role(name)
        if kind in out:
            out[kind] += n
    return out


@functools.cache
def count_parameters(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts of a spec, built on the meta device.

    ``total`` counts every parameter as built (GPT-NeoX: untied input and output embeddings, GPT-NeoX's own
    convention). ``tied`` counts the vocabulary matrix once: the convention behind GPT-3-style nominal names
    such as "125M".
    """
    counts = parameter_breakdown(build_model(spec, device="meta"), family_of(spec).param_role)
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
