"""A third model family, defined only here: its spec, its model and its record, on a third shard format (``toy``,
tests/toyformat.py).

It comes in as any family from outside the package does, through ``model.families=[tests.toyfamily]``
(``model.registry.load_families``); no file outside tests/ names it. A pre-LN decoder: token embeddings, blocks
of causal SDPA attention and an MLP, an untied LM head; its own evaluation metric (``eval_toy_perplexity``) and
logged loss part (``lm_loss``) show that evaluation and logging ask the record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.family import CompileTarget, Evaluation, Family, ParamRole, check_sizes, lm_head_weights, pad_vocab


@dataclass(frozen=True)
class ToySpec:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab_size: int = 4096
    vocab_multiple: int = 64
    max_positions: int = 512
    dropout: float = 0.0
    family: str = "toy"

    def __post_init__(self) -> None:
        check_sizes(self)

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


class ToyBlock(nn.Module):
    def __init__(self, spec: ToySpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.ln1, self.ln2 = nn.LayerNorm(spec.hidden), nn.LayerNorm(spec.hidden)
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.proj = nn.Linear(spec.hidden, spec.hidden)
        self.up, self.down = nn.Linear(spec.hidden, spec.ffn), nn.Linear(spec.ffn, spec.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ToyModel(nn.Module):
    """Causal LM loss on packed windows of ``seq_len + 1`` tokens (inputs [:-1], targets [1:])."""

    def __init__(self, spec: ToySpec, attention: str = "sdpa") -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.padded_vocab, spec.hidden)
        self.blocks = nn.ModuleList(ToyBlock(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.padded_vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1).long())
        return {"loss": loss, "lm_loss": loss.detach(), "tokens": torch.tensor(float(targets.numel()))}


def param_role(name: str) -> ParamRole:
    if name == "embed.weight":
        return "input_embedding"
    if name == "head.weight":
        return "output_embedding"
    return "layer"


def compile_scope(model: ToyModel) -> list[CompileTarget]:
    return [(block, "forward", block.forward) for block in model.blocks]


def _pieces(out: Mapping[str, Any], n: float) -> dict[str, Any]:
    return {"tokens": out["tokens"], "loss_x_tokens": out["lm_loss"].double() * out["tokens"].double()}


def _metrics(total: Mapping[str, float]) -> dict[str, float]:
    loss = total["loss_x_tokens"] / total["tokens"]
    return {"eval_loss": loss, "eval_toy_perplexity": math.exp(min(loss, 50.0))}


FAMILY = Family(
    name="toy",
    title="Toy",
    spec_class=ToySpec,
    sizes=(ToySpec("toy-debug", layers=2, hidden=64, heads=2, ffn=128),),
    model=ToyModel,
    shard_format="toy",  # tests/toyformat.py, registered by data.formats=[tests.toyformat]
    unpads=False,
    head_weights=lm_head_weights,
    param_role=param_role,
    compile_scope=compile_scope,
    loss_parts=("lm_loss",),
    evaluation=Evaluation(
        sums=("tokens", "loss_x_tokens"), pieces=_pieces, metrics=_metrics, labels=(("eval_toy_perplexity", "toy ppl"),)
    ),
)
