"""LANS and LAMB with per-tensor trust ratios that stay per-tensor under DeepSpeed ZeRO.

Layer-wise optimizers need the norm of every *whole* tensor (||g||, ||w|| and the update norms). DeepSpeed
ZeRO-1/2 and its BF16 optimizer hand the wrapped optimizer one flat fp32 partition per parameter group and
rank, so a naive layer-wise optimizer takes norms over arbitrary slices of concatenated tensors and its result
changes with the world size. Here every parameter group is described by a *layout*: a list of fragments
``(start, numel, tensor index)`` of the flat tensor the optimizer sees. Norms are summed per fragment, added
per tensor, all-reduced over the data-parallel group (LANS: one call for ||g||, one for ||w|| and the two
update norms; LAMB: one call), and the per-tensor factors are applied back to the local fragments. Without
ZeRO a tensor is its own single fragment and no communication happens. ``training.optim.factory.attach_zero`` builds the
layouts from DeepSpeed's own lp->hp fragment links (see ``training/optim/zero_map.py``).

Maths (LANS, Zheng et al. 2020, Algorithm 2), per tensor with gradient g at step t::

    g~ = g / (||g|| + eps)            (g itself when ||g|| = 0)
    m = b1 m + (1-b1) g~ ;  v = b2 v + (1-b2) g~^2
    d = sqrt(v / (1-b2^t)) + eps
    r = m / (1-b1^t) / d + wd w ;  c = g~ / d + wd w
    w <- w - lr b1 ||w||/||r|| r - lr (1-b1) ||w||/||c|| c      (a ratio is 1 when either norm is 0)

The kernels compute r and c up to a positive per-tensor factor (r = k_r r', c = k_c c', with the bias
corrections folded into eps and the weight-decay coefficient); the trust-ratio step only needs the direction
and the norm, so ``||w|| r / ||r|| = ||w|| r' / ||r'||``; the factor is applied explicitly when a ratio is 1.

Three implementations of the element-wise work, same maths, each a subclass of ``_Kernels`` (moments, sums
of squares, update, per fragment). The group step does the per-tensor part (norms, all-reduces, trust
ratios) and hands the fragments to the implementation ``impl`` names; one that does not take a fragment
hands it to its ``fallback``:

- ``"cpu"`` (``_CppKernels``): C++ kernels (``training/optim/csrc/lans_cpu.cpp``), one call per phase over all
  fragments of a group; the moment update and the sums of squares of r', c', w share one pass, and the
  update of w recomputes r' and c' rather than storing them: 12 memory passes per step against
  AdamW-foreach's ~20. They take fp32 or bf16 gradients; fragments with other gradients (float64, fp16) go
  to the foreach ops instead.
- ``"fused"`` (``_CompiledKernels``): three ``torch.compile``-d kernels per fragment (moments; sums of
  squares; update) for fragments of 64k elements or more, the foreach ops for the rest: 15 passes. On
  accelerators, the path of groups that are not a flat ZeRO partition.
- ``"foreach"`` (``_ForeachKernels``): eager ``torch._foreach_*`` ops over the fragment lists; needs no
  compiler.
- ``"multi"`` (``_FlatKernels``): a ZeRO group's flat partition as one tensor: per phase one multi-tensor
  norm and at most one fused operator, whatever the number of fragments, no host sync: 72 bytes per element
  and step for LANS, 52 for LAMB (``benchmarks/bench_gpu_readiness.py``); groups that are not a flat
  partition go to ``fused`` (accelerators) or ``foreach``. The accelerator path.

``impl="auto"`` takes ``cpu`` for CPU tensors and ``multi`` elsewhere, and falls back (with a warning) to
``fused`` / ``foreach`` when a build fails.

Precision: the working dtype of a tensor is float64 for a float64 parameter and fp32 for every other. State
(m, v) and the element-wise maths are in the working dtype; the per-tensor scalars (norms, trust ratios, bias
corrections) are float64 and rounded once to it. A float64 run is float64 throughout, on every path (the C++
kernels hand float64 fragments to the foreach ops). A bf16 or fp16 parameter (outside DeepSpeed) gets an fp32
master copy in the state; the update is applied to the master in fp32 and the master is cast (round to
nearest) into the parameter. Under DeepSpeed the parameters the optimizer sees are already fp32 masters. On CPU
every norm is accumulated in float64 in all implementations (error bound: ``sum_of_squares``).

``trust_no_decay=False`` gives parameter groups with weight decay 0 (biases, LayerNorm) trust ratio 1 in
both LANS terms: w <- w - lr b1 r - lr (1-b1) c (LAMB: w <- w - lr r), as NVIDIA's FusedLAMB does
(``use_nvlamb=False``). The default (True) applies the ratio to every tensor, as in the papers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from common.errors import UserError
from model.compile import compile_errors
from training import collectives
from training.optim.zero_map import GroupLayout, allreduce_sums

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


def _sumsq_dtype(w: torch.Tensor) -> torch.dtype:
    """Accumulator of the compiled sums of squares (a constant when dynamo traces: device and dtype are
    static)."""
    return torch.float64 if w.device.type == "cpu" or w.dtype == torch.float64 else torch.float32


def _lans_sumsq_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor
) -> torch.Tensor:
    """Partial sums of squares of r', c' and w over the fragment (after the moment update); accumulated
    in float64 on CPU (see ``sum_of_squares``), fp32 elsewhere (accelerators: tree reductions; no fp64 on
    HPU)."""
    acc = _sumsq_dtype(w)
    gt = g.to(w.dtype) * sc[0]
    b = v.sqrt() + sc[4]
    r = (m / b + sc[5] * w).to(acc)
    c = (gt / b + sc[6] * w).to(acc)
    wd = w.to(acc)
    return torch.stack([(r * r).sum(), (c * c).sum(), (wd * wd).sum()])


def _lamb_sumsq_kernel(
    g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: torch.Tensor
) -> torch.Tensor:
    acc = _sumsq_dtype(w)
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


def _compiled(name: str) -> Callable:
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


_CPU_EXT: list = []  # [module or None] once tried


def _cpu_kernels(required: bool = False) -> Any:
    """The C++ CPU kernels (``training/optim/csrc/lans_cpu.cpp``), built on first use with torch's extension
    builder and cached under ~/.cache/torch_extensions (a file lock keeps concurrent ranks from building
    twice). ``-march=native``: the cache name carries a hash of this CPU's model and flags, so a home
    directory shared by different machines does not hand one machine another's binary (and of the source's
    path and the Python environment, so that two checkouts do not rebuild one cache directory in turn). None if
    the build fails (with a warning), or UserError when ``required`` (impl="cpu" asked for explicitly)."""
    if not _CPU_EXT:
        from torch.utils import cpp_extension  # deferred: it imports setuptools; only the CPU path builds

        cpu_id = platform.machine()
        try:
            info = Path("/proc/cpuinfo").read_text()
            cpu_id += "".join(ln for ln in info.splitlines() if ln.startswith(("model name", "flags")))[:4096]
        except OSError:
            pass
        src = Path(__file__).with_name("csrc") / "lans_cpu.cpp"
        # and this copy of the source and this environment's torch: two checkouts or venvs sharing the cache
        # would otherwise rebuild one directory in turn (ninja sees another command line each time)
        where = f"{src.resolve()}:{sys.prefix}"
        name = "lans_cpu_" + hashlib.sha256((cpu_id + where).encode()).hexdigest()[:10]
        # One ninja for every process: the environment's own (pip's ninja, beside this interpreter) ahead of a
        # system one. Two ninja versions (1.11 and 1.13 write different .ninja_log formats) each discard the
        # other's log and rebuild: a venv activated by scripts/setup.sh and a test run without it did, 25 s.
        here = str(Path(sys.executable).parent)
        path = os.environ.get("PATH", "")
        pinned = (Path(here) / "ninja").is_file() and path.split(os.pathsep)[0] != here
        if pinned:
            os.environ["PATH"] = here + os.pathsep + path
        try:
            ext = cpp_extension.load(
                name,
                sources=[str(src)],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-mprefer-vector-width=512",
                    "-fno-math-errno",
                    "-fopenmp",
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 -- no compiler / ninja / headers: use the other paths
            warnings.warn(
                f"building the LANS/LAMB CPU kernels failed ({type(e).__name__}: {str(e)[:300]}); "
                "using the torch.compile or foreach implementation",
                RuntimeWarning,
                stacklevel=3,
            )
            ext = None
        finally:
            if pinned:
                os.environ["PATH"] = path
        _CPU_EXT.append(ext)
    if _CPU_EXT[0] is None and required:
        raise UserError("optimizer impl 'cpu': the C++ kernels could not be built (see the warning above)")
    return _CPU_EXT[0]


_FUSED_OK: dict[str, bool] = {}
_WARMED: set[tuple] = set()
_WARM_NUMEL = 1 << 16


def _warm_fused(device: torch.device, grad_dtype: torch.dtype) -> None:
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
                _compiled("moments")(g, m, v, sc)
            _compiled(f"{kind}_sumsq")(g, w, m, v, sc)
            _compiled(f"{kind}_update")(g, w, m, v, sc, a)
    _WARMED.add(key)


def _fused_available(device: torch.device) -> bool:
    """Try compiling the kernels once per device type; ``auto`` falls back to eager foreach if it fails."""
    key = device.type
    if key not in _FUSED_OK:
        try:
            _warm_fused(device, torch.float32)
            _FUSED_OK[key] = True
        except Exception as e:  # noqa: BLE001 -- any compiler failure means "use the eager path"
            warnings.warn(
                f"torch.compile of the LANS/LAMB kernels failed on {key} ({type(e).__name__}: {e}); "
                "using the eager foreach implementation",
                RuntimeWarning,
                stacklevel=3,
            )
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


# --------------------------------------------------------------------------------------------------------
# The flat-partition path's two fused kernels (``_FlatKernels``), each one operator: a byte counter
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
        return _compiled(name)(*args)
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


# --------------------------------------------------------------------------------------------------------
# The implementations, behind one interface. The group step (``LayerwiseAdaptive._step_group``) does the
# per-tensor part (sums per tensor, all-reduces, trust ratios) and hands the element-wise work on the
# fragments to one ``_Kernels`` object per group and step.
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


class _Kernels(ABC):
    """One implementation of the element-wise work of a group step (all have the same maths).

    Built for one step of one group with the fragments it is to handle, it keeps those that ``takes``
    accepts and hands the others to an instance of ``fallback`` (``rest``): the group step calls one object,
    in this order: ``grad_sumsq`` (LANS only), ``moments_sumsq``, ``update``. ``sc`` and ``a`` hold one row
    per fragment of the group (see the kernels' comment above). A new implementation is one subclass,
    listed in ``_KERNELS``.
    """

    name: ClassVar[str]  # the value of ``impl`` that selects it, and of the optimizer's ``last_impl``
    fallback: ClassVar[type[_Kernels] | None] = None

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: LayerwiseAdaptive) -> None:
        self.frags = frags
        self.lans = opt._lans
        taken = [self.takes(i, opt) for i in idx]
        self.idx = [i for i, t in zip(idx, taken) if t]
        rest = [i for i, t in zip(idx, taken) if not t]
        self.rest: _Kernels | None = None
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

    def takes(self, i: int, opt: LayerwiseAdaptive) -> bool:
        """Whether fragment ``i`` is ours; the others go to ``fallback``."""
        return True

    @classmethod
    def fallback_for(cls, device: torch.device) -> type[_Kernels] | None:
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


class _ForeachKernels(_Kernels):
    """Eager ``torch._foreach_*`` ops over the fragment lists: needs no compiler, takes every fragment. The
    moment phase materialises r' and c', and the update reuses them."""

    name = "foreach"

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: LayerwiseAdaptive) -> None:
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


class _CompiledKernels(_Kernels):
    """The ``torch.compile``-d kernels, one call per fragment and phase, for fragments of ``fused_min_numel``
    elements or more; the foreach ops take the rest (biases, norms, ZeRO boundary slivers), where a compiled
    call's fixed cost (~40 us on CPU) would dominate. The update recomputes r' and c'."""

    name = "fused"
    fallback = _ForeachKernels

    @classmethod
    def usable(cls, device: torch.device) -> bool:
        return _fused_available(device)

    def takes(self, i: int, opt: LayerwiseAdaptive) -> bool:
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
            _warm_fused(f.device, gdt)
        moments, sumsq = _compiled("moments"), _compiled("lans_sumsq" if self.lans else "lamb_sumsq")
        rows = _rows(sc, f.ms)
        for i in self.idx:
            moments(f.gs[i], f.ms[i], f.vs[i], rows[i])
        parts = torch.stack([sumsq(f.gs[i], f.ws[i], f.ms[i], f.vs[i], rows[i]) for i in self.idx])
        return parts.to(torch.float64)

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        f = self.frags
        kern = _compiled("lans_update" if self.lans else "lamb_update")
        rows, arows = _rows(sc, f.ms), _rows(a, f.ms)
        for i in self.idx:
            kern(f.gs[i], f.ws[i], f.ms[i], f.vs[i], rows[i], arows[i])


class _FlatKernels(_Kernels):
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
    fallback = _ForeachKernels

    @classmethod
    def fallback_for(cls, device: torch.device) -> type[_Kernels] | None:
        """Groups that are not a flat partition: the compiled kernels on accelerators where they compile,
        else the foreach ops (CPU: the C++ kernels are the default there; ``multi`` is asked for by name)."""
        return _CompiledKernels if device.type != "cpu" and _fused_available(device) else _ForeachKernels

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: LayerwiseAdaptive) -> None:
        self.ok = frags.flat is not None and len(set(frags.steps)) <= 1
        super().__init__(frags, idx, opt)
        opt.flat_group_steps += bool(self.idx)
        if self.idx:
            self.numels = list(frags.numels or [])
            self.frag = opt._fragment_of_element(frags)
            w = frags.flat[0] if frags.flat is not None else frags.ws[0]
            self.acc = _sumsq_dtype(w)
        self.r: torch.Tensor | None = None
        self.c: torch.Tensor | None = None

    def takes(self, i: int, opt: LayerwiseAdaptive) -> bool:
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


