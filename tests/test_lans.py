"""LANS / LAMB against an independent per-tensor reference written from the papers' formulas."""

from __future__ import annotations

import ast
import copy
import io
import json
import math

import pytest
import torch

from common.errors import UserError
from tests.conftest import REPO, run_env, run_python
from training.config import load_config
from training.optim import backends, cpu_ext, elementwise
from training.optim import lans as lans_mod
from training.optim.elementwise import sum_of_squares
from training.optim.factory import build_optimizer, param_groups
from training.optim.lans import LAMB, LANS
from training.optim.zero_map import GroupLayout


class Tiny(torch.nn.Module):
    """Mixed shapes: embedding, linear with bias, LayerNorm, a parameter initialised to zero."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.fc1 = torch.nn.Linear(6, 9)
        self.LayerNorm = torch.nn.LayerNorm(9)
        self.fc2 = torch.nn.Linear(9, 3)
        self.zero = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.LayerNorm(torch.tanh(self.fc1(self.emb(x).mean(1))))
        return self.fc2(h) + self.zero


def reference_step(params, grads, states, *, lr, b1, b2, eps, wd, step, lans: bool, trust: bool = True):
    """Straightforward per-tensor float64 LANS / LAMB (Zheng et al. 2020 Alg. 2; You et al. 2019 Alg. 2).

    ``trust=False``: every trust ratio is 1 (NVIDIA FusedLAMB's treatment of the group without decay)."""
    out = []
    for w, g, st in zip(params, grads, states):
        w, g = w.double(), g.double()
        if lans:
            gn = g.norm()
            g = g / (gn + eps) if gn > 0 else g
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        mh = st["m"] / (1 - b1**step)
        vh = st["v"] / (1 - b2**step)
        d = vh.sqrt() + eps
        r = mh / d + wd * w
        wn = w.norm()

        def ratio(u, wn=wn):
            un = u.norm()
            return wn / un if (trust and wn > 0 and un > 0) else 1.0

        if lans:
            c = g / d + wd * w
            w = w - lr * b1 * ratio(r) * r - lr * (1 - b1) * ratio(c) * c
        else:
            w = w - lr * ratio(r) * r
        out.append(w)
    return out


def split_layout(numels: list[int], split: int) -> GroupLayout:
    """A one-rank group whose sums still go through the all-reduce (``process_group`` set)."""
    return GroupLayout.split_first(numels, split, process_group=object())


def _grads(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randint(0, 11, (8, 5))
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).mean().backward()
    model.zero.grad.zero_()  # a zero gradient exercises the ||g|| = 0 branch


# "fused" sends every tensor through the compiled kernels, "mixed" the larger ones only (emb, fc1, fc2.weight)
# and the rest through the foreach ops, as the default threshold does with BERT's weights and biases.
@pytest.mark.parametrize(("impl", "fused_min_numel"), [("cpu", None), ("foreach", None), ("fused", 0), ("fused", 20)])
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_matches_reference(cls, impl: str, fused_min_numel: int | None) -> None:
    torch.manual_seed(0)
    _check_against_reference(cls, Tiny(), impl, fused_min_numel)


def _check_against_reference(
    cls,
    model: torch.nn.Module,
    impl: str,
    fused_min_numel: int | None = None,
    trust_no_decay: bool = True,
    rtol: float = 2e-5,
    atol: float = 2e-6,
) -> torch.optim.Optimizer:
    """Five steps of the optimizer on ``model`` against ``reference_step``, compared after every step."""
    hp = {"lr": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-6}
    wd = 0.01
    opt = cls(
        param_groups(model, wd),
        lr=hp["lr"],
        betas=(hp["b1"], hp["b2"]),
        eps=hp["eps"],
        impl=impl,
        trust_no_decay=trust_no_decay,
    )
    if fused_min_numel is not None:
        opt.fused_min_numel = fused_min_numel
    ref_params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ref_state = {n: {"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for n, p in ref_params.items()}
    decay = {n for n, p in model.named_parameters() if p.ndim > 1 and "norm" not in n.lower()}
    for step in range(1, 6):
        _grads(model, step)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n in ref_params:
            (ref_params[n],) = reference_step(
                [ref_params[n]],
                [grads[n]],
                [ref_state[n]],
                wd=wd if n in decay else 0.0,
                step=step,
                lans=cls is LANS,
                trust=trust_no_decay or n in decay,
                lr=hp["lr"],
                b1=hp["b1"],
                b2=hp["b2"],
                eps=hp["eps"],
            )
        # Compare after every step (same gradients, same moments history).
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach().double(), ref_params[n], rtol=rtol, atol=atol, msg=n)
        # Keep the reference on exactly the model's weights so errors do not compound over steps.
        ref_params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    assert any((p.detach() != 0).any() for p in model.parameters())
    return opt


@pytest.mark.parametrize(
    ("impl", "fused_min_numel"), [("cpu", None), ("auto", None), ("foreach", None), ("fused", 0), ("fused", 20)]
)
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_float64_params_match_reference(cls, impl: str, fused_min_numel: int | None) -> None:
    """A float64 model is stepped in float64 throughout, on every path (the C++ kernels hand float64 fragments
    to the foreach ops): its weights equal the float64 reference's to 1e-12 relative at every step, and its
    state is float64 with no master copy. (An FP32 part anywhere, state or scalars, is off by ~1e-7.)"""
    torch.manual_seed(5)
    model = Tiny().double()
    opt = _check_against_reference(cls, model, impl, fused_min_numel, rtol=1e-12, atol=1e-15)
    opt_states = list(opt.state.values())
    assert len(opt_states) == len(list(model.parameters())) and all(
        s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float64 and "master" not in s for s in opt_states
    )


@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_cpu_kernels_and_eager_fallback_mix_in_one_group(cls) -> None:
    """fp32 / bf16 gradients go to the C++ kernels, float64 / fp16 ones to the foreach ops, in one group: the
    result equals the all-foreach run."""
    torch.manual_seed(6)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32]
    sizes = [(70_001,), (300, 7), (40_000,), (129,), (5,)]
    init = [torch.randn(*sz).to(dt) for sz, dt in zip(sizes, dtypes)]
    runs = {impl: [torch.nn.Parameter(t.clone()) for t in init] for impl in ("cpu", "foreach")}
    opts = {impl: cls(ps, lr=0.01, impl=impl) for impl, ps in runs.items()}
    for step in range(3):
        torch.manual_seed(20 + step)
        grads = [torch.randn_like(t) for t in init]
        for impl, ps in runs.items():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opts[impl].step()
    for k, (p, q) in enumerate(zip(runs["cpu"], runs["foreach"])):
        assert p.dtype == dtypes[k]
        wp = opts["cpu"].state[p].get("master", p.detach())
        wq = opts["foreach"].state[q].get("master", q.detach())
        torch.testing.assert_close(wp, wq, rtol=1e-5, atol=1e-6, msg=f"{cls.__name__} {dtypes[k]}")
        assert not torch.equal(wq, init[k].float())  # the steps moved the weights


@pytest.mark.parametrize("impl", ["cpu", "foreach", "fused"])
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_trust_no_decay_false_gives_no_decay_group_ratio_one(cls, impl: str) -> None:
    """trust_no_decay=False (NVIDIA FusedLAMB): the group with weight decay 0 steps by lr * update (LANS:
    lr (b1 r + (1-b1) c)), the decayed group is untouched by the setting."""
    torch.manual_seed(7)
    _check_against_reference(cls, Tiny(), impl, fused_min_numel=0, trust_no_decay=False)
    # One step from the same weights and gradients, with and without the setting.
    torch.manual_seed(8)
    base = Tiny()
    models = {trust: copy.deepcopy(base) for trust in (True, False)}
    for trust, model in models.items():
        opt = cls(param_groups(model, 0.01), lr=0.05, impl=impl, trust_no_decay=trust)
        opt.fused_min_numel = 0
        _grads(model, 1)
        opt.step()
    on, off = (dict(models[t].named_parameters()) for t in (True, False))
    for n in ("emb.weight", "fc1.weight", "fc2.weight"):
        assert torch.equal(on[n], off[n]), n
    # fc1.bias: ||w|| is ~0.2 of ||update||, so the ratio matters: the steps differ by far more than rounding
    step_on = (on["fc1.bias"] - base.fc1.bias).norm()
    step_off = (off["fc1.bias"] - base.fc1.bias).norm()
    assert step_off > 2 * step_on


def test_build_optimizer_passes_trust_no_decay_and_recipes_set_it() -> None:
    model = Tiny()
    for name in ("lans", "lamb"):
        for trust in (True, False):
            opt = build_optimizer(name, param_groups(model, 0.01), lr=1e-3, trust_no_decay=trust)
            assert opt.trust_no_decay is trust
    adamw = build_optimizer("adamw", model.parameters(), lr=1e-3, trust_no_decay=False)
    assert isinstance(adamw, torch.optim.AdamW)
    assert load_config().optimizer.trust_no_decay is True
    for recipe in ("bert-large-phase1", "bert-large-phase2"):  # NVIDIA's LAMB recipe (phase 2 inherits it)
        assert load_config(recipe).optimizer.trust_no_decay is False, recipe


@pytest.mark.parametrize(
    ("module", "above"),
    [
        ("zero_map", ("lans", "backends", "elementwise", "cpu_ext")),
        ("backends", ("lans",)),
        ("elementwise", ("lans", "backends", "cpu_ext")),
        ("cpu_ext", ("lans", "backends", "elementwise")),
    ],
)
def test_the_optimizer_modules_import_one_way(module: str, above: tuple[str, ...]) -> None:
    """One import direction: lans (the optimizer) -> backends (the implementations) -> elementwise, cpu_ext
    (the kernels), and lans -> zero_map; not even a lazy import back."""
    tree = ast.parse((REPO / "training" / "optim" / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert "__future__.annotations" in imported  # the walk sees the module's imports
    back = [f"training.optim.{m}" for m in above]
    assert not [m for m in imported if m in back or m.startswith(tuple(f"{b}." for b in back))]


def test_fragments_an_implementation_does_not_take_go_to_its_fallback() -> None:
    """ "cpu" hands gradients other than fp32 / bf16 to the foreach ops, "fused" fragments under
    fused_min_numel, "multi" groups that are not a flat partition; "foreach" takes everything."""
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32]
    params = [torch.nn.Parameter(torch.randn(n).to(dt)) for n, dt in zip([100, 10, 100, 10, 10], dtypes)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = LANS(params, lr=0.01)
    opt.fused_min_numel = 50
    frags = opt._collect(opt.param_groups[0])
    assert frags is not None and len(frags) == 5
    routes = {}
    for kernels in (backends.CppKernels, backends.CompiledKernels, backends.ForeachKernels, backends.FlatKernels):
        k = kernels(frags, range(len(frags)), opt)
        routes[k.name] = (k.idx, k.rest and (type(k.rest).__name__, k.rest.idx, k.rest.rest))
    assert routes == {
        "cpu": ([0, 2, 4], ("ForeachKernels", [1, 3], None)),
        "fused": ([0, 2], ("ForeachKernels", [1, 3, 4], None)),
        "foreach": ([0, 1, 2, 3, 4], None),
        "multi": ([], ("ForeachKernels", [0, 1, 2, 3, 4], None)),  # no flat partition here; on CPU: foreach
    }
    assert backends.IMPLS == ("auto", "cpu", "multi", "fused", "foreach")


@pytest.mark.parametrize("impl", ["cpu", "fused", "foreach", "multi"])
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_zero_layout_all_reduces_once_per_phase(cls, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat partition described by a layout (one tensor in two fragments, as at a ZeRO rank boundary):
    one all-reduce of per-tensor sums per phase (LANS: ||g||^2, then ||r'||^2, ||c'||^2, ||w||^2; LAMB: the
    second), and the same step as the tensors optimised whole, up to the order of the float64 sums."""
    calls: list[tuple[int, ...]] = []

    def allreduce(sums: torch.Tensor, pg: object) -> torch.Tensor:
        calls.append(tuple(sums.shape))
        return sums  # a group of one rank

    monkeypatch.setattr(lans_mod, "allreduce_sums", allreduce)
    torch.manual_seed(9)
    numels = [70_001, 300, 40]
    init = [torch.randn(n) for n in numels]
    flat = torch.nn.Parameter(torch.cat(init))
    layout = split_layout(numels, 50_000)
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    opts = {"flat": cls([flat], lr=0.05, impl=impl), "whole": cls(whole, lr=0.05, impl=impl)}
    opts["flat"].set_layouts({id(flat): layout})
    for opt in opts.values():
        opt.fused_min_numel = 1000  # "fused": both fragments of the first tensor compiled, the rest foreach
    for step in range(3):
        torch.manual_seed(30 + step)
        grads = [torch.randn(n) for n in numels]
        flat.grad = torch.cat(grads)
        for p, g in zip(whole, grads):
            p.grad = g.clone()
        for opt in opts.values():
            opt.step()
        assert opts["flat"].last_impl == opts["whole"].last_impl == impl
    per_step = [(3,), (3, 3)] if cls is LANS else [(3, 3)]
    assert calls == per_step * 3
    torch.testing.assert_close(flat.detach(), torch.cat([p.detach() for p in whole]), rtol=1e-6, atol=1e-7)
    assert not torch.equal(flat.detach(), torch.cat(init))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_flat_partition_path_matches_reference(cls, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """impl="multi" (the accelerator path, here on CPU tensors) on a ZeRO-like flat partition (a tensor split
    in two fragments, one whole, a zero one): 5 steps equal the per-tensor reference, to 1e-12 in float64 and
    to fp32 rounding in fp32, each phase in whole-partition kernels (no per-fragment fallback)."""
    monkeypatch.setattr(lans_mod, "allreduce_sums", lambda sums, pg: sums)  # a group of one rank
    torch.manual_seed(11)
    numels = [3_001, 40, 17]
    init = [torch.randn(n, dtype=dtype) for n in numels]
    init[2].zero_()
    flat = torch.nn.Parameter(torch.cat(init))
    layout = split_layout(numels, 1_000)
    hp = {"lr": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-6, "wd": 0.01}
    opt = cls([flat], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["wd"], impl="multi")
    opt.set_layouts({id(flat): layout})
    ref = [t.double().clone() for t in init]
    states = [{"m": torch.zeros_like(t), "v": torch.zeros_like(t)} for t in ref]
    taken: list[bool] = []
    real_init = backends.FlatKernels.__init__

    def spy(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        taken.append(self.rest is None and len(self.idx) == 4)

    monkeypatch.setattr(backends.FlatKernels, "__init__", spy)
    for step in range(1, 6):
        torch.manual_seed(40 + step)
        grads = [torch.randn(n, dtype=dtype) for n in numels]
        grads[2].zero_()  # a zero gradient: ||g|| = 0
        flat.grad = torch.cat(grads)
        opt.step()
        ref = reference_step(
            ref,
            grads,
            states,
            lr=hp["lr"],
            b1=hp["b1"],
            b2=hp["b2"],
            eps=hp["eps"],
            wd=hp["wd"],
            step=step,
            lans=cls is LANS,
        )  # fmt: skip -- the reference's keyword arguments on two lines
        tol = {"rtol": 1e-12, "atol": 1e-15} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
        torch.testing.assert_close(flat.detach().double(), torch.cat(ref), **tol)
        ref = [t.double().clone() for t in flat.detach().split(numels)]
    assert taken == [True] * 5 and opt.last_impl == "multi"
    # the fused operators ran compiled (a failed compile would fall back to their eager bodies with a warning)
    kernels = ("flat_moments", "flat_update")
    assert all(k in elementwise._COMPILED and (k, "cpu") not in elementwise._EAGER for k in kernels)
    assert opt.state[flat]["exp_avg"].dtype == dtype
    assert not torch.equal(flat.detach(), torch.cat(init))


def test_zero_weights_take_unscaled_step() -> None:
    """||w|| = 0 -> ratio 1: the zero-initialised vector moves by lr*(b1 r + (1-b1) c) exactly."""
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.tensor([1.0, -2.0, 0.5, 0.0])
    LANS([w], lr=0.1, weight_decay=0.0, impl="foreach").step()
    ref = reference_step(
        [torch.zeros(4)],
        [w.grad],
        [{"m": 0.0, "v": 0.0}],
        lr=0.1,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        wd=0.0,
        step=1,
        lans=True,
    )[0]
    torch.testing.assert_close(w.detach().double(), ref, rtol=1e-6, atol=1e-7)
    assert w.abs().sum() > 0


def test_param_groups_exempt_bias_and_norm() -> None:
    model = Tiny()
    groups = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    exempt = {names[id(p)] for p in groups[1]["params"]}
    assert decayed == {"emb.weight", "fc1.weight", "fc2.weight"}
    assert {"fc1.bias", "LayerNorm.weight", "LayerNorm.bias", "zero"} <= exempt
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_state_dict_round_trip_is_bit_exact(cls) -> None:
    torch.manual_seed(1)
    a = Tiny()
    opt_a = cls(param_groups(a, 0.01), lr=0.02)
    for s in range(3):
        _grads(a, s)
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    b = Tiny()
    buf.seek(0)
    ck = torch.load(buf)
    b.load_state_dict(ck["model"])
    opt_b = cls(param_groups(b, 0.01), lr=0.02)
    opt_b.load_state_dict(ck["opt"])
    for s in range(3, 6):
        for m, o in ((a, opt_a), (b, opt_b)):
            _grads(m, s)
            o.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_bf16_params_keep_fp32_state_and_master() -> None:
    torch.manual_seed(2)
    model = Tiny()
    ref = copy.deepcopy(model)
    model.to(torch.bfloat16)
    opt = LANS(param_groups(model, 0.01), lr=0.01, impl="foreach")
    ref_opt = LANS(param_groups(ref, 0.01), lr=0.01, impl="foreach")
    for s in range(4):
        for m in (model, ref):
            _grads(m, s)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()  # identical gradients; only the parameter dtype differs
        opt.step()
        ref_opt.step()
    st = opt.state[model.fc1.weight]
    assert st["exp_avg"].dtype == torch.float32 and st["master"].dtype == torch.float32
    # The fp32 master follows the fp32 run (up to bf16 rounding of the forward); params are its bf16 cast.
    assert torch.equal(model.fc1.weight, st["master"].to(torch.bfloat16))
    torch.testing.assert_close(st["master"], ref.fc1.weight.detach(), rtol=2e-2, atol=2e-3)
    # state survives a round trip as fp32 (torch would cast it to the parameter dtype)
    sd = opt.state_dict()
    opt2 = LANS(param_groups(model, 0.01), lr=0.01)
    opt2.load_state_dict(sd)
    assert opt2.state[model.fc1.weight]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt2.state[model.fc1.weight]["master"], st["master"])


def test_build_optimizer_and_bad_input() -> None:
    model = Tiny()
    for name, cls in (("lans", LANS), ("LAMB", LAMB), ("adamw", torch.optim.AdamW)):
        opt = build_optimizer(name, param_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
        assert isinstance(opt, cls)
    with pytest.raises(UserError, match="optimizer.name"):
        build_optimizer("sgdx", model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    with pytest.raises(UserError, match="betas"):
        LANS(model.parameters(), lr=1e-3, betas=(1.0, 0.9))
    with pytest.raises(UserError, match="impl"):
        LANS(model.parameters(), impl="cuda-magic")


SUMSQ_N = 9_000_001


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = 2^-53: the relative error bound of a float64 sum of n
    nonnegative terms in any order, which our sums of squares claim (exact squares, float64 additions)."""
    nu = n * 2.0**-53
    return nu / (1 - nu)


def sumsq_relative_errors(cpp: bool) -> dict[str, float]:
    """Relative errors of our sums of squares of a 9M-element tensor (fp32 and its bf16 rounding) against
    the exact sum (math.fsum of the float64 squares, which are exact). Run in-process and in subprocesses
    with other instruction sets."""
    torch.manual_seed(3)
    big = torch.randn(SUMSQ_N) * 1e-3 + 3e-4  # mean > 0: all chunk sums are large and alike
    half = big.to(torch.bfloat16)
    exact = {k: math.fsum((x.double() ** 2).tolist()) for k, x in (("fp32", big), ("bf16", half))}
    got: dict[str, tuple[float, str]] = {}  # name -> (our sum, key of the exact sum)
    eager = sum_of_squares([big, torch.tensor([3.0, 4.0]), half])
    assert eager.dtype == torch.float64 and eager[1] == 25.0
    got["eager fp32"], got["eager bf16"] = (float(eager[0]), "fp32"), (float(eager[2]), "bf16")
    if cpp:
        ext = cpu_ext.cpu_kernels(required=True)
        native = ext.sum_of_squares([big, half])
        got["cpp fp32"], got["cpp bf16"] = (float(native[0]), "fp32"), (float(native[1]), "bf16")
        # moments_sumsq with g = m = v = 0, wd_r = wd_c = 1: r' = c' = w, so all three sums are sum w^2
        zeros = [torch.zeros(SUMSQ_N) for _ in range(3)]
        sc = torch.tensor([[1.0, 0.1, 0.99, 0.01, 1e-6, 1.0, 1.0]])
        parts = ext.moments_sumsq([zeros[0]], [big.clone()], [zeros[1]], [zeros[2]], sc)
        for j, name in enumerate(("r", "c", "w")):
            got[f"cpp moments {name}"] = (float(parts[0, j]), "fp32")
        # the torch.compile'd sums of squares (impl "fused"), same inputs
        lans_sums = elementwise.compiled("lans_sumsq")(zeros[0], big, zeros[1], zeros[2], sc[0])
        lamb_sums = elementwise.compiled("lamb_sumsq")(zeros[0], big, zeros[1], zeros[2], sc[0])
        for j, name in enumerate(("r", "c", "w")):
            got[f"fused lans {name}"] = (float(lans_sums[j]), "fp32")
        got["fused lamb u"] = (float(lamb_sums[0]), "fp32")
        got["fused lamb w"] = (float(lamb_sums[2]), "fp32")
    return {name: abs(v - exact[key]) / exact[key] for name, (v, key) in got.items()}


def test_sum_of_squares_is_accurate_on_large_tensors() -> None:
    """The norms behind every trust ratio, from the eager path (BLAS), the C++ kernels (-march=native) and
    the compiled kernels: within gamma_n (1e-9 here) of the exact sum, a bound that holds for any summation
    order and vector width.
    (The former fp32 chunk sums were off by 3.6e-6 on the bf16 data with AVX2, 5e-8 on the fp32 data.)"""
    errors = sumsq_relative_errors(cpp=True)
    assert len(errors) == 12
    for name, err in errors.items():
        assert err <= gamma(SUMSQ_N), (name, err)


@pytest.mark.parametrize(
    "env",
    [
        {
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        },
        {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
    ],
    ids=["sse", "mkl-compatible"],
)
def test_sum_of_squares_bound_holds_with_other_instruction_sets(env: dict[str, str]) -> None:
    """The same bound with torch's and MKL's kernels held to older instruction sets (a subprocess: the
    variables are read when the libraries load)."""
    code = (
        "import json, torch\n"
        "from tests.test_lans import sumsq_relative_errors\n"
        "print(json.dumps([torch.backends.cpu.get_cpu_capability(), sumsq_relative_errors(cpp=False)]))\n"
    )
    proc = run_python(["-c", code], timeout=300, env={**run_env(), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    capability, errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert capability == "DEFAULT"  # the variables took effect: no AVX2 / AVX-512 kernels in ATen
    assert set(errors) == {"eager fp32", "eager bf16"}
    for name, err in errors.items():
        assert err <= gamma(SUMSQ_N), (name, err)


def test_implementations_agree_and_compiled_graphs_stay_bounded() -> None:
    """Tensors of many sizes (several 32k-element C++ work blocks, a single element), fp32 and bf16
    parameters: the C++ and compiled paths equal the eager foreach path, and the compiled kernels stay a
    bounded set of graphs, never dynamo's limit (past it a kernel would silently run eagerly)."""
    torch._dynamo.reset()  # count from an empty cache (earlier tests compile small-size variants on purpose)
    elementwise._COMPILED.clear()
    elementwise._WARMED.clear()
    torch.manual_seed(4)
    sizes = [(300, 300), (70_001,), (1 << 16,), (256, 1024), (5,), (1,)]

    for cls in (LANS, LAMB):
        for dtype in (torch.float32, torch.bfloat16):
            ref_p = [torch.nn.Parameter(torch.randn(*sz).to(dtype)) for sz in sizes]
            init = [p.detach().float().clone() for p in ref_p]
            runs = {"foreach": ref_p}
            for impl in ("cpu", "fused"):
                runs[impl] = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
            opts = {impl: cls(ps, lr=0.01, impl=impl) for impl, ps in runs.items()}
            for step in range(3):
                torch.manual_seed(10 + step)
                grads = [torch.randn_like(p) for p in ref_p]
                for impl, ps in runs.items():
                    for p, g in zip(ps, grads):
                        p.grad = g.clone()
                    opts[impl].step()
            for impl in ("cpu", "fused"):
                for p, q, q0 in zip(runs[impl], ref_p, init):
                    # fp32 masters (bf16 parameters are their rounding, which may differ by one ulp at ties)
                    wp = opts[impl].state[p].get("master", p.detach())
                    wq = opts["foreach"].state[q].get("master", q.detach())
                    torch.testing.assert_close(wp, wq, rtol=1e-5, atol=1e-6, msg=f"{cls.__name__} {impl} {dtype}")
                    assert not torch.equal(wq, q0)  # the step moved the weights
    limit = torch._dynamo.config.recompile_limit
    for name, fn in elementwise._COMPILED.items():
        code = fn._torchdynamo_orig_callable.__code__
        n = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
        assert 1 <= n <= 4 < limit, (name, n)


def test_a_build_lock_left_by_a_killed_process_does_not_hold_the_next_start() -> None:
    """torch's extension builder leaves its lock file behind when its process is killed while it checks the
    build (a rank killed -9 as it starts), and every later process waited on it for good: the LANS kernels are
    loaded under a lock the kernel releases with its process, and a stale lock file found under it is removed."""
    name = cpu_ext.extension_name()
    with cpu_ext.build_lock(name) as build_dir:  # as a process that died building: its file, not its flock
        (build_dir / cpu_ext.TORCH_LOCK).touch()
    code = "from training.optim import cpu_ext; assert cpu_ext.cpu_kernels(required=True) is not None"
    r = run_python(["-c", code], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (build_dir / cpu_ext.TORCH_LOCK).exists()
