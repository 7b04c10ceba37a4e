"""What a model family is: one ``Family`` record, and what every family module shares.

A family module (``model.bert``, ``model.neox``, or one named by ``model.families``: the hook in
``model.registry``) defines its spec dataclass, its pre-training model, and one record, ``FAMILY``, that
everything else asks: the build and whether a run unpads, the compile scope, the FLOPs rule, evaluation and
the logged outputs, the name of its shard format (whose record, ``data.formats``, holds the data's facts: tokenizer
file and hash attribute, ``max_pred``) and the Hugging Face export. This module imports no family, so the
family modules and the registry that collects them form no circle.

A spec is a frozen dataclass with at least ``name``, ``family`` (the record's name), ``layers``, ``hidden``,
``heads``, ``ffn``, ``vocab_size``, ``max_positions``, ``dropout`` and the derived ``padded_vocab``; its fields
are the architecture a resume checks (``training.checkpoint.resume.architecture``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from common.errors import UserError
from data.formats import FORMATS, ShardFormat

if TYPE_CHECKING:
    from torch import nn

    from model.unpad import AttentionKernel


def pad_vocab(size: int, multiple: int) -> int:
    """Round a vocabulary size up to a multiple (tensor-core friendly shapes)."""
    return ((size + multiple - 1) // multiple) * multiple


def check_sizes(spec: Any) -> None:
    """The checks every spec's ``__post_init__`` makes: positive sizes, whole heads, a dropout in [0, 1)."""
    for field in ("layers", "hidden", "heads", "ffn", "vocab_size", "max_positions"):
        if getattr(spec, field) <= 0:
            raise ValueError(f"{spec.name}: {field} must be positive, got {getattr(spec, field)}")
    if spec.hidden % spec.heads:
        raise ValueError(f"{spec.name}: hidden {spec.hidden} is not divisible by heads {spec.heads}")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"{spec.name}: dropout must be in [0, 1), got {spec.dropout}")


def lm_head_weights(pred_head: int, seq_head: int, max_pred: int | None) -> tuple[int, int]:
    """Causal LM: the LM head at every token (per-sequence heads, if any, once per sequence)."""
    return pred_head, seq_head


HeadRule = Callable[[int, int, "int | None"], tuple[int, int]]

ParamRole = Literal[
    "input_embedding", "position_embedding", "output_embedding", "prediction_head", "sequence_head", "layer"
]
"""What a parameter is, for parameter counts and FLOPs (``model.build``, ``model.flops``). Embedding lookups
(``input_embedding``, ``position_embedding``: token types too) cost no matmul; ``output_embedding`` and
``prediction_head`` run per prediction, ``sequence_head`` once per sequence, ``layer`` at every token."""

CompileTarget = tuple["nn.Module", str, Callable[..., Any]]
"""(module, the attribute its compiled call replaces: ``forward``, or another the model calls, the eager
callable compiled) (``model.compile``)."""


_MOVED = {
    "shard_kind": "name",  # the registry key: shard_format="gpt" for shard_kind="gpt"
    "hash_key": "hash_key",
    "tokenizer_file": "tokenizer_kind",
    "uses_max_pred": "uses_max_pred",
}
"""The fields the Family record held before it named its shard format -> where each is now: a field of the format's
record (``data.formats.ShardFormat``)."""


def hf_inside(model: Any) -> Any:
    """``Family.transformers_model`` for a model that holds its ``transformers`` model as ``.hf``."""
    return model.hf


@dataclass(frozen=True)
class Evaluation:
    """How a family's held-out evaluation adds its forward outputs up, over batches and ranks
    (``training.evaluate``), and the metrics it reports. The row count ``n`` and the mean loss per row
    (``eval_loss``) are every family's; these are the family's own."""

    sums: tuple[str, ...]
    """Names of the family's sums, in the order of the one all-reduce."""
    pieces: Callable[[Mapping[str, Any], float], dict[str, Any]]
    """(forward outputs, rows in the batch) -> this batch's addends, by name (a subset of ``sums``)."""
    metrics: Callable[[Mapping[str, float]], dict[str, float]]
    """Totals over every batch and rank (``n`` included) -> reported metrics; an ``eval_loss`` here replaces the
    mean loss per row."""
    labels: tuple[tuple[str, str], ...]
    """(metric, its console label) for the metrics the console shows after ``eval_loss``."""


