"""Named model sizes: one typed spec per family, one registry of names.

Sizes follow the published shapes: BERT base/large (Devlin et al.), the pre-LayerNorm BERT 1.5B/5B shapes of
the Gaudi DeepSpeed BERT recipes, and GPT-NeoX's own configs (``configs/125M.yml`` ... ``20B.yml``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.errors import UserError

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


def get_spec(name: str, **overrides: object) -> ModelSpec:
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
    """Rebuild a spec stored in a checkpoint or summary."""
    cls = {"bert": BertSpec, "neox": NeoxSpec}[d["family"]]
    return cls(**d)
