"""BERT on its real tokens only ("unpadding", as MosaicBERT and ModernBERT do), with the ``transformers`` weights.

A padded micro-batch ``[B, S]`` holds ``T <= B * S`` real tokens. The unpadded forward gathers them once into
a packed ``[T, hidden]`` tensor and runs the embeddings (and their LayerNorm), every linear, GELU, LayerNorm and
dropout on those rows only; attention is variable-length, each sequence attending within itself
(``cu_seqlens``). The MLM head then takes the masked positions' rows, the pooler each sequence's first row.

It walks the submodules of ``transformers``' ``BertModel`` (post-LN) or ``MegatronBertModel`` (pre-LN) and
calls each of them, so the parameters and their names are theirs (checkpoints and the Hugging Face export are
unchanged) and module hooks (ZeRO-3's parameter gathering) still fire. Activation checkpointing follows what
``gradient_checkpointing_enable`` set on each layer (``model.build``).

Attention kernels (``model.unpad_attention`` picks one; ``default_kernel`` is auto):

* ``varlen``, the default on CPU and on CUDA where flash runs: one registered operator,
  ``model.attention`` (``torch.ops.wikipretrain.varlen_attn``): torch's flash variable-length kernel with
  dropout on CUDA (BF16/FP16, compute capability >= 8.0, head size <= 256 and a multiple of 8), one sequence at a
  time on the CPU (lengths from the host copy of ``cu_seqlens``: exactly ``sum(n_i**2)`` attention work).
  Compiled code sees one opaque node. Not yet measured on a GPU.
* ``padded``, the default on other accelerators and on CUDA where flash does not run (FP32, older cards): the
  packed q/k/v are scattered into ``[B, max_seqlen]`` for attention alone and run through one SDPA call with a
  key-padding mask (the memory-efficient kernel on CUDA, as ``transformers``' padded forward); the linear layers
  still see only the real tokens. ``B * max_seqlen**2`` attention work plus a scatter and a gather.
* ``jagged``: ``F.scaled_dot_product_attention`` on jagged nested tensors (``torch.nested``,
  ``layout=torch.jagged``). Measured on an H200 (bert-large, seq 128, micro-batch 128, BF16, torch 2.11,
  docs/gpu-notes.md): 373 sequences/s against 1,291 for the padded ``transformers`` forward of the same run.
  Kept for comparison.

Host synchronisation: none when the batch carries the loader's ``unpad_indices`` / ``cu_seqlens`` /
``max_seqlen`` (``data.loader.unpadding_index``). ``max_seqlen`` is used only when it is a Python int or a CPU
tensor; one already moved to the accelerator is replaced by the padded width ``S``, an upper bound the kernels
accept (reading it would wait for the device). The jagged tensors get both bounds (the shortest: 1) so that
SDPA never computes them from the offsets with ``.item()``. Without the keys they are computed here (a
``nonzero``: direct callers only).

On a GPU: the jagged kernel trained in the GPU tier (bert-debug, LANS/AdamW, ZeRO-1/2, activation
checkpointing) before ``padded`` became the CUDA default; neither ``padded`` nor ``varlen`` on CUDA is measured
yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from data.loader import unpadding_index
from model import attention as varlen  # its functions looked up on call: a test or benchmark may replace one

UNPAD_KEYS = ("unpad_indices", "cu_seqlens", "max_seqlen")
"""Micro-batch keys of the unpadding (``data.loader.unpadding_index``)."""
HOST_KEYS = frozenset({"max_seqlen", "min_seqlen"})
"""Keys a trainer should leave on the host when it moves a batch to the device (exact kernel sizes and the
padded path's choice of mask, no sync). ``min_seqlen``: every BERT micro-batch's shortest row (the loader's)."""

KERNELS = ("varlen", "padded", "jagged")


@dataclass(frozen=True)
class Packing:
    """Where a padded batch's real tokens are, and how the packed layout maps back to it."""

    indices: torch.Tensor
    """[T] int64: flat (row-major) indices of the real tokens in the padded ``[B * S]`` layout."""
    cu_seqlens: torch.Tensor
    """[B + 1] int32: sequence b is packed rows ``[cu_seqlens[b], cu_seqlens[b + 1])``."""
    max_seqlen: int
    """The longest sequence (exact) or the padded width (an upper bound), on the host."""
    batch: int
    seq_len: int
    """Padded width S."""
    offsets: torch.Tensor | None = None
    """``cu_seqlens`` as int64, made once per forward: the jagged tensors' offsets. Made inside a checkpointed
    layer, each recomputation would get new offsets, hence another ragged size, and checkpointing would refuse
    the recomputed tensors as different from the saved ones."""
    lengths: tuple[int, ...] | None = None
    """The sequences' real lengths on the host, when ``cu_seqlens`` came on the host (CPU training)."""
    shortest: int | None = None
    """The shortest sequence, when the loader gave it on the host (``min_seqlen``)."""

    @property
    def min_seqlen(self) -> int:
        """The shortest sequence: exact from host lengths or the loader's ``min_seqlen``, else 1 (a lower bound:
        every BERT row has its [CLS]). Given to the jagged tensors so that SDPA's kernel choice (which refuses
        empty sequences) reads no device value."""
        if self.lengths is not None:
            return min(self.lengths, default=0)
        return self.shortest if self.shortest is not None else 1

    @property
    def positions(self) -> torch.Tensor:
        """[T] position of each real token in its padded row (the position embedding's index)."""
        return self.indices % self.seq_len

    def rows(self, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed rows of the padded positions ``positions`` ([B, P], per-sequence indices) of each sequence.

        A position that is padding maps to the real token before it (clamped to row 0): callers give real
        positions (masked tokens, [CLS]) or ones they weigh by zero.
        """
        rank = torch.cumsum((attention_mask != 0).reshape(-1), 0) - 1  # packed row of each padded slot
        starts = torch.arange(self.batch, device=positions.device) * self.seq_len
        return rank[starts.view(-1, *([1] * (positions.dim() - 1))) + positions].clamp(min=0)


def host_int(value: Any) -> int | None:
    """``value`` as an int when it can be read without the device (a Python int or a CPU tensor), else None."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return int(value)
    return None


def packing(
    attention_mask: torch.Tensor,
    unpad_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | torch.Tensor | None = None,
    min_seqlen: int | torch.Tensor | None = None,
) -> Packing:
    """The batch's :class:`Packing`: from the loader's keys when given, else computed from the mask."""
    b, s = attention_mask.shape
    if unpad_indices is None or cu_seqlens is None:
        index = unpadding_index(attention_mask)  # nonzero: waits for the device; direct callers only
        unpad_indices, cu_seqlens, max_seqlen = index["unpad_indices"], index["cu_seqlens"], index["max_seqlen"]
    exact = host_int(max_seqlen)
    on_host = cu_seqlens.device.type == "cpu"
    cu_seqlens = cu_seqlens.to(attention_mask.device, torch.int32)
    return Packing(
        indices=unpad_indices.to(attention_mask.device, torch.long),
        cu_seqlens=cu_seqlens,
        max_seqlen=s if exact is None else min(exact, s),
        batch=b,
        seq_len=s,
        offsets=cu_seqlens.long(),
        lengths=tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()) if on_host else None,
        shortest=host_int(min_seqlen),
    )


def nested(x: torch.Tensor, pack: Packing) -> torch.Tensor:
    """Packed rows ``[T, ...]`` as a jagged nested tensor ``[B, j, ...]`` (a view; no copy)."""
    offsets = pack.offsets if pack.offsets is not None else pack.cu_seqlens.long()
    return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=pack.min_seqlen, max_seqlen=pack.max_seqlen)


def default_kernel(device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """``varlen`` on CPU, and on CUDA where the flash kernel runs for ``dtype`` and ``head_dim`` (both needed
    to tell); ``padded`` elsewhere (see the module docstring). ``device`` is a device or its type's name."""
    device = torch.device(device)
    if device.type == "cpu":
        return "varlen"
    if dtype is not None and head_dim is not None and varlen.flash_usable(device, dtype, head_dim):
        return "varlen"
    return "padded"


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Packing, dropout_p: float, kernel: str | None = None
) -> torch.Tensor:
    """Softmax attention within each sequence of the packed ``[T, heads, head_dim]`` q/k/v; returns the same
    shape. Scale ``head_dim ** -0.5``, bidirectional."""
    kernel = kernel or default_kernel(q.device, q.dtype, q.size(-1))
    if kernel == "varlen":
        if q.device.type != "cpu" and not varlen.flash_usable(q.device, q.dtype, q.size(-1)):
            raise ValueError(
                f"attention kernel varlen runs on the CPU, or on CUDA in BF16/FP16 on compute capability >= 8.0 "
                f"with a head size <= 256 and a multiple of 8; not {q.device.type} {q.dtype} head size "
                f"{q.size(-1)}: use padded"
            )
        return varlen.attention(q, k, v, pack.cu_seqlens, pack.max_seqlen, dropout_p)
    if kernel == "jagged":
        nq, nk, nv = (nested(x.contiguous(), pack).transpose(1, 2) for x in (q, k, v))  # [B, heads, j, head_dim]
        return F.scaled_dot_product_attention(nq, nk, nv, dropout_p=dropout_p).transpose(1, 2).values()
    if kernel != "padded":
        raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    t, heads, dim = q.shape
    b, m = pack.batch, pack.max_seqlen
    lengths = pack.cu_seqlens[1:] - pack.cu_seqlens[:-1]
    seq = pack.indices // pack.seq_len
    slot = seq * m + torch.arange(t, device=q.device) - pack.cu_seqlens.long()[seq]  # row in [B * m]
    qkv = q.new_zeros(b * m, 3, heads, dim).index_put((slot,), torch.stack((q, k, v), 1))
    qkv = qkv.view(b, m, 3, heads, dim).permute(2, 0, 3, 1, 4)  # [3, B, heads, m, head_dim]
    keys = (torch.arange(m, device=q.device) < lengths.unsqueeze(1)).view(b, 1, 1, m)
    out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keys, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(b * m, heads, dim).index_select(0, slot)


def partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partition (gathered only by its own module's hooks)."""
    return hasattr(param, "ds_id")


def qkv_projection(self_attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[T, heads, head_dim]`` of the packed rows ``x``: one matmul with the three projections'
    weights stacked (the parameters stay ``query``, ``key`` and ``value``: names, checkpoints and the export
    are unchanged). Under ZeRO-3 each projection is its own module's call, whose hooks gather its weight."""
    t = x.size(0)
    heads, dim = self_attn.num_attention_heads, self_attn.attention_head_size
    linears = (self_attn.query, self_attn.key, self_attn.value)
    biases = [m.bias for m in linears]
    mixed = any(b is None for b in biases) and any(b is not None for b in biases)
    if mixed or any(partitioned(m.weight) for m in linears):
        q, k, v = (m(x).view(t, heads, dim) for m in linears)
        return q, k, v
    weight = torch.cat([m.weight for m in linears])
    bias = None if biases[0] is None else torch.cat(biases)
    q, k, v = F.linear(x, weight, bias).view(t, 3, heads, dim).unbind(1)
    return q, k, v


def _attention(self_attn: Any, x: torch.Tensor, pack: Packing, kernel: str | None) -> torch.Tensor:
    """``transformers``' (Megatron)BertSelfAttention on packed rows: its q/k/v projections, varlen attention."""
    q, k, v = qkv_projection(self_attn, x)
    p = self_attn.dropout.p if self_attn.training else 0.0
    return varlen_attention(q, k, v, pack, p, kernel).reshape(x.size(0), -1)


def _post_ln_layer(layer: Any, x: torch.Tensor, pack: Packing, kernel: str | None) -> torch.Tensor:
    """BertLayer: x -> LN(x + attn(x)) -> LN(h + FFN(h)) (BertSelfOutput / BertOutput add and normalise)."""
    h = layer.attention.output(_attention(layer.attention.self, x, pack, kernel), x)
    return layer.output(layer.intermediate(h), h)


def _pre_ln_layer(layer: Any, x: torch.Tensor, pack: Packing, kernel: str | None) -> torch.Tensor:
    """MegatronBertLayer: h = x + attn(LN(x)); h + FFN(LN(h)) (the output modules add the residual)."""
    attention = layer.attention
    h = attention.output(_attention(attention.self, attention.ln(x), pack, kernel), x)
    return layer.output(layer.intermediate(layer.ln(h)), h)


def packed_layer(
    layer: Any,
    pre_layernorm: bool,
    x: torch.Tensor,
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    batch: int,
    seq_len: int,
    kernel: str,
) -> torch.Tensor:
    """One encoder layer on the packed rows ``x``, from the packing's fields alone: what ``model.compile``
    compiles whole (tensors and ints only, so every micro-batch's token count, lengths and sequence count reuse
    one graph; the attention is one opaque operator, ``model.attention``)."""
    pack = Packing(indices=indices, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, batch=batch, seq_len=seq_len)
    return (_pre_ln_layer if pre_layernorm else _post_ln_layer)(layer, x, pack, kernel)


WHOLE_LAYER_KERNELS = ("varlen", "padded")
"""The kernels a compiled whole layer runs (``jagged`` keeps the per-submodule compile)."""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layers' matmuls produce from ``x``: autocast's where it is on for ``x``'s device."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def encode(
    bert: Any,
    pre_layernorm: bool,
    input_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    pack: Packing,
    kernel: str | None = None,
) -> torch.Tensor:
    """The encoder's output at the real tokens, packed ``[T, hidden]``: ``bert`` is ``BertModel`` (post-LN) or
    ``MegatronBertModel`` (pre-LN: no embedding LayerNorm, a final one)."""
    emb = bert.embeddings
    x = emb.word_embeddings(input_ids.reshape(-1)[pack.indices])
    x = x + emb.token_type_embeddings(token_type_ids.reshape(-1)[pack.indices])
    x = x + emb.position_embeddings(pack.positions)
    if not pre_layernorm:
        x = emb.LayerNorm(x)
    x = emb.dropout(x)
    layer_fn: Any = _pre_ln_layer if pre_layernorm else _post_ln_layer
    layers = bert.encoder.layer
    if getattr(layers[0], "packed_call", None) is not None:  # model.compile: each layer a compiled whole
        head_dim = layers[0].attention.self.attention_head_size
        resolved = kernel or default_kernel(x.device, compute_dtype(x), head_dim)  # outside the graph
        if resolved in WHOLE_LAYER_KERNELS:
            layer_fn = partial(_call_packed, kernel=resolved)
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            ckpt = getattr(layer, "_gradient_checkpointing_func", partial(checkpoint, use_reentrant=False))
            x = ckpt(layer_fn, layer, x, pack, kernel)
        else:
            x = layer_fn(layer, x, pack, kernel)
    if pre_layernorm:
        x = bert.encoder.ln(x)
    return x


def _call_packed(layer: Any, x: torch.Tensor, pack: Packing, _: str | None, kernel: str) -> torch.Tensor:
    return layer.packed_call(x, pack.indices, pack.cu_seqlens, pack.max_seqlen, pack.batch, pack.seq_len, kernel)
