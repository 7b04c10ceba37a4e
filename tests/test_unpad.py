"""Unpadded BERT (``model.unpad``): the loader's unpadding keys, and the unpadded forward/backward against the
padded one, both measured against a float64 run of the padded model on real shards."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from data.loader import PretrainingLoader, _unpack, unpadding_index
from model import unpad
from model.bert import BertSpec
from model.build import build_model
from model.flops import _layer_and_head_params, training_flops_of_lengths, training_flops_per_token
from model.registry import get_spec
from tests.conftest import data_bert, run_python

BATCH_KEYS = {
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "masked_lm_positions",
    "masked_lm_ids",
    "masked_lm_weights",
    "next_sentence_labels",
    "min_seqlen",
}
FP32_EPS = 2.0**-23  # a relative error below FP32's rounding counts as that rounding


@pytest.fixture(scope="module")
def shards(wiki_text_dir: Path, wiki_vocab: Path, tmp_path_factory) -> Path:
    """Seq-128 BERT shards of the enwiki sample (``python -m data bert``, as the loader tests build them)."""
    out = tmp_path_factory.mktemp("unpad") / "bert"
    cmd = data_bert(wiki_text_dir, wiki_vocab, out, "--dupe-factor", "1", "--seed", "5", "--no-progress")
    p = run_python(cmd, timeout=600)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def batch(shards: Path) -> dict[str, torch.Tensor]:
    """A real micro-batch of 8 with at least three padded rows of different lengths (the first such of the
    loader's order), with the loader's unpadding keys."""
    ld = PretrainingLoader(
        shards, "bert", micro_batch=8, grad_accum=1, dp_rank=0, dp_world=1, num_workers=0, unpad=True
    )
    for _, b in zip(range(200), ld):
        lengths = b["attention_mask"].sum(1)
        if len(set(lengths[lengths < 128].tolist())) >= 3:
            return b
    raise AssertionError("no micro-batch with three padded lengths in the first 200")


def _spec(pre_layernorm: bool) -> BertSpec:
    """bert-debug (post-LN BertForPreTraining) or a pre-LN (MegatronBert) of the same tiny shape; no dropout."""
    spec = get_spec("bert-debug", dropout=0.0, pre_layernorm=pre_layernorm, vocab_size=8000)
    assert isinstance(spec, BertSpec)
    return spec


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch)["loss"]
    loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), grads


def _errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor relative error; tensors near zero in exact arithmetic (an attention key's bias) are measured
    against 1e-3 x the whole gradient's norm instead of their own."""
    floor = 1e-3 * torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.values()])).item()
    assert set(grads) == set(ref)
    return {n: ((grads[n] - r).norm() / max(r.norm().item(), floor)).item() for n, r in ref.items()}


def _unpadding_keys_of(lengths: list[int], seq: int) -> dict[str, torch.Tensor]:
    """Pack rows with these real lengths the way the shards store them, and collate them with ``unpad``."""
    b, pred = len(lengths), 4
    ids = torch.zeros(b, seq, dtype=torch.int32)
    mask = torch.zeros(b, seq, dtype=torch.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1)
        mask[i, :n] = 1
    positions = torch.tensor([[1, 2, 0, 0]] * b, dtype=torch.int32)
    packed = torch.cat(
        [ids, mask, torch.zeros(b, seq, dtype=torch.int32), positions, positions, torch.zeros(b, 1, dtype=torch.int32)],
        1,
    )
    return _unpack("bert", packed, [seq, seq, seq, pred, pred, 1], unpad=True)


def test_collate_builds_the_unpadding_index():
    lengths, seq = [5, 8, 3, 8, 1], 8
    got = _unpadding_keys_of(lengths, seq)
    assert set(got) == BATCH_KEYS | set(unpad.UNPAD_KEYS)
    expected_indices = [r * seq + p for r, n in enumerate(lengths) for p in range(n)]
    assert got["unpad_indices"].dtype == torch.long and got["unpad_indices"].tolist() == expected_indices
    assert got["cu_seqlens"].dtype == torch.int32 and got["cu_seqlens"].tolist() == [0, 5, 13, 16, 24, 25]
    assert got["max_seqlen"].shape == () and got["max_seqlen"].device.type == "cpu" and int(got["max_seqlen"]) == 8
    assert int(got["min_seqlen"]) == 1
    assert torch.equal(
        got["input_ids"].reshape(-1)[got["unpad_indices"]], torch.cat([torch.arange(1, n + 1) for n in lengths])
    )
    # without the switch the micro-batch is unchanged
    plain = _unpack("bert", torch.zeros(2, 3 * seq + 9, dtype=torch.int32), [seq, seq, seq, 4, 4, 1])
    assert set(plain) == BATCH_KEYS


