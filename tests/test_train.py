"""train.py end to end with real DeepSpeed on 2 CPU ranks: exact resume, refusals, a full disk, export, wandb, sweeps
(the jobs under faults, SIGTERM among them: test_train_faults.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from data.loader import PretrainingLoader
from tests.conftest import FP32, REPO, common, deepspeed, expect_error, run_env, run_python
from tests.prefork import SITECUSTOMIZE_ENV
from training import events

pytestmark = pytest.mark.slow


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss in ``metrics.jsonl``; of a run still writing it, the lines it has ended (a line being
    written is left for the next read)."""
    text = (run_dir / "metrics.jsonl").read_text()
    out = {}
    for line in text[: text.rfind("\n") + 1].splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def last_logged(run_dir: Path) -> int:
    """The last step whose loss ``metrics.jsonl`` holds so far (``losses``); 0 before the run has written it:
    what a test waits on while a run trains."""
    return max(losses(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


@pytest.mark.cuda  # on the GPU tier too: 2 ranks sharing its one GPU
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
    assert summary["sequences_per_sec"] > 0 and 0 < summary["mfu"] <= 1
    # BERT unpads by default (model.unpad): tokens are the real tokens it computed, every rank's, exactly those
    # of the 8 x 16 samples the two ranks' loaders gave (counted here from their masks), FLOPs at their lengths
    config = json.loads((straight_run / "config.json").read_text())
    assert config["model"]["unpad"] is True
    real = 0
    for rank in range(2):
        loader = PretrainingLoader(
            config["data"]["train"],
            "bert",
            micro_batch=4,
            grad_accum=2,
            dp_rank=rank,
            dp_world=2,
            seed=config["train"]["seed"],
            num_workers=0,
        )
        real += sum(int(b["attention_mask"].sum()) for _, b in zip(range(8 * 2), loader))
    assert summary["tokens"] == real < summary["samples"] * 128
    assert summary["padding_fraction"] == pytest.approx(1 - real / (summary["samples"] * 128), abs=1e-15)
    assert summary["tokens_per_sec"] < summary["sequences_per_sec"] * 128
    # one convention: TFLOP/s is the window's tokens/s x its FLOPs per token, and MFU that over the peak
    achieved = summary["tokens_per_sec_per_device"] * summary["flops_per_token"]
    assert summary["tflops_per_device"] * 1e12 == pytest.approx(achieved, rel=1e-12)
    assert summary["mfu"] == pytest.approx(achieved / summary["peak_flops_per_device"], rel=1e-12)
    # the first step (compilation, when model.compile is on) is reported apart, inside the warm-up's time
    assert 0 < summary["first_step_s"] <= summary["warmup_s"]
    assert 0 <= summary["eval_mlm_accuracy"] <= 1 and 0 <= summary["eval_nsp_accuracy"] <= 1
    assert summary["eval_samples"] == 32 and summary["attempt"] == 1 and summary["stopped"] == ""
    records = [json.loads(x) for x in (straight_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 9))
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records if "loss" in r)  # finite
    assert any("tokens_per_sec" in r and "mfu" in r and "peak_memory_bytes" in r for r in records)
    # DeepSpeed's CPU shared-memory all-reduce (unused by training) is off: the job left nothing in /dev/shm
    assert json.loads((straight_run.parent / "shm_new.json").read_text()) == []
    # BERT's two losses are logged apart, and they add up to the total
    assert all(r["mlm_loss"] + r["nsp_loss"] == pytest.approx(r["loss"]) for r in records if "loss" in r)
    # the attention kernel that ran (resolved in the model's forward: BF16, auto), in the summary and every row
    import torch

    kernel = "varlen-flash" if torch.cuda.is_available() else "varlen-cpu"
    assert config["model"]["unpad_attention"] == "auto"
    assert (summary["attention_kernel"], summary["attention_kernel_reason"]) == (kernel, None)
    assert [r["attention_kernel"] for r in records] == [kernel] * len(records) and len(records) > 8  # + evaluation


def test_time_accounting_covers_the_wall_time(straight_run):
    """The throughput window holds training steps only: evaluation (steps 4 and 8) and saves (4, 8) are
    apart."""
    s = json.loads((straight_run / "summary.json").read_text())
    parts = ("startup_s", "warmup_s", "train_window_s", "eval_s", "save_s", "log_s")
    assert all(s[p] >= 0 for p in parts)
    assert s["eval_s"] > 0 and s["save_s"] > 0 and s["train_window_s"] > 0
    accounted = sum(s[p] for p in parts)
    assert accounted <= s["wall_time_s"] + 1e-3
    assert s["wall_time_s"] - accounted < 0.05 * s["wall_time_s"] + 2.0, s
    assert 0 <= s["data_wait_fraction"] <= 1
    # throughput is over the window: measured steps x global batch / window seconds
    assert s["sequences_per_sec"] == pytest.approx(s["measured_steps"] * 16 / s["train_window_s"])
    assert s["measured_steps"] == 8 - 2  # logging.warmup_steps=2 are left out


def single(args: list[str]) -> subprocess.CompletedProcess:
    """train.py as one process, without the launcher."""
    return run_python(["train.py", *args])


@pytest.mark.cuda  # on the GPU tier too: 2 ranks sharing its one GPU
def test_resume_is_exact(bert_data, straight_run, tmp_path):
    run_dir = tmp_path / "run"
    # overlap_comm off here, on (the default) in the straight run: on a GPU the two must train the same
    # (on the CPU it is always off)
    first = deepspeed(common(bert_data, run_dir, "train.stop_at_step=4", "deepspeed.overlap_comm=false"))
    assert first.returncode == 3, first.stderr[-3000:]  # like SIGTERM: saved, stopped early
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    second = deepspeed(common(bert_data, run_dir, "deepspeed.overlap_comm=false"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    assert losses(run_dir) == losses(straight_run)  # identical values, step by step
    # the same held-out samples at every evaluation: the final figures repeat exactly too
    done, straight = (json.loads((d / "summary.json").read_text()) for d in (run_dir, straight_run))
    figures = [k for k in straight if k.startswith("eval_") and k != "eval_s"]
    assert "eval_mlm_accuracy" in figures and {k: done[k] for k in figures} == {k: straight[k] for k in figures}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [(r["attempt"], r["step"]) for r in rows] == [(1, s) for s in range(1, 5)] + [(2, s) for s in range(5, 9)]

    # Started again at train.steps: nothing to train, exit 0, the summary is left alone.
    before = (run_dir / "summary.json").read_bytes()
    again = single(common(bert_data, run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train" in again.stderr
    assert (run_dir / "summary.json").read_bytes() == before
    # Fewer steps than the checkpoint holds: one line, a non-zero exit, nothing written.
    short = single(common(bert_data, run_dir, "train.steps=6"))
    assert short.returncode == 2
    errors = [line for line in short.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "beyond train.steps=6" in errors[0] and "Traceback" not in short.stderr
    assert (run_dir / "summary.json").read_bytes() == before


@pytest.mark.cuda  # on the GPU tier too: the padded-attention kernel there, the per-sequence one here
def test_unpadded_and_padded_runs_train_the_same_model(bert_data, tmp_path):
    """Two ranks, activation checkpointing, FP32, no dropout: BERT unpadded (``model.unpad``, the default, with
    the device's attention kernel) at ZeRO-2, the same with its layers compiled whole (``model.compile``) at
    ZeRO-1, and padded at ZeRO-2 see the same samples and must give the same loss at every step (FP32 rounding
    apart: the in-process tests hold every kernel to a float64 run). The compiled run's micro-batches differ in
    token count and lengths, yet it compiles no graph after its first step, and breaks none. Each counts what it
    computed: the padded run every position, the unpadded one the real tokens, of the same data (one padding
    fraction)."""
    import torch

    # the kernel that runs in FP32: the varlen operator's CPU branch; on a GPU auto falls back to padded, and says so
    kernel, why = ("varlen-cpu", None)
    if torch.cuda.is_available():
        kernel, why = ("padded", "auto: FP32 on CUDA runs padded (flash takes BF16/FP16)")
    same = (FP32, "model.dropout=0", "model.activation_checkpointing=true")
    same += ("train.steps=6", "train.eval_every=0", "checkpoint.every=0", "logging.every=1")
    runs = {}
    eager = ("model.compile=false",)  # on by default on a GPU (this test runs in the GPU tier too)
    for name, extra in (
        ("true", eager),
        ("compiled", ("model.compile=true", "deepspeed.zero_stage=1")),
        ("false", ("model.unpad=false", *eager)),
    ):
        run_dir = tmp_path / name
        res = deepspeed(common(bert_data, run_dir, *same, *extra))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        on = f"model.unpad: BERT computes its real tokens only, {kernel} attention kernel (model.unpad_attention=auto"
        assert (on in res.stdout + res.stderr) == (name != "false")
        assert (why is not None and why in res.stdout + res.stderr) == (why is not None and name != "false")
        # recorded as it ran (compiled whole, the kernel resolved outside the graph), none for the padded forward
        ran = json.loads((run_dir / "summary.json").read_text())
        expect = (kernel, why) if name != "false" else (None, None)
        assert (ran["attention_kernel"], ran["attention_kernel_reason"]) == expect, name
        rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert {r["attention_kernel"] for r in rows} == {expect[0]}, name
        runs[name] = run_dir
    unpadded, compiled, padded = (losses(runs[k]) for k in ("true", "compiled", "false"))
    assert sorted(unpadded) == list(range(1, 7))
    for step, loss in padded.items():
        assert unpadded[step] == pytest.approx(loss, rel=2e-5), (step, unpadded, padded)
        assert compiled[step] == pytest.approx(loss, rel=2e-5), (step, compiled, padded)
    rows = [json.loads(ln) for ln in (runs["compiled"] / "metrics.jsonl").read_text().splitlines()]
    graphs = [(r["compiled_graphs"], r["graph_breaks"]) for r in rows if "loss" in r]
    assert len(graphs) == 6 and graphs[0][0] > 0 and graphs == [(graphs[0][0], 0)] * 6, graphs
    assert "compiled_graphs" not in (runs["true"] / "metrics.jsonl").read_text()
    on, off = (json.loads((runs[k] / "summary.json").read_text()) for k in ("true", "false"))
    assert json.loads((runs["compiled"] / "summary.json").read_text())["zero_stage"] == 1 == on["zero_stage"] - 1
    assert off["tokens"] == off["samples"] * 128 > on["tokens"]  # padded: every position it computed
    assert on["padding_fraction"] == off["padding_fraction"] == pytest.approx(1 - on["tokens"] / off["tokens"])


def test_refuses_architecture_change(bert_data, straight_run, tmp_path):
    run_dir = tmp_path / "run"  # a copy: the refused start writes its probes and event into the run directory
    shutil.copytree(straight_run, run_dir)
    res = deepspeed(common(bert_data, run_dir, "model.name=bert-10m", "train.steps=9"))
    assert res.returncode != 0
    assert "checkpoint has model layers=2 but this run has layers=4; refusing to resume" in res.stderr


def test_half_written_and_damaged_checkpoints(bert_data, straight_run, tmp_path):
    """A tag without COMPLETE is ignored and removed by the next save; a COMPLETE tag whose model file was
    truncated afterwards is passed over for the previous one, with a warning: never a fresh start."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    ckpt = run_dir / "checkpoints"
    partial = ckpt / "step00000099"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    model = ckpt / "step00000008" / "mp_rank_00_model_states.pt"
    with open(model, "r+b") as f:
        f.truncate(1000)
    res = deepspeed(common(bert_data, run_dir, "train.steps=10"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint {ckpt / 'step00000008'} is damaged: {model} has 1000 bytes" in out
    assert f"resumed from {ckpt / 'step00000004'} at step 4" in out
    assert (ckpt / "latest").read_text().strip() == "step00000010"
    assert not partial.exists()  # cleaned by the next save
    assert losses(run_dir)[5] == losses(straight_run)[5]  # step 5 redone from step 4's state, exactly


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` (created) for the block, unmounted after; skips unless root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root; root also ignores file modes)")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_disk_full_during_a_save_fails_cleanly(bert_data, tmp_path):
    """checkpoint.dir on a 32 MiB tmpfs: the step-4 checkpoint (about 25 MB in FP32) fits, the step-8 one does not.
    Every rank stops at once with one line saying the disk is full; the partial tag is gone, latest still
    names step 4, which loads: after the filesystem grows, the restart resumes from it and finishes."""
    with tmpfs(tmp_path / "ckpt", "size=32m") as ckpt:
        run_dir = tmp_path / "run"
        args = common(bert_data, run_dir, f"checkpoint.dir={ckpt}", "train.eval_every=0", FP32)
        full = deepspeed(args)
        errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
        assert full.returncode != 0 and len(errors) == 1, full.stderr[-3000:]
        assert f"saving checkpoint {ckpt / 'step00000008'} failed on node" in errors[0], errors
        assert "the disk is full" in errors[0] and f"{ckpt / 'latest'} still names step00000004" in errors[0]
        assert "Traceback" not in full.stderr
        assert not (ckpt / "step00000008").exists() and (ckpt / "latest").read_text().strip() == "step00000004"
        subprocess.run(["mount", "-o", "remount,size=96m", str(ckpt)], check=True)
        again = deepspeed(args)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resumed from {ckpt / 'step00000004'} at step 4" in again.stderr
        assert (ckpt / "latest").read_text().strip() == "step00000008"


@pytest.mark.cuda  # on the GPU tier too: 2 ranks sharing its one GPU
def test_async_save_commits_and_resumes_exactly(bert_data, straight_run, tmp_path):
    """checkpoint.async_save: the checkpoints of steps 2, 4 and 6 are written while training goes on, each
    committed with every file of both ranks, and a resume from step 6 repeats the uninterrupted run's losses
    exactly."""
    from training.checkpoint.storage import complete_tags, read_latest, tag_problem

    run_dir = tmp_path / "run"
    first = deepspeed(
        common(
            bert_data,
            run_dir,
            "checkpoint.async_save=true",
            "checkpoint.every=2",
            "checkpoint.keep=3",
            "train.stop_at_step=6",
        )
    )
    assert first.returncode == 3, first.stderr[-3000:]
    ckpt = run_dir / "checkpoints"
    assert complete_tags(ckpt) == ["step00000002", "step00000004", "step00000006"]
    assert read_latest(ckpt) == "step00000006"
    for tag in complete_tags(ckpt):
        assert tag_problem(ckpt, tag) is None
        files = json.loads((ckpt / tag / "COMPLETE").read_text())["files"]
        assert {"rng_rank0.pt", "rng_rank1.pt", "client_state.json"} <= set(files)
        assert sum(1 for f in files if "optim_states" in f) == 2  # both ranks' ZeRO shards
    saves = [e for e in events.read(run_dir) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    for e in saves:  # committed after the stall ended, the files written in the meantime
        assert e["write_s"] > 0 and e["save_s"] > 0 and e["done_at"] <= e["time"]
    second = deepspeed(common(bert_data, run_dir, "checkpoint.async_save=true"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {ckpt / 'step00000006'} at step 6" in second.stderr
    assert losses(run_dir) == losses(straight_run)  # identical values, step by step


def test_async_save_that_fills_the_disk_fails_cleanly(bert_data, tmp_path):
    """A background save that fails (checkpoint.dir on a 32 MiB tmpfs: step 4, 25 MB, fits; step 8 does not) stops
    every rank with one line, at the latest when the next save (step 12) waits for it; nothing of step 8 is
    committed and latest names step 4."""
    with tmpfs(tmp_path / "ckpt", "size=32m") as ckpt:
        run_dir = tmp_path / "run"
        args = common(
            bert_data,
            run_dir,
            f"checkpoint.dir={ckpt}",
            "train.eval_every=0",
            "train.steps=16",
            "checkpoint.async_save=true",
            FP32,
        )
        full = deepspeed(args)
        errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
        assert full.returncode != 0 and len(errors) == 1, full.stderr[-3000:]
        assert f"saving checkpoint {ckpt / 'step00000008'} (in the background) failed on node" in errors[0]
        assert "the disk is full" in errors[0] and f"{ckpt / 'latest'} still names step00000004" in errors[0]
        assert "Traceback" not in full.stderr
        assert not (ckpt / "step00000008").exists()
        assert (ckpt / "latest").read_text().strip() == "step00000004"
        assert max(losses(run_dir)) <= 12  # it stopped (a hung rank would time the run out instead)


@pytest.mark.parametrize("which", ["run.dir", "checkpoint.dir"])
def test_read_only_directories_are_refused_at_start(bert_data, tmp_path, which):
    """run.dir (or checkpoint.dir, the other one writable elsewhere) on a read-only mount: every rank stops
    before building anything, with one line naming the directory; nothing is written."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        run_dir, ckpt = (ro, tmp_path / "ckpt") if which == "run.dir" else (tmp_path / "run", ro)
        t0 = time.time()
        res = deepspeed(common(bert_data, run_dir, f"checkpoint.dir={ckpt}"))
        took = time.time() - t0
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode != 0 and len(errors) == 1, res.stderr[-3000:]
        assert "Traceback" not in res.stderr and "Read-only file system" in errors[0], errors
        want = f"run.dir {ro} is not writable" if which == "run.dir" else f"{ro}: cannot write checkpoints"
        assert want in errors[0], errors
        assert list(ro.iterdir()) == []
        print(f"{which} read-only: refused in {took:.1f} s (launch included)")


def test_wandb_offline(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    env = {**run_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # also the accelerators' unpadded attention kernel, asked for by name on the CPU
    res = deepspeed(
        common(
            bert_data,
            run_dir,
            "train.steps=3",
            "logging.wandb.project=wikipretrain-test",
            "model.unpad_attention=padded",
            FP32,
        ),
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = "model.unpad: BERT computes its real tokens only, padded attention kernel (model.unpad_attention=padded)"
    assert line in res.stdout + res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["attention_kernel"], summary["attention_kernel_reason"]) == ("padded", None)
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def _cli(*args: str) -> None:
    res = run_python(["-m", *args], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory, wiki_text_dir) -> dict[str, Path]:
    """A byte-level BPE tokenizer trained on the sample, and packed seq-128 windows (train / eval split)."""
    root = tmp_path_factory.mktemp("gptdata")
    shards = sorted(Path(wiki_text_dir).glob("*.txt"))
    tok = root / "tokenizer.json"
    _cli("data", "vocab", str(wiki_text_dir), "--out", str(tok), "--size", "4000", "--kind", "bpe")
    out = {"vocab": tok}
    for name, files in (("train", shards[:-1]), ("eval", shards[-1:])):
        text = root / f"text-{name}"
        text.mkdir()
        for s in files:
            (text / s.name).write_bytes(s.read_bytes())
        _cli(
            "data",
            "gpt",
            "--text",
            str(text),
            "--tokenizer",
            str(tok),
            "--out",
            str(root / name),
            "--seq-len",
            "128",
            "--no-progress",
        )
        out[name] = root / name
    return out


def test_neox_trains_and_reports_perplexity(gpt_data, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--config",
        "smoke",
        "model.name=neox-debug",
        f"run.dir={run_dir}",
        f"data.train={gpt_data['train']}",
        f"data.eval={gpt_data['eval']}",
        f"data.vocab={gpt_data['vocab']}",
        "data.seq_len=128",
        "optimizer.name=adamw",
        "optimizer.lr=1e-3",
        "schedule.kind=cosine_warmup",
        "schedule.min_ratio=0.1",
        "deepspeed.zero_stage=0",
        "train.steps=6",
        "train.global_batch=8",
        "train.micro_batch=2",
        "train.eval_every=0",
        "train.eval_samples=32",
        "logging.every=1",
        "checkpoint.every=0",
    ]
    res = deepspeed(args)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["family"] == "neox" and summary["steps"] == 6 and summary["tokens_per_sec"] > 0
    # bf16 asked at ZeRO 0 runs DeepSpeed's BF16 optimizer, stage 1: the summary records what ran
    assert summary["zero_stage_requested"] == 0 and summary["zero_stage"] == 1
    assert "ZeRO 1" in res.stderr
    assert summary["eval_perplexity"] == pytest.approx(2.718281828 ** summary["eval_loss"], rel=1e-6)
    assert summary["eval_perplexity"] < 4000  # better than uniform over the 4000-entry vocabulary
    # no unpadding, no attention kernel chosen: null in the summary and in every row
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["attention_kernel"] is None and all(r["attention_kernel"] is None for r in rows) and rows
    assert "real tokens only" not in res.stderr
    first, last = losses(run_dir)[1], losses(run_dir)[6]
    assert last < first


@pytest.fixture(scope="module")
def toy_data(gpt_data, tmp_path_factory) -> dict[str, Path]:
    """The GPT data's text and tokenizer in the toy shard format (tests/toyformat.py: its record and builder)."""
    from data.formats import FORMATS, load_formats
    from tests.toyformat import build_toy_shards

    root = tmp_path_factory.mktemp("toydata")
    load_formats(["tests.toyformat"])  # the hook data.formats calls
    try:
        for name in ("train", "eval"):
            build_toy_shards(gpt_data["train"].parent / f"text-{name}", gpt_data["vocab"], root / name, seq_len=128)
    finally:  # the rest of the session sees the built-in formats only
        FORMATS.pop("toy")
    return {"vocab": gpt_data["vocab"], "train": root / "train", "eval": root / "eval"}


def test_data_verify_and_convert_read_a_format_from_outside_the_package_given_its_module(toy_data, tmp_path):
    """``python -m data verify`` and ``convert`` read shards of a format from outside the package once
    ``--formats`` names its module (as ``data.formats`` does at training time); without it, one line that names
    the manifest and the flag."""
    r = run_python(["-m", "data", "verify", str(toy_data["train"])], timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'wikipretrain-toy' is not a shard format" in r.stderr and "--formats MODULE" in r.stderr, r.stderr
    r = run_python(["-m", "data", "verify", str(toy_data["train"]), "--formats", "tests.toyformat"], timeout=120)
    assert r.returncode == 0 and " toy shard(s)" in r.stdout and "match the manifest" in r.stdout, r.stderr
    out = tmp_path / "converted"
    args = ["-m", "data", "convert", "--src", str(toy_data["train"]), "--out", str(out), "--no-progress"]
    r = run_python(args, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "is not a shard format" in r.stderr and "--formats MODULE" in r.stderr and not out.exists(), r.stderr
    r = run_python([*args, "--workers", "2", "--formats", "tests.toyformat"], timeout=120)  # spawned workers too
    assert r.returncode == 0 and "convert: 2 toy shard(s)" in r.stdout, r.stderr
    r = run_python(["-m", "data", "verify", str(out), "--formats", "tests.toyformat"], timeout=120)
    assert r.returncode == 0 and "2 toy shard(s)" in r.stdout, r.stderr


def test_a_family_and_a_format_from_outside_the_package_train_evaluate_and_resume(toy_data, tmp_path):
    """A third model family and a third shard format, each defined only in tests/ (tests/toyfamily.py: its record
    and model; tests/toyformat.py: its record and builder) and brought in through model.families and data.formats.
    The family names the format: it trains 2 steps on its shards and evaluates (its record's metric and logged
    loss part), resumes from the step-2 checkpoint (the loader state names the format), and reports MFU from its
    record's FLOPs. Its export, given the module (``--families``), finds the family and refuses it: the record names
    no ``transformers`` model (tests/test_export.py exports one that does)."""
    run_dir = tmp_path / "run"
    manifest = json.loads((toy_data["train"] / "manifest.json").read_text())
    assert manifest["format"] == "wikipretrain-toy" and all(r["windows"] > 0 for r in manifest["shards"])
    args = [
        "--config",
        "smoke",
        "model.families=[tests.toyfamily]",
        "data.formats=[tests.toyformat]",
        "model.name=toy-debug",
        f"run.dir={run_dir}",
        f"data.train={toy_data['train']}",
        f"data.eval={toy_data['eval']}",
        f"data.vocab={toy_data['vocab']}",
        "data.num_workers=0",
        "optimizer.name=adamw",
        "deepspeed.zero_stage=0",
        FP32,
        "train.steps=3",
        "train.global_batch=4",
        "train.micro_batch=4",
        "train.eval_every=2",
        "train.eval_samples=8",
        "logging.every=1",
        "logging.warmup_steps=0",
        "checkpoint.every=2",
        "train.deterministic=true",
    ]
    first = single([*args, "train.stop_at_step=2"])
    assert first.returncode == 3, first.stderr[-3000:]  # saved at step 2, stopped there
    second = single(args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [(r["attempt"], r["step"]) for r in records if "loss" in r]
    assert trained == [(1, 1), (1, 2), (2, 3)]
    saved = json.loads((run_dir / "checkpoints" / "step00000002" / "client_state.json").read_text())
    assert saved["loader"]["kind"] == "toy"
    assert all(r["lm_loss"] == pytest.approx(r["loss"]) for r in records if "loss" in r)  # its loss part
    evaluated = [r for r in records if "eval_toy_perplexity" in r]
    assert [r["step"] for r in evaluated] == [2, 3] and all("eval_perplexity" not in r for r in evaluated)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["family"] == "toy" and summary["model"] == "toy-debug" and summary["steps"] == 3
    assert summary["eval_toy_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]), rel=1e-9)
    assert 0 < summary["mfu"] <= 1 and summary["flops_per_token"] > 0
    straight = tmp_path / "straight"
    assert single([*args, f"run.dir={straight}"]).returncode == 0
    assert losses(run_dir) == losses(straight)  # the resume is exact
    export = ["-m", "training", "export", str(run_dir / "checkpoints"), "--out", str(tmp_path / "hf")]
    refused = run_python([*export, "--families", "tests.toyfamily"])
    expect_error(refused, f"{run_dir / 'checkpoints' / 'step00000003'}: model family 'toy' has no Hugging Face export")


@pytest.mark.cuda  # on the GPU tier too: 2 ranks sharing its one GPU
def test_zero3_builds_partitioned_trains_resumes_and_exports(gpt_data, tmp_path):
    """ZeRO-3 builds the model under zero.Init (each rank holds half of it from the start), trains, resumes
    exactly from an earlier checkpoint and exports the whole model."""
    run_dir, again = tmp_path / "run", tmp_path / "again"
    args = [
        "--config",
        "smoke",
        "model.name=neox-debug",
        f"data.train={gpt_data['train']}",
        f"data.eval={gpt_data['eval']}",
        f"data.vocab={gpt_data['vocab']}",
        "data.seq_len=128",
        "optimizer.name=adamw",
        "optimizer.lr=1e-3",
        "deepspeed.zero_stage=3",
        "train.steps=6",
        "train.global_batch=8",
        "train.micro_batch=2",
        "train.eval_every=0",
        "train.eval_samples=32",
        "logging.every=1",
        "checkpoint.every=3",
        "train.deterministic=true",
    ]
    res = deepspeed([*args, f"run.dir={run_dir}"])
    assert res.returncode == 0, res.stderr[-3000:]
    held = re.search(r"built under zero.Init: this rank holds ([0-9,]+) of ([0-9,]+) parameters", res.stderr)
    assert held, res.stderr[-3000:]
    mine, whole = (int(x.replace(",", "")) for x in held.groups())
    assert whole > 1_000_000 and whole / 2 <= mine < whole / 2 + 1000  # half, rounded up per tensor
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["steps"] == 6
    # resume from step 3 of a copy of the run: steps 4-6 repeat exactly
    shutil.copytree(run_dir, again)
    shutil.rmtree(again / "checkpoints" / "step00000006")
    (again / "checkpoints" / "latest").write_text("step00000003")
    (again / "metrics.jsonl").unlink()
    res = deepspeed([*args, f"run.dir={again}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {again / 'checkpoints' / 'step00000003'} at step 3" in res.stderr
    a, b = losses(run_dir), losses(again)
    assert sorted(b) == [4, 5, 6] and [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]
    out = tmp_path / "hf"
    exp = run_python(["-m", "training", "export", str(run_dir / "checkpoints"), "--out", str(out)])
    assert exp.returncode == 0, exp.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters()) == whole


def test_phase2_starts_from_phase1_weights_with_fresh_schedule(bert_data, straight_run, tmp_path):
    """NVIDIA's two-phase recipe: phase 2 loads phase 1's weights; optimizer, step count and schedule
    restart."""
    run_dir = tmp_path / "phase2"
    args = common(
        bert_data,
        run_dir,
        f"train.init_from={straight_run / 'checkpoints'}",
        "train.steps=4",
        "schedule.kind=poly_warmup",
        "schedule.warmup=0.75",
        "schedule.constant=0",
    )
    res = deepspeed(args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "initialised weights from" in res.stdout + res.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the step count restarts
    # a fresh warm-up over 3 of the 4 new steps (lr 2e-3 x 1/3, 2/3, ...), not phase 1's decayed rate
    assert [r["lr"] for r in records[:2]] == pytest.approx([2e-3 / 3, 2e-3 * 2 / 3])
    fresh = deepspeed(common(bert_data, tmp_path / "fresh", "train.steps=1"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    # Phase 1's training shows: on the same first batch, the loaded weights beat a fresh initialisation.
    assert records[0]["loss"] < losses(tmp_path / "fresh")[1]


def test_resume_on_a_different_world_size(bert_data, tmp_path):
    """1 rank to step 4, then 2 ranks with the same global batch: a universal checkpoint, the next samples.
    Rank 0 converts while rank 1 waits on the checkpoint directory, outside any collective: the conversion
    starts 6 s late (a test-only ``sitecustomize``, tests/scripts/slow_conversion), so it outlasts the resumed
    run's collective timeout (5 s) on any machine, and the run still goes on."""
    nodrop = ("model.dropout=0.0", FP32)  # only the reduction order then differs between 2 ranks and 1
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert deepspeed(common(bert_data, straight, *nodrop)).returncode == 0
    first = deepspeed(common(bert_data, run_dir, *nodrop, "train.stop_at_step=4"), ranks=1)
    assert first.returncode == 3, first.stderr[-3000:]
    delay_s = 6  # longer than the resumed run's collective timeout (5 s)
    late = {SITECUSTOMIZE_ENV: str(REPO / "tests" / "scripts" / "slow_conversion")}
    late["WIKIPRETRAIN_TEST_CONVERSION_DELAY_S"] = str(delay_s)
    second = deepspeed(common(bert_data, run_dir, *nodrop, "deepspeed.timeout_s=5"), env={**run_env(), **late})
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'universal-step00000004'} at step 4" in second.stderr
    hook = f"test hook: the conversion starts {delay_s} s late"
    assert second.stderr.count(hook) == 1, second.stderr[-3000:]  # rank 0
    took = re.search(r"converted .*step00000004 in ([0-9.]+) s", second.stderr)
    assert took, second.stderr[-3000:]
    print(f"conversion took {delay_s} s late + {took.group(1)} s under a 5 s collective timeout")
    a, b = losses(straight), losses(run_dir)
    assert sorted(b) == list(range(1, 9))
    assert [b[s] for s in range(5, 9)] == pytest.approx([a[s] for s in range(5, 9)], rel=2e-3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grad_accum"] == 2 and summary["samples"] == 8 * 16
    # the same 32 held-out samples on 2 ranks after 1: equal evaluation up to the reduction order
    ref = json.loads((straight / "summary.json").read_text())
    assert summary["eval_samples"] == ref["eval_samples"] == 32
    assert summary["eval_loss"] == pytest.approx(ref["eval_loss"], rel=2e-3)


def test_sweep_of_train_py_reports_measured_efficiency(bert_data, tmp_path):
    """launch sweep runs the real train.py at 1 and 2 ranks, evaluating and saving inside the runs, and
    tabulates the efficiency; run again, it skips the sizes already measured; launch report computes the
    efficiency (runs never write it themselves) and draws a PNG."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(
        f"base: {REPO / 'configs' / 'smoke.yaml'}\n"
        f"data: {{train: {bert_data['train']}, eval: {bert_data['eval']}, vocab: {bert_data['vocab']}}}\n"
        "train: {global_batch: 16, micro_batch: 4, eval_every: 3, eval_samples: 32}\n"
        "checkpoint: {every: 3}\nlogging: {every: 1}\n"
        "deepspeed: {precision: fp32}\n"  # the sweep's machinery, not BF16 (which this CPU may emulate, slowly)
    )
    runs, png = tmp_path / "runs", tmp_path / "scaling.png"
    res = run_python(
        ["-m", "launch", "sweep", "--config", str(cfg), "--world-sizes", "1,2", "--steps", "8", "--out", str(runs)],
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s1, s2 = (json.loads((runs / f"w{w}" / "summary.json").read_text()) for w in (1, 2))
    assert s1["fingerprint"] == s2["fingerprint"] and (s1["world_size"], s2["world_size"]) == (1, 2)
    for s in (s1, s2):
        assert 0 < s["mfu"] <= 1 and 0 <= s["data_wait_fraction"] <= 1
        assert s["zero_stage"] == s["zero_stage_requested"] == 2
        assert s["eval_s"] > 0 and s["save_s"] > 0 and s["eval_samples"] == 32
        assert "scaling_efficiency" not in s  # each run: its own figures
        assert s["nodes"] == 1
    measured = s2["sequences_per_sec_per_device"] / s1["sequences_per_sec_per_device"]
    assert 0 < measured < 2
    assert f"{measured * 100:.1f}%" in res.stdout  # the sweep's own table, computed from the summaries
    # a second sweep skips the sizes already measured
    again = run_python(
        ["-m", "launch", "sweep", "--config", str(cfg), "--world-sizes", "1,2", "--steps", "8", "--out", str(runs)],
        timeout=120,
    )
    assert again.returncode == 0 and again.stdout.count("skip ") == 2, again.stdout + again.stderr
    rep = run_python(["-m", "launch", "report", str(runs), "--plot", str(png)], timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert f"{measured * 100:.1f}%" in rep.stdout and "(baseline)" in rep.stdout
    assert "| 1 | 2 |" in rep.stdout  # one node, two ranks
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (1100, 420)
