"""LANS / LAMB against an independent per-tensor reference written from the papers' formulas."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from common.errors import UserError
from training import lans as lans_mod
from training.lans import LAMB, LANS, build_optimizer, param_groups, sum_of_squares


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


def reference_step(params, grads, states, *, lr, b1, b2, eps, wd, step, lans: bool):
    """Straightforward per-tensor float64 LANS / LAMB (Zheng et al. 2020 Alg. 2; You et al. 2019 Alg. 2)."""
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
            return wn / un if (wn > 0 and un > 0) else 1.0

        if lans:
            c = g / d + wd * w
            w = w - lr * b1 * ratio(r) * r - lr * (1 - b1) * ratio(c) * c
        else:
            w = w - lr * ratio(r) * r
        out.append(w)
    return out


def _grads(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randint(0, 11, (8, 5))
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).mean().backward()
    model.zero.grad.zero_()  # a zero gradient exercises the ||g|| = 0 branch


# "fused" sends every tensor through the compiled kernels, "mixed" the larger ones only (emb, fc1, fc2.weight)
# and the rest through the foreach ops, as the default threshold does with BERT's weights and biases.
@pytest.mark.parametrize(
    ("impl", "fused_min_numel"), [("cpu", None), ("foreach", None), ("fused", 0), ("fused", 20)]
)
@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_matches_reference(cls, impl: str, fused_min_numel: int | None) -> None:
    torch.manual_seed(0)
    model = Tiny()
    hp = {"lr": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-6}
    wd = 0.01
    opt = cls(param_groups(model, wd), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], impl=impl)
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
                lr=hp["lr"],
                b1=hp["b1"],
                b2=hp["b2"],
                eps=hp["eps"],
            )
        # Compare after every step (same gradients, same moments history).
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach().double(), ref_params[n], rtol=2e-5, atol=2e-6, msg=n)
        # Keep the reference on exactly the model's weights so errors do not compound over steps.
        ref_params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    assert any((p.detach() != 0).any() for p in model.parameters())


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
        opt = build_optimizer(
            name, param_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01
        )
        assert isinstance(opt, cls)
    with pytest.raises(UserError, match="optimizer.name"):
        build_optimizer("sgdx", model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    with pytest.raises(UserError, match="betas"):
        LANS(model.parameters(), lr=1e-3, betas=(1.0, 0.9))
    with pytest.raises(UserError, match="impl"):
        LANS(model.parameters(), impl="cuda-magic")


def test_sum_of_squares_is_accurate_on_large_tensors() -> None:
    """The norms behind every trust ratio: 1e-6 relative on a 9M-element tensor (138 BLAS chunks), bf16 too."""
    torch.manual_seed(3)
    big = torch.randn(9_000_001) * 1e-3 + 3e-4
    small = torch.tensor([3.0, 4.0])
    got = sum_of_squares([big, small, big.to(torch.bfloat16)])
    assert got.dtype == torch.float64
    ref_big = (big.double() ** 2).sum()
    ref_bf16 = (big.to(torch.bfloat16).double() ** 2).sum()
    assert abs(got[0] - ref_big) / ref_big < 1e-6
    assert got[1] == 25.0
    assert abs(got[2] - ref_bf16) / ref_bf16 < 2e-6


def test_implementations_agree_and_compiled_graphs_stay_bounded() -> None:
    """Tensors of many sizes (several 32k-element C++ work blocks, a single element), fp32 and bf16 parameters:
    the C++ and compiled paths equal the eager foreach path, and the compiled kernels stay a bounded set of
    graphs, never dynamo's limit (past it a kernel would silently run eagerly)."""
    torch._dynamo.reset()  # count from an empty cache (earlier tests compile small-size variants on purpose)
    lans_mod._COMPILED.clear()
    lans_mod._WARMED.clear()
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
                    torch.testing.assert_close(
                        wp, wq, rtol=1e-5, atol=1e-6, msg=f"{cls.__name__} {impl} {dtype}"
                    )
                    assert not torch.equal(wq, q0)  # the step moved the weights
    limit = torch._dynamo.config.recompile_limit
    for name, fn in lans_mod._COMPILED.items():
        code = fn._torchdynamo_orig_callable.__code__
        n = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
        assert 1 <= n <= 4 < limit, (name, n)
