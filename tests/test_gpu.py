"""The GPU tier (``pytest -m cuda``): one-GPU train.py runs under NCCL with real DeepSpeed.

bert-debug and neox-debug, ZeRO 1 and 2, BF16, LANS and AdamW; checkpoint and resume with identical losses in
deterministic mode; export. ``scripts/gpu.sh`` installs from the offline bundle and runs this tier on a GPU
machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, run_env
from tests.test_train import bert_data, common, deepspeed, gpt_data, losses  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the GPU tier runs on a GPU machine (bash scripts/gpu.sh BUNDLE)",
    ),
]

NCCL = ("deepspeed.backend=nccl", "run.threads_per_rank=0", "data.num_workers=2")


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("optimizer", ["lans", "adamw"])
def test_bert_trains_on_one_gpu(bert_data, tmp_path, zero, optimizer):  # noqa: F811
    run_dir = tmp_path / "run"
    res = deepspeed(common(bert_data, run_dir, *NCCL, "deepspeed.zero_stage="
        f"{zero}", f"optimizer.name={optimizer}",
                           "deepspeed.precision=bf16"), ranks=1)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["device_kind"] != "cpu" and s["zero_stage"] == zero and s["steps"] == 8
    assert s["mfu"] is None or 0 < s["mfu"] <= 1
    ls = losses(run_dir)
    assert all(v == v for v in ls.values()) and ls[8] < ls[1]


def test_neox_trains_on_one_gpu(gpt_data, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = ["--config", "smoke", "model.name=neox-debug", f"run.dir={run_dir}", "data.train="
        f"{gpt_data['train']}",
            f"data.eval={gpt_data['eval']}", f"data.vocab={gpt_data['vocab']}", "data.seq_len=128",
            "optimizer.name=adamw", "optimizer.lr=1e-3", "schedule.kind=cosine_warmup",
            "deepspeed.zero_stage=2", "train.steps=8", "train.global_batch=8", "train.micro_batch=4",
            "train.eval_samples=32", "logging.every=1", "checkpoint.every=4", *NCCL]  # fmt: skip
    res = deepspeed(args, ranks=1)
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["family"] == "neox" and s["steps"] == 8 and s["eval_perplexity"] < 4000


def test_deterministic_resume_is_exact_on_gpu(bert_data, tmp_path):  # noqa: F811
    det = (*NCCL, "train.deterministic=true", "deepspeed.zero_stage=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert deepspeed(common(bert_data, straight, *det), ranks=1).returncode == 0
    first = deepspeed(common(bert_data, resumed, *det, "train.stop_at_step=4"), ranks=1)
    assert first.returncode == 3, first.stderr[-3000:]
    second = deepspeed(common(bert_data, resumed, *det), ranks=1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(resumed) == losses(straight)  # bit for bit


def test_export_from_a_gpu_run(bert_data, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    assert deepspeed(common(bert_data, run_dir, *NCCL), ranks=1).returncode == 0
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "-m", "training", "export", str(run_dir / "checkpoints"), "--out",
                          str(out)],
                         cwd=REPO, env=run_env(), capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    from transformers import AutoModelForPreTraining

    model = AutoModelForPreTraining.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
