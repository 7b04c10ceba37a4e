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

The family's spec (``NeoxSpec``), its named sizes and its record (``FAMILY``, ``model.family``) are here too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.errors import UserError
from data.tokenizer import load_tokenizer
from model.family import (
    CompileTarget,
    Evaluation,
    Family,
    ParamRole,
    check_sizes,
    hf_inside,
    lm_head_weights,
    pad_vocab,
)
from model.losses import CHUNK_TOKENS, ChunkedLossHead

if TYPE_CHECKING:
    from transformers import GPTNeoXConfig

NEOX_VOCAB = 50432  # GPT-NeoX-20B's padded vocabulary (50277 tokens + padding)


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
        check_sizes(self)
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"{self.name}: rotary_pct must be in (0, 1], got {self.rotary_pct}")

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


# GPT-NeoX's own configs (configs/125M.yml ... 20B.yml)
SIZES = (
    NeoxSpec("neox-debug", layers=2, hidden=128, heads=4, max_positions=2048),
    NeoxSpec("neox-125m", layers=12, hidden=768, heads=12),
    NeoxSpec("neox-350m", layers=24, hidden=1024, heads=16),
    NeoxSpec("neox-760m", layers=24, hidden=1536, heads=16),
    NeoxSpec("neox-1.3b", layers=24, hidden=2048, heads=16),
    NeoxSpec("neox-2.7b", layers=32, hidden=2560, heads=32),
    NeoxSpec("neox-6.7b", layers=32, hidden=4096, heads=32),
    NeoxSpec("neox-13b", layers=40, hidden=5120, heads=40),
    NeoxSpec("neox-20b", layers=44, hidden=6144, heads=64, rotary_pct=0.25, parallel_residual=True),
)


# ``transformers``' model classes are imported on call: they take seconds to load, and the registry (every
# start-up, ``python -m model list``, FLOPs for a report) imports this module without building a model.


def hf_config(spec: NeoxSpec, attention: str = "sdpa") -> GPTNeoXConfig:
    from transformers import GPTNeoXConfig  # on call: start-up time (above)

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
        from transformers import GPTNeoXForCausalLM  # on call: start-up time (above hf_config)

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
    from transformers import PreTrainedTokenizerFast  # on call (start-up time): only an export needs it

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


def save_tokenizer(tokenizer: Path, out: Path, spec: NeoxSpec, data_attrs: dict[str, Any]) -> dict[str, int]:
    """The record's tokenizer writer: the shards' end-of-document id from their attributes."""
    return save_hf_tokenizer(tokenizer, out, spec, eod_id=data_attrs.get("eod_id"))


# ---------------------------------------------------------------------------------------------- the record


def param_role(name: str) -> ParamRole:
    """``transformers``' names: ``embed_in`` looked up, ``embed_out`` (``lm_head``) the untied output embedding."""
    if name.endswith("embed_in.weight"):
        return "input_embedding"
    if name.endswith(("embed_out.weight", "lm_head.weight")):
        return "output_embedding"
    return "layer"


def compile_scope(model: NeoxPretraining) -> list[CompileTarget]:
    """Each whole ``GPTNeoXLayer`` (fixed-length windows, causal SDPA)."""
    return [(layer, "forward", layer.forward) for layer in model.hf.gpt_neox.layers]


def _eval_pieces(out: Mapping[str, Any], n: float) -> dict[str, Any]:
    return {"tokens": out["tokens"], "lm_loss_x_tokens": out["lm_loss"].double() * out["tokens"].double()}


def _eval_metrics(total: Mapping[str, float]) -> dict[str, float]:
    """The loss per token (every window has as many) and its perplexity."""
    if total["tokens"] <= 0:
        return {}
    lm = total["lm_loss_x_tokens"] / total["tokens"]
    return {"eval_loss": lm, "eval_perplexity": math.exp(min(lm, 50.0))}


FAMILY = Family(
    name="neox",
    title="GPT-NeoX",
    spec_class=NeoxSpec,
    sizes=SIZES,
    model=NeoxPretraining,
    shard_format="gpt",
    unpads=False,
    head_weights=lm_head_weights,
    param_role=param_role,
    compile_scope=compile_scope,
    loss_parts=(),
    evaluation=Evaluation(
        sums=("tokens", "lm_loss_x_tokens"),
        pieces=_eval_pieces,
        metrics=_eval_metrics,
        labels=(("eval_perplexity", "eval ppl"),),
    ),
    transformers_model=hf_inside,
    save_tokenizer=save_tokenizer,
    hf_auto_class="AutoModelForCausalLM",
)
