"""The element-wise work of LANS and LAMB as torch code: the float64 sums of squares every path shares, the
per-fragment kernels that ``torch.compile`` compiles (impl ``"fused"``), and the flat-partition path's two
operators (impl ``"multi"``, registered as ``wikipretrain::lans_flat_moments`` and ``lans_flat_update`` when
this module is imported). The implementations that call them are in ``training.optim.backends``; the maths
they share is in ``training.optim.lans``'s docstring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from model.compile import compile_errors

# What the torch._foreach_* functions take and return.
TensorList = list[torch.Tensor] | tuple[torch.Tensor, ...]

_DOT_CHUNK = 1 << 16


def sum_of_squares(xs: TensorList) -> torch.Tensor:
    """Per-tensor sums of squares of 1-D contiguous tensors, float64 on the tensors' device.

    On CPU (the foreach and torch.compile paths, and tensors the C++ kernels do not take): every chunk of 64k
    elements is converted to float64 and fed to BLAS ``ddot``; the chunk sums are added in float64. The
    square of an fp32 / bf16 / fp16 value is exact in float64, and all terms are >= 0, so whatever order
    and vector width the BLAS build adds them in (AVX-512, AVX2 and SSE kernels differ), the relative error
    of a tensor of n elements is at most gamma_n = n u / (1 - n u), u = 2^-53 (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., section 4.2; the bound also covers float64 inputs, whose
    squares round once): 3.5e-9 for BERT-Large's 31M-element word embedding. It runs at the speed of one
    read of the data (memory-bound: as fast as fp32 ``sdot`` on a 23M-element tensor). Sums in fp32 (BLAS
    ``sdot``, torch's ``vector_norm``) are off by 1e-6 to 1e-3, by amounts that depend on the CPU's ISA.
    """
    if not xs:
        return torch.zeros(0, dtype=torch.float64)
    if xs[0].device.type != "cpu":
        # Accelerators: one multi-tensor kernel with tree reductions (accurate; chunked dots would be
        # thousands of launches), in float64 for float64 tensors.
        acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
        norms = torch.stack(torch._foreach_norm(xs, dtype=acc)).to(torch.float64)
        return norms * norms
    dots, owner = [], []
    for k, x in enumerate(xs):
        for chunk in x.split(_DOT_CHUNK) if x.numel() > _DOT_CHUNK else (x,):
            chunk = chunk if chunk.dtype == torch.float64 else chunk.to(torch.float64)
            dots.append(torch.dot(chunk, chunk))
            owner.append(k)
    out = torch.zeros(len(xs), dtype=torch.float64, device=xs[0].device)
    idx = torch.tensor(owner, dtype=torch.long, device=out.device)
    return out.index_add_(0, idx, torch.stack(dots).to(torch.float64))


# --------------------------------------------------------------------------------------------------------
# Element-wise kernels (one fragment each). sc rows: LANS  [s, 1-b1, b2, 1-b2, eps', wd_r, wd_c]
#                                                     LAMB  [1, 1-b1, b2, 1-b2, eps', wd_r, 0]
# sc and a are in the fragment's working dtype (m's dtype: fp32, or float64 for a float64 parameter), rounded
# from float64 once (1-b computed in float64: 1 - float32(0.999) would be off by 1e-5).
# The moment update and the sums of squares are two kernels, not one: on CPU inductor's fused
# "update in place + three reductions" loop runs ~1.5x slower than the two loops back to back (measured with
# torch 2.13 on a 2-core AVX-512 machine; benchmarks/bench_lans.py).
# --------------------------------------------------------------------------------------------------------


def _moments_kernel(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor) -> None:
    """In place: m <- b1 m + (1-b1) s g ; v <- b2 v + (1-b2) (s g)^2; s = 1/(||g||+eps) (LANS) or 1 (LAMB)."""
    gt = g.to(m.dtype) * sc[0]
    m.copy_(torch.lerp(m, gt, sc[1]))
    v.copy_(v * sc[2] + gt * gt * sc[3])


def sumsq_dtype(w: torch.Tensor) -> torch.dtype:
    """Accumulator of the compiled sums of squares (a constant when dynamo traces: device and dtype are
    static)."""
    return torch.float64 if w.device.type == "cpu" or w.dtype == torch.float64 else torch.float32


def _lans_sumsq_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor
) -> torch.Tensor:
    """Partial sums of squares of r', c' and w over the fragment (after the moment update); accumulated
    in float64 on CPU (see ``sum_of_squares``), fp32 elsewhere (accelerators: tree reductions; no fp64 on
    HPU)."""
    acc = sumsq_dtype(w)
    gt = g.to(w.dtype) * sc[0]
    b = v.sqrt() + sc[4]
    r = (m / b + sc[5] * w).to(acc)
    c = (gt / b + sc[6] * w).to(acc)
    wd = w.to(acc)
    return torch.stack([(r * r).sum(), (c * c).sum(), (wd * wd).sum()])


def _lamb_sumsq_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor
) -> torch.Tensor:
    acc = sumsq_dtype(w)
    u = (m / (v.sqrt() + sc[4]) + sc[5] * w).to(acc)
    wd = w.to(acc)
    return torch.stack([(u * u).sum(), torch.zeros((), dtype=u.dtype, device=u.device), (wd * wd).sum()])


def _lans_update_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor, a: torch.Tensor
) -> None:
    gt = g.to(w.dtype) * sc[0]
    b = v.sqrt() + sc[4]
    r = m / b + sc[5] * w
    c = gt / b + sc[6] * w
    w.add_(a[0] * r + a[1] * c)


def _lamb_update_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor, a: torch.Tensor
) -> None:
    u = m / (v.sqrt() + sc[4]) + sc[5] * w
    w.add_(a[0] * u)


_COMPILED: dict[str, Callable] = {}  # kernel name -> compiled (the bodies: ``_BODIES``, below)


def compiled(name: str) -> Callable:
    """torch.compile'd kernel ``name`` of ``_BODIES``, built once per process.

    Dynamic shapes: one graph serves a whole size class (inductor still specialises on numel 1 and, for the
    sums, on numel > 4096, where it switches to cascade summation), times the input kinds seen (views or
    not, fp32 or bf16 gradients): a handful of graphs per kernel. Not ``fullgraph``: should a run ever pass
    dynamo's recompile limit, dynamo warns and runs the kernel's eager code (same maths) instead of failing.
    """
    if name not in _COMPILED:
        # dynamic_threads: OpenMP parallel regions whatever the size seen at compile time, thread count read
        # at run time (torch.set_num_threads after compilation still applies).
        _COMPILED[name] = torch.compile(_BODIES[name], dynamic=True, options={"cpp.dynamic_threads": True})
    return _COMPILED[name]


_FUSED_OK: dict[str, bool] = {}
_WARMED: set[tuple] = set()
_WARM_NUMEL = 1 << 16


def warm_fused(device: torch.device, grad_dtype: torch.dtype) -> None:
    """Compile the kernels on large inputs first: inductor decides OpenMP parallelism from the size seen at
    compile time, so a first call on a bias vector would give serial code for every tensor after it. Both
    input kinds the optimizer passes (views of a base, and plain tensors) are compiled here."""
    key = (device.type, grad_dtype)
    if key in _WARMED:
        return
    base = torch.ones(4 * _WARM_NUMEL + 8, device=device)
    sc = torch.tensor([1.0, 0.1, 0.99, 0.01, 1e-6, 0.0, 0.0], device=device)
    a = torch.zeros(2, device=device)
    for as_view in (True, False):
        for kind in ("lans", "lamb"):
            if as_view:
                g = base.to(grad_dtype).narrow(0, 1, _WARM_NUMEL)
                w, m, v = (base.clone().narrow(0, 2 + k, _WARM_NUMEL) for k in range(3))
            else:
                g = torch.ones(_WARM_NUMEL, device=device, dtype=grad_dtype)
                w, m, v = (torch.ones(_WARM_NUMEL, device=device) for _ in range(3))
            if kind == "lans":
                compiled("moments")(g, m, v, sc)
            compiled(f"{kind}_sumsq")(g, w, m, v, sc)
            compiled(f"{kind}_update")(g, w, m, v, sc, a)
    _WARMED.add(key)


def fused_available(device: torch.device) -> bool:
    """Try compiling the kernels once per device type; ``auto`` falls back to eager foreach if it fails."""
    key = device.type
    if key not in _FUSED_OK:
        try:
            warm_fused(device, torch.float32)
            _FUSED_OK[key] = True
        except Exception as e:  # any compiler failure means "use the eager path"
            warnings.warn(
                f"torch.compile of the LANS/LAMB kernels failed on {key} ({type(e).__name__}: {e}); "
                "using the eager foreach implementation",
                RuntimeWarning,
                stacklevel=3,
            )
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


# --------------------------------------------------------------------------------------------------------
# The flat-partition path's two fused kernels (``FlatKernels``), each one operator: a byte counter
# (``common/bytecount.py``) sees each call with its tensor arguments, and the element-wise chain inside is one
# compiled kernel where torch.compile works on the device (eager, the same maths, where it does not).
# consts: [1-b1, b2, 1-b2, eps', wd_r, wd_c] in the working dtype; s: LANS's 1/(||g||+eps) per fragment;
# a: (a_r, a_c) per fragment; frag: the fragment of each element (int32).
# --------------------------------------------------------------------------------------------------------


_T = torch.Tensor


def _flat_moments_body(g: _T, w: _T, m: _T, v: _T, frag: _T, s: _T, consts: _T, lans: bool) -> tuple[_T, _T]:
    gt = g.to(w.dtype)
    if lans:
        gt = gt * s[frag]
    m_new = torch.lerp(m, gt, consts[0])
    v_new = v * consts[1] + gt * gt * consts[2]
    m.copy_(m_new)
    v.copy_(v_new)
    b = v_new.sqrt() + consts[3]
    r = m_new / b + consts[4] * w
    c = gt / b + consts[5] * w if lans else w.new_empty(0)
    return r, c


def _flat_update_body(w: _T, r: _T, c: _T, frag: _T, a: _T, lans: bool) -> None:
    step = a[:, 0][frag] * r
    if lans:
        step = step + a[:, 1][frag] * c
    w.add_(step)


# Every compiled kernel's eager body, by name: the per-tensor path's five and the flat path's two.
_BODIES: dict[str, Callable[..., Any]] = {
    "moments": _moments_kernel,
    "lans_sumsq": _lans_sumsq_kernel,
    "lamb_sumsq": _lamb_sumsq_kernel,
    "lans_update": _lans_update_kernel,
    "lamb_update": _lamb_update_kernel,
    "flat_moments": _flat_moments_body,
    "flat_update": _flat_update_body,
}
_EAGER: set[tuple[str, str]] = set()  # (flat kernel, device type) where compiling it failed: its body runs


def _run_flat(name: str, device: torch.device, *args: Any) -> Any:
    """Flat kernel ``name`` compiled (dynamic shapes: one graph per input kind); its eager body, with one
    warning, on a device type where compiling it fails."""
    if (name, device.type) in _EAGER:
        return _BODIES[name](*args)
    try:
        return compiled(name)(*args)
    except compile_errors() as e:  # raised before the compiled code runs: nothing was written yet
        warnings.warn(
            f"torch.compile of the LANS/LAMB flat-partition kernel {name!r} failed on {device.type} "
            f"({type(e).__name__}: {str(e)[:300]}); running it eagerly",
            RuntimeWarning,
            stacklevel=3,
        )
        _EAGER.add((name, device.type))
        return _BODIES[name](*args)


@torch.library.custom_op("wikipretrain::lans_flat_moments", mutates_args=("m", "v"))
def flat_moments(
    g: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    frag: torch.Tensor,
    s: torch.Tensor,
    consts: torch.Tensor,
    lans: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: m, v updated; returns r' and (LANS; else empty) c' over the flat partition."""
    return _run_flat("flat_moments", w.device, g, w, m, v, frag, s, consts, lans)


@flat_moments.register_fake
def _(g, w, m, v, frag, s, consts, lans):
    return torch.empty_like(w), torch.empty_like(w) if lans else w.new_empty(0)


@torch.library.custom_op("wikipretrain::lans_flat_update", mutates_args=("w",))
def flat_update(
    w: torch.Tensor, r: torch.Tensor, c: torch.Tensor, frag: torch.Tensor, a: torch.Tensor, lans: bool
) -> None:
    """In place: w += a_r r' + a_c c', the coefficients per fragment."""
    _run_flat("flat_update", w.device, w, r, c, frag, a, lans)


@flat_update.register_fake
def _(w, r, c, frag, a, lans):
    return None
