"""No benchmark rots: every script in benchmarks/ runs at toy size (seconds, not a measurement) and prints
its figures.

Each benchmark runs as a user runs it (this interpreter, the repository root as working directory), with toy
arguments; the test parses the figures it printed. The helpers that a benchmark starts run inside it:
``bench_train_ours.py`` and ``bench_train_hf.py`` under ``bench_train.py`` (its "ours" and "peer" columns,
the CPU-time column from ``bench_train_ours.py``), ``startup_floor.py`` under ``bench_startup.py`` (the floor
column). Peers that are not installed (WikiExtractor, mwparserfromhell, mosaicml-streaming, NVIDIA's
scripts) are left out by the benchmark itself, which says so; our side is checked either way.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env

BENCH = REPO / "benchmarks"
HELPERS = {  # run by another benchmark, which the test checks
    "bench_train_ours.py": "bench_train.py",
    "bench_train_hf.py": "bench_train.py",
    "startup_floor.py": "bench_startup.py",
}
NUM = r"(\d+(?:,\d{3})*(?:\.\d+)?)"  # a printed figure: 12, 0.034, 13,307,392


def number(text: str) -> float:
    return float(text.replace(",", ""))


def run_bench(script: str, *args: str, timeout: int = 600) -> str:
    """Run ``benchmarks/<script>`` with ``args``; its stdout (a failure shows the end of both streams)."""
    res = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"{script} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout


def figures(pattern: str, out: str, count: int = 1) -> list[tuple[float, ...]]:
    """The numbers of each line of ``out`` that ``pattern`` (groups of NUM) matches; at least ``count``."""
    rows = [tuple(number(g) for g in m.groups()) for m in re.finditer(pattern, out, re.MULTILINE)]
    assert len(rows) >= count, f"expected {count} line(s) matching {pattern!r} in:\n{out[-3000:]}"
    return rows


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory) -> dict[str, Path]:
    """BERT shards (seq 128, max_pred 20, as the smoke recipe) and their vocabulary, built once by
    ``bench_train.build_data`` in a work directory the training benchmarks share."""
    from benchmarks.bench_train import build_data

    work = tmp_path_factory.mktemp("bench_work")
    args = argparse.Namespace(bert_seq=128, max_pred=20, gpt_seq=128, rebuild=False)
    return {"work": work, **build_data(work, args, kinds=("bert",))}


def test_every_benchmark_is_run_here() -> None:
    """A new script in benchmarks/ needs a test below (or an entry in HELPERS)."""
    tested = {name[len("test_") :] + ".py" for name in globals() if name.startswith("test_bench_")}
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts - tested - set(HELPERS) == set(), "benchmarks without a test in tests/test_benchmarks.py"
    assert set(HELPERS.values()) <= tested


@pytest.mark.slow
def test_bench_train(bench_data: dict[str, Path]) -> None:
    out = run_bench(
        "bench_train.py",
        "--work",
        str(bench_data["work"]),
        "--models",
        "bert-debug",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--micro-batch",
        "2",
        "--global-batch",
        "4",
    )
    (row,) = figures(
        rf"^\| bert-debug \| 128 \| 2 x 2 \| {NUM} \(.*?\) \| {NUM} \(.*?\) \| {NUM}x \| {NUM} \(.*?\) \| "
        rf"{NUM} \(.*?\) \| {NUM}x \|",
        out,
    )
    ours, peer, ratio, ours_cpu, peer_cpu, cpu_ratio = row
    assert min(ours, peer, ours_cpu, peer_cpu) > 0  # ours_cpu: bench_train_ours.py's CPU-time window
    assert ratio == pytest.approx(ours / peer, rel=0.02) and math.isfinite(cpu_ratio)


@pytest.mark.slow
def test_bench_train_tiny_rows(bench_data: dict[str, Path], tmp_path: Path) -> None:
    """``--tiny``: the GPU rows (bert-large phase 1 and 2 with LAMB and LANS, neox-1.3b with AdamW, each beside
    the Trainer) at debug sizes on CPU: every run printed, and every figure of both sides recorded (unrounded,
    in the JSON) with the versions."""
    import json

    out = run_bench("bench_train.py", "--tiny", "--work", str(bench_data["work"]), "--json", str(tmp_path / "r.json"))
    printed = re.findall(r"^\| ([\w.-]+) \| \d+ \| (ours|peer) \| (\w+) \| 2 x 2 \| .* \|$", out, re.MULTILINE)
    expected = [
        ("bert-large-p1", "ours", "lamb"),
        ("bert-large-p1", "ours", "lans"),
        ("bert-large-p1", "peer", "adamw_torch_fused"),
        ("bert-large-p2", "ours", "lamb"),
        ("bert-large-p2", "ours", "lans"),
        ("bert-large-p2", "peer", "adamw_torch_fused"),
        ("neox-1.3b", "ours", "adamw"),
        ("neox-1.3b", "peer", "adamw_torch_fused"),
    ]
    assert printed == expected, out
    assert len(re.findall(r"^[\w.-]+: ours / Trainer at micro-batch 2: .*\d\.\d\dx", out, re.MULTILINE)) == 3
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["versions"]["torch"] and saved["versions"]["deepspeed"] and saved["versions"]["device"] == "cpu"
    runs = [(name, r) for name, row in saved["rows"].items() for r in row["runs"]]
    assert [(name, r["side"], r["optimizer"]) for name, r in runs] == expected
    for name, r in runs:
        seq = saved["rows"][name]["seq"]
        assert r["sequences_per_sec"] > 0 and 0 < r["mfu"] <= 1 and r["peak_memory_bytes"] > 0, r
        assert r["optimizer_step_s"] > 0 and r["host_syncs_per_step"] is None, r  # no device queue on CPU
        # tokens/s: every position the side computes; unpadded BERT computes fewer than seq per row
        padded = r["side"] == "peer" or name == "neox-1.3b"
        if padded:
            assert r["tokens_per_sec"] == pytest.approx(r["sequences_per_sec"] * seq), r
        else:
            assert 0 < r["tokens_per_sec"] < r["sequences_per_sec"] * seq, r
        if r["side"] == "ours":  # the background save's stall, and what a synchronous one stalls
            assert 0 < r["checkpoint_stall_s"] < r["checkpoint_sync_stall_s"], r


@pytest.mark.slow
def test_bench_switch(bench_data: dict[str, Path]) -> None:
    """model.unpad on and off: both sides ran and reported the padding of what they read and their first step;
    the ratios are the medians' quotients."""
    out = run_bench(
        "bench_switch.py",
        *("--work", str(bench_data["work"]), "--model", "bert-debug", "--seqs", "128:20"),
        *("--steps", "2", "--warmup", "1", "--repeats", "1", "--micro-batch", "2", "--global-batch", "4"),
    )
    (row,) = figures(
        rf"^\| 128 \| 20 \| {NUM}% \| {NUM} \| {NUM} \| {NUM}x \| {NUM} \| {NUM} \| {NUM}x \| {NUM} \| {NUM} \| "
        rf"{NUM}x \|",
        out,
    )
    pad, on, off, ratio, on_cpu, off_cpu, cpu_ratio, first_on, first_off, ideal = row
    assert 0 < pad < 100 and ideal == pytest.approx(1 / (1 - pad / 100), abs=0.01)
    assert min(on, off, on_cpu, off_cpu, first_on, first_off) > 0
    assert ratio == pytest.approx(on / off, rel=0.03) and cpu_ratio == pytest.approx(on_cpu / off_cpu, rel=0.03)


