"""BERT for pre-training: the ``transformers`` model with a sparse MLM head.

The MLM decoder (a ``hidden x vocab`` matmul, the largest single matmul of a small BERT) runs only at the
masked positions: hidden states are gathered at ``masked_lm_positions`` before the prediction head, as
NVIDIA's reference does, instead of over every position as ``BertForPreTraining`` does. With ``unpad`` (the
default) the encoder runs on the real tokens only (``model.unpad``). The weights are the ``transformers`` ones
either way, so a checkpoint exports to Hugging Face format unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForPreTraining, MegatronBertConfig, MegatronBertForPreTraining
from transformers.models.megatron_bert import modeling_megatron_bert as megatron

from common.errors import UserError
from model import unpad as unpadding
from model.losses import IGNORE_INDEX, ChunkedLossHead
from model.registry import BertSpec


def hf_config(spec: BertSpec, attention: str = "sdpa") -> BertConfig | MegatronBertConfig:
    cls = MegatronBertConfig if spec.pre_layernorm else BertConfig
    return cls(
        vocab_size=spec.padded_vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        intermediate_size=spec.ffn,
        max_position_embeddings=spec.max_positions,
        type_vocab_size=spec.type_vocab,
        hidden_dropout_prob=spec.dropout,
        attention_probs_dropout_prob=spec.dropout,
        hidden_act="gelu",
        pad_token_id=0,
    )


class SdpaMegatronSelfAttention(megatron.MegatronBertSelfAttention):
    """MegatronBert's self-attention through ``F.scaled_dot_product_attention`` (flash/efficient kernels).

    ``transformers`` has no SDPA path for the pre-LN BERT; this keeps its parameters (query/key/value) and
    state-dict names, and replaces only the softmax(QK^T)V computation. Encoder-only: no KV cache.
    """

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        b, s, _ = hidden_states.shape
        shape = (b, s, self.num_attention_heads, self.attention_head_size)
        q = self.query(hidden_states).view(shape).transpose(1, 2)
        k = self.key(hidden_states).view(shape).transpose(1, 2)
        v = self.value(hidden_states).view(shape).transpose(1, 2)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout.p if self.training else 0.0
        )
        return ctx.transpose(1, 2).reshape(b, s, self.all_head_size), None


def _use_sdpa_in_megatron(model: MegatronBertForPreTraining) -> None:
    for module in model.modules():
        if type(module) is megatron.MegatronBertSelfAttention:
            module.__class__ = SdpaMegatronSelfAttention
    # Masks are then built in SDPA form (boolean, or None when nothing is padded).
    model.config._attn_implementation = "sdpa"


def build_hf_bert(spec: BertSpec, attention: str = "sdpa") -> BertForPreTraining | MegatronBertForPreTraining:
    """The ``transformers`` pre-training model for a spec (on the current default device)."""
    config = hf_config(spec)
    if spec.pre_layernorm:
        config._attn_implementation = "eager"
        model = MegatronBertForPreTraining(cast(MegatronBertConfig, config))
        if attention == "sdpa":
            _use_sdpa_in_megatron(model)
        return model
    config._attn_implementation = attention
    return BertForPreTraining(cast(BertConfig, config))


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Losses in FP32 from BF16/FP16 logits; a float64 model (reference runs in tests) stays float64."""
    return logits if logits.dtype == torch.float64 else logits.float()