def test_loader_adds_the_keys_only_when_asked(shards: Path, batch: dict[str, torch.Tensor]):
    assert set(batch) == BATCH_KEYS | set(unpad.UNPAD_KEYS)
    index = unpadding_index(batch["attention_mask"])
    assert all(torch.equal(batch[k], index[k]) for k in unpad.UNPAD_KEYS)
    lengths = batch["attention_mask"].sum(1)
    assert batch["cu_seqlens"].diff().tolist() == lengths.tolist() and int(batch["max_seqlen"]) == lengths.max()
    ld = PretrainingLoader(shards, "bert", micro_batch=8, grad_accum=1, dp_rank=0, dp_world=1, num_workers=0)
    assert set(next(iter(ld))) == BATCH_KEYS


def test_packing_never_reads_a_device_max_seqlen():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    keys = unpadding_index(mask)
    assert unpad.packing(mask, **keys).max_seqlen == 3
    assert unpad.packing(mask, keys["unpad_indices"], keys["cu_seqlens"], 3).max_seqlen == 3
    on_device = torch.empty((), dtype=torch.long, device="meta")  # stands for a tensor already on the GPU
    assert unpad.packing(mask, keys["unpad_indices"], keys["cu_seqlens"], on_device).max_seqlen == 4  # width S
    assert unpad.packing(mask).max_seqlen == 3


@pytest.mark.parametrize("pre_layernorm", [False, True], ids=["post-ln", "pre-ln"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "ckpt"])
def test_unpadded_is_as_close_to_float64_as_padded(batch, pre_layernorm, checkpointing):
    """FP32 loss and every gradient of the unpadded model are no further from a float64 padded run than twice
    the padded FP32 run's distance (per tensor; a gradient's distance below 4 FP32 roundings counts as 4).

    The batch's NSP labels are all one class. With mixed labels at chance level, the NSP bias's gradient (the
    batch mean of p - label) nearly cancels, so its relative error is a few roundings of the [CLS] states
    amplified ~100x: one noise sample per path, which a 2x comparison turns into a coin flip (seen: from 0.3x
    to 3.8x, median 0.55x). With one class, no tensor went past 1.6x over the 64 real batches tried.
    """
    batch = {**batch, "next_sentence_labels": torch.ones_like(batch["next_sentence_labels"])}
    spec = _spec(pre_layernorm)
    torch.manual_seed(0)
    model = build_model(spec, activation_checkpointing=checkpointing).train()
    padded = build_model(spec, activation_checkpointing=checkpointing, unpad=False).train()
    padded.load_state_dict(model.state_dict())  # the same weights, the padded forward
    ref_model = copy.deepcopy(padded).double()
    loss64, grads64 = _run(ref_model, batch)

    calls: list[int] = []
    hooks = [
        m.hf.bert.encoder.layer[0].intermediate.dense.register_forward_hook(lambda *_: calls.append(1))
        for m in (padded, model)
    ]
    loss_pad, grads_pad = _run(padded, batch)
    loss_unpad, grads_unpad = _run(model, batch)
    for hook in hooks:
        hook.remove()
    assert len(calls) == (4 if checkpointing else 2)  # checkpointing recomputes the layer in both paths

    assert abs(loss_unpad - loss64) <= 2 * max(abs(loss_pad - loss64), FP32_EPS * abs(loss64)), (
        loss_unpad,
        loss_pad,
        loss64,
    )
    err_pad, err_unpad = _errors(grads_pad, grads64), _errors(grads_unpad, grads64)
    # a floor of 4 roundings: a tensor whose padded error is 1 rounding may take 2.2 unpadded, and the order of
    # OpenMP's sums can change from run to run (seen in CI: query.bias, pre-LN, 2.6e-7 against 1.2e-7)
    floor = 4 * FP32_EPS
    worse = {n: (err_unpad[n], err_pad[n]) for n in err_pad if err_unpad[n] > 2 * max(err_pad[n], floor)}
    assert not worse, worse
    assert max(err_unpad.values()) < 1e-4


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_unpadded_without_the_keys_and_with_each_kernel(batch):
    """The model computes the keys itself when a caller gives none; the three varlen kernels (the varlen
    operator's CPU branch, the padded fallback, jagged nested tensors) agree."""
    torch.manual_seed(0)
    model = build_model(_spec(False), unpad=True).double().train()
    bare = {k: v for k, v in batch.items() if k not in unpad.UNPAD_KEYS}
    loss, grads = _run(model, batch)
    loss_bare, grads_bare = _run(model, bare)
    assert loss_bare == loss and all(torch.equal(grads[n], grads_bare[n]) for n in grads)
    assert unpad.default_kernel(torch.device("cpu")) == "varlen"
    assert unpad.default_kernel(torch.device("cuda")) == "padded"  # flash unknown without a dtype and head size
    for kernel in unpad.KERNELS:
        other = build_model(_spec(False), unpad=True, unpad_kernel=kernel).double().train()
        other.load_state_dict(model.state_dict())
        loss_k, grads_k = _run(other, batch)
        assert abs(loss_k - loss) < 1e-12 * abs(loss), kernel
        assert max(_errors(grads_k, grads).values()) < 1e-10, kernel


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_attention_dropout_follows_the_config(batch, monkeypatch):
    spec = get_spec("bert-debug", dropout=0.25, vocab_size=8000)
    model = build_model(spec, unpad=True)
    seen: list[float] = []
    real = unpad.varlen_attention

    def spy(q, k, v, pack, dropout_p, kernel=None):
        seen.append(dropout_p)
        return real(q, k, v, pack, dropout_p, kernel)

    monkeypatch.setattr(unpad, "varlen_attention", spy)
    torch.manual_seed(1)
    a = model.train()(**batch)["loss"]
    b = model(**batch)["loss"]
    assert seen == [0.25] * spec.layers * 2 and a != b  # dropout on, and drawn anew
    seen.clear()
    with torch.no_grad():
        c, d = model.eval()(**batch)["loss"], model(**batch)["loss"]
    assert seen == [0.0] * spec.layers * 2 and c == d
    # both kernels drop attention probabilities: the output moves when p > 0
    mask = batch["attention_mask"]
    pack = unpad.packing(mask)
    q, k, v = (torch.randn(int(mask.sum()), 2, 16) for _ in range(3))
    for kernel in unpad.KERNELS:
        assert not torch.allclose(real(q, k, v, pack, 0.5, kernel), real(q, k, v, pack, 0.0, kernel))


