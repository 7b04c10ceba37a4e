"""Compiled transformer blocks (``model.compile``), in process on CPU: as close to a float64 eager run as eager
FP32 is, one compilation for every length under unpadding, names unchanged, and eager after a failed compile,
without changing a checkpointed micro-batch's gradients. ZeRO-2 and ZeRO-3 under compile belong to the GPU
tier."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from data.loader import unpadding_index
from model import compile as mc
from model import unpad
from model.build import build_model
from model.registry import get_spec
from tests.test_unpad import FP32_EPS, _errors, _run, _spec, batch, shards  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:.*TensorFloat32.*")


def _neox_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(1))}


@pytest.mark.parametrize("family", ["bert", "bert-pre-ln", "neox"])
def test_compiled_is_as_close_to_float64_as_eager(batch, family):  # noqa: F811
    """With dropout 0, the compiled FP32 loss is no further from the float64 eager loss than twice the eager FP32
    loss's distance (below FP32 rounding counts as FP32 rounding); its gradients stay within 1e-4."""
    torch._dynamo.reset()
    if family == "neox":
        spec, data = get_spec("neox-debug", vocab_size=512), _neox_batch()
    else:
        spec = _spec(pre_layernorm=family == "bert-pre-ln")
        data = {**batch, "next_sentence_labels": torch.ones_like(batch["next_sentence_labels"])}
    torch.manual_seed(0)
    eager = build_model(spec).train()
    ref = copy.deepcopy(eager).double()
    compiled = copy.deepcopy(eager)
    names = list(compiled.state_dict())
    done = mc.compile_blocks(compiled)
    assert done.modules == len(mc.compiled_modules(compiled)) > 0
    assert list(compiled.state_dict()) == names  # checkpoints and the export see the same names

    loss64, grads64 = _run(ref, data)
    loss32, _ = _run(eager, data)
    loss_c, grads_c = _run(compiled, data)
    assert done.failed is None
    assert abs(loss_c - loss64) <= 2 * max(abs(loss32 - loss64), FP32_EPS * abs(loss64)), (loss_c, loss32, loss64)
    assert max(_errors(grads_c, grads64).values()) < 1e-4


def test_unpadded_lengths_do_not_recompile(batch):  # noqa: F811
    """Micro-batches with other real lengths (another token count for the packed rows) reuse the compiled
    graphs: TorchDynamo's count of compiled graphs stays the same after the first step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(_spec(pre_layernorm=False)).train()
    done = mc.compile_blocks(model)
    mask = batch["attention_mask"]
    counts = []
    for cut in (128, 100, 77, 64, 31):  # rows cut at another width: other lengths, another token count
        trimmed = {**batch, "attention_mask": mask * (torch.arange(mask.size(1)) < cut)}
        trimmed.pop("unpad_indices", None), trimmed.pop("cu_seqlens", None), trimmed.pop("max_seqlen", None)
        _run(model, trimmed)
        counts.append(mc.compile_count())
    assert counts[0] > 0 and counts[1:] == [counts[0]] * 4, counts
    assert done.failed is None


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "ckpt"])
def test_whole_layers_compile_once_for_every_micro_batch(batch, checkpointing):  # noqa: F811
    """Unpadded BERT's layers compile whole, attention (one operator) included: six micro-batches that differ in
    token count, longest row and number of rows, trained with dropout, give as many graphs after the second as
    after the sixth, with no graph break; eager where activation checkpointing recomputes the layers too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    spec = get_spec("bert-debug", dropout=0.1, vocab_size=8000)
    model = build_model(spec, unpad=True, activation_checkpointing=checkpointing).train()
    done = mc.compile_blocks(model)
    assert done.modules == spec.layers and mc.whole_layers(model)
    mask = batch["attention_mask"]
    counts = []
    for rows, cut in ((8, 128), (5, 100), (8, 77), (3, 64), (6, 31), (2, 128)):
        trimmed = {k: v[:rows] for k, v in batch.items() if k not in unpad.UNPAD_KEYS and k != "min_seqlen"}
        trimmed["attention_mask"] = mask[:rows] * (torch.arange(mask.size(1)) < cut)
        trimmed.update(unpadding_index(trimmed["attention_mask"]))
        loss = model(**trimmed)["loss"]
        loss.backward()
        assert torch.isfinite(loss)
        counts.append(mc.compile_count())
    assert counts[0] > 0 and counts[1] == counts[5], counts
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert done.failed is None


