"""train.py end to end with real DeepSpeed on 2 CPU ranks: exact resume, SIGTERM, refusals, export, wandb."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, run_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory, wiki_text_dir, wiki_vocab) -> dict[str, Path]:
    """BERT seq-128 shards of the enwiki sample: the first text shards for training, the last for eval."""
    root = tmp_path_factory.mktemp("bertdata")
    shards = sorted(Path(wiki_text_dir).glob("*.txt"))
    assert len(shards) >= 2
    train_text, eval_text = root / "text-train", root / "text-eval"
    train_text.mkdir()
    eval_text.mkdir()
    for s in shards[:-1]:
        (train_text / s.name).write_bytes(s.read_bytes())
    (eval_text / shards[-1].name).write_bytes(shards[-1].read_bytes())
    out = {"vocab": Path(wiki_vocab)}
    for name, text, dupe in (("train", train_text, "2"), ("eval", eval_text, "1")):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "data",
                "bert",
                "--text",
                str(text),
                "--vocab",
                str(wiki_vocab),
                "--out",
                str(root / name),
                "--seq-len",
                "128",
                "--max-pred",
                "20",
                "--dupe-factor",
                dupe,
            ],
            cwd=REPO,
            env=run_env(),
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        out[name] = root / name
    return out


def deepspeed(
    args: list[str], ranks: int = 2, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(29500 + os.getpid() % 1000),
        "train.py",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=env or run_env(), capture_output=True, text=True, timeout=timeout
    )


def common(data: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "smoke",
        f"run.dir={run_dir}",
        f"data.train={data['train']}",
        f"data.eval={data['eval']}",
        f"data.vocab={data['vocab']}",
        "train.steps=8",
        "train.global_batch=16",
        "train.micro_batch=4",
        "logging.every=1",
        "checkpoint.every=0",
        "train.eval_every=0",
        "train.eval_batches=2",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def straight_run(bert_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    res = deepspeed(common(bert_data, run_dir))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run_dir


def test_run_writes_metrics_and_summary(straight_run):
    summary = json.loads((straight_run / "summary.json").read_text())
    for key in (
        "model",
        "world_size",
        "device_kind",
        "device_count",
        "precision",
        "zero_stage",
        "micro_batch",
        "global_batch",
        "seq_len",
        "steps",
        "sequences_per_sec",
        "tokens_per_sec",
        "mfu",
        "tflops_per_device",
        "peak_memory_bytes",
        "wall_time_s",
        "fingerprint",
        "threads_per_rank",
    ):
        assert key in summary, key
    assert summary["world_size"] == 2 and summary["zero_stage"] == 2 and summary["steps"] == 8
    assert summary["grad_accum"] == 2  # 16 = 4 x 2 ranks x 2
    assert summary["sequences_per_sec"] > 0 and 0 < summary["mfu"] < 1
    assert summary["tokens_per_sec"] == pytest.approx(summary["sequences_per_sec"] * 128)
    assert 0 <= summary["eval_mlm_accuracy"] <= 1 and 0 <= summary["eval_nsp_accuracy"] <= 1
    records = [json.loads(x) for x in (straight_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 9))
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records if "loss" in r)  # finite
    assert any("tokens_per_sec" in r and "mfu" in r and "peak_memory_bytes" in r for r in records)


def test_resume_is_exact(bert_data, straight_run, tmp_path):
    run_dir = tmp_path / "run"
    first = deepspeed(common(bert_data, run_dir, "train.stop_at_step=4"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    second = deepspeed(common(bert_data, run_dir))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    assert losses(run_dir) == losses(straight_run)  # identical values, step by step


def test_refuses_architecture_change(bert_data, straight_run):
    res = deepspeed(common(bert_data, straight_run, "model.name=bert-10m", "train.steps=9"))
    assert res.returncode != 0
    assert "checkpoint has model layers=2 but this run has layers=4; refusing to resume" in res.stderr


def test_half_written_checkpoint_is_ignored(bert_data, straight_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    ckpt = run_dir / "checkpoints"
    partial = ckpt / "step00000099"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    res = deepspeed(common(bert_data, run_dir, "train.steps=10"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout + res.stderr and "step00000008" in res.stdout + res.stderr
    assert (ckpt / "latest").read_text().strip() == "step00000010"
    assert not partial.exists()  # cleaned by the next successful save


def test_export_loads_with_transformers(straight_run, tmp_path):
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = tmp_path / "hf"
    res = subprocess.run(
        [sys.executable, "-m", "model", "export", str(straight_run / "checkpoints"), "--out", str(out)],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok("the history of [MASK] is long.", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_sigterm_saves_and_exits_with_distinct_code(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(29600 + os.getpid() % 1000),
        "train.py",
        *common(bert_data, run_dir, "train.steps=10000"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training did not start")
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "train.py" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGTERM)  # one rank is enough: the ranks agree to stop together
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, output[-3000:]
    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = max(losses(run_dir))
    assert tag == f"step{stopped_at:08d}"
    res = deepspeed(common(bert_data, run_dir, f"train.steps={stopped_at + 2}"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(run_dir))[-2:] == [stopped_at + 1, stopped_at + 2]


def test_wandb_offline(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    env = {**run_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    res = deepspeed(
        common(bert_data, run_dir, "train.steps=3", "logging.wandb.project=wikipretrain-test"), env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