@pytest.mark.slow
def test_bench_train_profile(bench_data: dict[str, Path]) -> None:
    run_dir = bench_data["work"] / "runs" / "profile"
    out = run_bench(
        "bench_train_profile.py",
        "--top",
        "5",
        "--",
        "model.name=bert-debug",
        f"data.train={bench_data['bert']}",
        f"data.vocab={bench_data['vocab']}",
        "data.eval=null",
        "train.steps=3",
        "train.global_batch=4",
        "train.micro_batch=2",
        "logging.warmup_steps=1",
        f"run.dir={run_dir}",
        "checkpoint.every=0",
        "checkpoint.resume=never",
    )
    assert "bert-debug: 2 profiled optimizer steps" in out
    for phase in (
        "train_step \\(total\\)",
        "forward \\(engine\\)",
        "backward \\(engine\\)",
        "data \\(next batch\\)",
    ):
        ((ms, share),) = figures(rf"^  {phase} +{NUM} ms +{NUM}%", out)
        assert ms > 0 and 0 < share <= 100
    assert "Self CPU time total" in out


@pytest.mark.slow
def test_bench_checkpoint_stall(bench_data: dict[str, Path]) -> None:
    out = run_bench(
        "bench_checkpoint_stall.py",
        "--work",
        str(bench_data["work"]),
        "--model",
        "bert-debug",
        "--steps",
        "4",
        "--every",
        "2",
        "--ranks",
        "1",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
    )
    for side in (r"sync \(DeepSpeed save_checkpoint\)", r"async \(ours\)"):
        ((saves, stall, *_),) = figures(rf"^{side} +{NUM} +{NUM} ", out)
        assert saves == 1 and stall > 0
    ((ratio,),) = figures(rf"^stall ratio async / sync: {NUM}$", out)
    assert ratio > 0


@pytest.mark.slow
def test_bench_startup(bench_data: dict[str, Path]) -> None:
    out = run_bench("bench_startup.py", "--work", str(bench_data["work"]), "--repeats", "1", "--ranks", "1", "--no-shm")
    for what in ("launch -> exit", "process -> first step"):
        ((ours, floor, ratio),) = figures(rf"^\| {what} \| {NUM} s \| {NUM} s \| {NUM}x \|$", out)
        assert ours > 0 and floor > 0 and ratio > 0  # floor: startup_floor.py


