"""GPT-NeoX for causal-LM pre-training on packed windows, built with ``transformers``' GPTNeoX classes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from common.errors import UserError
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


def save_hf_tokenizer(tokenizer: Path, out: Path, spec: NeoxSpec, eod_id: int | None) -> dict[str, int]:
    """Write the ``tokenizer.json`` the shards were made with as Hugging Face files; return special-token ids.

    The end-of-document token (``<|endoftext|>`` for GPT-NeoX) is BOS, EOS and UNK, as in GPT-NeoX-20B's
    own tokenizer; ``<|padding|>`` is the pad token when the vocabulary has it.
    """
    from transformers import PreTrainedTokenizerFast

    from data.gpt import load_tokenizer

    tok, eod, eod_name = load_tokenizer(tokenizer)  # one line naming the file when it is unusable
    if eod_id is not None and eod != int(eod_id):
        raise UserError(f"{tokenizer}: end-of-document token {eod_name} has id {eod} but the shards used {eod_id}")
    size = tok.get_vocab_size()
    if size > spec.padded_vocab:
        raise UserError(f"{tokenizer}: {size} tokens do not fit {spec.name}'s {spec.padded_vocab} embedding rows")
    pad = "<|padding|>" if tok.token_to_id("<|padding|>") is not None else None
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=eod_name,
        eos_token=eod_name,
        unk_token=eod_name,
        pad_token=pad,
        model_max_length=spec.max_positions,
    )
    hf.save_pretrained(str(out))
    ids = {"bos_token_id": eod, "eos_token_id": eod}
    if pad is not None:
        ids["pad_token_id"] = hf.pad_token_id
    return ids