def test_flops_of_known_lengths():
    """6 x matmul weights x real tokens + 12 L d sum(n^2) + the heads per sequence, exactly."""
    spec, max_pred, lengths = get_spec("bert-debug"), 20, [128, 100, 37, 5]
    h, f, v, L = spec.hidden, spec.ffn, spec.padded_vocab, spec.layers
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h  # q k v o, FFN, two LayerNorms
    layers = L * layer + 2 * h  # + the embeddings' LayerNorm
    pred_head = (h * h + h) + 2 * h + v * h + v  # transform, its LayerNorm, tied decoder and its bias
    seq_head = (h * h + h) + (2 * h + 2)  # pooler, NSP classifier
    assert _layer_and_head_params(spec) == (layers, pred_head, seq_head)
    tokens, squares = sum(lengths), sum(n * n for n in lengths)
    expected = 6 * (layers * tokens + len(lengths) * (pred_head * max_pred + seq_head)) + 12 * L * h * squares
    assert training_flops_of_lengths(spec, lengths, max_pred) == expected == 2_626_894_896
    full = training_flops_of_lengths(spec, [128] * 4, max_pred)
    assert full == pytest.approx(4 * 128 * training_flops_per_token(spec, 128, max_pred), rel=1e-15)


def test_the_manifest_records_the_real_tokens(shards: Path) -> None:
    """``python -m data bert`` records each shard's real tokens and their lengths squared (``launch report``
    projects an unpadded recipe with them): they equal the sums over the shards' own input masks."""
    import json

    import h5py
    import numpy as np

    manifest = json.loads((shards / "manifest.json").read_text())
    real = squares = rows = 0
    for rec in manifest["shards"]:
        with h5py.File(shards / rec["file"]) as f:
            n = np.asarray(f["input_mask"]).sum(1, dtype=np.int64)
        assert (rec["real_tokens"], rec["real_tokens_squared"]) == (int(n.sum()), int((n * n).sum()))
        real, squares, rows = real + int(n.sum()), squares + int((n * n).sum()), rows + len(n)
    totals = manifest["totals"]
    assert (totals["real_tokens"], totals["real_tokens_squared"], totals["instances"]) == (real, squares, rows)
    assert 0 < real < rows * 128  # the sample pads some rows


