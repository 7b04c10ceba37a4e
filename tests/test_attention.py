"""The variable-length attention operator (``model.attention``, ``torch.ops.wikipretrain.varlen_attn``).

On the CPU: its CPU branch against the padded kernel and a float64 reference (forward and gradients), its
dropout (the kept fraction, the scaling, the same mask in the backward pass and under activation
checkpointing), ``torch.library.opcheck`` on both ops. The CUDA branch, which calls torch's flash kernel, runs
here under ``FakeTensorMode`` on fake CUDA tensors: what it passes to the flash ops, in which order, the shapes it
gets back, and how its backward is wired; a BERT layer on ``model.unpad.packing``'s output through it, and
the flash kernel's preconditions it checks (eagerly and in a symbolic trace, as torch.compile traces). The
schema check runs against the installed torch, torch 2.11's schemas and mutated ones (argument and output
names, a new required keyword). The flash kernel's numbers are the GPU tier's (``tests/test_gpu.py``).
"""

from __future__ import annotations

import copy
import functools
import re
import types
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

from model import attention as A
from model import bert, unpad

LENGTHS = [5, 0, 17, 9, 1]

# torch 2.11's schemas (the GPU image's torch), as its aten/src/ATen/native/native_functions.yaml declares them
# (pytorch v2.11.0; read from the copy the torch 2.11.0 wheel ships, torchgen/packaged/ATen/native/
# native_functions.yaml, lines 15260 and 15272): no block_table or num_splits keywords yet (2.13 adds both, with
# defaults), the argument and output names since 2.7.
FORWARD_2_11 = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
    "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None, "
    "SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? seqused_k=None, "
    "Tensor? alibi_slopes=None) -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, "
    "Tensor debug_attn_mask)"
)
BACKWARD_2_11 = (
    "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
    "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, "
    "SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)"
)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def qkv(lengths: list[int], heads: int = 3, dim: int = 8, dtype: torch.dtype = torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(lengths), heads, dim, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Softmax attention within each sequence, written out in float64."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].double().transpose(0, 1) for x in (q, k, v))
        probs = torch.softmax(qs @ ks.transpose(-1, -2) / q.size(-1) ** 0.5, dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packing(lengths: list[int]) -> unpad.Packing:
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return unpad.packing(mask)


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    weight = weight.to(out.dtype)  # the same weights whatever the dtype
    return list(torch.autograd.grad((out * weight).sum(), inputs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_branch_matches_padded_and_a_float64_reference(dtype: torch.dtype) -> None:
    """Dropout 0: the operator and the padded kernel, forward and gradients, against float64 written out."""
    q, k, v = qkv(LENGTHS, dtype=dtype)
    want = reference(q, k, v, LENGTHS)
    want_grads = grads(want, [q, k, v])
    pack = packing(LENGTHS)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for kernel in ("varlen", "padded"):
        got = unpad.varlen_attention(q, k, v, pack, 0.0, kernel)
        assert got.dtype == dtype and (got.double() - want).abs().max() < tol, kernel
        for g, w in zip(grads(got, [q, k, v]), want_grads):
            assert (g.double() - w).abs().max() < tol * 10, kernel
    assert unpad.default_kernel("cpu") == "varlen"


def test_bf16_is_computed_in_fp32_inside() -> None:
    """BF16 in and out, the softmax in FP32: no further from float64 than FP32 results rounded to BF16 (x 2)."""
    q, k, v = (x.detach().bfloat16() for x in qkv(LENGTHS, dim=16))
    want = reference(q, k, v, LENGTHS)
    got = A.attention(q, k, v, cu_seqlens(LENGTHS), max(LENGTHS), 0.0)
    rounded = want.float().bfloat16().double()
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2 * (rounded - want).abs().max() + 1e-6


def test_dropout_keeps_one_minus_p_scaled_and_the_backward_uses_the_same_mask() -> None:
    """q = k = 0 makes every probability 1/n; v = the identity then shows each kept probability in the output,
    as 1 / (n (1 - p)), and each dropped one as 0. Over 16 heads x 4 sequences of 128 (1,048,576 probabilities)
    the kept fraction is within 1% of 1 - p. The gradient with respect to v holds the same mask."""
    p, n, heads = 0.1, 128, 16
    lengths = [n] * 4
    q = torch.zeros(sum(lengths), heads, n)
    v = torch.eye(n).repeat(len(lengths), 1).unsqueeze(1).expand(-1, heads, -1).contiguous().requires_grad_()
    torch.manual_seed(0)
    out = A.attention(q, q, v, cu_seqlens(lengths), n, p)
    kept = out > 0
    assert kept.numel() == 1_048_576
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01 * (1 - p)
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (n * (1 - p))))
    (dv,) = torch.autograd.grad(out.sum(), [v])
    # d out[i, j] / d v[j', j] = kept probability of (i, j') / (1 - p): summed over i, the mask's column sums
    dropped_rows = kept.view(len(lengths), n, heads, n).permute(0, 2, 3, 1)  # [seq, head, key j, query i]
    want = dropped_rows.sum(-1).float() / (n * (1 - p))  # [seq, head, key j]
    assert torch.allclose(dv.view(len(lengths), n, heads, n)[..., 0].permute(0, 2, 1), want, atol=1e-5)


def test_dropout_gradients_are_exact_for_the_drawn_mask() -> None:
    """float64 gradcheck with dropout 0.3: every evaluation redraws from the same default-generator state, so
    the numerical and analytical gradients see one mask."""
    lengths = [3, 0, 6, 2]
    q, k, v = qkv(lengths, heads=2, dim=4)
    cu = cu_seqlens(lengths)

    def f(a, b, c):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            return A.attention(a, b, c, cu, max(lengths), 0.3)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)
    assert not torch.equal(f(q, k, v), A.attention(q, k, v, cu, max(lengths), 0.0))  # dropout did something


def test_activation_checkpointing_gives_the_same_gradients_with_dropout() -> None:
    q, k, v = qkv(LENGTHS)
    cu = cu_seqlens(LENGTHS)

    def f(a, b, c):
        return A.attention(a * 1.5, b, c, cu, max(LENGTHS), 0.25) * 2

    torch.manual_seed(3)
    plain = grads(f(q, k, v), [q, k, v])
    torch.manual_seed(3)
    checked = grads(checkpoint(f, q, k, v, use_reentrant=False), [q, k, v])
    assert all(torch.equal(a, b) for a, b in zip(plain, checked))
    torch.manual_seed(4)
    other = grads(f(q, k, v), [q, k, v])
    assert not torch.equal(plain[0], other[0])  # another draw, another mask: the comparison could fail


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_opcheck(dropout_p: float) -> None:
    """torch.library.opcheck: schema, autograd registration, the fake implementation against the real one,
    and AOTAutograd with dynamic shapes, on the operator and on its backward."""
    q, k, v = qkv(LENGTHS, dtype=torch.float32)
    cu = cu_seqlens(LENGTHS)
    torch.library.opcheck(A.varlen_attn, (q, k, v, cu, max(LENGTHS), dropout_p))
    out, lse, rng_state, unused = A.varlen_attn(q, k, v, cu, max(LENGTHS), dropout_p)
    grad = torch.randn_like(out)
    args = (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse, rng_state, unused, cu, max(LENGTHS))
    torch.library.opcheck(A.varlen_attn_backward, (*args, dropout_p))
    assert torch.Tag.nondeterministic_seeded in torch.ops.wikipretrain.varlen_attn.default.tags


@pytest.mark.parametrize("kernel_state", [torch.uint64, torch.int64], ids=["torch>=2.7", "torch<2.7"])
def test_the_cuda_branch_calls_flash_as_its_schema_says(monkeypatch, kernel_state) -> None:
    """On fake CUDA tensors (BF16, 40 tokens in 5 sequences, 4 heads of 64): the forward passes q, k, v,
    cu_seqlens twice, the host maximum twice, dropout_p, not causal, no debug mask and the scale; the backward
    passes the incoming gradient, q, k, v, the forward's output, logsumexp, cu_seqlens, the maxima, dropout_p and
    the forward's rng_state and unused (out as int64, back in the kernel's own dtype: uint64 from torch 2.7,
    int64 before, as a forward returning int64 stands for here), and returns gradients shaped as q, k and v."""
    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(A, "_flash_state_dtype", A._flash_state_dtype)  # the forward sets it: restored after

    def recorded(name: str):
        real = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            out = real(*args, **kwargs)
            if name == "_flash_attention_forward":  # the philox state as this torch's kernel returns it
                out = (*out[:2], *(x.view(kernel_state) for x in out[2:4]), *out[4:])
            return out

        return call

    names = ("_flash_attention_forward", "_flash_attention_backward")
    monkeypatch.setattr(A, "_aten", types.SimpleNamespace(**{n: recorded(n) for n in names}))
    t, heads, dim, longest, p = 40, 4, 64, 17, 0.1
    with FakeTensorMode():
        q, k, v = (torch.empty(t, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.empty(6, dtype=torch.int32, device="cuda")
        out, lse, rng_state, unused = A.varlen_attn(q, k, v, cu, longest, p)
        ctx = types.SimpleNamespace(mark_non_differentiable=lambda *_: None)
        ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
        A._setup_context(ctx, (q, k, v, cu, longest, p), (out, lse, rng_state, unused))
        grad = torch.empty_like(out)
        dq, dk, dv, *rest = A._backward(ctx, grad, None, None, None)
    assert [name for name, _, _ in calls] == list(names)
    (_, fwd, fwd_kw), (_, bwd, bwd_kw) = calls
    assert fwd[0] is q and fwd[1] is k and fwd[2] is v and fwd[3] is cu and fwd[4] is cu
    assert fwd[5:] == (longest, longest, p, False, False) and fwd_kw == {"scale": dim**-0.5}
    assert bwd[0] is grad and bwd[1] is q and bwd[2] is k and bwd[3] is v and bwd[4] is out and bwd[5] is lse
    assert bwd[6] is cu and bwd[7] is cu and bwd[8:12] == (longest, longest, p, False)
    # the philox state goes out as int64 (torch supports few uint64 operations) and back in the kernel's dtype
    assert rng_state.dtype == unused.dtype == torch.int64 and bwd_kw == {"scale": dim**-0.5}
    assert (bwd[12].dtype, bwd[12].shape, bwd[13].dtype, bwd[13].shape) == (kernel_state, (2,), kernel_state, ())
    assert out.shape == (t, heads, dim) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert lse.shape == (heads, t) and lse.dtype == torch.float32
    assert all(g.shape == q.shape and g.dtype == q.dtype and g.device.type == "cuda" for g in (dq, dk, dv))
    assert rest == [None, None, None]  # cu_seqlens, max_seqlen, dropout_p


def test_flash_is_used_where_it_runs() -> None:
    cuda = torch.device("cuda")
    assert A.flash_usable(cuda, torch.bfloat16, 64, capability=(9, 0))
    assert A.flash_usable(cuda, torch.float16, 256, capability=(8, 0))
    assert not A.flash_usable(cuda, torch.bfloat16, 64, capability=(7, 5))  # before Ampere
    assert not A.flash_usable(cuda, torch.float32, 64, capability=(9, 0))
    assert not A.flash_usable(cuda, torch.bfloat16, 264, capability=(9, 0))
    assert not A.flash_usable(cuda, torch.bfloat16, 60, capability=(9, 0))
    assert not A.flash_usable(torch.device("cpu"), torch.bfloat16, 64, capability=(9, 0))


def test_the_schema_check_passes_this_torch_and_2_11_and_refuses_a_changed_schema(monkeypatch) -> None:
    parse = torch._C.parse_schema
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where the schemas fit
        assert A.check_flash_schemas() is None and A.FLASH_SCHEMA_PROBLEM is None  # torch 2.13, installed
        assert A.check_flash_schemas(parse(FORWARD_2_11), parse(BACKWARD_2_11)) is None
        old_names = BACKWARD_2_11.replace("rng_state", "philox_seed").replace("unused", "philox_offset")
        assert A.check_flash_schemas(parse(FORWARD_2_11), parse(old_names)) is None  # the same places and types
    swapped = FORWARD_2_11.replace("float dropout_p, bool is_causal", "bool is_causal, float dropout_p")
    fewer_outputs = BACKWARD_2_11.replace("-> (Tensor, Tensor, Tensor)", "-> (Tensor, Tensor)")
    no_scale = BACKWARD_2_11.replace("*, float? scale=None, ", "*, ")
    for forward, backward in ((swapped, BACKWARD_2_11), (FORWARD_2_11, fewer_outputs), (FORWARD_2_11, no_scale)):
        with pytest.warns(UserWarning, match=rf"^torch {re.escape(torch.__version__)}: the flash variable-length"):
            assert A.check_flash_schemas(parse(forward), parse(backward))
    # a torch whose schemas do not fit: CUDA runs padded
    monkeypatch.setattr(A, "FLASH_SCHEMA_PROBLEM", "changed")
    assert not A.flash_usable(torch.device("cuda"), torch.bfloat16, 64, capability=(9, 0))
    assert unpad.default_kernel("cuda", torch.bfloat16, 64) == "padded"


CUDA = torch.device("cuda")
FLASH_CASES = {  # head size, q/k/v dtype, the batch's row lengths, cu_seqlens' dtype as passed on, message
    "BF16, head size 64": (64, torch.bfloat16, LENGTHS, torch.int32, None),
    "int64 cu_seqlens": (64, torch.bfloat16, LENGTHS, torch.int64, "cu_seqlens is torch.int64, it takes int32"),
    "head size 60": (60, torch.bfloat16, LENGTHS, torch.int32, "head size 60, it takes a multiple of 8"),
    "FP32": (64, torch.float32, LENGTHS, torch.int32, "q/k/v are torch.float32, it takes BF16 or FP16"),
    "zero sequences": (64, torch.bfloat16, [], torch.int32, "cu_seqlens has 1 entries, it takes at least one"),
}


def packed_batch(lengths: list[int], width: int = 20) -> unpad.Packing:
    """``model.unpad.packing`` of a padded ``[len(lengths), width]`` batch whose rows hold ``lengths`` tokens."""
    mask = torch.arange(width) < torch.tensor(lengths, dtype=torch.long).view(-1, 1)
    return unpad.packing(mask.long())


def fake_cuda(mode: FakeTensorMode, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake CUDA copy of ``t`` (shape and dtype, no data, no GPU). Through ``aten._to_copy`` itself:
    ``Tensor.to("cuda")`` initialises CUDA first, which a CPU build of torch refuses even for a fake tensor."""
    return torch.ops.aten._to_copy.default(mode.from_tensor(t), device=CUDA, dtype=dtype)


def fake_cuda_layer(mode: FakeTensorMode, layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``layer`` with fake CUDA parameters of ``dtype`` that need no gradient: autograd on a fake CUDA
    tensor asks for CUDA's device guard, which a CPU build of torch lacks (the process aborts), so the tests below
    call the backward op directly."""
    layer = copy.deepcopy(layer)
    real = [(m, name, p.detach()) for m in layer.modules() for name, p in m._parameters.items() if p is not None]
    with mode:
        for module, name, p in real:
            module._parameters[name] = torch.nn.Parameter(fake_cuda(mode, p, dtype), requires_grad=False)
    return layer


@pytest.fixture(scope="module")
def bert_layers() -> dict[int, torch.nn.Module]:
    """A post-LN BERT layer of 2 heads (``transformers``' BertLayer, as ``model.bert`` builds it) per head size."""
    specs = {h: bert.BertSpec(f"h{h}", 1, 2 * h, 2, 4 * h, vocab_size=64, max_positions=32) for h in (64, 60)}
    return {h: bert.build_hf_bert(spec).bert.encoder.layer[0] for h, spec in specs.items()}


def refused(op: str, message: str) -> str:
    return "^" + re.escape(f"{op} on CUDA (torch's flash kernel): {message}")


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_the_cuda_branch_refuses_what_the_flash_kernel_refuses(case: str, bert_layers, monkeypatch) -> None:
    """On fake CUDA tensors (no GPU): ``model.unpad.packing``'s output and a BERT layer in training mode (dropout
    0.1) as ``model.compile`` runs it whole (``unpad.packed_layer``, kernel varlen) through the operator, and its
    backward op called directly. BF16 at head size 64 runs; each input torch's flash kernel refuses raises this
    module's message from the forward op's fake implementation and from the backward op's, and again where a
    symbolic trace (what torch.compile's AOTAutograd runs) meets the operator. ``packing`` gives int32 and
    ``flash_usable`` (an H100's capability) refuses FP32 and head size 60 before the operator (unpad raises);
    waved through, the operator's own checks refuse them."""
    head, dtype, lengths, cu_dtype, message = FLASH_CASES[case]
    pack = packed_batch(lengths)
    assert pack.cu_seqlens.dtype == torch.int32 and pack.cu_seqlens.numel() == len(lengths) + 1
    cu, t, p = pack.cu_seqlens.to(cu_dtype), pack.indices.numel(), 0.1
    h100 = functools.partial(A.flash_usable, capability=(9, 0))
    usable = h100(CUDA, dtype, head)
    assert usable == (case not in ("head size 60", "FP32"))
    mode = FakeTensorMode()
    layer = fake_cuda_layer(mode, bert_layers[head], dtype)
    assert layer.training and layer.attention.self.dropout.p == p
    with mode, torch.no_grad():
        x = torch.empty(t, 2 * head, device=CUDA, dtype=dtype)
        fields = (fake_cuda(mode, pack.indices), fake_cuda(mode, cu), pack.max_seqlen, pack.batch, pack.seq_len)

        def run_layer(flash_usable) -> torch.Tensor:
            monkeypatch.setattr(A, "flash_usable", flash_usable)
            return unpad.packed_layer(layer, False, x, *fields, "varlen")

        q = torch.empty(t, 2, head, device=CUDA, dtype=dtype)
        lse = torch.empty(2, t, device=CUDA)
        rng_state, unused = (torch.empty(n, device=CUDA, dtype=torch.uint64) for n in ((2,), ()))
        backward = functools.partial(A.varlen_attn_backward, q, q, q, q, q, lse, rng_state, unused, fields[1])
        if message is None:
            out = run_layer(h100)
            assert out.shape == (t, 2 * head) and out.dtype == dtype and out.device.type == "cuda"
            assert all(g.shape == q.shape and g.dtype == dtype for g in backward(pack.max_seqlen, p))
        else:
            if not usable:
                with pytest.raises(ValueError, match=f"not cuda {dtype} head size {head}: use padded$"):
                    run_layer(h100)
            with pytest.raises(RuntimeError, match=refused(A.OP, message)):
                run_layer(lambda *_, **__: True)
            with pytest.raises(RuntimeError, match=refused(A.BACKWARD_OP, message)):
                backward(pack.max_seqlen, p)

    def traced(q: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, cu = (torch.ops.aten._to_copy.default(a, device=CUDA) for a in (q, cu))
        return A.attention(q, q, q, cu, pack.max_seqlen, p)

    trace = functools.partial(make_fx(traced, tracing_mode="symbolic"), torch.zeros(t, 2, head, dtype=dtype), cu)
    if message is None:
        graph = trace()
        assert [n.target for n in graph.graph.nodes].count(torch.ops.wikipretrain.varlen_attn.default) == 1
    else:
        with pytest.raises(RuntimeError, match=refused(A.OP, message)):
            trace()


def installed_schemas() -> tuple[str, str]:
    """The installed torch's (2.13 here) flash schemas, as text."""
    ops = torch.ops.aten
    return str(ops._flash_attention_forward.default._schema), str(ops._flash_attention_backward.default._schema)


def test_the_schema_check_reads_names_and_keeps_former_ones() -> None:
    """Torch 2.11's and the installed torch's schemas fit; so do the names before torch 2.7 (``philox_seed``,
    ``philox_offset``: forward outputs and backward arguments) and forward outputs left unnamed (count and
    type)."""
    parse = torch._C.parse_schema
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where the schemas fit
        for forward, backward in ((FORWARD_2_11, BACKWARD_2_11), installed_schemas()):
            assert A.check_flash_schemas(parse(forward), parse(backward)) is None
            former = [
                s.replace("rng_state", "philox_seed").replace("unused", "philox_offset") for s in (forward, backward)
            ]
            assert "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)" in former[0]
            assert "Tensor philox_seed, Tensor philox_offset, *" in former[1]
            assert A.check_flash_schemas(parse(former[0]), parse(former[1])) is None
            unnamed = re.sub(r"-> \(.*\)$", "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", forward)
            assert unnamed != forward and A.check_flash_schemas(parse(unnamed), parse(backward)) is None


SCHEMA_MUTATIONS = {  # op, text, its replacement, the problem line
    "swapped forward outputs": (
        "forward",
        "Tensor softmax_logsumexp, Tensor rng_state",
        "Tensor rng_state, Tensor softmax_logsumexp",
        "aten::_flash_attention_forward output 1 is rng_state: Tensor where softmax_logsumexp: Tensor was expected",
    ),
    "a new required keyword-only argument": (
        "forward",
        "*, float? scale=None,",
        "*, bool deterministic, float? scale=None,",
        "aten::_flash_attention_forward requires keyword arguments that are not passed: ['deterministic']",
    ),
    "a renamed positional argument": (
        "backward",
        "Tensor out, Tensor logsumexp,",
        "Tensor out, Tensor softmax_lse,",
        "aten::_flash_attention_backward argument 5 is softmax_lse: Tensor where logsumexp: Tensor was expected",
    ),
}


@pytest.mark.parametrize("base", ["2.11", "installed"])
@pytest.mark.parametrize("mutation", list(SCHEMA_MUTATIONS))
def test_the_schema_check_names_what_a_changed_schema_changes(mutation: str, base: str) -> None:
    """Each mutation of a schema that fits turns the flash branch off with one warning, its line naming what
    differs: the place and both names."""
    forward, backward = (FORWARD_2_11, BACKWARD_2_11) if base == "2.11" else installed_schemas()
    schemas = {"forward": forward, "backward": backward}
    op, text, replacement, problem = SCHEMA_MUTATIONS[mutation]
    assert schemas[op].count(text) == 1
    schemas[op] = schemas[op].replace(text, replacement)
    parse = torch._C.parse_schema
    with pytest.warns(UserWarning) as caught:
        assert A.check_flash_schemas(parse(schemas["forward"]), parse(schemas["backward"])) == problem
    assert [str(w.message) for w in caught] == [
        f"torch {torch.__version__}: the flash variable-length attention is off, CUDA BERT attention runs the "
        f"padded kernel ({problem})"
    ]
