"""Variable-length softmax attention as one operator: ``torch.ops.wikipretrain.varlen_attn``.

q, k and v are packed ``[T, heads, head_dim]`` (the real tokens of a micro-batch, sequence after sequence);
``cu_seqlens`` ``[B + 1]`` (int32) says where each sequence starts; ``max_seqlen`` is the longest on the host;
``dropout_p`` drops attention probabilities. Bidirectional, scale ``head_dim ** -0.5``.

The operator is registered with ``torch.library`` with a fake implementation and autograd, so compiled code
sees one opaque node (no graph break, dynamic in the token count), and tagged ``nondeterministic_seeded``
(dropout). Inside:

* **CUDA** (NVIDIA, BF16/FP16, compute capability >= 8.0, head size <= 256 and a multiple of 8:
  :func:`flash_usable`):
  the flash variable-length kernel that torch ships, dropout included: ``aten._flash_attention_forward`` /
  ``_flash_attention_backward`` with ``cum_seq_q/k``, ``max_q/k`` and ``dropout_p``, what nested-tensor SDPA
  calls inside. Its dropout draws from the CUDA generator (seed and offset, returned as ``rng_state``), so
  activation checkpointing's recomputation, which restores that generator, drops the same probabilities.
  The kernel's preconditions on what this module passes (int32 ``cu_seqlens`` with at least one sequence,
  BF16/FP16 q/k/v of one dtype, head size a multiple of 8 and at most 256) are ``torch._check``-ed before the
  call, by the real implementation and by the fake one alike (:func:`check_flash_inputs`): an input the kernel
  would refuse fails with this operator's name eagerly, under ``FakeTensorMode`` and while ``torch.compile``
  traces, not only on a GPU. ``model.unpad`` keeps the product's inputs inside them (``packing`` makes
  ``cu_seqlens`` int32, :func:`flash_usable` picks ``padded`` for the rest).
* **CPU**: one sequence at a time (``cu_seqlens`` on the host), softmax in at least FP32, the probabilities
  recomputed in the backward pass (as flash does) rather than kept. Dropout keeps a probability where a
  uniform draw from a generator seeded by one 62-bit draw of the default CPU generator is ``>= p``: the
  backward pass redraws the same mask from the saved seed, and activation checkpointing's recomputation draws
  the same seed because ``torch.utils.checkpoint`` restores the default generator first
  (``preserve_rng_state=True``, its default and the way ``model.build`` uses it; a recomputation that does not
  restore it would compute gradients for another mask).

Elsewhere (CUDA in FP32, an older card, an odd head size, another accelerator) ``model.unpad`` uses its
``padded`` kernel (``model.unpad.default_kernel``).

**Schema check at import.** The flash ops are private; what this module passes and reads is checked against
their schemas (:func:`flash_schema_problem`): each positional argument (up to ``return_debug_mask`` forward)
by type and name, the outputs by count and type and, where torch names them, by name (the forward's
``output``, ``softmax_logsumexp``, ``rng_state``, ``unused``, ``debug_attn_mask``, in that order; the
backward's are unnamed in torch 2.11 and 2.13), and the ``scale`` keyword. Names that torch changed with the
same meaning are accepted (``philox_seed``/``philox_offset`` before 2.7). Later releases add keyword arguments
with defaults, which do not matter; a new keyword-only argument without a default would make the first call a
TypeError, so it is refused. A mismatch disables the flash branch with one warning naming the torch version and
what differs: CUDA then runs ``padded``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

OP = "wikipretrain::varlen_attn"
BACKWARD_OP = "wikipretrain::varlen_attn_backward"
FLASH_DTYPES = (torch.bfloat16, torch.float16)
_aten: Any = torch.ops.aten  # the flash ops are called through this name (tests record the calls)

# What this module passes to the flash ops, by position, and what it reads back: (name, type as torch prints it).
FLASH_FORWARD_ARGS = (
    ("query", "Tensor"),
    ("key", "Tensor"),
    ("value", "Tensor"),
    ("cum_seq_q", "Optional[Tensor]"),
    ("cum_seq_k", "Optional[Tensor]"),
    ("max_q", "int"),
    ("max_k", "int"),
    ("dropout_p", "float"),
    ("is_causal", "bool"),
    ("return_debug_mask", "bool"),
)
FLASH_FORWARD_RETURNS = (
    ("output", "Tensor"),
    ("softmax_logsumexp", "Tensor"),
    ("rng_state", "Tensor"),  # the philox seed and offset
    ("unused", "Tensor"),
    ("debug_attn_mask", "Tensor"),
)
FLASH_BACKWARD_ARGS = (
    ("grad_out", "Tensor"),
    ("query", "Tensor"),
    ("key", "Tensor"),
    ("value", "Tensor"),
    ("out", "Tensor"),
    ("logsumexp", "Tensor"),
    ("cum_seq_q", "Tensor"),
    ("cum_seq_k", "Tensor"),
    ("max_q", "int"),
    ("max_k", "int"),
    ("dropout_p", "float"),
    ("is_causal", "bool"),
    ("rng_state", "Tensor"),
    ("unused", "Tensor"),
)
# unnamed in torch 2.11 and 2.13; should torch name them, the names of _scaled_dot_product_flash_attention_backward's
FLASH_BACKWARD_RETURNS = (("grad_query", "Tensor"), ("grad_key", "Tensor"), ("grad_value", "Tensor"))
FLASH_KEYWORDS = (("scale", "Optional[float]"),)
FLASH_FORMER_NAMES = {"rng_state": "philox_seed", "unused": "philox_offset"}
"""Names of the same argument or output, in the same place with the same type, before torch 2.7."""


def _fits(name: str, expected: str) -> bool:
    return name == expected or name == FLASH_FORMER_NAMES.get(expected)


def flash_schema_problem(forward: Any, backward: Any) -> str | None:
    """What in the flash ops' schemas (``torch._C.FunctionSchema``) differs from what this module passes and
    reads, or None: each positional argument it passes by place, type and name (or its former name,
    ``FLASH_FORMER_NAMES``), no further required positional or keyword-only argument, the outputs by count, type
    and, where the schema names them, name, and the keywords it passes. Keywords with a default that it does not
    pass are not read. The first difference found, as one line naming the op, the place and both sides."""
    passed = {name for name, _ in FLASH_KEYWORDS}
    for schema, args, returns in (
        (forward, FLASH_FORWARD_ARGS, FLASH_FORWARD_RETURNS),
        (backward, FLASH_BACKWARD_ARGS, FLASH_BACKWARD_RETURNS),
    ):
        positional = [a for a in schema.arguments if not a.kwarg_only]
        for i, (name, kind) in enumerate(args):
            if i >= len(positional):
                return f"{schema.name} takes {len(positional)} positional arguments where {len(args)} are passed"
            got = positional[i]
            if str(got.type) != kind or not _fits(got.name, name):
                return f"{schema.name} argument {i} is {got.name}: {got.type} where {name}: {kind} was expected"
        extra = [a.name for a in positional[len(args) :] if not a.has_default_value()]
        if extra:
            return f"{schema.name} requires more positional arguments: {extra}"
        missing = [
            a.name for a in schema.arguments if a.kwarg_only and not a.has_default_value() and a.name not in passed
        ]
        if missing:
            return f"{schema.name} requires keyword arguments that are not passed: {missing}"
        if len(schema.returns) != len(returns):
            return f"{schema.name} returns {len(schema.returns)} outputs where {len(returns)} were expected"
        for i, ((name, kind), got) in enumerate(zip(returns, schema.returns)):
            if str(got.type) != kind or (got.name and not _fits(got.name, name)):
                shown = got.name or "(unnamed)"
                return f"{schema.name} output {i} is {shown}: {got.type} where {name}: {kind} was expected"
    keywords = {a.name: str(a.type) for a in forward.arguments if a.kwarg_only}
    keywords_back = {a.name: str(a.type) for a in backward.arguments if a.kwarg_only}
    for name, kind in FLASH_KEYWORDS:
        if keywords.get(name) != kind or keywords_back.get(name) != kind:
            return f"the flash ops take no keyword {name}: {kind}"
    return None


def check_flash_schemas(forward: Any = None, backward: Any = None) -> str | None:
    """:func:`flash_schema_problem` of the given schemas (the installed torch's when None), with one warning
    naming the torch version when there is one: the flash branch is then off and CUDA runs ``padded``."""
    ops = torch.ops.aten
    problem: str | None
    if forward is None and not (hasattr(ops, "_flash_attention_forward") and hasattr(ops, "_flash_attention_backward")):
        problem = "this torch has no aten._flash_attention_forward/_backward"
    else:
        forward = forward if forward is not None else ops._flash_attention_forward.default._schema
        backward = backward if backward is not None else ops._flash_attention_backward.default._schema
        problem = flash_schema_problem(forward, backward)
    if problem is not None:
        warnings.warn(
            f"torch {torch.__version__}: the flash variable-length attention is off, CUDA BERT attention runs "
            f"the padded kernel ({problem})",
            stacklevel=2,
        )
    return problem


FLASH_SCHEMA_PROBLEM = check_flash_schemas()
"""Why the flash branch is off on this torch (its ops' schemas differ from what this module calls), or None."""


def flash_usable(
    device: torch.device, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None = None
) -> bool:
    """Whether the operator runs torch's flash variable-length kernel for these q/k/v: CUDA, BF16/FP16, compute
    capability >= 8.0 (``capability``: the device's when None), head size <= 256 and a multiple of 8, a torch
    built with flash attention whose ops have the expected schemas."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES or FLASH_SCHEMA_PROBLEM is not None:
        return False
    if torch.version.hip is not None:  # ROCm's flash ops keep the older outputs and rules: padded there
        return False
    if head_dim > 256 or head_dim % 8:
        return False
    if capability is None:
        if not torch.backends.cuda.is_flash_attention_available():
            return False
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) >= (8, 0)


def _scale(head_dim: int) -> float:
    return head_dim**-0.5


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The CPU kernel's accumulation type: FP32 for 16-bit inputs, the inputs' own otherwise (FP64 stays)."""
    return torch.promote_types(dtype, torch.float32)


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    if cu_seqlens.device.type != "cpu":
        raise ValueError(f"{OP} on {cu_seqlens.device.type}: the CPU kernel reads cu_seqlens on the host")
    return cu_seqlens.diff().tolist()


def _keep(gen: torch.Generator | None, shape: Sequence[int], p: float) -> torch.Tensor | None:
    if gen is None:
        return None
    return torch.rand(shape, generator=gen) >= p


def _generator(seed: torch.Tensor, p: float) -> torch.Generator | None:
    if p <= 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    return gen


def _probs(q: torch.Tensor, k: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Softmax attention probabilities ``[heads, n, n]`` of one sequence's ``[heads, n, d]`` q and k."""
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * _scale(q.size(-1))
    return torch.softmax(scores, dim=-1)


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, p: float, seed: torch.Tensor):
    acc, gen = _acc(q.dtype), _generator(seed, p)
    out = torch.empty(q.shape, dtype=q.dtype)
    start = 0
    for n in _lengths(cu):
        if n:
            qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
            probs = _probs(qs, ks, acc)
            keep = _keep(gen, probs.shape, p)
            if keep is not None:
                probs = probs * keep / (1 - p)
            out[start : start + n] = torch.matmul(probs, vs.to(acc)).transpose(0, 1).to(q.dtype)
        start += n
    return out


def _cpu_backward(grad, q, k, v, cu, p: float, seed: torch.Tensor):
    """The gradients of the CPU kernel, its probabilities recomputed and its mask redrawn from ``seed``."""
    acc, gen = _acc(q.dtype), _generator(seed, p)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    start = 0
    for n in _lengths(cu):
        if n:
            qs, ks, vs, gs = (x[start : start + n].transpose(0, 1).to(acc) for x in (q, k, v, grad))
            probs = _probs(qs, ks, acc)
            keep = _keep(gen, probs.shape, p)
            dropped = probs if keep is None else probs * keep / (1 - p)
            dv[start : start + n] = torch.matmul(dropped.transpose(-1, -2), gs).transpose(0, 1).to(v.dtype)
            d_probs = torch.matmul(gs, vs.transpose(-1, -2))
            if keep is not None:
                d_probs = d_probs * keep / (1 - p)
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * _scale(q.size(-1))
            dq[start : start + n] = torch.matmul(d_scores, ks).transpose(0, 1).to(q.dtype)
            dk[start : start + n] = torch.matmul(d_scores.transpose(-1, -2), qs).transpose(0, 1).to(k.dtype)
        start += n
    return dq, dk, dv


def check_flash_inputs(op: str, cu_seqlens: torch.Tensor, q: torch.Tensor, *others: torch.Tensor) -> None:
    """Refuse, with ``torch._check`` and ``op``'s name, what torch's flash variable-length kernel refuses of what
    this module passes (its ``mha_varlen_fwd`` / ``mha_varlen_bwd`` checks): ``q`` (and ``others``, of q's dtype)
    BF16 or FP16, a head size that is a multiple of 8 and at most 256, ``cu_seqlens`` int32 with at least two
    entries (one sequence). The CUDA branch's real and fake implementations both call it, so the fake one refuses
    what the kernel would (under ``FakeTensorMode`` and while ``torch.compile`` traces, on any machine)."""
    where = f"{op} on CUDA (torch's flash kernel)"
    dtypes = [x.dtype for x in (q, *others)]
    torch._check(q.dtype in FLASH_DTYPES, lambda: f"{where}: q/k/v are {q.dtype}, it takes BF16 or FP16")
    torch._check(all(d == q.dtype for d in dtypes), lambda: f"{where}: q/k/v of mixed dtypes {dtypes}")
    head = q.size(-1)  # the messages read symbolic sizes as ints (a trace that fails no longer needs them symbolic)
    torch._check(head % 8 == 0, lambda: f"{where}: head size {int(head)}, it takes a multiple of 8 (at most 256)")
    torch._check(head <= 256, lambda: f"{where}: head size {int(head)}, it takes at most 256")
    torch._check(cu_seqlens.dtype == torch.int32, lambda: f"{where}: cu_seqlens is {cu_seqlens.dtype}, it takes int32")
    torch._check(cu_seqlens.dim() == 1, lambda: f"{where}: cu_seqlens has shape {list(cu_seqlens.shape)}, not [B + 1]")
    torch._check(
        cu_seqlens.size(0) >= 2,
        lambda: (
            f"{where}: cu_seqlens has {int(cu_seqlens.size(0))} entries, it takes at least one sequence (2 entries)"
        ),
    )


_flash_state_dtype = torch.uint64
"""The dtype of the philox state the flash forward returned last (uint64 from torch 2.7, int64 before): the
backward gives the state back to the kernel in it."""


def _flash_forward(q, k, v, cu, max_seqlen: int, p: float):
    global _flash_state_dtype
    check_flash_inputs(OP, cu, q, k, v)
    out, lse, rng_state, unused, _ = _aten._flash_attention_forward(
        q, k, v, cu, cu, max_seqlen, max_seqlen, p, False, False, scale=_scale(q.size(-1))
    )
    _flash_state_dtype = rng_state.dtype
    if p <= 0:  # no dropout: the kernel leaves them unwritten; zeros keep the outputs a function of the inputs
        rng_state, unused = torch.zeros_like(rng_state), torch.zeros_like(unused)
    return out.contiguous(), lse, _as_int64(rng_state), _as_int64(unused)


def _as_int64(x: torch.Tensor) -> torch.Tensor:
    """The flash kernel's uint64 philox state seen as int64, the same bits (a view): torch supports few uint64
    operations (opcheck and autograd compare and sum the outputs), and the CPU kernel's seed is int64 too."""
    return x.view(torch.int64) if x.dtype == torch.uint64 else x


def _aux_cpu(q: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU kernel's saved outputs, in the flash kernel's places: no logsumexp (recomputed), the dropout
    seed as its ``rng_state``, nothing ``unused``."""
    return q.new_empty(0, dtype=torch.float32), seed, q.new_empty(0, dtype=torch.int64)


@torch.library.custom_op(OP, mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def varlen_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out ``[T, heads, head_dim]``, logsumexp, rng_state, unused): the last three are saved for the backward
    pass (see the module docstring)."""
    if q.device.type == "cuda":
        return _flash_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p)
    if q.device.type != "cpu":
        raise ValueError(f"{OP} runs on CUDA and the CPU, not {q.device.type}: use model.unpad_attention=padded")
    seed = torch.zeros(1, dtype=torch.int64)
    if dropout_p > 0:  # from the default CPU generator, which checkpointing restores
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return _cpu_forward(q, k, v, cu_seqlens, dropout_p, seed), *_aux_cpu(q, seed)


@varlen_attn.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, dropout_p):
    if q.device.type == "cuda":  # the kernel's preconditions checked, then the flash op's own fake implementation
        return _flash_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p)
    return torch.empty_like(q, memory_format=torch.contiguous_format), *_aux_cpu(q, q.new_empty(1, dtype=torch.int64))


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def varlen_attn_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        return _flash_backward(grad, q, k, v, out, lse, rng_state, unused, cu_seqlens, max_seqlen, dropout_p)
    return _cpu_backward(grad, q, k, v, cu_seqlens, dropout_p, rng_state)