def test_a_run_counts_the_positions_its_model_computes():
    """The counting convention (``model.flops.WorkCounter``, ``training.metrics``): a micro-batch of known
    lengths gives exactly these tokens and FLOPs, from its unpadding keys or from its mask alone; the padded path
    counts every position at ``training_flops_per_token``; a packed GPT window has no padding. Throughput and
    MFU are then those counts over the window's seconds."""
    from model.flops import NO_WORK, Work, WorkCounter
    from training.metrics import flops_per_sec_per_device, mfu, throughput

    spec, max_pred, lengths = get_spec("bert-debug"), 20, [128, 100, 37, 5]
    mask = (torch.arange(128) < torch.tensor(lengths).unsqueeze(1)).long()
    exact = 2_626_894_896  # test_flops_of_known_lengths: 6 N x 270 tokens + heads + 12 L d sum(n^2)
    unpadded = WorkCounter(spec, 128, max_pred, unpadded=True)
    keyed = {"attention_mask": mask, **unpadding_index(mask)}
    assert unpadded(keyed) == unpadded({"attention_mask": mask}) == Work(512, 270, 270, exact)
    padded = WorkCounter(spec, 128, max_pred, unpadded=False)
    full = training_flops_of_lengths(spec, [128] * 4, max_pred)
    assert padded(keyed) == Work(512, 270, 512, full)
    assert full == pytest.approx(512 * training_flops_per_token(spec, 128, max_pred), rel=1e-15)
    neox = WorkCounter(get_spec("neox-debug"), 64, None, unpadded=False)
    assert neox({"input_ids": torch.zeros(3, 64, dtype=torch.long)}) == Work(
        192, 192, 192, 192 * int(training_flops_per_token(get_spec("neox-debug"), 64))
    )
    step = NO_WORK + unpadded(keyed) + unpadded(keyed)
    assert step == Work(1024, 540, 540, 2 * exact) and step.padding_fraction == 1 - 540 / 1024
    tp = throughput(8, step.computed, 2.0, 2)  # 8 sequences, 540 tokens in 2 s on 2 devices
    assert (tp.sequences_per_sec, tp.tokens_per_sec, tp.tokens_per_sec_per_device) == (4.0, 270.0, 135.0)
    achieved = flops_per_sec_per_device(step.flops, 2.0, 2)
    assert achieved == 2 * exact / 4 and mfu(achieved, 4 * achieved) == 0.25


def test_jagged_tensors_survive_activation_checkpointing():
    """The jagged kernel's nested tensors share the offsets made once per forward: a checkpointed layer's
    recomputation then has the same ragged size as the forward, which checkpointing checks (CUDA's path; on CPU
    the jagged SDPA itself falls back to strided nested tensors, which checkpointing cannot hold)."""
    pack = unpad.packing(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]))
    x = torch.randn(10, 2, 8, dtype=torch.float64, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(unpad.nested(x * 2, pack).transpose(1, 2)).transpose(1, 2).values()

    nt = unpad.nested(x, pack)
    assert (nt._maybe_min_seqlen, nt._maybe_max_seqlen) == (2, 5)  # given: SDPA reads no device value
    checkpoint(layer, x, use_reentrant=False).pow(2).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 4 * torch.sin(2 * x) * torch.cos(2 * x))


def test_qkv_is_one_matmul_over_the_same_parameters(batch):
    """The three projections run as one matmul over their stacked weights (their modules are not called), with
    the parameters and their names unchanged; where the weights are ZeRO-3 partitions (``ds_id``: only their
    own modules' hooks gather them) each module is called as before. Both give the same loss and gradients."""
    torch.manual_seed(0)
    model = build_model(_spec(False), unpad=True).double().train()
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("attention.self.query.weight") for n in names)
    called: list[str] = []
    projections = [m for n, m in model.named_modules() if n.endswith(("self.query", "self.key", "self.value"))]
    for m in projections:
        m.register_forward_hook(lambda mod, args, out: called.append("call"))
    fused_loss, fused_grads = _run(model, batch)
    assert called == []  # one matmul: no projection module ran
    for m in projections:
        m.weight.ds_id = 0  # as a ZeRO-3 partition is marked
    try:
        loss, grads = _run(model, batch)
    finally:
        for m in projections:
            del m.weight.ds_id
    assert len(called) == len(projections) == 3 * model.spec.layers
    assert abs(fused_loss - loss) < 1e-12 * abs(loss)
    assert max(_errors(fused_grads, grads).values()) < 1e-10
    assert [n for n, _ in model.named_parameters()] == names


def test_varlen_asked_where_it_cannot_run_is_refused_at_the_start_in_one_line() -> None:
    """``model.unpad_attention=varlen`` on CUDA in FP32, or with a head size flash does not take, is refused as
    the engine is built (one line naming the setting and what would run), not by a traceback at the first
    forward; on the CPU, and for the other kernels, nothing is refused."""
    from common.errors import UserError
    from training.build import check_unpad_kernel

    spec = get_spec("bert-debug")
    fp32, bf16 = torch.float32, torch.bfloat16
    with pytest.raises(UserError, match=r"^model.unpad_attention=varlen: .* not cuda torch.float32 .*: use padded$"):
        check_unpad_kernel("varlen", "cuda", fp32, spec)
    odd = BertSpec(**{**spec.__dict__, "hidden": 60 * spec.heads})
    with pytest.raises(UserError, match=r"head size 60: use padded$"):
        check_unpad_kernel("varlen", "cuda", bf16, odd)
    check_unpad_kernel("varlen", "cpu", fp32, spec)
    for kernel in (None, "padded", "jagged"):
        check_unpad_kernel(kernel, "cuda", fp32, spec)