class BertPretraining(nn.Module):
    """MLM + NSP pre-training with the MLM head evaluated only at masked positions.

    ``unpad``: the encoder computes only the real tokens (``model.unpad``; ``attention`` then does not apply,
    the varlen kernel is ``attention_kernel``, ``None`` for the device's default); false: ``transformers``'
    padded forward, kept for comparison and equality tests.
    """

    family = "bert"

    def __init__(self, spec: BertSpec, attention: str = "sdpa", unpad: bool = True) -> None:
        super().__init__()
        self.spec = spec
        self.hf = build_hf_bert(spec, attention)
        # the MLM decoder (tied to the word embeddings) computes its loss in chunks, without the [B, P, V] logits
        ChunkedLossHead.adopt(self.hf.cls.predictions.decoder)
        self.unpad = unpad
        self.attention_kernel: str | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        masked_lm_positions: torch.Tensor,
        masked_lm_ids: torch.Tensor,
        masked_lm_weights: torch.Tensor,
        next_sentence_labels: torch.Tensor,
        unpad_indices: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | torch.Tensor | None = None,
        min_seqlen: int | torch.Tensor | None = None,
        **_: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Returns ``loss`` (MLM mean over real predictions + NSP mean) and the pieces for metrics.

        ``unpad_indices`` / ``cu_seqlens`` / ``max_seqlen``: the loader's unpadding keys (computed when absent).
        ``min_seqlen``: the shortest row, on the host (the loader's): the padded path passes ``transformers`` no
        attention mask when no row is padded, so its mask code has nothing to check on the device.
        """
        if self.unpad:
            pack = unpadding.packing(attention_mask, unpad_indices, cu_seqlens, max_seqlen, min_seqlen)
            bert: Any = self.hf.bert  # BertModel | MegatronBertModel, walked module by module
            packed = unpadding.encode(
                bert, self.spec.pre_layernorm, input_ids, token_type_ids, pack, self.attention_kernel
            )  # [T, H]
            # each sequence's first token (the pooler's input) and its masked positions, in the packed rows
            rows = pack.rows(attention_mask, F.pad(masked_lm_positions, (1, 0)))  # [B, 1 + P]
            gathered = packed[rows[:, 1:]]  # [B, P, H]
            pooled = bert.pooler(packed[rows[:, :1]])
        else:
            full = unpadding.host_int(min_seqlen) == input_ids.size(1)  # no row padded
            mask = None if full else attention_mask
            out = self.hf.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=mask)
            sequence, pooled = out[0], out[1]
            index = masked_lm_positions.unsqueeze(-1).expand(-1, -1, sequence.size(-1))
            gathered = torch.gather(sequence, 1, index)  # [B, P, H]
        predictions = self.hf.cls.predictions
        # the masked positions' loss (the mean over real predictions: a weight 0 is a padding slot; none: 0) and
        # how many of them the head predicts, in chunks of predictions, never the [B, P, V] logits (model.losses)
        counted = masked_lm_weights != 0
        targets = masked_lm_ids.long().masked_fill(~counted, IGNORE_INDEX)
        hidden = predictions.transform(gathered)
        mlm_loss, mlm_correct = predictions.decoder(hidden, targets, with_correct=True, none_is_zero=True)
        nsp_logits = _at_least_fp32(self.hf.cls.seq_relationship(pooled))  # [B, 2]
        nsp_loss = F.cross_entropy(nsp_logits, next_sentence_labels.view(-1))
        with torch.no_grad():
            nsp_correct = (nsp_logits.argmax(-1) == next_sentence_labels.view(-1)).float().sum()
        return {
            "loss": mlm_loss + nsp_loss,
            "mlm_loss": mlm_loss.detach(),
            "nsp_loss": nsp_loss.detach(),
            "mlm_correct": mlm_correct.to(mlm_loss.dtype),
            "mlm_count": counted.sum().to(mlm_loss.dtype),
            "nsp_correct": nsp_correct,
            "nsp_count": torch.tensor(float(nsp_logits.size(0))),
        }


def save_hf_tokenizer(vocab: Path, out: Path, spec: BertSpec, lowercase: bool) -> dict[str, int]:
    """Write the tokenizer the shards were made with as Hugging Face files; return its special-token ids.

    ``tokenizer.json`` holds the very ``tokenizers`` pipeline of ``data.tokenize_text.bert_tokenizer``
    (BERT normalizer with the shards' casing, WordPiece over ``vocab``), so ``AutoTokenizer`` gives the
    training ids; ``vocab.txt`` is copied beside it for readers that want the plain vocabulary.
    """
    # transformers 5 exports BertTokenizerFast lazily (an alias of BertTokenizer) without declaring it
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    from data.tokenize_text import bert_tokenizer, check_bert_vocab

    words = check_bert_vocab(vocab)  # one line naming the file when it is not a BERT vocab.txt
    if len(words) > spec.padded_vocab:
        raise UserError(f"{vocab}: {len(words)} tokens do not fit {spec.name}'s {spec.padded_vocab} embedding rows")
    tok = BertTokenizerFast(
        tokenizer_object=bert_tokenizer(vocab, lowercase),
        do_lower_case=lowercase,
        strip_accents=lowercase,
        tokenize_chinese_chars=True,
        model_max_length=spec.max_positions,
    )
    tok.save_pretrained(str(out))
    shutil.copyfile(vocab, Path(out) / "vocab.txt")
    return {"pad_token_id": tok.pad_token_id}
