"""The implementations of LANS and LAMB's element-wise work, behind one interface (``Kernels``): ``impl`` names
one (``IMPLS``), ``"auto"`` takes the first of ``KERNELS`` usable on the device. Each takes the fragments it
can and hands the others to its ``fallback``. What each does, and what it costs, is in
``training.optim.lans``'s docstring; the kernels they run are in ``training.optim.elementwise`` (torch) and
``training.optim.cpu_ext`` (C++).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from common.errors import UserError
from training.optim.cpu_ext import cpu_kernels
from training.optim.elementwise import (
    TensorList,
    compiled,
    fused_available,
    sum_of_squares,
    sumsq_dtype,
    warm_fused,
)

# --------------------------------------------------------------------------------------------------------
# The implementations, behind one interface. The group step (``LayerwiseAdaptive._step_group``) does the
# per-tensor part (sums per tensor, all-reduces, trust ratios) and hands the element-wise work on the
# fragments to one ``Kernels`` object per group and step.
# --------------------------------------------------------------------------------------------------------


@dataclass
class GroupFragments:
    """One parameter group as the kernels see it: per fragment, 1-D views of w, g, m, v (w, m, v fp32).

    Without ZeRO a fragment is a whole tensor; under ZeRO, the part of a tensor in this rank's flat partition
    (``training/optim/zero_map.py``), so the norms are summed per tensor (``tensor_index``) and all-reduced.
    """

    ws: list[torch.Tensor]  # the parameter, or its fp32 master
    gs: list[torch.Tensor]
    ms: list[torch.Tensor]
    vs: list[torch.Tensor]
    tensor_index: list[int]  # fragment -> tensor of the group
    num_tensors: int
    process_group: Any  # the group the per-tensor sums are all-reduced over; None: no all-reduce
    steps: list[int]  # per fragment: the step number of its tensor, after this step
    device: torch.device
    lowp: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its fp32 master): cast back after the step
    # ZeRO: the flat w, g, m, v the fragments are views of, when the fragments tile their start (``FlatKernels``)
    flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    numels: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ws)


class Layerwise(Protocol):
    """What an implementation reads of the optimizer it works for (``training.optim.lans.LayerwiseAdaptive``),
    named here so that this module need not import that one."""

    _lans: bool  # LANS (True) or LAMB
    fused_min_numel: int  # ``CompiledKernels`` takes fragments of at least this many elements
    flat_group_steps: int  # group steps ``FlatKernels`` took whole (counted here, read by tests)

    def _fragment_of_element(self, f: GroupFragments) -> torch.Tensor: ...


class Kernels(ABC):
    """One implementation of the element-wise work of a group step (all have the same maths).

    Built for one step of one group with the fragments it is to handle, it keeps those that ``takes``
    accepts and hands the others to an instance of ``fallback`` (``rest``): the group step calls one object,
    in this order: ``grad_sumsq`` (LANS only), ``moments_sumsq``, ``update``. ``sc`` and ``a`` hold one row
    per fragment of the group (see the kernels' comment in ``training.optim.elementwise``). A new
    implementation is one subclass, listed in ``KERNELS``.
    """

    name: ClassVar[str]  # the value of ``impl`` that selects it, and of the optimizer's ``last_impl``
    fallback: ClassVar[type[Kernels] | None] = None

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: Layerwise) -> None:
        self.frags = frags
        self.lans = opt._lans
        taken = [self.takes(i, opt) for i in idx]
        self.idx = [i for i, t in zip(idx, taken) if t]
        rest = [i for i, t in zip(idx, taken) if not t]
        self.rest: Kernels | None = None
        if rest:
            fallback = self.fallback_for(frags.device)
            assert fallback is not None, f"impl {self.name!r} takes every fragment or names a fallback"
            self.rest = fallback(frags, rest, opt)

    @classmethod
    def usable(cls, device: torch.device) -> bool:
        """Whether ``impl="auto"`` may take it on this device (the first call may build or compile)."""
        return True

    @classmethod
    def require(cls, device: torch.device) -> None:
        """Raise UserError when it was asked for by name and cannot run here."""
        return None

    def takes(self, i: int, opt: Layerwise) -> bool:
        """Whether fragment ``i`` is ours; the others go to ``fallback``."""
        return True

    @classmethod
    def fallback_for(cls, device: torch.device) -> type[Kernels] | None:
        """The implementation that takes the fragments this one does not, on ``device``."""
        return cls.fallback

    # The group step calls these three; each does our fragments, then has ``rest`` do its own.
    def grad_sumsq(self, out: torch.Tensor) -> None:
        """LANS phase 1: out[i] = ||g_i||^2 (float64) for every fragment i handled."""
        if self.idx:
            out[self.idx] = self._grad_sumsq()
        if self.rest is not None:
            self.rest.grad_sumsq(out)

    def moments_sumsq(self, sc: torch.Tensor, parts: torch.Tensor) -> None:
        """Update m and v; parts[i] = the sums of squares of r', c', w (float64) over fragment i."""
        if self.idx:
            parts[self.idx] = self._moments_sumsq(sc)
        if self.rest is not None:
            self.rest.moments_sumsq(sc, parts)

    def update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        """w += a[i, 0] r' + a[i, 1] c' on every fragment i handled."""
        if self.idx:
            self._update(sc, a)
        if self.rest is not None:
            self.rest.update(sc, a)

    # The work on our own fragments (``self.idx``, never empty here).
    def _grad_sumsq(self) -> torch.Tensor:
        return sum_of_squares([self.frags.gs[i] for i in self.idx])

    @abstractmethod
    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        """Update m, v; return the (len(idx), 3) partial sums of squares of r', c' (0 for LAMB) and w."""

    @abstractmethod
    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None: ...


class ForeachKernels(Kernels):
    """Eager ``torch._foreach_*`` ops over the fragment lists: needs no compiler, takes every fragment. The
    moment phase materialises r' and c', and the update reuses them."""

    name = "foreach"

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: Layerwise) -> None:
        super().__init__(frags, idx, opt)
        self.r: TensorList = []
        self.c: TensorList | None = None

    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        f, idx = self.frags, self.idx
        ws, gs, ms, vs = ([xs[i] for i in idx] for xs in (f.ws, f.gs, f.ms, f.vs))
        s, omb1, b2, omb2, epsp, wdr, wdc = sc[idx].t().tolist()
        gf = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(gs, ms)]
        gt = torch._foreach_mul(gf, s) if self.lans else gf
        torch._foreach_lerp_(ms, gt, omb1[0])
        torch._foreach_mul_(vs, b2[0])
        torch._foreach_addcmul_(vs, gt, gt, omb2[0])
        b = torch._foreach_sqrt(vs)
        torch._foreach_add_(b, epsp)
        self.r = torch._foreach_div(ms, b)
        _add_scaled(self.r, ws, wdr)
        rsq, wsq = sum_of_squares(self.r), sum_of_squares(ws)
        if not self.lans:
            return torch.stack([rsq, torch.zeros_like(rsq), wsq], dim=1)
        torch._foreach_div_(gt, b)  # gt is our own temporary here: it becomes c'
        self.c = gt
        del b
        _add_scaled(self.c, ws, wdc)
        return torch.stack([rsq, sum_of_squares(self.c), wsq], dim=1)

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        ws = [self.frags.ws[i] for i in self.idx]
        ar, ac = a[self.idx].t().tolist()
        torch._foreach_mul_(self.r, ar)
        torch._foreach_add_(ws, self.r)
        if self.c is not None:
            torch._foreach_mul_(self.c, ac)
            torch._foreach_add_(ws, self.c)


def _add_scaled(xs: TensorList, ws: TensorList, coef: list[float]) -> None:
    """xs += coef * ws, coef per fragment (one scalar alpha in the usual case of equal coefficients)."""
    if len(set(coef)) == 1:
        if coef[0] != 0.0:
            torch._foreach_add_(xs, ws, alpha=coef[0])
    else:
        torch._foreach_add_(xs, torch._foreach_mul(ws, coef))


class CompiledKernels(Kernels):
    """The ``torch.compile``-d kernels, one call per fragment and phase, for fragments of ``fused_min_numel``
    elements or more; the foreach ops take the rest (biases, norms, ZeRO boundary slivers), where a compiled
    call's fixed cost (~40 us on CPU) would dominate. The update recomputes r' and c'."""

    name = "fused"
    fallback = ForeachKernels

    @classmethod
    def usable(cls, device: torch.device) -> bool:
        return fused_available(device)

    def takes(self, i: int, opt: Layerwise) -> bool:
        return self.frags.ws[i].numel() >= opt.fused_min_numel

    def grad_sumsq(self, out: torch.Tensor) -> None:
        # Ours and the foreach path's in one call (its sums are the same function): one multi-tensor kernel
        # on accelerators.
        idx = self.idx + (self.rest.idx if self.rest is not None else [])
        if idx:
            out[idx] = sum_of_squares([self.frags.gs[i] for i in idx])

    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        f = self.frags
        for gdt in {f.gs[i].dtype for i in self.idx}:
            warm_fused(f.device, gdt)
        moments, sumsq = compiled("moments"), compiled("lans_sumsq" if self.lans else "lamb_sumsq")
        rows = _rows(sc, f.ms)
        for i in self.idx:
            moments(f.gs[i], f.ms[i], f.vs[i], rows[i])
        parts = torch.stack([sumsq(f.gs[i], f.ws[i], f.ms[i], f.vs[i], rows[i]) for i in self.idx])
        return parts.to(torch.float64)

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        f = self.frags
        kern = compiled("lans_update" if self.lans else "lamb_update")
        rows, arows = _rows(sc, f.ms), _rows(a, f.ms)
        for i in self.idx:
            kern(f.gs[i], f.ws[i], f.ms[i], f.vs[i], rows[i], arows[i])


class FlatKernels(Kernels):
    """A ZeRO partition as one flat tensor: four phases per step, whatever its number of fragments (no
    per-fragment launch, no host sync), 72 bytes moved per element for LANS with fp32 gradients, 52 for LAMB
    (``benchmarks/bench_gpu_readiness.py`` counts them):

    - the per-fragment norms of g, then of r', c' and w: ``torch._foreach_norm`` over the fragments' views
      (one read each; one multi-tensor call for g, one for r', c' and w), accumulated as the other paths do (float64 on
      CPU and for float64 parameters, fp32 on accelerators);
    - the moments: one fused kernel (``lans_flat_moments``) reads g, w, m, v and writes m, v, r' and c';
    - the update: one fused kernel (``lans_flat_update``) reads w, r', c' and writes w.

    Per-fragment scalars (LANS's 1/(||g||+eps), the trust-ratio coefficients) reach the elements through one
    int32 element -> fragment index, built once per layout and gathered inside the fused kernels (it stays on
    the device: 4 bytes per element of the partition; r' and c' live from the moments to the update: 8 more). It takes
    the fragments of a group whose flat partition they tile from its start, with every fragment at the same
    step (the bias corrections and weight-decay factors are then the same for all: ZeRO always), and hands
    the others to ``fallback``. The accelerator path of ``impl="auto"``; CPU CI runs it on CPU tensors
    (``impl="multi"``)."""

    name = "multi"
    fallback = ForeachKernels

    @classmethod
    def fallback_for(cls, device: torch.device) -> type[Kernels] | None:
        """Groups that are not a flat partition: the compiled kernels on accelerators where they compile,
        else the foreach ops (CPU: the C++ kernels are the default there; ``multi`` is asked for by name)."""
        return CompiledKernels if device.type != "cpu" and fused_available(device) else ForeachKernels

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: Layerwise) -> None:
        self.ok = frags.flat is not None and len(set(frags.steps)) <= 1
        super().__init__(frags, idx, opt)
        opt.flat_group_steps += bool(self.idx)
        if self.idx:
            self.numels = list(frags.numels or [])
            self.frag = opt._fragment_of_element(frags)
            w = frags.flat[0] if frags.flat is not None else frags.ws[0]
            self.acc = sumsq_dtype(w)
        self.r: torch.Tensor | None = None
        self.c: torch.Tensor | None = None

    def takes(self, i: int, opt: Layerwise) -> bool:
        return self.ok

    def _sumsq(self, *xs: torch.Tensor) -> torch.Tensor:
        """Per-fragment sums of squares (float64) of flat tensors, one multi-tensor call: [len(xs), fragments]."""
        views = [view for x in xs for view in x.split(self.numels)]
        norms = torch.stack(torch._foreach_norm(views, 2, dtype=self.acc)).to(torch.float64)
        return norms.square().view(len(xs), -1)

    def _grad_sumsq(self) -> torch.Tensor:
        assert self.frags.flat is not None
        return self._sumsq(self.frags.flat[1])[0]

    # Taking every fragment, in order, it writes the whole output: no index list to copy to the device.
    def grad_sumsq(self, out: torch.Tensor) -> None:
        if self.idx and self.rest is None:
            out.copy_(self._grad_sumsq())
        else:
            super().grad_sumsq(out)

    def moments_sumsq(self, sc: torch.Tensor, parts: torch.Tensor) -> None:
        if self.idx and self.rest is None:
            parts.copy_(self._moments_sumsq(sc))
        else:
            super().moments_sumsq(sc, parts)

    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        assert self.frags.flat is not None
        w, g, m, v = self.frags.flat
        s = sc[:, 0].to(w.dtype)
        consts = sc[0, 1:].to(w.dtype)  # the same for every fragment (one step): no host read
        frag = self.frag if self.lans else self.frag[:0]  # LAMB scales nothing per fragment: nothing to read
        self.r, self.c = torch.ops.wikipretrain.lans_flat_moments(g, w, m, v, frag, s, consts, self.lans)
        if self.lans:
            return self._sumsq(self.r, self.c, w).T
        rsq, wsq = self._sumsq(self.r, w)
        return torch.stack([rsq, torch.zeros_like(rsq), wsq], dim=1)

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        assert self.frags.flat is not None and self.r is not None and self.c is not None
        w = self.frags.flat[0]
        torch.ops.wikipretrain.lans_flat_update(w, self.r, self.c, self.frag, a.to(w.dtype), self.lans)
        self.r = self.c = None