@pytest.mark.slow
def test_bench_comm() -> None:
    out = run_bench("bench_comm.py", "--ranks", "2", "--sizes", "1K..4K", "--iters", "3")
    assert out.startswith("2 ranks, backend gloo")
    rows = figures(rf"^(?:all_reduce|all_gather|reduce_scatter) +\d+K +{NUM} +{NUM} +{NUM}$", out, count=6)
    assert all(ours > 0 and peer > 0 for ours, peer, _ in rows)


@pytest.mark.slow
def test_bench_lans() -> None:
    out = run_bench(
        "bench_lans.py",
        "--params",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--zero-model",
        "mixed",
        "--zero-steps",
        "1",
    )
    for name in ("torch AdamW", "LANS cpu", "LANS fused", "LANS foreach", "naive per-tensor LANS"):
        ((median, *_),) = figures(rf"^{name} .*? {NUM} +{NUM} +{NUM} +{NUM}$", out)
        assert median > 0
    figures(rf"^naive / LANS cpu: {NUM}x \(median\)", out)
    ((step_s, comm_s, share),) = figures(rf"^ +{NUM} +{NUM} +{NUM}%$", out)  # part 2: 2 ranks, ZeRO-2
    assert step_s > 0 and comm_s >= 0 and 0 <= share <= 100


@pytest.mark.slow
def test_bench_build_memory() -> None:
    out = run_bench("bench_build_memory.py", "--models", "neox-debug:1")
    for side in ("full", "ours", "hf"):
        ((ranks, peak, before, build_s, held),) = figures(
            rf"^neox-debug +{NUM} {side} +{NUM} +{NUM} +{NUM} +{NUM}$", out
        )
        assert ranks == 1 and peak >= before > 0 and build_s > 0 and held > 0


@pytest.mark.slow
def test_bench_loader() -> None:
    out = run_bench(
        "bench_loader.py", "--tiny", "--world-sizes", "2", "--steps", "1", "--seconds", "0.5", "--startup-shards", "8"
    )
    ((ranks, accum, worst, mean, per_s, startup, rss),) = figures(
        rf"^ +{NUM} +{NUM} ours +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} ", out
    )
    assert (ranks, accum) == (2, 32) and worst >= mean >= 1 and per_s > 0 and startup > 0 and rss > 0
    rows = figures(rf"^start-up over 8 shards, rank 0 of 2, .*: {NUM} s, {NUM} HDF5 files opened$", out, 2)
    assert rows[0][1] < rows[1][1]  # the manifest spares opening every shard


@pytest.mark.slow
def test_bench_bert_instances(bench_data: dict[str, Path]) -> None:
    out = run_bench(
        "bench_bert_instances.py",
        "--copies",
        "1",
        "--dupe-factor",
        "1",
        "--skip-peer",
        "--vocab",
        str(bench_data["vocab"]),
    )
    rows = figures(rf"^1 copy +data bert --workers [12] +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} ", out, count=2)
    assert all(inst > 0 and tokens > 0 and per_s > 0 for inst, tokens, _, per_s, _ in rows)
    assert rows[0][:2] == rows[1][:2]  # the same instances with 1 and 2 workers


@pytest.mark.slow
def test_bench_wiki(tmp_path: Path) -> None:
    out = run_bench(
        "bench_wiki.py", "--workers", "1", "--repeat", "1", "--rss-repeats", "1", "1", "--workdir", str(tmp_path)
    )
    ((workers, wall, cpu, articles, *_),) = figures(
        rf"^\| ours \(data.wiki\) \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|", out
    )
    assert workers == 1 and wall > 0 and cpu > 0 and articles > 100
    assert len(figures(rf"^  sample x +1: +{NUM} MB bz2, +{NUM} s, peak RSS {NUM} MiB$", out, 2)) == 2
    ((seconds, mb_s, residue),) = figures(rf"^\| ours clean_wikitext \| {NUM} \| {NUM} \| {NUM} \|$", out)
    assert mb_s > 0 and residue == 0


@pytest.mark.slow
def test_bench_neox_loss() -> None:
    out = run_bench("bench_neox_loss.py", "--tiny")
    for side in ("ours", "peer"):
        # model MiB, added MiB, best s, median s, cold added MiB, cold s, loss
        ((model_mib, added_mib, step_s, *_, loss),) = figures(rf"^{side}" + rf" +{NUM}" * 7 + "$", out)
        assert model_mib > 0 and added_mib > 0 and step_s > 0 and loss > 0
    for key in ("memory", "time"):
        ((ratio,),) = figures(rf"^ours/peer {key}: {NUM} \(", out)
        assert ratio > 0
