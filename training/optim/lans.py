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

Four implementations of the element-wise work, same maths, each a subclass of ``Kernels`` (moments, sums
of squares, update, per fragment; ``training.optim.backends``). The group step (this module: the optimizer
classes) does the per-tensor part (norms, all-reduces, trust ratios) and hands the fragments to the
implementation ``impl`` names; one that does not take a fragment hands it to its ``fallback``. The kernels
they run are torch code in ``training.optim.elementwise`` and C++ loaded by ``training.optim.cpu_ext``:

- ``"cpu"`` (``CppKernels``): C++ kernels (``training/optim/csrc/lans_cpu.cpp``), one call per phase over all
  fragments of a group; the moment update and the sums of squares of r', c', w share one pass, and the
  update of w recomputes r' and c' rather than storing them: 12 memory passes per step against
  AdamW-foreach's ~20. They take fp32 or bf16 gradients; fragments with other gradients (float64, fp16) go
  to the foreach ops instead.
- ``"fused"`` (``CompiledKernels``): three ``torch.compile``-d kernels per fragment (moments; sums of
  squares; update) for fragments of 64k elements or more, the foreach ops for the rest: 15 passes. On
  accelerators, the path of groups that are not a flat ZeRO partition.
- ``"foreach"`` (``ForeachKernels``): eager ``torch._foreach_*`` ops over the fragment lists; needs no
  compiler.
- ``"multi"`` (``FlatKernels``): a ZeRO group's flat partition as one tensor: per phase one multi-tensor
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
every norm is accumulated in float64 in all implementations (error bound: ``elementwise.sum_of_squares``).

``trust_no_decay=False`` gives parameter groups with weight decay 0 (biases, LayerNorm) trust ratio 1 in
both LANS terms: w <- w - lr b1 r - lr (1-b1) c (LAMB: w <- w - lr r), as NVIDIA's FusedLAMB does
(``use_nvlamb=False``). The default (True) applies the ratio to every tensor, as in the papers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from common.errors import UserError
from training import collectives
from training.optim.backends import IMPLS, KERNELS, GroupFragments, Kernels
from training.optim.zero_map import GroupLayout, allreduce_sums


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
    def _resolve_impl(self, device: torch.device) -> type[Kernels]:
        if self.impl == "auto":
            return next(k for k in KERNELS if k.usable(device))
        kernels = next(k for k in KERNELS if k.name == self.impl)
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
