"""BERT for pre-training: the ``transformers`` model with a sparse MLM head.

The MLM decoder (a ``hidden x vocab`` matmul, the largest single matmul of a small BERT) runs only at the
masked positions: hidden states are gathered at ``masked_lm_positions`` before the prediction head, as
NVIDIA's reference does, instead of over every position as ``BertForPreTraining`` does. With ``unpad`` (the
default) the encoder runs on the real tokens only (``model.unpad``). The weights are the ``transformers`` ones
either way, so a checkpoint exports to Hugging Face format unchanged.

The family's spec (``BertSpec``), its named sizes and its record (``FAMILY``, ``model.family``) are here too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import UserError
from data.tokenizer import bert_tokenizer, check_bert_vocab
from model import unpad as unpadding
from model.family import CompileTarget, Evaluation, Family, ParamRole, check_sizes, hf_inside, pad_vocab
from model.losses import IGNORE_INDEX, ChunkedLossHead

if TYPE_CHECKING:
    from transformers import BertConfig, BertForPreTraining, MegatronBertConfig, MegatronBertForPreTraining

BERT_VOCAB = 30522  # BERT uncased WordPiece vocabulary


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
        check_sizes(self)

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_multiple)


# BERT base/large (Devlin et al.) and the pre-LayerNorm 1.5B/5B shapes of the Gaudi DeepSpeed BERT recipes
SIZES = (
    BertSpec("bert-debug", layers=2, hidden=128, heads=2, ffn=512, max_positions=512),
    BertSpec("bert-10m", layers=4, hidden=256, heads=4, ffn=1024),
    BertSpec("bert-base", layers=12, hidden=768, heads=12, ffn=3072),
    BertSpec("bert-large", layers=24, hidden=1024, heads=16, ffn=4096),
    BertSpec("bert-1.5b", layers=48, hidden=1600, heads=25, ffn=6400, pre_layernorm=True),
    BertSpec("bert-5b", layers=63, hidden=2560, heads=40, ffn=10240, pre_layernorm=True),
)


# ``transformers``' model classes are imported on call: they take about 5 s to load, and the registry (every
# start-up, ``python -m model list``, FLOPs for a report) imports this module without building a model.


def hf_config(spec: BertSpec, attention: str = "sdpa") -> BertConfig | MegatronBertConfig:
    from transformers import BertConfig, MegatronBertConfig  # on call: start-up time (above)

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


@functools.cache
def sdpa_megatron_self_attention() -> type[nn.Module]:
    """MegatronBert's self-attention through ``F.scaled_dot_product_attention`` (flash/efficient kernels): a
    subclass of ``transformers``' (made on first use, start-up time above).

    ``transformers`` has no SDPA path for the pre-LN BERT; this keeps its parameters (query/key/value) and
    state-dict names, and replaces only the softmax(QK^T)V computation. Encoder-only: no KV cache.
    """
    from transformers.models.megatron_bert import modeling_megatron_bert as megatron  # on call: start-up time

    class SdpaMegatronSelfAttention(megatron.MegatronBertSelfAttention):
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

    SdpaMegatronSelfAttention.__qualname__ = SdpaMegatronSelfAttention.__name__  # pickled by reference: below
    return SdpaMegatronSelfAttention


def __getattr__(name: str) -> Any:
    """``model.bert.SdpaMegatronSelfAttention``, made on first use (what pickle looks the class up by)."""
    if name == "SdpaMegatronSelfAttention":
        return sdpa_megatron_self_attention()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _use_sdpa_in_megatron(model: MegatronBertForPreTraining) -> None:
    sdpa = sdpa_megatron_self_attention()
    (eager,) = sdpa.__bases__
    for module in model.modules():
        if type(module) is eager:
            module.__class__ = sdpa
    # Masks are then built in SDPA form (boolean, or None when nothing is padded).
    model.config._attn_implementation = "sdpa"


def build_hf_bert(spec: BertSpec, attention: str = "sdpa") -> BertForPreTraining | MegatronBertForPreTraining:
    """The ``transformers`` pre-training model for a spec (on the current default device)."""
    from transformers import BertForPreTraining, MegatronBertForPreTraining  # on call: start-up time (above)

    config = hf_config(spec)
    if spec.pre_layernorm:
        config._attn_implementation = "eager"
        model = MegatronBertForPreTraining(cast("MegatronBertConfig", config))
        if attention == "sdpa":
            _use_sdpa_in_megatron(model)
        return model
    config._attn_implementation = attention
    return BertForPreTraining(cast("BertConfig", config))


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Losses in FP32 from BF16/FP16 logits; a float64 model (reference runs in tests) stays float64."""
    return logits if logits.dtype == torch.float64 else logits.float()


