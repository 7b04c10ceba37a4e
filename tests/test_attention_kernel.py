"""The attention kernel that ran (``attention_kernel`` in summary.json, each metrics.jsonl row and the benchmark
records): ``model.unpad.resolve_kernel`` for every CUDA case at an explicit compute capability, the model's record
of its own forward, and the Hugging Face Trainer's name for its kernel. The training runs' records are checked
on the suite's shared runs (tests/test_train.py, tests/test_trainer.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from model import attention as A
from model import unpad
from model.build import build_model
from model.registry import family_of, get_spec
from tests.conftest import REPO

CUDA = torch.device("cuda")
H100 = (9, 0)


@pytest.mark.parametrize(
    ("asked", "dtype", "head_dim", "capability", "name"),
    [
        (None, torch.bfloat16, 64, H100, "varlen-flash"),
        ("auto", torch.float16, 256, (8, 0), "varlen-flash"),
        ("varlen", torch.bfloat16, 128, H100, "varlen-flash"),
        ("padded", torch.bfloat16, 64, H100, "padded"),  # asked for: no fallback, no reason
        ("jagged", torch.bfloat16, 64, H100, "jagged"),
    ],
)
def test_cuda_runs_what_was_asked_where_it_runs(asked, dtype, head_dim, capability, name) -> None:
    ran = unpad.resolve_kernel(asked, CUDA, dtype, head_dim, capability)
    assert (ran.asked, ran.name, ran.reason) == (asked or "auto", name, None)
    assert ran.kernel == {"varlen-flash": "varlen"}.get(name, name)  # the branch of varlen_attention it runs
    assert ran.name in unpad.RECORDED_KERNELS and ran.kernel in unpad.KERNELS


@pytest.mark.parametrize(
    ("dtype", "head_dim", "capability", "reason"),
    [
        (torch.float32, 64, H100, "auto: FP32 on CUDA runs padded (flash takes BF16/FP16)"),
        (torch.float64, 64, H100, "auto: FP64 on CUDA runs padded (flash takes BF16/FP16)"),
        (torch.bfloat16, 64, (7, 5), "auto: compute capability 7.5 runs padded (flash needs >= 8.0)"),
        (torch.float16, 60, H100, "auto: head size 60 on CUDA runs padded (flash takes <= 256, a multiple of 8)"),
        (torch.bfloat16, 264, H100, "auto: head size 264 on CUDA runs padded (flash takes <= 256, a multiple of 8)"),
    ],
)
def test_auto_on_cuda_falls_back_to_padded_and_says_why(dtype, head_dim, capability, reason) -> None:
    ran = unpad.resolve_kernel(None, CUDA, dtype, head_dim, capability)
    assert (ran.asked, ran.kernel, ran.name, ran.reason) == ("auto", "padded", "padded", reason)
    with pytest.raises(ValueError, match=r"^attention kernel varlen runs on the CPU, or on CUDA .*: use padded$"):
        unpad.resolve_kernel("varlen", CUDA, dtype, head_dim, capability)  # asked for by name: refused


def test_auto_elsewhere_and_on_a_torch_whose_flash_ops_differ(monkeypatch) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for asked in (None, "varlen"):
            ran = unpad.resolve_kernel(asked, "cpu", dtype, 64)
            assert (ran.kernel, ran.name, ran.reason) == ("varlen", "varlen-cpu", None)
    xpu = unpad.resolve_kernel(None, "xpu", torch.bfloat16, 64)
    assert (xpu.name, xpu.reason) == ("padded", "auto: xpu runs padded (the varlen operator runs on CUDA and the CPU)")
    with pytest.raises(ValueError, match="attention kernel 'flash': expected auto or one of varlen, padded, jagged"):
        unpad.resolve_kernel("flash", "cpu", torch.float32, 64)
    monkeypatch.setattr(A, "FLASH_SCHEMA_PROBLEM", "changed")  # what the import-time schema check sets
    ran = unpad.resolve_kernel(None, CUDA, torch.bfloat16, 64, H100)
    assert (ran.name, ran.reason) == (
        "padded",
        f"auto: torch {torch.__version__} runs padded (its flash ops differ: changed)",
    )


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of 16, the second padded after 10 tokens, two masked positions each (one a padding slot)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    return {
        "input_ids": torch.randint(1, vocab, (2, 16), generator=g) * mask,
        "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
        "attention_mask": mask,
        "masked_lm_positions": torch.tensor([[1, 2], [3, 0]]),
        "masked_lm_ids": torch.tensor([[5, 6], [7, 0]]),
        "masked_lm_weights": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "next_sentence_labels": torch.tensor([0, 1]),
    }


def test_the_model_records_the_kernel_its_forward_ran() -> None:
    """In the model's forward, from the runtime dtype (autocast's where it is on): what the family record hands
    the trainer. A padded-forward BERT and GPT-NeoX record none."""
    spec = get_spec("bert-debug", vocab_size=1000)
    record = family_of(spec)
    batch = _batch(1000)
    for asked, unpadded, name in ((None, True, "varlen-cpu"), ("padded", True, "padded"), (None, False, None)):
        model = build_model(spec, unpad=unpadded, unpad_kernel=asked)
        assert record.kernel_ran(model) is None  # before a forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch)
        ran = record.kernel_ran(model)
        assert (None if ran is None else (ran.asked, ran.name, ran.reason)) == (
            None if name is None else (asked or "auto", name, None)
        )
    assert family_of(get_spec("neox-debug")).kernel_ran(object()) is None


def test_the_hf_trainer_records_sdpa_over_padded_rows() -> None:
    """benchmarks/bench_train_hf.py: BERT's Trainer runs ``transformers``' SDPA over the padded rows; GPT-NeoX
    records null on both sides."""
    spec = importlib.util.spec_from_file_location("bench_train_hf", REPO / "benchmarks" / "bench_train_hf.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.peer_attention_kernel(bench.build_peer_model("bert-debug", 1000), "bert") == "sdpa-padded"
    eager = bench.build_peer_model("bert-debug", 1000, attention="eager")
    assert bench.peer_attention_kernel(eager, "bert") == "eager-padded"
    assert bench.peer_attention_kernel(torch.nn.Linear(1, 1), "neox") is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU tier runs this (scripts/gpu.sh)")
def test_on_the_gpu_bf16_runs_flash_and_fp32_falls_back() -> None:
    spec = get_spec("bert-debug", vocab_size=1000)
    batch = {k: v.cuda() for k, v in _batch(1000).items()}
    model = build_model(spec, unpad=True).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**batch)
    assert model.attention_kernel is not None and model.attention_kernel.name == "varlen-flash"
    model(**batch)
    assert model.attention_kernel.name == "padded"
    assert model.attention_kernel.reason == "auto: FP32 on CUDA runs padded (flash takes BF16/FP16)"