class _CppKernels(_Kernels):
    """The C++ kernels (``training/optim/csrc/lans_cpu.cpp``), one call per phase over all our fragments. They
    take fp32 or bf16 gradients; fragments with others (float64, fp16) go to the foreach ops, silently."""

    name = "cpu"
    fallback = _ForeachKernels

    @classmethod
    def usable(cls, device: torch.device) -> bool:
        return device.type == "cpu" and _cpu_kernels() is not None

    @classmethod
    def require(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise UserError(f"optimizer impl 'cpu' needs CPU parameters (these are on {device})")
        _cpu_kernels(required=True)

    def takes(self, i: int, opt: LayerwiseAdaptive) -> bool:
        """The kernels' own checks (``check_group`` in lans_cpu.cpp)."""
        f = self.frags
        g = f.gs[i]
        return (
            g.device.type == "cpu"
            and g.dtype in (torch.float32, torch.bfloat16)
            and g.is_contiguous()
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (f.ws[i], f.ms[i], f.vs[i]))
        )

    def __init__(self, frags: GroupFragments, idx: Sequence[int], opt: LayerwiseAdaptive) -> None:
        super().__init__(frags, idx, opt)
        self.ext: Any = _cpu_kernels(required=True) if self.idx else None  # the module (None: no fragments)
        self.g, self.w, self.m, self.v = ([xs[i] for i in self.idx] for xs in (frags.gs, frags.ws, frags.ms, frags.vs))

    def _grad_sumsq(self) -> torch.Tensor:
        return self.ext.sum_of_squares(self.g)

    def _moments_sumsq(self, sc: torch.Tensor) -> torch.Tensor:
        return self.ext.moments_sumsq(self.g, self.w, self.m, self.v, sc[self.idx].float())

    def _update(self, sc: torch.Tensor, a: torch.Tensor) -> None:
        self.ext.update(self.g, self.w, self.m, self.v, sc[self.idx].float(), a[self.idx].float())