def _flash_backward(grad, q, k, v, out, lse, rng_state, unused, cu, max_seqlen: int, p: float):
    check_flash_inputs(BACKWARD_OP, cu, q, k, v, out, grad)
    state = (x.view(_flash_state_dtype) for x in (rng_state, unused))  # back to the kernel's own dtype
    args = (grad.contiguous(), q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen, p, False, *state)
    dq, dk, dv = _aten._flash_attention_backward(*args, scale=_scale(q.size(-1)))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_attn_backward.register_fake
def _(grad, q, k, v, out, lse, rng_state, unused, cu_seqlens, max_seqlen, dropout_p):
    if q.device.type == "cuda":
        return _flash_backward(grad, q, k, v, out, lse, rng_state, unused, cu_seqlens, max_seqlen, dropout_p)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, dropout_p = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, cu_seqlens)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p
    ctx.mark_non_differentiable(lse, rng_state, unused)


def _backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
    q, k, v, out, lse, rng_state, unused, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = varlen_attn_backward(
        grad, q, k, v, out, lse, rng_state, unused, cu_seqlens, ctx.max_seqlen, ctx.dropout_p
    )
    return dq, dk, dv, None, None, None


varlen_attn.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float
) -> torch.Tensor:
    """The operator's output ``[T, heads, head_dim]`` (see the module docstring)."""
    return varlen_attn(q, k, v, cu_seqlens, max_seqlen, dropout_p)[0]
