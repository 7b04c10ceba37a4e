"""Cross-entropy of a linear LM head computed in chunks of tokens: the [tokens, vocabulary] logits never exist.

``logits = hidden @ W^T (+ b)`` followed by ``cross_entropy`` holds the whole logits matrix, its FP32 copy, its
log-softmax and, in backward, the gradient of each: for GPT-NeoX's 50k vocabulary that is most of a small
model's activation memory. Here one chunk of tokens is done at a time: its logits in the compute dtype (the
hidden states'), then in FP32 (FP64 in an FP64 run) its log-sum-exp, target logit and ``softmax - onehot``,
from which the chunk's share of every gradient is formed at once: rows of ``(P - Y) W`` for the hidden states,
``(P - Y)^T h`` and ``(P - Y)`` summed into FP32 accumulators for ``W`` and ``b``. Then the chunk is dropped.

The loss is a scalar, so its gradients are these times the incoming gradient: backward only scales them (by
``grad / tokens counted``, in FP32) and casts them to the parameters' dtypes. Nothing is recomputed (the same three
``tokens x hidden x vocab`` matmuls as the plain head), and FP16's loss scale is applied in FP32 to quantities of
order one, so it cannot underflow where the plain head's ``grad x (P - Y) / tokens`` in FP16 would not. Held from
forward to backward: the hidden states' gradient (the size of the hidden states) and the FP32 accumulators (what
backward would allocate anyway). The forward skips the gradients under ``torch.no_grad`` (evaluation); no host
synchronisation anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100  # F.cross_entropy's default: targets with this value count neither in the loss nor the mean
CHUNK_TOKENS = 1024  # tokens per chunk: GPT-NeoX's 50432-row vocabulary gives 206 MB of FP32 logits a chunk


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP32 for the log-sum-exp of half-precision logits; FP32 and FP64 runs keep their own precision."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        grad_enabled: bool,
        none_is_zero: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, n = hidden.dtype, hidden.shape[0]
        score = _score_dtype(dtype)
        counted = targets != ignore_index
        safe = targets.masked_fill(~counted, 0)  # any row: an ignored token's weight is 0
        counted_f = counted.to(score)
        need_h, need_w, need_b = (grad_enabled and needed for needed in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        # The loss's gradients before the mean and the incoming gradient (both applied in backward, in the score
        # dtype): rows (P - Y) W for every token, sums over counted tokens of (P - Y)^T h and of (P - Y).
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=score, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=score, device=weight.device) if need_b else None
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        nll = torch.empty(n, dtype=score, device=hidden.device)
        hits = torch.zeros(n, dtype=torch.bool, device=hidden.device)  # the top logit is the target's
        for s in range(0, n, chunk):
            h, t = hidden[s : s + chunk], safe[s : s + chunk, None]
            z = F.linear(h, w, b).to(score)  # the chunk's logits (a copy only for half precision)
            target_logit = z.gather(1, t).squeeze(1)
            top, best = z.max(dim=1, keepdim=True)  # one pass: the log-sum-exp's shift and the prediction
            hits[s : s + chunk] = best.squeeze(1) == t.squeeze(1)
            z.sub_(top).exp_()
            total = z.sum(dim=1, keepdim=True)
            nll[s : s + chunk] = (top + total.log()).squeeze(1) - target_logit
            if not (need_h or need_w or need_b):
                continue
            z.div_(total).scatter_add_(1, t, torch.full_like(t, -1, dtype=score))  # softmax - onehot(target)
            c = counted_f[s : s + chunk]
            if grad_b is not None:
                grad_b.add_(z.t() @ c)
            g = z.to(dtype)
            del z
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[s : s + chunk])
            if grad_w is not None:
                hc = h * c[:, None].to(dtype)  # ignored tokens contribute nothing
                if score == dtype:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w.add_(g.t() @ hc)
        count = counted.sum()  # 0 counted: 0/0, NaN, as F.cross_entropy (none_is_zero: 0, and no gradient)
        if none_is_zero:
            count = count.clamp(min=1)
        # The mean in FP64: an FP32 sum of ~10 per token would round at the sum's magnitude, not the mean's.
        loss = ((nll.double() * counted).sum() / count).to(score)
        correct = (hits & counted).sum()  # counted targets predicted (the argmax of their logits)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.save_for_backward(counted_f, count)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor | None = None):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: its gradients were used by an earlier backward")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None  # scaled in place below, and freed with the graph
        counted_f, count = ctx.saved_tensors
        scale = grad_loss.to(counted_f.dtype) / count  # the mean and the incoming gradient (FP16's loss scale)
        if grad_h is not None:
            grad_h.mul_((counted_f * scale)[:, None])
        w_dtype, b_dtype = ctx.dtypes
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(w_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(b_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    with_correct: bool = False,
    none_is_zero: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` (mean over counted targets) without
    the logits: ``hidden`` [..., H], ``weight`` [V, H], ``targets`` [...] (class ids or ``ignore_index``).

    The loss is FP32 (FP64 in an FP64 run); its gradients have the dtypes of ``hidden``, ``weight``, ``bias``.
    ``with_correct``: also the number of counted targets whose logit is the largest (an accuracy's numerator,
    from the pass that finds the log-sum-exp's shift: no extra read of the logits), as ``(loss, correct)``.
    ``none_is_zero``: with no target counted the loss is 0 and every gradient 0 (``F.cross_entropy``'s NaN
    otherwise), as a sum over the counted targets divided by at least one.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states but {t.shape[0]} targets")
    loss, correct = _LinearCrossEntropy.apply(
        h, weight, bias, t, chunk_tokens, ignore_index, torch.is_grad_enabled(), none_is_zero
    )
    return (loss, correct) if with_correct else loss


class ChunkedLossHead(nn.Linear):
    """An LM head ``nn.Linear`` whose call with targets returns the mean cross-entropy, never the logits.

    ``head(hidden)`` is ``nn.Linear``'s (logits: what ``transformers`` calls); ``head(hidden, targets)`` is
    :func:`linear_cross_entropy` on the head's own weight and bias. Adopting an existing ``nn.Linear``
    (:meth:`adopt`) changes no parameter, name or initialisation. The loss runs inside the head's own call, so
    that the hooks on the module apply to it: under ZeRO-3, DeepSpeed gathers the partitioned weight in the
    head's forward pre-hook and releases it after the forward (the loss needs the weight only there), and the
    weight's gradient, returned by the head's backward, is reduced by DeepSpeed's gradient hooks as any other.
    """

    chunk_tokens: int = CHUNK_TOKENS

    @classmethod
    def adopt(cls, linear: nn.Linear, chunk_tokens: int = CHUNK_TOKENS) -> ChunkedLossHead:
        """Turn ``linear`` into a ``ChunkedLossHead`` in place (same object, parameters and hooks)."""
        if type(linear) is not nn.Linear and not isinstance(linear, cls):
            raise TypeError(f"expected a torch.nn.Linear LM head, got {type(linear).__name__}")
        linear.__class__ = cls
        head: ChunkedLossHead = linear  # type: ignore[assignment]
        head.chunk_tokens = chunk_tokens
        return head

    def forward(  # type: ignore[override]  # nn.Linear's call, or with targets the loss
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        with_correct: bool = False,
        none_is_zero: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(
            hidden,
            self.weight,
            targets,
            self.bias,
            chunk_tokens=self.chunk_tokens,
            ignore_index=ignore_index,
            with_correct=with_correct,
            none_is_zero=none_is_zero,
        )
