"""A plug-in model family that wraps a ``transformers`` model: Llama, defined only here.

It comes in as any family from outside the package does, through ``model.families=[tests.llamafamily]`` at
training time and ``python -m training export --families tests.llamafamily`` at export. Unlike the toy family
(tests/toyfamily.py) its record names the ``transformers`` model inside it, so its checkpoints export to a
directory ``AutoModelForCausalLM`` loads. A Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention)
is no built-in family's architecture: nothing here is borrowed from ``model.neox`` but the tokenizer writer and
the evaluation, which a causal LM on the GPT shard format shares with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model import neox
from model.family import CompileTarget, Family, ParamRole, check_sizes, hf_inside, lm_head_weights, pad_vocab


@dataclass(frozen=True)
class LlamaSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    kv_heads: int = 1
    vocab_size: int = 4096
    vocab_multiple: int = 64
    max_positions: int = 512
    dropout: float = 0.0
    family: str = "hfllama"

    def __post_init__(self) -> None:
        check_sizes(self)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


class LlamaPretraining(nn.Module):
    """Causal LM loss on packed windows of ``seq_len + 1`` tokens (inputs [:-1], targets [1:]), through
    ``transformers``' ``LlamaForCausalLM`` held as ``.hf`` (what the export saves)."""

    def __init__(self, spec: LlamaSpec, attention: str = "sdpa") -> None:
        from transformers import LlamaConfig, LlamaForCausalLM  # on call: seconds to import, as in model.neox

        super().__init__()
        self.spec = spec
        config = LlamaConfig(
            vocab_size=spec.padded_vocab,
            hidden_size=spec.hidden,
            intermediate_size=spec.ffn,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            max_position_embeddings=spec.max_positions,
            attention_dropout=spec.dropout,
            tie_word_embeddings=False,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        config._attn_implementation = attention
        self.hf = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        logits = self.hf(input_ids=inputs).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1).long())
        return {"loss": loss, "lm_loss": loss.detach(), "tokens": torch.tensor(float(targets.numel()))}


def param_role(name: str) -> ParamRole:
    if name.endswith("embed_tokens.weight"):
        return "input_embedding"
    if name.endswith("lm_head.weight"):
        return "output_embedding"
    return "layer"


def compile_scope(model: LlamaPretraining) -> list[CompileTarget]:
    return [(layer, "forward", layer.forward) for layer in model.hf.model.layers]


def save_tokenizer(tokenizer: Any, out: Any, spec: LlamaSpec, data_attrs: dict[str, Any]) -> dict[str, int]:
    """GPT-NeoX's writer: the same ``tokenizer.json`` shards, the end-of-document token as BOS and EOS."""
    return neox.save_hf_tokenizer(tokenizer, out, spec, eod_id=data_attrs.get("eod_id"))


FAMILY = Family(
    name="hfllama",
    title="Llama (a test plug-in)",
    spec_class=LlamaSpec,
    sizes=(LlamaSpec("hfllama-debug", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128),),
    model=LlamaPretraining,
    shard_format="gpt",
    unpads=False,
    head_weights=lm_head_weights,
    param_role=param_role,
    compile_scope=compile_scope,
    loss_parts=(),
    evaluation=neox.FAMILY.evaluation,
    transformers_model=hf_inside,
    save_tokenizer=save_tokenizer,
    hf_auto_class="AutoModelForCausalLM",
)