@dataclass(frozen=True)
class Family:
    """What differs between model families, in one record."""

    name: str
    """The value of ``spec.family``; stored in checkpoints and summaries."""
    title: str
    """The family's name in messages (``BERT``, ``GPT-NeoX``)."""
    spec_class: type
    """The spec dataclass of the family's sizes."""
    sizes: tuple[Any, ...]
    """The family's named sizes (``spec_class`` instances): ``model.name`` picks one (``python -m model list``)."""
    model: Callable[..., nn.Module]
    """The pre-training model: ``model(spec, attention)``; when the family ``unpads``, also keywords ``unpad``
    and ``unpad_kernel`` (the kernel asked for over the packed tokens, None for auto: the device's default).
    Built through :meth:`build`, on the current default device."""
    shard_format: str
    """The name of the shard format the family trains on, a key of ``data.formats``' registry (``bert``,
    ``gpt``, or one a ``data.formats`` module registers): :attr:`format` is its record."""
    unpads: bool
    """Its model can compute only the real tokens of padded rows (``model.unpad``): :meth:`unpadded`."""
    head_weights: HeadRule
    """(per-prediction head weights, a tied decoder included; per-sequence head weights; max_pred) -> (head
    weights every token is multiplied by, head weights multiplied once per sequence) (``model.flops``)."""
    param_role: Callable[[str], ParamRole]
    """A parameter's role (``ParamRole``) from its name in the pre-training model."""
    compile_scope: Callable[[Any], list[CompileTarget]]
    """(a built model of the family) -> what ``model.compile`` compiles in it, in place."""
    loss_parts: tuple[str, ...]
    """Forward outputs logged beside the total loss (each step's record, the console)."""
    evaluation: Evaluation
    """The held-out evaluation's sums and metrics."""
    attention_kernel: Callable[[Any], AttentionKernel | None] | None = None
    """(a built model of the family) -> the attention kernel its last forward ran over the packed tokens
    (``model.unpad.AttentionKernel``: what a run records as ``attention_kernel``), None before its first
    forward or where it did not unpad. None: the family never unpads (its runs record null)."""
    transformers_model: Callable[[Any], Any] | None = None
    """(a built model of the family) -> the ``transformers`` ``PreTrainedModel`` inside it, through which
    activation checkpointing is enabled (``gradient_checkpointing_enable``), ZeRO-3 initialises the partitioned
    weights and the Hugging Face export saves. None: a model of the family's own, which then has none of the
    three (each refused in one line)."""
    save_tokenizer: Callable[[Path, Path, Any, dict[str, Any]], dict[str, int]] | None = None
    """(tokenizer file used in training, output dir, spec, shard attributes): write Hugging Face tokenizer
    files that give the training ids; return special-token ids for the model config (``eos_token_id``...).
    None: the family has no Hugging Face export (it needs ``transformers_model`` too)."""
    hf_auto_class: str | None = None
    """The ``transformers`` auto class an exported directory loads with."""

    @property
    def format(self) -> ShardFormat:
        """The record of the family's shard format (``data.formats``): its tokenizer file and hash attribute,
        whether it has ``max_pred``. Looked up when asked, so a format registered by a ``data.formats``
        module loaded after the family (``training.config.load_config``) is found."""
        fmt = FORMATS.get(self.shard_format)
        if fmt is None:
            raise UserError(
                f"model family {self.name!r} trains on shard format {self.shard_format!r}, which is not registered "
                f"(known: {', '.join(FORMATS)}); a format from outside the package comes in through data.formats"
            )
        return fmt

    def unpadded(self, setting: bool) -> bool:
        """Whether a run computes only the real tokens: ``model.unpad`` (``setting``) where the family can. The
        one place this is decided, before the model is built: the model, the loaders and the FLOPs counter are
        given the answer."""
        return self.unpads and setting

    def kernel_ran(self, model: Any) -> AttentionKernel | None:
        """The attention kernel ``model``'s last forward ran (its :attr:`attention_kernel`), or None."""
        return None if self.attention_kernel is None else self.attention_kernel(model)

    def build(
        self, spec: Any, attention: str = "sdpa", unpad: bool = False, unpad_kernel: str | None = None
    ) -> nn.Module:
        """The family's pre-training model for ``spec`` (``unpad``: :meth:`unpadded`'s answer)."""
        if self.unpads:
            return self.model(spec, attention, unpad=unpad, unpad_kernel=unpad_kernel)
        if unpad:
            raise ValueError(f"{self.title} models do not unpad (Family.unpadded)")
        return self.model(spec, attention)


def _refuse_moved_fields(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap the record's ``__init__``: a family module that still sets a field the record held before it named
    its shard format is told, in one line naming the family and the field, what to set instead."""

    @functools.wraps(init)
    def checked(self: Family, *args: Any, **fields: Any) -> None:
        for name in _MOVED:
            if name in fields:
                what = (
                    f"shard_format={fields[name]!r} instead"
                    if name == "shard_kind"
                    else f"shard_format, its format's name, instead: that record (data.formats) holds {_MOVED[name]}"
                )
                raise UserError(
                    f"model family {fields.get('name', '?')!r} sets {name}, which the Family record no longer has: "
                    f"set {what}"
                )
        init(self, *args, **fields)

    return checked


Family.__init__ = _refuse_moved_fields(Family.__init__)  # type: ignore[method-assign]
