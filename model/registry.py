"""Model families and named model sizes: one typed spec and one ``Family`` record per family, one registry.

Everything that differs between families (which spec and model class, which shard format and vocabulary
hash, how the output heads count in FLOPs, which eval metrics, how the tokenizer is exported) lives in its
``Family`` record: code elsewhere asks ``family_of(spec)`` instead of comparing family names, so a third
family is one more spec class, model module and record in ``FAMILIES``.

Sizes follow the published shapes: BERT base/large (Devlin et al.), the pre-LayerNorm BERT 1.5B/5B shapes of
the Gaudi DeepSpeed BERT recipes, and GPT-NeoX's own configs (``configs/125M.yml`` ... ``20B.yml``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import UserError

if TYPE_CHECKING:
    from torch import nn

BERT_VOCAB = 30522  # BERT uncased WordPiece vocabulary
NEOX_VOCAB = 50432  # GPT-NeoX-20B's padded vocabulary (50277 tokens + padding)


def pad_vocab(size: int, multiple: int) -> int:
    """Round a vocabulary size up to a multiple (tensor-core friendly shapes)."""
    return ((size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class BertSpec:
    """A BERT encoder with the MLM + next-sentence pre-training heads."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab_size: int = BERT_VOCAB
    vocab_multiple: int = 8
    max_positions: int = 512
    type_vocab: int = 2
    pre_layernorm: bool = False  # pre-LN blocks (MegatronBert) for the deep 1.5B / 5B models
    dropout: float = 0.1
    family: str = "bert"

    def __post_init__(self) -> None:
        _check_common(self)

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


@dataclass(frozen=True)
class NeoxSpec:
    """A GPT-NeoX decoder: rotary embeddings, untied input/output embeddings."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int = 0  # 0: 4 x hidden
    vocab_size: int = NEOX_VOCAB
    vocab_multiple: int = 128
    max_positions: int = 2048
    rotary_pct: float = 1.0
    rotary_base: float = 10000.0
    parallel_residual: bool = False  # GPT-J style residual (20B uses it)
    dropout: float = 0.0
    family: str = "neox"

    def __post_init__(self) -> None:
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        _check_common(self)
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"{self.name}: rotary_pct must be in (0, 1], got {self.rotary_pct}")

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


ModelSpec = BertSpec | NeoxSpec


def _check_common(spec: BertSpec | NeoxSpec) -> None:
    for field in ("layers", "hidden", "heads", "ffn", "vocab_size", "max_positions"):
        if getattr(spec, field) <= 0:
            raise ValueError(f"{spec.name}: {field} must be positive, got {getattr(spec, field)}")
    if spec.hidden % spec.heads:
        raise ValueError(f"{spec.name}: hidden {spec.hidden} is not divisible by heads {spec.heads}")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"{spec.name}: dropout must be in [0, 1), got {spec.dropout}")


_SPECS: list[ModelSpec] = [
    BertSpec("bert-debug", layers=2, hidden=128, heads=2, ffn=512, max_positions=512),
    BertSpec("bert-10m", layers=4, hidden=256, heads=4, ffn=1024),
    BertSpec("bert-base", layers=12, hidden=768, heads=12, ffn=3072),
    BertSpec("bert-large", layers=24, hidden=1024, heads=16, ffn=4096),
    BertSpec("bert-1.5b", layers=48, hidden=1600, heads=25, ffn=6400, pre_layernorm=True),
    BertSpec("bert-5b", layers=63, hidden=2560, heads=40, ffn=10240, pre_layernorm=True),
    NeoxSpec("neox-debug", layers=2, hidden=128, heads=4, max_positions=2048),
    NeoxSpec("neox-125m", layers=12, hidden=768, heads=12),
    NeoxSpec("neox-350m", layers=24, hidden=1024, heads=16),
    NeoxSpec("neox-760m", layers=24, hidden=1536, heads=16),
    NeoxSpec("neox-1.3b", layers=24, hidden=2048, heads=16),
    NeoxSpec("neox-2.7b", layers=32, hidden=2560, heads=32),
    NeoxSpec("neox-6.7b", layers=32, hidden=4096, heads=32),
    NeoxSpec("neox-13b", layers=40, hidden=5120, heads=40),
    NeoxSpec("neox-20b", layers=44, hidden=6144, heads=64, rotary_pct=0.25, parallel_residual=True),
]

REGISTRY: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def get_spec(name: str, **overrides: Any) -> ModelSpec:
    """The named size, optionally with fields replaced (e.g. ``vocab_size`` from the data's vocabulary)."""
    try:
        spec = REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}") from None
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return spec
    fields = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"model {name!r} has no field(s) {', '.join(unknown)}")
    try:
        return dataclasses.replace(spec, **overrides)
    except ValueError as e:
        raise UserError(str(e)) from None