# The implementations a user may name (``impl``); ``impl="auto"`` takes the first usable one on the device.
_KERNELS: tuple[type[_Kernels], ...] = (_CppKernels, _FlatKernels, _CompiledKernels, _ForeachKernels)
IMPLS = ("auto", *(k.name for k in _KERNELS))


class LayerwiseAdaptive(torch.optim.Optimizer):
    """Shared machinery of LANS and LAMB: layouts, per-tensor norms (optionally all-reduced), two phases."""

    _lans: bool = True
    #: fragments with fewer elements take the eager foreach path even when impl is "fused" (tests lower it)
    fused_min_numel: int = 1 << 16

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        impl: str = "auto",
        trust_no_decay: bool = True,
    ) -> None:
        if lr < 0:
            raise UserError(f"optimizer lr must be >= 0 (got {lr})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise UserError(f"optimizer betas must lie in [0, 1) (got {tuple(betas)})")
        if eps <= 0:
            raise UserError(f"optimizer eps must be > 0 (got {eps})")
        if weight_decay < 0:
            raise UserError(f"optimizer weight_decay must be >= 0 (got {weight_decay})")
        if impl not in IMPLS:
            raise UserError(f"optimizer impl must be one of {IMPLS} (got {impl!r})")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.impl = impl
        self.last_impl: str | None = None  # the path the latest step ran (tests: no silent fallback)
        # False: parameter groups with weight_decay 0 get trust ratio 1 (NVIDIA FusedLAMB's default).
        self.trust_no_decay = bool(trust_no_decay)
        # id(flat partition tensor) -> layout; filled by attach_zero(); absent = "each tensor is whole".
        self._layouts: dict[int, GroupLayout] = {}
        self._comm = _CommTimer()
        self.flat_group_steps = 0  # group steps the flat-partition path (impl "multi") took whole
        self._segs: dict[tuple, torch.Tensor] = {}  # per-fragment maps and lengths on the device (_on_device)

    @property
    def comm_seconds(self) -> float:
        """Time spent in the per-tensor norm all-reduces, to their completion (benchmarks read it; reading it
        waits for the all-reduces timed on an accelerator)."""
        return self._comm.seconds()

    # ---- ZeRO ---------------------------------------------------------------------------------------
    def set_layouts(self, layouts: dict[int, GroupLayout]) -> None:
        """Install fragment layouts keyed by ``id`` of the flat tensors in ``param_groups`` (see zero_map)."""
        self._layouts = dict(layouts)

    @property
    def zero_attached(self) -> bool:
        return bool(self._layouts)

    # ---- state --------------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            work = torch.float64 if p.dtype == torch.float64 else torch.float32  # the working dtype
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=work, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=work, memory_format=torch.contiguous_format)
            if p.dtype != work:
                state["master"] = p.detach().to(work, memory_format=torch.contiguous_format).clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but keeps fp32 state fp32 for low-precision parameters (torch would cast it down)."""
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for p, pid in zip(group["params"], saved_group["params"]):
                st = self.state.get(p)
                if not st or pid not in saved_state:
                    continue
                for key, value in saved_state[pid].items():
                    if torch.is_tensor(value) and value.dtype == torch.float32 and st[key].dtype != torch.float32:
                        st[key] = value.to(device=p.device, dtype=torch.float32).clone()

    # ---- step ---------------------------------------------------------------------------------------
    def _resolve_impl(self, device: torch.device) -> type[_Kernels]:
        if self.impl == "auto":
            return next(k for k in _KERNELS if k.usable(device))
        kernels = next(k for k in _KERNELS if k.name == self.impl)
        kernels.require(device)
        return kernels

    # torch.optim.Optimizer.step is declared as two overloads (closure None -> None, closure -> float);
    # this one signature covers both.
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _collect(self, group: dict) -> GroupFragments | None:
        """The group's fragments (steps its state); None when no parameter has a gradient."""
        params = group["params"]
        layout = self._layouts.get(id(params[0])) if len(params) == 1 else None
        if self._layouts and layout is None:
            raise RuntimeError(
                "LANS/LAMB: a parameter group is not covered by the ZeRO layout (DeepSpeed rebuilt its flat "
                "partitions?); call attach_zero(engine) again"
            )
        if layout is not None:
            p = params[0]
            if p.grad is None:
                raise RuntimeError("LANS/LAMB under ZeRO: the flat partition has no gradient at step()")
            if p.numel() != layout.partition_numel:
                raise RuntimeError(
                    "LANS/LAMB: the ZeRO layout does not match the flat partition "
                    f"({layout.partition_numel} vs {p.numel()} elements); call attach_zero(engine) again"
                )
            st = self._init_state(p)
            w = st["master"].view(-1) if "master" in st else p.detach().view(-1)
            g, m, v = p.grad.detach().view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            ws = [w.narrow(0, s, n) for s, n in zip(layout.starts, layout.numels)]
            gs = [g.narrow(0, s, n) for s, n in zip(layout.starts, layout.numels)]
            ms = [m.narrow(0, s, n) for s, n in zip(layout.starts, layout.numels)]
            vs = [v.narrow(0, s, n) for s, n in zip(layout.starts, layout.numels)]
            steps = [st["step"] + 1] * len(ws)
            st["step"] += 1
            tiled = all(a + n == b for a, n, b in zip(layout.starts, layout.numels, layout.starts[1:]))
            covered = layout.starts[-1] + layout.numels[-1] if layout.starts else 0
            flat = (w[:covered], g[:covered], m[:covered], v[:covered]) if tiled and layout.starts[:1] == [0] else None
            return GroupFragments(
                ws,
                gs,
                ms,
                vs,
                layout.tensor_index,
                layout.num_tensors,
                layout.process_group,
                steps,
                device=m.device,
                lowp=[],
                flat=flat,
                numels=list(layout.numels),
            )
        ws, gs, ms, vs, steps, lowp = [], [], [], [], [], []
        for p in params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LANS/LAMB do not support sparse gradients")
            st = self._init_state(p)
            st["step"] += 1
            if "master" in st:
                ws.append(st["master"].view(-1))
                lowp.append((p, st["master"]))
            else:
                ws.append(p.detach().view(-1))
            gs.append(p.grad.detach().reshape(-1))
            ms.append(st["exp_avg"].view(-1))
            vs.append(st["exp_avg_sq"].view(-1))
            steps.append(st["step"])
        if not ws:
            return None
        n = len(ws)
        return GroupFragments(ws, gs, ms, vs, list(range(n)), n, None, steps, device=ms[0].device, lowp=lowp)

    def _allreduce(self, sums: torch.Tensor, pg: Any) -> torch.Tensor:
        if pg is None:
            return sums
        if collectives.world_size() == 1:  # nothing to wait for: not timed
            return allreduce_sums(sums, pg)
        with self._comm.timing(sums.device):
            return allreduce_sums(sums, pg)

    def _on_device(self, what: str, values: Sequence[int], device: torch.device) -> torch.Tensor:
        """A per-fragment list of ints as a device tensor, copied from the host once per layout, not every step
        (a copy from a Python list waits for the device)."""
        key = (what, device, tuple(values))
        out = self._segs.get(key)
        if out is None:
            out = self._segs[key] = torch.tensor(values, dtype=torch.long, device=device)
        return out

    def _fragment_of_element(self, f: GroupFragments) -> torch.Tensor:
        """The fragment of each element of a flat partition (int32, ``FlatKernels``), built once per layout."""
        numels = tuple(f.numels or [])
        key = ("fragment of element", f.device, numels)
        out = self._segs.get(key)
        if out is None:
            lengths = torch.tensor(numels, dtype=torch.long, device=f.device)
            ids = torch.arange(len(numels), dtype=torch.int32, device=f.device)
            out = self._segs[key] = torch.repeat_interleave(ids, lengths, output_size=sum(numels))
        return out

    def _seg(self, f: GroupFragments) -> torch.Tensor:
        """Fragment -> tensor index."""
        return self._on_device("seg", f.tensor_index, f.device)

    def _step_group(self, group: dict) -> None:
        """Per-tensor norms from per-fragment sums of squares, each all-reduced once (LANS: ||g||, then
        ||r||, ||c||, ||w|| together; LAMB: the second only); the element-wise work is the kernels'."""
        f = self._collect(group)
        if f is None:
            return
        kernels_cls = self._resolve_impl(f.device)
        self.last_impl = kernels_cls.name
        kernels = kernels_cls(f, range(len(f)), self)
        seg = self._seg(f)

        # Phase 1 (LANS only): ||g||^2 per tensor, all-reduced -- the normalisation must precede the moments.
        g_norm = None
        if self._lans:
            gsq = torch.zeros(f.num_tensors, dtype=torch.float64, device=f.device)
            if len(f):
                fsq = torch.zeros(len(f), dtype=torch.float64, device=f.device)
                kernels.grad_sumsq(fsq)
                gsq.index_add_(0, seg, fsq)
            g_norm = self._allreduce(gsq, f.process_group).sqrt()
        sc, k_r, k_c = self._scalars(group, f, g_norm, seg)

        # Phase 2: moments; partial ||r'||^2, ||c'||^2, ||w||^2 per fragment; one all-reduce (LAMB's only).
        uq = torch.zeros((3, f.num_tensors), dtype=torch.float64, device=f.device)
        parts = torch.zeros((len(f), 3), dtype=torch.float64, device=f.device)
        kernels.moments_sumsq(sc, parts)
        if len(f):
            uq.index_add_(1, seg, parts.t().contiguous())
        uq = self._allreduce(uq, f.process_group)

        # Phase 3: update w.
        if len(f):
            kernels.update(sc, self._update_coefs(group, uq, seg, k_r, k_c))
        for p, master in f.lowp:
            p.copy_(master.view_as(p))

    def _scalars(
        self, group: dict, f: GroupFragments, g_norm: torch.Tensor | None, seg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernels' per-fragment scalars ``sc`` (float64; each implementation rounds them to its
        fragments' working dtype), and k_r, k_c (r = k_r r', c = k_c c')."""
        (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
        if len(set(f.steps)) <= 1:  # every tensor at the same step (always under ZeRO): host arithmetic
            t = f.steps[0] if f.steps else 1
            one = torch.ones(len(f), dtype=torch.float64, device=f.device)
            bc1, bc2 = one * (1 - b1**t), one * (1 - b2**t)
        else:  # tensors that joined later (a parameter unfrozen mid-run): their own bias corrections
            step_t = torch.tensor(f.steps, dtype=torch.float64, device=f.device)
            bc1 = 1 - b1**step_t
            bc2 = 1 - b2**step_t
        k_r = bc2.sqrt() / bc1
        k_c = bc2.sqrt()
        if self._lans:
            assert g_norm is not None  # phase 1 ran
            s_t = torch.where(g_norm > 0, 1.0 / (g_norm + eps), torch.ones_like(g_norm))
            s = s_t[seg] if len(f) else s_t[:0]
        else:
            s = torch.ones(len(f), dtype=torch.float64, device=f.device)
        sc = torch.stack(
            [
                s,
                torch.full_like(s, 1.0 - b1),
                torch.full_like(s, b2),
                torch.full_like(s, 1.0 - b2),
                eps * bc2.sqrt(),
                wd / k_r,
                (wd / k_c) if self._lans else torch.zeros_like(s),
            ],
            dim=1,
        )
        return sc, k_r, k_c

    def _update_coefs(
        self, group: dict, uq: torch.Tensor, seg: torch.Tensor, k_r: torch.Tensor, k_c: torch.Tensor
    ) -> torch.Tensor:
        """Per fragment (a_r, a_c) with w += a_r r' + a_c c', from the per-tensor ||r'||^2, ||c'||^2, ||w||^2.

        Trust ratio ||w||/||r'|| applied to r' (the k factor cancels); ratio 1 -> explicit factor k.
        trust_no_decay=False: ratio 1 throughout a group without weight decay (NVIDIA FusedLAMB)."""
        lr, b1, wd = group["lr"], group["betas"][0], group["weight_decay"]
        r_norm, c_norm, w_norm = uq[0].sqrt(), uq[1].sqrt(), uq[2].sqrt()
        wn_f, rn_f, cn_f = w_norm[seg], r_norm[seg], c_norm[seg]
        if not self.trust_no_decay and wd == 0:
            wn_f = torch.zeros_like(wn_f)
        coef_r = torch.where((wn_f > 0) & (rn_f > 0), wn_f / rn_f.clamp_min(1e-300), k_r)
        coef_c = torch.where((wn_f > 0) & (cn_f > 0), wn_f / cn_f.clamp_min(1e-300), k_c)
        if self._lans:
            a = torch.stack([-lr * b1 * coef_r, -lr * (1 - b1) * coef_c], dim=1)
        else:
            a = torch.stack([-lr * coef_r, torch.zeros_like(coef_r)], dim=1)
        return a


class _CommTimer:
    """Time of the collectives it wraps, to their completion: wall time around a host-synchronous collective
    (gloo on CPU tensors), device events around one on an accelerator (enqueued, not waited for: read
    when ``seconds`` is called, which waits for the newest)."""

    def __init__(self) -> None:
        self.done = 0.0
        self.pending: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        if device.type == "cpu":
            t0 = time.perf_counter()
            yield
            self.done += time.perf_counter() - t0
            return
        start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        start.record()
        yield
        end.record()
        self.pending.append((start, end))
        self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Add the timed collectives that have completed (all of them, waiting, with ``wait``): a run that
        never reads ``seconds`` holds only the few pairs still in flight."""
        while self.pending and (wait or self.pending[0][1].query()):
            start, end = self.pending.pop(0)
            end.synchronize()
            self.done += start.elapsed_time(end) / 1000.0

    def seconds(self) -> float:
        self._fold(wait=True)
        return self.done


class LANS(LayerwiseAdaptive):
    """LANS (Zheng et al. 2020): normalized gradients, Nesterov-style blend of two trust-ratio steps."""

    _lans = True


class LAMB(LayerwiseAdaptive):
    """LAMB (You et al. 2019): Adam moments with bias correction, one trust ratio ||w||/||update||.

    Unlike DeepSpeed's fused LAMB it needs no loss scaling and works with bf16 (fp32 state and math).
    """

    _lans = False
