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

Which kernel ran is resolved once per forward, in eager code before the layers (compiled whole or not), from the
runtime device, compute dtype and head size (:func:`resolve_kernel`): an :class:`AttentionKernel` that the model
keeps (``BertPretraining.attention_kernel``) and a run records as ``attention_kernel`` (``varlen-flash``,
``varlen-cpu``, ``padded``, ``jagged``) in summary.json and each metrics.jsonl row, apart from what was asked
(``model.unpad_attention``), with the reason when auto fell back from the varlen kernel.

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
RECORDED_KERNELS = ("varlen-flash", "varlen-cpu", "padded", "jagged")
"""What a run records as ``attention_kernel`` (:attr:`AttentionKernel.name`): the varlen operator's two branches
named apart."""


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


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel an unpadded forward runs, resolved from the runtime device, dtype and head size
    (:func:`resolve_kernel`)."""

    asked: str
    """What the model was built with: ``model.unpad_attention`` (``auto``, or one of ``KERNELS``)."""
    kernel: str
    """The branch of :func:`varlen_attention` that runs: one of ``KERNELS``."""
    name: str
    """What ran, as a run records it (``attention_kernel``): one of ``RECORDED_KERNELS``."""
    reason: str | None = None
    """Why auto runs ``padded`` where the varlen kernel does not run (``auto: FP32 on CUDA runs padded ...``);
    None when the kernel is the one asked for or auto's first choice."""


def _no_flash(device: torch.device, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None) -> str:
    """Why ``model.attention.flash_usable`` says no, as "WHAT runs padded (RULE)" (its checks, in its order)."""
    names = {torch.float32: "FP32", torch.float64: "FP64", torch.bfloat16: "BF16", torch.float16: "FP16"}
    if device.type != "cuda":
        return f"{device.type} runs padded (the varlen operator runs on CUDA and the CPU)"
    if dtype not in varlen.FLASH_DTYPES:
        return f"{names.get(dtype, str(dtype))} on CUDA runs padded (flash takes BF16/FP16)"
    if varlen.FLASH_SCHEMA_PROBLEM is not None:
        return f"torch {torch.__version__} runs padded (its flash ops differ: {varlen.FLASH_SCHEMA_PROBLEM})"
    if torch.version.hip is not None:
        return "ROCm runs padded (the flash ops' older outputs and rules there)"
    if head_dim > 256 or head_dim % 8:
        return f"head size {head_dim} on CUDA runs padded (flash takes <= 256, a multiple of 8)"
    if capability is None:
        if not torch.backends.cuda.is_flash_attention_available():
            return "CUDA runs padded (this torch is built without flash attention)"
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]} runs padded (flash needs >= 8.0)"
    return "CUDA runs padded (flash does not run on this device)"


def resolve_kernel(
    asked: str | None,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
) -> AttentionKernel:
    """The kernel that runs for q/k/v of ``dtype`` and ``head_dim`` on ``device`` when ``asked`` (None: auto)
    is asked for; ``capability``: the CUDA device's compute capability (the device's own when None).

    Host-only (no device value is read): called once per forward, outside the compiled layers. ``varlen``
    asked where it cannot run raises ValueError, as :func:`varlen_attention` does."""
    device = torch.device(device)
    asked = asked or "auto"
    if asked in ("padded", "jagged"):
        return AttentionKernel(asked, asked, asked)
    if asked not in ("auto", "varlen"):
        raise ValueError(f"attention kernel {asked!r}: expected auto or one of {', '.join(KERNELS)}")
    if device.type == "cpu":
        return AttentionKernel(asked, "varlen", "varlen-cpu")
    if varlen.flash_usable(device, dtype, head_dim, capability):
        return AttentionKernel(asked, "varlen", "varlen-flash")
    if asked == "varlen":
        raise ValueError(_varlen_refused(device, dtype, head_dim))
    return AttentionKernel(asked, "padded", "padded", f"auto: {_no_flash(device, dtype, head_dim, capability)}")


def _varlen_refused(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    return (
        f"attention kernel varlen runs on the CPU, or on CUDA in BF16/FP16 on compute capability >= 8.0 "
        f"with a head size <= 256 and a multiple of 8; not {device.type} {dtype} head size {head_dim}: use padded"
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Packing, dropout_p: float, kernel: str | None = None
) -> torch.Tensor:
    """Softmax attention within each sequence of the packed ``[T, heads, head_dim]`` q/k/v; returns the same
    shape. Scale ``head_dim ** -0.5``, bidirectional. ``kernel``: one of ``KERNELS`` (the model's forward gives
    the one :func:`resolve_kernel` resolved); None: the device's default."""
    kernel = kernel or default_kernel(q.device, q.dtype, q.size(-1))
    if kernel == "varlen":
        if q.device.type != "cpu" and not varlen.flash_usable(q.device, q.dtype, q.size(-1)):
            raise ValueError(_varlen_refused(q.device, q.dtype, q.size(-1)))
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
    kind = x.device.type  # a device autocast does not know (meta: the byte counts) has no autocast to ask
    on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    return torch.get_autocast_dtype(kind) if on else x.dtype


def encoder_kernel(bert: Any, asked: str | None) -> AttentionKernel:
    """The kernel ``bert``'s layers run (:func:`resolve_kernel`) when ``asked`` (None: auto) is asked for: on its
    word embeddings' device, in the dtype its layers compute in (the embeddings' own, or autocast's where it is
    on: what :func:`encode`'s rows are), at its head size. Host-only: the model's forward calls it once, before
    the layers."""
    weight = bert.embeddings.word_embeddings.weight  # a ZeRO-3 partition keeps its dtype and device
    head_dim = bert.encoder.layer[0].attention.self.attention_head_size
    return resolve_kernel(asked, weight.device, compute_dtype(weight), head_dim)


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
    if kernel is None:  # a direct caller: the device's default, resolved here, outside the (compiled) layers
        kernel = resolve_kernel(None, x.device, compute_dtype(x), layers[0].attention.self.attention_head_size).kernel
    if getattr(layers[0], "packed_call", None) is not None and kernel in WHOLE_LAYER_KERNELS:
        layer_fn = partial(_call_packed, kernel=kernel)  # model.compile: each layer a compiled whole
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