def test_a_failed_compile_warns_once_and_runs_eager(batch, caplog):  # noqa: F811
    """A backend that fails: one warning for the whole model, every block eager, the eager loss."""
    torch._dynamo.reset()

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    torch.manual_seed(0)
    model = build_model(_spec(pre_layernorm=False)).eval()
    want = model(**batch)["loss"]
    done = mc.compile_blocks(model, backend=broken)
    with caplog.at_level(logging.WARNING):
        got = model(**batch)["loss"]
        again = model(**batch)["loss"]
    warnings = [r for r in caplog.records if r.name.endswith("model.compile")]
    assert len(warnings) == 1 and "running eager instead" in warnings[0].getMessage()
    assert "no compiler here" in warnings[0].getMessage() and "no compiler here" in (done.failed or "")
    assert torch.equal(got, want) and torch.equal(again, want)


def _report_running_layer(model: torch.nn.Module, running: list[int]) -> None:
    """``running[0]`` set to the index of the BERT layer that runs, in its forward and its recompute, outside
    its compiled calls: around each layer's ``packed_call`` where layers compile whole, else before each layer."""
    for i, layer in enumerate(model.hf.bert.encoder.layer):
        if mc.whole_layers(model):

            def call(*args, _i=i, _compiled=layer.packed_call):
                running[0] = _i
                return _compiled(*args)

            object.__setattr__(layer, "packed_call", call)
        else:
            layer.register_forward_pre_hook(lambda module, args, _i=i: running.__setitem__(0, _i))


@pytest.mark.parametrize("unpadded", [True, False], ids=["whole-layers", "padded"])
def test_a_compile_failing_mid_forward_keeps_checkpointing_exact(batch, unpadded, caplog):  # noqa: F811
    """Compiling layer 1 of 3 fails in the first micro-batch, trained with dropout: with activation checkpointing
    the gradients are those without it (same seed, same failure), in that micro-batch (what ran compiled before
    the failure recomputes compiled, the rest eager in its forward and its recompute) and in the next (eager
    throughout: an eager model's gradients). Layer 1's graph is another (a frozen LayerNorm bias): it compiles
    anew when layer 1 first runs, and the test's backend refuses it (inductor compiles the others). Whole
    compiled layers (unpadded BERT) and compiled dense modules (the padded forward, as under ZeRO-3)."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    spec = get_spec("bert-debug", dropout=0.1, vocab_size=8000, layers=3)
    running = [-1]  # the layer running now (set outside the compiled calls)

    def refuses_layer_1(gm, example_inputs):
        if running[0] == 1:
            raise RuntimeError("no graph for layer 1")
        return compile_fx(gm, example_inputs)

    def build(checkpointing: bool, compiled: bool) -> tuple[torch.nn.Module, mc.Compiled | None]:
        torch.manual_seed(0)
        model = build_model(spec, unpad=unpadded, activation_checkpointing=checkpointing).train()
        layers = model.hf.bert.encoder.layer
        layers[1].output.LayerNorm.bias.requires_grad_(False)
        done = mc.compile_blocks(model, backend=refuses_layer_1) if compiled else None
        if compiled:
            _report_running_layer(model, running)
        return model, done

    def grads(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
        out = []
        for seed in (1, 2):  # two micro-batches, each its own dropout draws
            torch.manual_seed(seed)
            out.append(_run(model, batch)[1])
        return out

    with caplog.at_level(logging.WARNING):
        (plain, plain_done), (ckpt, ckpt_done) = build(False, True), build(True, True)
        got_plain, got_ckpt = grads(plain), grads(ckpt)
    eager = grads(build(False, False)[0])
    for done in plain_done, ckpt_done:
        assert done is not None and "no graph for layer 1" in (done.failed or "")
    assert len([r for r in caplog.records if r.name.endswith("model.compile")]) == 2  # once per model
    for micro_batch in 0, 1:
        errors = _errors(got_ckpt[micro_batch], got_plain[micro_batch])
        assert max(errors.values()) < 1e-5, (micro_batch, max(errors.items(), key=lambda kv: kv[1]))
    assert max(_errors(got_plain[0], eager[0]).values()) > 1e-2  # layer 0 compiled: inductor's dropout draws
    assert max(_errors(got_plain[1], eager[1]).values()) < 1e-5  # the next micro-batch eager


def test_compile_is_on_by_default_on_accelerators_only():
    assert mc.wanted(None, "cuda") and mc.wanted(None, "hpu") and not mc.wanted(None, "cpu")
    assert mc.wanted(True, "cpu") and not mc.wanted(False, "cuda")