def _rows(table: torch.Tensor, ms: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row i of a float64 per-fragment table in fragment i's working dtype (``ms[i].dtype``)."""
    by_dtype = {dt: table.to(dt).unbind(0) for dt in {m.dtype for m in ms}}
    return [by_dtype[m.dtype][i] for i, m in enumerate(ms)]


class CppKernels(Kernels):
    """The C++ kernels (``training/optim/csrc/lans_cpu.cpp``), one call per phase over all our fragments. They
    take fp32 or bf16 gradients; fragments with others (float64, fp16) go to the foreach ops, silently."""

    name = "cpu"
    fallback = ForeachKernels

    @classmethod
    def usable(cls, device: torch.device) -> bool:
        return device.type == "cpu" and cpu_kernels() is not None

    @classmethod
    def require(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise UserError(f"optimizer impl 'cpu' needs CPU parameters (these are on {device})")
        cpu_kernels(required=True)

    def takes(self, i: int, opt: Layerwise) -> bool:
        """The kernels' own checks (``check_group`` in lans_cpu.cpp)."""
        f = self.frags
        g = f.gs[i]
        return (
            g.device.type == "cpu"
            and g.dtype in (torch.float32, torch.bfloat16)
            and g.is_contiguous()
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (f.ws[i], f.ms[i], f.vs[i]))
        )

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: Layerwise) -> None:
        super().__init__(frags, idx, opt)
        self.ext: Any = cpu_kernels(required=True) if self.idx else None  # the module (None: no fragments)
        self.g, self.w, self.m, self.v = ([xs[i] for i in self.idx] for xs in (frags.gs, frags.ws, frags.ms, frags.vs))

    def _grad_sumsq(self) -> torch.Tensor:
        return self.ext.sum_of_squares(self.g)

    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        return self.ext.moments_sumsq(self.g, self.w, self.m, self.v, sc[self.idx].float())

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        self.ext.update(self.g, self.w, self.m, self.v, sc[self.idx].float(), a[self.idx].float())


# The implementations a user may name (``impl``); ``impl="auto"`` takes the first usable one on the device.
KERNELS: tuple[type[Kernels], ...] = (CppKernels, FlatKernels, CompiledKernels, ForeachKernels)
IMPLS = ("auto", *(k.name for k in KERNELS))
