"""GPT-NeoX's chunked LM loss (``model.losses``) and its mask-free backbone call (``NeoxPretraining``).

Accuracy is judged against a float64 run: ours may be no further from it than twice the distance of the full-
logits path it replaces (``logits.float()`` then ``F.cross_entropy``), loss and every parameter's gradient.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPTNeoXForCausalLM

from model.build import build_model
from model.losses import ChunkedLossHead, linear_cross_entropy
from model.neox import hf_config
from model.registry import get_spec


def _full_logits_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The replaced path: transformers' logits, in FP32 (FP64 in an FP64 run), then ``F.cross_entropy``."""
    logits = model.hf(input_ids=ids[:, :-1], use_cache=False).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _ids(spec, batch: int, window: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (batch, window), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ accuracy


def test_loss_and_every_gradient_as_close_to_float64_as_the_full_logits_path():
    """neox-debug (its 50432-row vocabulary), 66 targets in chunks of 24: three chunks, the last one short."""
    torch.manual_seed(0)
    spec = get_spec("neox-debug")
    ours = build_model(spec)
    ours.hf.get_output_embeddings().chunk_tokens = 24
    ids = _ids(spec, 2, 34)
    exact = copy.deepcopy(ours).double()
    loss64, grads64 = _loss_and_grads(exact, lambda m: _full_logits_loss(m, ids))
    loss_full, grads_full = _loss_and_grads(ours, lambda m: _full_logits_loss(m, ids))
    loss_ours, grads_ours = _loss_and_grads(ours, lambda m: m(input_ids=ids)["loss"])

    assert ours(input_ids=ids)["loss"].dtype == torch.float32
    # A scalar FP32 result is only as close as its last bit: the loss's floor is one FP32 ulp at its value.
    ulp = torch.finfo(torch.float32).eps * loss64.abs()
    assert (loss_ours - loss64).abs() <= max(2 * (loss_full - loss64).abs(), ulp)
    total = torch.sqrt(sum((g**2).sum() for g in grads64.values()))
    ratios = {}
    for name, g64 in grads64.items():
        scale = torch.maximum(g64.norm(), 1e-3 * total)  # the floor, for tensors that are zero in exact arithmetic
        err_full = (grads_full[name] - g64).norm() / scale
        err_ours = (grads_ours[name] - g64).norm() / scale
        ratios[name] = float(err_ours / err_full)
        assert err_ours <= 2 * err_full, (name, float(err_ours), float(err_full))
    assert len(ratios) == len(list(ours.parameters()))


def test_linear_cross_entropy_ignores_targets_as_cross_entropy_does():
    """Bias, ignored targets (-100) and a token count not divisible by the chunk; all-ignored gives NaN."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    t[::3] = -100
    ref = F.cross_entropy(F.linear(h, w, b), t)
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    ours = linear_cross_entropy(h, w, t, b, chunk_tokens=8)
    grads = torch.autograd.grad(ours, (h, w, b))
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    none = torch.full_like(t, -100)
    assert torch.isnan(linear_cross_entropy(h, w, none, b, chunk_tokens=8))
    assert torch.isnan(F.cross_entropy(F.linear(h, w, b), none))
    # with_correct: the counted targets whose logit is the largest, as argmax of the whole logits says
    hit = F.linear(h, w, b).argmax(-1)
    t[1::3] = hit[1::3]  # a third predicted, a third ignored, a third drawn at random
    loss, correct = linear_cross_entropy(h, w, t, b, chunk_tokens=8, with_correct=True)
    assert int(correct) == int(((hit == t) & (t != -100)).sum()) >= 12 and not correct.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w, b), t), rtol=1e-12, atol=1e-12)
    # none_is_zero: the same loss where a target counts; with none, 0 and zero gradients (not NaN)
    same = linear_cross_entropy(h, w, t, b, chunk_tokens=8, none_is_zero=True)
    torch.testing.assert_close(same, loss, rtol=0, atol=0)
    zero = linear_cross_entropy(h, w, none, b, chunk_tokens=8, none_is_zero=True)
    assert zero.item() == 0 and all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(zero, (h, w, b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loss_in_fp32_and_the_loss_scale_applied_in_fp32(dtype):
    """BF16/FP16 compute, FP32 log-sum-exp and accumulators; FP16's loss scale (65536) and the mean are applied
    in FP32 to the accumulated gradients: they agree with the FP32 head's, and no weight row's underflows."""
    g = torch.Generator().manual_seed(0)
    h32 = torch.randn(64, 32, generator=g)
    w32 = torch.randn(2048, 32, generator=g) * 0.05
    t = torch.randint(0, 2048, (64,), generator=g)
    h, w = h32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
    loss = linear_cross_entropy(h, w, t, chunk_tokens=24)
    assert loss.dtype == torch.float32
    (loss * 65536).backward()
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(hr, wr), t)
    (ref * 65536).backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=0)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    for got, want in ((h.grad, hr.grad), (w.grad, wr.grad)):
        assert (got.float() - want).norm() <= 2e-2 * want.norm()
    # Every weight row gets a gradient (the softmax of each token); none underflowed to zero.
    assert (w.grad.float().abs().sum(1) > 0).all()


# ------------------------------------------------------------------------------------- memory, export


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an operator returns with a ``vocab``-long dimension and no ``hidden``-long
    one (logits and their relatives, not the [vocab, hidden] weight and its gradient)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape and self.hidden not in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_in_forward_or_backward():
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=4096)
    ours = build_model(spec)
    ours.hf.get_output_embeddings().chunk_tokens = 50
    ids = _ids(spec, 2, 101)  # 200 targets
    tokens, vocab = 200, spec.padded_vocab
    with _LargestLogits(vocab, spec.hidden) as seen:
        ours(input_ids=ids)["loss"].backward()
    assert seen.largest == 50 * vocab  # one chunk's logits at a time
    with _LargestLogits(vocab, spec.hidden) as full:  # the check sees the full logits where they exist
        _full_logits_loss(ours, ids).backward()
    assert full.largest == tokens * vocab


def test_parameters_names_and_export_are_transformers_own(tmp_path):
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    ours = build_model(spec)
    reference = GPTNeoXForCausalLM(hf_config(spec))
    assert list(ours.state_dict()) == [f"hf.{k}" for k in reference.state_dict()]
    assert isinstance(ours.hf.get_output_embeddings(), ChunkedLossHead)
    ours.hf.save_pretrained(str(tmp_path))
    loaded = GPTNeoXForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(loaded.get_output_embeddings()) is nn.Linear
    ids = _ids(spec, 2, 17)
    torch.testing.assert_close(loaded(input_ids=ids).logits, ours.eval().hf(input_ids=ids).logits)


def test_zero3_style_partitioned_head_is_gathered_by_its_own_hooks():
    """DeepSpeed ZeRO-3 keeps a parameter's data empty except between its module's forward pre-hook and forward
    hook, and again from the module's backward on (a hook on the module's outputs). The loss runs inside the
    head's call, so it works under exactly those hooks (it reads the weight only there) and gives the
    unpartitioned loss and gradients; a loss that read the weight outside the head's call would find it empty."""
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    plain = build_model(spec)
    plain.hf.get_output_embeddings().chunk_tokens = 16
    parted = copy.deepcopy(plain)
    head = parted.hf.get_output_embeddings()
    whole = head.weight.data
    events = Counter()

    def gather(*_):
        events["gather"] += 1
        head.weight.data = whole

    def release():
        head.weight.data = torch.empty(0)

    def after_forward(module, args, out):
        release()
        out.register_hook(lambda grad: gather())  # DeepSpeed's pre-backward gather
        return out

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(after_forward)
    release()
    ids = _ids(spec, 2, 41)
    loss_plain, grads_plain = _loss_and_grads(plain, lambda m: m(input_ids=ids)["loss"])
    loss_parted, grads_parted = _loss_and_grads(parted, lambda m: m(input_ids=ids)["loss"])
    assert events["gather"] == 2
    torch.testing.assert_close(loss_parted, loss_plain, rtol=0, atol=0)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_parted[name], g, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------ backbone, no mask probe


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_backbone_equals_transformers_and_is_causal(attention):
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    ours = build_model(spec, attention=attention).eval()
    reference = GPTNeoXForCausalLM(hf_config(spec, attention)).eval()
    reference.load_state_dict(ours.hf.state_dict())
    ids = _ids(spec, 2, 33)
    hidden = ours.hidden_states(ids)
    torch.testing.assert_close(ours.hf.get_output_embeddings()(hidden), reference(input_ids=ids).logits)
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 512
    torch.testing.assert_close(ours.hidden_states(changed)[:, :20], hidden[:, :20], rtol=0, atol=0)
    assert not torch.equal(ours.hidden_states(changed)[:, 20:], hidden[:, 20:])


_HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """Counts calls of transformers' packed-sequence probe and Python-level reads of tensor values (what would
    be a host synchronisation on a GPU); start counting with ``counts["on"] = 1``."""
    import transformers.masking_utils as masking

    counts: Counter = Counter()
    probe = masking.find_packed_sequence_indices

    def counted_probe(*args, **kwargs):
        counts["probe"] += 1
        return probe(*args, **kwargs)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", counted_probe)
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if counts["on"]:
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_packed_sequence_probe_nor_host_read_in_a_training_step(host_reads, attention):
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    ours = build_model(spec, attention=attention)
    ours.hf.get_output_embeddings().chunk_tokens = 16
    ids = _ids(spec, 2, 41)
    host_reads["on"] = 1
    out = ours(input_ids=ids)
    out["loss"].backward()
    host_reads["on"] = 0
    assert set(host_reads) == {"on"}, host_reads
    # The counters see transformers' own forward probe and read: its `if` on the packed-sequence tensor.
    reference = GPTNeoXForCausalLM(hf_config(spec, attention))
    host_reads["on"] = 1
    reference(input_ids=ids[:, :-1])
    host_reads["on"] = 0
    assert host_reads["probe"] == 1 and host_reads["__bool__"] >= 1


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients():
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    plain = build_model(spec)
    ckpt = build_model(spec, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    calls = Counter()
    for key, model in (("plain", plain), ("ckpt", ckpt)):
        model.hf.gpt_neox.layers[0].attention.register_forward_hook(lambda *_, k=key: calls.update([k]))
    ids = _ids(spec, 2, 33)
    _, grads_plain = _loss_and_grads(plain, lambda m: m(input_ids=ids)["loss"])
    _, grads_ckpt = _loss_and_grads(ckpt, lambda m: m(input_ids=ids)["loss"])
    assert (calls["plain"], calls["ckpt"]) == (1, 2)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-5, atol=1e-8, msg=name)