def spec_to_dict(spec: ModelSpec) -> dict:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict) -> ModelSpec:
    """Rebuild a spec stored in a checkpoint or summary (the derived ``padded_vocab`` is ignored)."""
    try:
        family = FAMILIES[d["family"]]
    except KeyError:
        raise UserError(f"model spec has family {d.get('family')!r}; known families: {', '.join(FAMILIES)}") from None
    fields = {f.name for f in dataclasses.fields(family.spec_class)}
    derived = {"padded_vocab"}
    unknown = sorted(set(d) - fields - derived)
    if unknown:
        raise UserError(f"model spec {d.get('name')!r} has unknown field(s) {', '.join(unknown)}")
    try:
        return family.spec_class(**{k: v for k, v in d.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise UserError(f"model spec {d.get('name')!r}: {e}") from None


# ---------------------------------------------------------------------------------------------- families
# Builders and tokenizer writers import their module on call: the family modules import this one (for the
# spec classes), and listing sizes or reading a spec must not load ``transformers``.


def _build_bert(spec: BertSpec, attention: str) -> nn.Module:
    from model.bert import BertPretraining

    return BertPretraining(spec, attention)


def _build_neox(spec: NeoxSpec, attention: str) -> nn.Module:
    from model.neox import NeoxPretraining

    return NeoxPretraining(spec, attention)


def _save_bert_tokenizer(vocab: Path, out: Path, spec: BertSpec, data_attrs: dict[str, Any]) -> dict[str, int]:
    from model.bert import save_hf_tokenizer

    return save_hf_tokenizer(vocab, out, spec, lowercase=bool(data_attrs.get("lowercase", True)))


def _save_neox_tokenizer(tokenizer: Path, out: Path, spec: NeoxSpec, data_attrs: dict[str, Any]) -> dict[str, int]:
    from model.neox import save_hf_tokenizer

    return save_hf_tokenizer(tokenizer, out, spec, eod_id=data_attrs.get("eod_id"))


def _mlm_head_weights(pred_head: int, seq_head: int, max_pred: int | None) -> tuple[int, int]:
    """BERT: nothing per token; per sequence the MLM head at ``max_pred`` gathered positions, pooler + NSP once."""
    if max_pred is None:
        raise ValueError("BERT FLOPs need max_pred (MLM predictions per sequence)")
    return 0, pred_head * max_pred + seq_head


def _lm_head_weights(pred_head: int, seq_head: int, max_pred: int | None) -> tuple[int, int]:
    """Causal LM: the LM head at every token (per-sequence heads, if any, once per sequence)."""
    return pred_head, seq_head


HeadRule = Callable[[int, int, "int | None"], tuple[int, int]]


@dataclass(frozen=True)
class Family:
    """What differs between model families, in one record."""

    name: str
    """The value of ``spec.family``; stored in checkpoints and summaries."""
    spec_class: type
    """The spec dataclass of the family's sizes."""
    build: Callable[[Any, str], nn.Module]
    """(spec, attention implementation) -> the pre-training model, on the current default device."""
    shard_kind: str
    """The data layer's name of the shard format the family trains on (``data.h5format.SCHEMAS``)."""
    hash_key: str
    """Shard attribute holding the sha256 of the vocabulary / tokenizer file the shards were made with."""
    tokenizer_file: str
    """What the tokenizer file is (for messages): ``vocab.txt`` or ``tokenizer.json``."""
    uses_max_pred: bool
    """Shards and FLOPs depend on ``data.max_pred`` (MLM predictions per sequence)."""
    unpads: bool
    """Its model can compute only the real tokens of padded rows (``model.unpad``)."""
    head_weights: HeadRule
    """(per-position head weights, a tied decoder included; per-sequence head weights; max_pred) -> (head
    weights every token is multiplied by, head weights multiplied once per sequence) (``model.flops``)."""
    eval_metrics: tuple[str, ...]
    """Keys ``Trainer.evaluate`` reports for the family."""
    save_tokenizer: Callable[[Path, Path, Any, dict[str, Any]], dict[str, int]]
    """(tokenizer file used in training, output dir, spec, shard attributes): write Hugging Face tokenizer
    files that give the training ids; return special-token ids for the model config (``eos_token_id``...)."""
    hf_auto_class: str
    """The ``transformers`` auto class an exported directory loads with."""


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="bert",
            spec_class=BertSpec,
            build=_build_bert,
            shard_kind="bert",
            hash_key="vocab_sha256",
            tokenizer_file="vocab.txt",
            uses_max_pred=True,
            unpads=True,
            head_weights=_mlm_head_weights,
            eval_metrics=("eval_loss", "eval_mlm_accuracy", "eval_nsp_accuracy"),
            save_tokenizer=_save_bert_tokenizer,
            hf_auto_class="AutoModelForPreTraining",
        ),
        Family(
            name="neox",
            spec_class=NeoxSpec,
            build=_build_neox,
            shard_kind="gpt",
            hash_key="tokenizer_sha256",
            tokenizer_file="tokenizer.json",
            uses_max_pred=False,
            unpads=False,
            head_weights=_lm_head_weights,
            eval_metrics=("eval_loss", "eval_perplexity"),
            save_tokenizer=_save_neox_tokenizer,
            hf_auto_class="AutoModelForCausalLM",
        ),
    )
}


def family_of(spec: ModelSpec) -> Family:
    """The family record of a spec."""
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise UserError(f"model {spec.name!r} has unknown family {spec.family!r}") from None
