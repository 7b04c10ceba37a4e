"""Count the bytes a piece of torch code moves, per kernel call, from the calls' tensor arguments.

The convention (the BERT-speed issue's): every call the dispatcher sees (an aten op, or a custom op such as
a compiled region or a C++ kernel registered with ``torch.library``) reads each distinct tensor input once
and writes each output, and each input it mutates, once. A call that only makes a view (``is_view``, a
``detach``) or allocates (``empty``) moves nothing. What happens inside a call (a compiled kernel's
registers, a matmul's tiles) is not seen: the figure is the memory traffic an ideal implementation of each
call would need, which is what fusing calls lowers.

Work the dispatcher does not see (a pybind function, a Triton kernel called directly) would count as zero.
So a counter is given the tensors the code should change (``watch``): one that changed while no counted call
wrote its memory raises :class:`InvisibleWork` on exit, rather than report too few bytes.

    with ByteCounter(watch=[w, m, v]) as bc:
        optimizer.step()
    bc.total, bc.by_op
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that move no data: views whatever their schema says, and allocations (their memory is written by the
# call that fills it)
_NO_COPY = {
    "aten::_unsafe_view",
    "aten::lift_fresh",
    "aten::detach",
    "aten::alias",
    "aten::_reshape_alias",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
}


class InvisibleWork(RuntimeError):
    """A watched tensor changed, but no counted call wrote its memory."""


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaNs in the same places counting as equal (an unchanged tensor holding NaN is unchanged)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    return torch.equal(a, b)


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """The memory a tensor covers: (storage id, first byte, one past its last byte)."""
    storage = t.untyped_storage().data_ptr()
    start = t.data_ptr()
    return storage, start, start + _nbytes(t)


# in-place ops that overwrite their tensor without reading it
_WRITE_ONLY = {
    "aten::copy_",
    "aten::fill_",
    "aten::zero_",
    "aten::bernoulli_",
    "aten::uniform_",
    "aten::normal_",
    "aten::random_",
    "aten::exponential_",
}


def _arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list, list]:
    """The tensors ``func`` reads and those its schema marks as written (``Tensor(a!)``, ``Tensor(a!)[]``);
    an ``out=`` argument, and the tensor a write-only in-place op fills, are written, not read."""
    read: list[torch.Tensor] = []
    written: list[torch.Tensor] = []
    write_only = func._schema.name in _WRITE_ONLY
    for i, arg in enumerate(func._schema.arguments):
        value = _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.extend(value)
            if arg.is_out or write_only:
                continue
        read.extend(value)
    return read, written


def op_class(name: str) -> str:
    """ "matmul", "attention" or "other": how the readiness report splits bytes (matmuls and attention are the
    work; the rest is what fusing removes)."""
    base = name.split("::", 1)[-1].split(".", 1)[0]
    if base in {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"}:
        return "matmul"
    if "attention" in base or "attn" in base:
        return "attention"
    return "other"


class ByteCounter(TorchDispatchMode):
    """Bytes moved inside the ``with`` block, per call, by the convention above.

    ``total``: all bytes; ``by_op``: bytes per op name; ``calls``: calls per op name; ``by_class``: bytes per
    :func:`op_class`. ``watch``: tensors whose changes must have been written by counted calls."""

    def __init__(self, watch: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._watch = [(t, t.detach().clone()) for t in watch]
        self._written: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if getattr(func, "is_view", False) or name in _NO_COPY:
            return out
        read, mutated = _arguments(func, args, kwargs)
        inputs = {id(t): t for t in read}
        written = {id(t): t for t in mutated}
        for t in _tensors(out):
            if id(t) not in inputs and id(t) not in written:  # an in-place op returns its input: counted once
                written[id(t)] = t
        moved = sum(_nbytes(t) for t in inputs.values()) + sum(_nbytes(t) for t in written.values())
        self._written.extend(_span(t) for t in written.values() if t.device.type != "meta")
        self.total += moved
        self.by_op[name] += moved
        self.calls[name] += 1
        return out

    @property
    def by_class(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for name, moved in self.by_op.items():
            out[op_class(name)] += moved
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            for i, (t, before) in enumerate(self._watch):
                if _same(t.detach(), before):
                    continue
                storage, start, end = _span(t)
                if not any(s == storage and a < end and start < b for s, a, b in self._written):
                    raise InvisibleWork(
                        f"watched tensor {i} (shape {tuple(t.shape)}) changed, but no call the counter saw "
                        "wrote it: its bytes would count as zero"
                    )
        self._watch = []
        return result
