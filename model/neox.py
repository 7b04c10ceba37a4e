"""GPT-NeoX for causal-LM pre-training on packed windows, built with ``transformers``' GPTNeoX classes.

The training forward runs ``transformers``' own modules (the exported model is theirs, parameter for parameter)
in two ways of its own:

* The loss comes from the final hidden states and the output embedding's weight (``lm_head``, GPT-NeoX's
  ``embed_out``) in chunks of tokens (``model.losses``): the [tokens, vocabulary] logits exist neither in forward
  nor in backward.
* The blocks get the attention mask they need, given, not derived: none for SDPA (its ``is_causal`` kernels),
  a causal mask built on the device for eager attention. ``GPTNeoXModel.forward`` instead derives it with
  ``create_causal_mask``, which probes ``position_ids`` for packed sequences with a Python ``if`` on a device
  tensor, a host synchronisation every step (``transformers`` 5.17 to 5.24 at least). Our windows are packed
  documents attended causally across document boundaries, as GPT-NeoX trains, so there is nothing to probe.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from common.errors import UserError
from model.losses import CHUNK_TOKENS, ChunkedLossHead
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

    def __init__(self, spec: NeoxSpec, attention: str = "sdpa", loss_chunk_tokens: int = CHUNK_TOKENS) -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.hf = GPTNeoXForCausalLM(hf_config(spec, attention))
        # The same module, parameter (``hf.lm_head.weight``) and export; called with targets it returns the
        # loss (not registered a second time here: the state dict keeps its keys).
        ChunkedLossHead.adopt(self.hf.get_output_embeddings(), loss_chunk_tokens)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-LayerNorm output for ``input_ids`` [batch, seq]: ``GPTNeoXModel.forward`` less its mask derivation.

        Each module is called (not its ``forward``), so ZeRO-3's gather hooks and activation checkpointing
        (``GradientCheckpointingLayer.__call__``) apply as in ``transformers``' own forward.
        """
        neox = self.hf.gpt_neox
        if self.attention not in ("sdpa", "eager"):  # e.g. flash attention: transformers' own mask handling
            return neox(input_ids=input_ids, use_cache=False).last_hidden_state
        x = neox.emb_dropout(neox.embed_in(input_ids))
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        rotary = neox.rotary_emb(x, position_ids=positions)
        mask = None  # SDPA: no mask, so its causal (flash / efficient) kernels run
        if self.attention == "eager":  # additive causal mask, made on the device without reading it
            mask = torch.full((seq, seq), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
            mask = mask.triu(1)[None, None]
        for layer in neox.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rotary)
        return neox.final_layer_norm(x)

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        # Mean cross-entropy over every target (none is IGNORE_INDEX: token ids are >= 0), in FP32.
        loss = self.hf.get_output_embeddings()(self.hidden_states(inputs), targets)
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
