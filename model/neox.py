"""GPT-NeoX for causal-LM pre-training on packed windows, built with ``transformers``' GPTNeoX classes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from model.registry import NeoxSpec


def hf_config(spec: NeoxSpec, attention: str = "sdpa") -> GPTNeoXConfig:
    config = GPTNeoXConfig(
        vocab_size=spec.padded_vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        intermediate_size=spec.ffn,
        max_position_embeddings=spec.max_positions,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": spec.rotary_base,
            "partial_rotary_factor": spec.rotary_pct,
        },
        use_parallel_residual=spec.parallel_residual,
        hidden_dropout=spec.dropout,
        attention_dropout=spec.dropout,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attention
    return config


class NeoxPretraining(nn.Module):
    """Causal LM loss on packed windows of ``seq_len + 1`` tokens (inputs [:-1], targets [1:])."""

    family = "neox"

    def __init__(self, spec: NeoxSpec, attention: str = "sdpa") -> None:
        super().__init__()
        self.spec = spec
        self.hf = GPTNeoXForCausalLM(hf_config(spec, attention))

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        logits = self.hf(input_ids=inputs, use_cache=False).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return {"loss": loss, "lm_loss": loss.detach(), "tokens": torch.tensor(float(targets.numel()))}