class BertPretraining(nn.Module):
    """MLM + NSP pre-training with the MLM head evaluated only at masked positions.

    ``unpad``: the encoder computes only the real tokens (``model.unpad``; ``attention`` then does not apply,
    the kernel over the packed tokens is asked for as ``unpad_kernel``, ``None`` for auto: the device's
    default); false: ``transformers``' padded forward, kept for comparison and equality tests.
    """

    family = "bert"

    def __init__(
        self, spec: BertSpec, attention: str = "sdpa", unpad: bool = True, unpad_kernel: str | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.hf = build_hf_bert(spec, attention)
        # the MLM decoder (tied to the word embeddings) computes its loss in chunks, without the [B, P, V] logits
        ChunkedLossHead.adopt(self.hf.cls.predictions.decoder)
        self.unpad = unpad
        self.unpad_kernel = unpad_kernel  # asked for (model.unpad_attention); None: auto
        # what the last unpadded forward ran (model.unpad.resolve_kernel); None before one, and for the padded
        # forward (unpad false)
        self.attention_kernel: unpadding.AttentionKernel | None = None

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
            # the kernel, from this forward's device and dtype: on the host, outside the (compiled) layers
            self.attention_kernel = unpadding.encoder_kernel(bert, self.unpad_kernel)
            kernel = self.attention_kernel.kernel
            packed = unpadding.encode(bert, self.spec.pre_layernorm, input_ids, token_type_ids, pack, kernel)  # [T, H]
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

    ``tokenizer.json`` holds the very ``tokenizers`` pipeline of ``data.tokenizer.bert_tokenizer``
    (BERT normalizer with the shards' casing, WordPiece over ``vocab``), so ``AutoTokenizer`` gives the
    training ids; ``vocab.txt`` is copied beside it for readers that want the plain vocabulary.
    """
    # On call (start-up time: the tokenizer classes take 0.4 s to load, and only an export needs them).
    # transformers 5 exports BertTokenizerFast lazily (an alias of BertTokenizer) without declaring it.
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    words = check_bert_vocab(vocab, lowercase)  # one line naming the file when it is not a BERT vocabulary
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
    (Path(out) / "vocab.txt").write_text("".join(w + "\n" for w in words), encoding="utf-8")  # also from a .json
    return {"pad_token_id": tok.pad_token_id}


def save_tokenizer(vocab: Path, out: Path, spec: BertSpec, data_attrs: dict[str, Any]) -> dict[str, int]:
    """The record's tokenizer writer: the shards' casing (``lowercase``) from their attributes."""
    return save_hf_tokenizer(vocab, out, spec, lowercase=bool(data_attrs.get("lowercase", True)))


# ---------------------------------------------------------------------------------------------- the record


def mlm_head_weights(pred_head: int, seq_head: int, max_pred: int | None) -> tuple[int, int]:
    """BERT: nothing per token; per sequence the MLM head at ``max_pred`` gathered positions, pooler + NSP once."""
    if max_pred is None:
        raise ValueError("BERT FLOPs need max_pred (MLM predictions per sequence)")
    return 0, pred_head * max_pred + seq_head


def param_role(name: str) -> ParamRole:
    """``transformers``' names: the tied MLM decoder is the output embedding, the rest of ``cls.predictions``
    the prediction head, the pooler and NSP classifier the per-sequence head."""
    if name.endswith("word_embeddings.weight"):
        return "input_embedding"
    if name.endswith(("position_embeddings.weight", "token_type_embeddings.weight")):
        return "position_embedding"
    if name.endswith("cls.predictions.decoder.weight"):
        return "output_embedding"
    if ".cls.predictions." in name:
        return "prediction_head"
    if ".pooler." in name or ".cls.seq_relationship." in name:
        return "sequence_head"
    return "layer"


def attention_kernel(model: BertPretraining) -> unpadding.AttentionKernel | None:
    """The record's ``attention_kernel``: what the model's last unpadded forward ran."""
    return model.attention_kernel


def whole_layers(model: BertPretraining) -> bool:
    """Whether ``model``'s layers compile whole: on its real tokens, outside ZeRO-3."""
    return model.unpad and not any(unpadding.partitioned(p) for p in model.parameters())


def compile_scope(model: BertPretraining) -> list[CompileTarget]:
    """What ``model.compile`` compiles (its module docstring): on the real tokens outside ZeRO-3 each whole layer,
    through the ``packed_call`` the encoder makes (``model.unpad.encode``); else each layer's dense modules."""
    layers = model.hf.bert.encoder.layer
    if whole_layers(model):
        pre_layernorm = model.spec.pre_layernorm
        return [
            (layer, "packed_call", functools.partial(unpadding.packed_layer, layer, pre_layernorm)) for layer in layers
        ]
    out: list[CompileTarget] = []
    for layer in layers:
        names: tuple[str, ...] = ("attention.output", "intermediate", "output")
        if hasattr(layer, "ln"):  # MegatronBertLayer (pre-LN): its two LayerNorms too
            names += ("attention.ln", "ln")
        out += [(m, "forward", m.forward) for m in map(layer.get_submodule, names)]
    return out


def _eval_pieces(out: Mapping[str, Any], n: float) -> dict[str, Any]:
    return {
        "mlm_loss_x_n": out["mlm_loss"].double() * n,
        "nsp_loss_x_n": out["nsp_loss"].double() * n,
        **{k: out[k] for k in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count")},
    }


def _eval_metrics(total: Mapping[str, float]) -> dict[str, float]:
    if total["mlm_count"] <= 0:
        return {}
    return {
        "eval_mlm_loss": total["mlm_loss_x_n"] / total["n"],
        "eval_nsp_loss": total["nsp_loss_x_n"] / total["n"],
        "eval_mlm_accuracy": total["mlm_correct"] / total["mlm_count"],
        "eval_nsp_accuracy": total["nsp_correct"] / max(total["nsp_count"], 1.0),
    }


FAMILY = Family(
    name="bert",
    title="BERT",
    spec_class=BertSpec,
    sizes=SIZES,
    model=BertPretraining,
    shard_format="bert",
    unpads=True,
    head_weights=mlm_head_weights,
    param_role=param_role,
    compile_scope=compile_scope,
    attention_kernel=attention_kernel,
    loss_parts=("mlm_loss", "nsp_loss"),
    evaluation=Evaluation(
        sums=("mlm_loss_x_n", "nsp_loss_x_n", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count"),
        pieces=_eval_pieces,
        metrics=_eval_metrics,
        labels=(("eval_mlm_accuracy", "eval MLM acc"), ("eval_nsp_accuracy", "eval NSP acc")),
    ),
    transformers_model=hf_inside,
    save_tokenizer=save_tokenizer,
    hf_auto_class="AutoModelForPreTraining",
)
