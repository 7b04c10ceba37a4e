"""No benchmark rots: every script in benchmarks/ runs at toy size (seconds, not a measurement) and prints
its figures.

Each benchmark runs as a user runs it (this interpreter, the repository root as working directory), with toy
arguments (forked rather than a fresh interpreter where the script measures nothing of its own process:
``FORKED``); the test parses the figures it printed. The helpers that a benchmark starts run inside it:
``bench_train_ours.py`` and ``bench_train_hf.py`` under ``bench_train.py`` (its "ours" and "peer" columns,
the CPU-time column from ``bench_train_ours.py``), ``startup_floor.py`` under ``bench_startup.py`` (the floor
column). Peers that are not installed (WikiExtractor, mwparserfromhell, mosaicml-streaming, NVIDIA's
scripts) are left out by the benchmark itself, which says so; our side is checked either way.

The toy runs are smoke tests, not measurements, so they run two at a time (``ARGS``, the ``bench``
fixture): alone, most of them leave one of the 2 CI cores idle; together the module takes 154 s, not 216 s.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import REPO, TwoAtATime, module_tests, run_python

BENCH = REPO / "benchmarks"
HELPERS = {  # run by another benchmark, which the test checks
    "bench_train_ours.py": "bench_train.py",
    "bench_train_hf.py": "bench_train.py",
    "startup_floor.py": "bench_startup.py",
}
NUM = r"(\d+(?:,\d{3})*(?:\.\d+)?)"  # a printed figure: 12, 0.034, 13,307,392

# Each test_bench_<key>'s benchmark and toy arguments, given the run's own work directory ``w`` (runs and logs
# apart; the shared text, vocabulary and shards linked in). The training benchmarks start their MASTER_PORTs
# apart (``--port``), as two of them run at once.
ARGS: dict[str, Callable[[Path], list[str]]] = {
    "train": lambda w: [
        *("bench_train.py", "--work", str(w), "--models", "bert-debug", "--port", "29850"),
        *("--steps", "2", "--warmup", "1", "--repeats", "1", "--micro-batch", "2", "--global-batch", "4"),
    ],
    "switch": lambda w: [
        *("bench_switch.py", "--work", str(w), "--model", "bert-debug", "--seqs", "128:20", "--port", "29950"),
        *("--steps", "2", "--warmup", "1", "--repeats", "1", "--micro-batch", "2", "--global-batch", "4"),
    ],
    "train_profile": lambda w: [
        *("bench_train_profile.py", "--top", "5", "--", "model.name=bert-debug"),
        *(f"data.train={w / 'bert128-p20'}", f"data.vocab={w / 'vocab.txt'}", "data.eval=null", "train.steps=3"),
        *("train.global_batch=4", "train.micro_batch=2", "logging.warmup_steps=1", f"run.dir={w / 'run'}"),
        *("checkpoint.every=0", "checkpoint.resume=never"),
    ],
    "checkpoint_stall": lambda w: [
        *("bench_checkpoint_stall.py", "--work", str(w), "--model", "bert-debug", "--steps", "4", "--every", "2"),
        *("--ranks", "1", "--global-batch", "4", "--micro-batch", "2"),
    ],
    "startup": lambda w: ["bench_startup.py", "--work", str(w), "--repeats", "1", "--ranks", "1", "--no-shm"],
    "comm": lambda w: ["bench_comm.py", "--ranks", "2", "--sizes", "1K..4K", "--iters", "3"],
    "lans": lambda w: [
        *("bench_lans.py", "--params", "tiny", "--steps", "2", "--warmup", "1"),
        *("--zero-model", "mixed", "--zero-steps", "1"),
    ],
    "build_memory": lambda w: ["bench_build_memory.py", "--models", "neox-debug:1"],
    "loader": lambda w: [
        *("bench_loader.py", "--tiny", "--world-sizes", "2", "--steps", "1", "--seconds", "0.5"),
        *("--startup-shards", "8"),
    ],
    "bert_instances": lambda w: [
        *("bench_bert_instances.py", "--copies", "1", "--dupe-factor", "1", "--skip-peer"),
        *("--vocab", str(w / "vocab.txt")),
    ],
    "corpus": lambda w: [
        *("bench_corpus.py", "--copies", "1", "--workers", "1", "--dupe-factor", "1", "--work", str(w / "c")),
        *("--vocab", str(w / "vocab.txt"), "--tokenizer", str(w / "c" / "none.json")),
    ],
    "wiki": lambda w: (
        ["bench_wiki.py", "--workers", "1", "--repeat", "1", "--rss-repeats", "1", "1"] + ["--workdir", str(w)]
    ),
    "neox_loss": lambda w: ["bench_neox_loss.py", "--tiny"],
    "gpu_readiness": lambda w: [
        *("bench_gpu_readiness.py", "--tokens", "256", "--rows", "4", "--compile", "varlen", "--json"),
    ],
}


def number(text: str) -> float:
    return float(text.replace(",", ""))


# The benchmarks whose script measures nothing of its own process (its memory, its start-up): they run forked
# by the suite's prefork server (``run_python``), the script as ``__main__`` with its arguments all the same,
# without the 3-8 CPU-s of a fresh interpreter's imports. The others, and every process a benchmark starts,
# start fresh.
FORKED = ("train", "switch", "train_profile", "lans", "gpu_readiness")


def run_bench(script: str, *args: str, timeout: int = 600, fresh: bool = True) -> str:
    """Run ``benchmarks/<script>`` with ``args`` (``fresh``: in a fresh interpreter, as a user runs it, else
    forked by the prefork server: see ``FORKED``); its stdout (a failure shows the end of both streams)."""
    res = run_python([str(BENCH / script), *args], timeout=timeout, fresh=fresh)
    assert res.returncode == 0, f"{script} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout


def printed(pattern: str, out: str, count: int = 1) -> list[tuple[str, ...]]:
    """The numbers as printed on each line of ``out`` that ``pattern`` (groups of NUM) matches; at least
    ``count`` lines."""
    rows = [m.groups() for m in re.finditer(pattern, out, re.MULTILINE)]
    assert len(rows) >= count, f"expected {count} line(s) matching {pattern!r} in:\n{out[-3000:]}"
    return rows


def figures(pattern: str, out: str, count: int = 1) -> list[tuple[float, ...]]:
    """The numbers of each line of ``out`` that ``pattern`` (groups of NUM) matches; at least ``count``."""
    return [tuple(number(g) for g in row) for row in printed(pattern, out, count)]


def _interval(text: str) -> tuple[float, float]:
    """What a printed figure can have been before rounding: half a unit of its last digit either side."""
    half = 0.5 * 10.0 ** -len(text.partition(".")[2])
    return number(text) - half, number(text) + half


def is_quotient(ratio: str, num: str, den: str, scale: float = 1.0) -> bool:
    """Whether the printed ``ratio`` can be ``scale * num / den`` of the unrounded figures behind the printed
    ones: a small figure printed to one decimal is off by up to a few percent, so no fixed tolerance holds on
    every machine (a slower CPU prints smaller rates)."""
    (r_lo, r_hi), (n_lo, n_hi), (d_lo, d_hi) = _interval(ratio), _interval(num), _interval(den)
    assert d_lo > 0, f"{den} printed too coarsely to divide by"
    return r_lo <= scale * max(n_hi, 0) / d_lo and scale * max(n_lo, 0) / d_hi <= r_hi


def test_is_quotient_allows_rounding_and_nothing_more() -> None:
    assert is_quotient("2.41", "3.7", "1.5")  # 3.7 / 1.5 = 2.47, yet 3.66 / 1.52 = 2.41 (a CI run's row)
    assert is_quotient("1.00", "12.34", "12.34") and not is_quotient("1.05", "12.34", "12.34")
    assert not is_quotient("2.60", "3.7", "1.5") and not is_quotient("2.20", "3.7", "1.5")
    assert is_quotient("0.0", "0.4", "1234.5", scale=100) and not is_quotient("0.1", "0.4", "1234.5", scale=100)


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory) -> dict[str, Path]:
    """BERT shards (seq 128, max_pred 20, as the smoke recipe) and their vocabulary, built once by
    ``bench_train.build_data`` in a work directory whose data the training benchmarks share."""
    from benchmarks.bench_train import build_data

    work = tmp_path_factory.mktemp("bench_work")
    args = argparse.Namespace(bert_seq=128, max_pred=20, gpt_seq=128, rebuild=False)
    return {"work": work, **build_data(work, args, kinds=("bert",))}


@pytest.fixture(scope="module")
def bench(request, bench_data: dict[str, Path], tmp_path_factory) -> Iterator[TwoAtATime]:
    """``bench(key)``: the stdout of test_bench_<key>'s run and its work directory. Every selected test's run
    starts with the first of them, two at a time, in ``ARGS``'s order; a run that failed fails its test."""
    selected = module_tests(request, "test_bench_")
    runs = TwoAtATime("bench")
    try:
        for key, args in ARGS.items():
            if key not in selected:
                continue
            work = tmp_path_factory.mktemp(f"bench_{key}")
            for name in ("text", "vocab", "bert"):  # the shared data, under the names build_data looks for
                (work / bench_data[name].name).symlink_to(bench_data[name])
            script, *rest = args(work)
            runs.start(key, work, partial(run_bench, fresh=key not in FORKED), script, *rest)
        yield runs
    finally:
        runs.close()


def test_every_benchmark_is_run_here() -> None:
    """A new script in benchmarks/ needs a test below (or an entry in HELPERS)."""
    tested = {name[len("test_") :] + ".py" for name in globals() if name.startswith("test_bench_")}
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts - tested - set(HELPERS) == set(), "benchmarks without a test in tests/test_benchmarks.py"
    assert set(HELPERS.values()) <= tested
    assert {name[len("test_bench_") :] for name in globals() if name.startswith("test_bench_")} == set(ARGS)
    assert set(FORKED) <= set(ARGS)


@pytest.mark.slow
def test_bench_train(bench: TwoAtATime) -> None:
    out, _ = bench("train")
    (row,) = printed(
        rf"^\| bert-debug \| 128 \| 2 x 2 \| {NUM} \(.*?\) \| {NUM} \(.*?\) \| {NUM}x \| {NUM} \(.*?\) \| "
        rf"{NUM} \(.*?\) \| {NUM}x \|",
        out,
    )
    ours, peer, ratio, ours_cpu, peer_cpu, cpu_ratio = row
    assert min(map(number, (ours, peer, ours_cpu, peer_cpu))) > 0  # ours_cpu: bench_train_ours.py's CPU time
    assert is_quotient(ratio, ours, peer) and math.isfinite(number(cpu_ratio)), row


@pytest.mark.slow
def test_bench_switch(bench: TwoAtATime) -> None:
    """model.unpad on and off: both sides ran and reported the padding of what they read and their first step;
    the ratios are the medians' quotients."""
    out, _ = bench("switch")
    (row,) = printed(
        rf"^\| 128 \| 20 \| {NUM}% \| {NUM} \| {NUM} \| {NUM}x \| {NUM} \| {NUM} \| {NUM}x \| {NUM} \| {NUM} \| "
        rf"{NUM}x \|",
        out,
    )
    pad, on, off, ratio, on_cpu, off_cpu, cpu_ratio, first_on, first_off, ideal = row
    assert 0 < number(pad) < 100 and number(ideal) == pytest.approx(1 / (1 - number(pad) / 100), abs=0.01)
    assert min(map(number, (on, off, on_cpu, off_cpu, first_on, first_off))) > 0
    assert is_quotient(ratio, on, off) and is_quotient(cpu_ratio, on_cpu, off_cpu), row


@pytest.mark.slow
def test_bench_train_profile(bench: TwoAtATime) -> None:
    out, _ = bench("train_profile")
    assert "bert-debug: 2 profiled optimizer steps" in out
    ((total, whole),) = printed(rf"^  train_step \(total\) +{NUM} ms +{NUM}%", out)
    assert number(total) > 0 and whole == "100.0"
    for phase in ("forward \\(engine\\)", "backward \\(engine\\)", "data \\(next batch\\)"):
        ((ms, share),) = printed(rf"^  {phase} +{NUM} ms +{NUM}%", out)
        # the share is the phase's time over the step's, to their printed precision (the next batch takes well
        # under a tenth of a per cent of a step on some machines: 0.0%)
        assert is_quotient(share, ms, total, scale=100) and number(share) <= 100, (phase, ms, share, total)
        assert number(ms) > 0 or "data" in phase, (phase, ms)
    assert "Self CPU time total" in out
    # the time split (the GPU call's profile: the share neither matmul nor attention), each share printed to 0.1%
    ((matmul, attention, other),) = printed(rf"^CPU \(self\) time: matmul {NUM}%, attention {NUM}%, other {NUM}%", out)
    assert number(matmul) > 0 and number(attention) > 0, out[-2000:]  # bert-debug runs both on the CPU
    assert abs(number(matmul) + number(attention) + number(other) - 100) <= 0.15, (matmul, attention, other)


@pytest.mark.slow
def test_bench_checkpoint_stall(bench: TwoAtATime) -> None:
    import json

    out, _ = bench("checkpoint_stall")
    stalls = []
    for side in (r"sync \(DeepSpeed save_checkpoint\)", r"async \(ours\)"):
        ((saves, stall, *_),) = printed(rf"^{side} +{NUM} +{NUM} ", out)
        assert saves == "1"
        stalls.append(stall)
    ((ratio,),) = printed(rf"^stall ratio async / sync: {NUM}$", out)
    assert is_quotient(ratio, stalls[1], stalls[0]), (ratio, stalls)
    unrounded = json.loads(out.strip().splitlines()[-1])  # the figures unrounded (a fast copy prints 0.000 s)
    assert unrounded["async (ours)"]["stall_s"] > 0 and unrounded["sync (DeepSpeed save_checkpoint)"]["stall_s"] > 0


@pytest.mark.slow
def test_bench_startup(bench: TwoAtATime) -> None:
    out, _ = bench("startup")
    for what in ("launch -> exit", "process -> first step"):
        ((ours, floor, ratio),) = figures(rf"^\| {what} \| {NUM} s \| {NUM} s \| {NUM}x \|$", out)
        assert ours > 0 and floor > 0 and ratio > 0  # floor: startup_floor.py


@pytest.mark.slow
def test_bench_comm(bench: TwoAtATime) -> None:
    out, _ = bench("comm")
    assert out.startswith("2 ranks, backend gloo")
    rows = figures(rf"^(?:all_reduce|all_gather|reduce_scatter) +\d+K +{NUM} +{NUM} +{NUM}$", out, count=6)
    assert all(ours > 0 and peer > 0 for ours, peer, _ in rows)


@pytest.mark.slow
def test_bench_lans(bench: TwoAtATime) -> None:
    out, _ = bench("lans")
    for name in ("torch AdamW", "LANS cpu", "LANS fused", "LANS foreach", "naive per-tensor LANS"):
        ((median, times_adamw, *_),) = figures(rf"^{name} .*? {NUM} +{NUM} +{NUM} +{NUM}$", out)
        assert median >= 0 and times_adamw > 0  # a toy step can print 0.000 s; its ratio to AdamW's cannot
    figures(rf"^naive / LANS cpu: {NUM}x \(median\)", out)
    ((step_s, comm_s, share),) = figures(rf"^ +{NUM} +{NUM} +{NUM}%$", out)  # part 2: 2 ranks, ZeRO-2
    assert step_s > 0 and comm_s >= 0 and 0 <= share <= 100


@pytest.mark.slow
def test_bench_build_memory(bench: TwoAtATime) -> None:
    out, _ = bench("build_memory")
    for side in ("full", "ours", "hf"):
        ((ranks, peak, before, build_s, held),) = figures(
            rf"^neox-debug +{NUM} {side} +{NUM} +{NUM} +{NUM} +{NUM}$", out
        )
        assert ranks == 1 and peak >= before > 0 and build_s > 0 and held > 0


@pytest.mark.slow
def test_bench_loader(bench: TwoAtATime) -> None:
    out, _ = bench("loader")
    ((ranks, accum, worst, mean, per_s, startup, rss),) = figures(
        rf"^ +{NUM} +{NUM} ours +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} ", out
    )
    assert (ranks, accum) == (2, 32) and worst >= mean >= 1 and per_s > 0 and startup > 0 and rss > 0
    rows = figures(rf"^start-up over 8 shards, rank 0 of 2, .*: {NUM} s, {NUM} HDF5 files opened$", out, 2)
    assert rows[0][1] < rows[1][1]  # the manifest spares opening every shard


@pytest.mark.slow
def test_bench_bert_instances(bench: TwoAtATime) -> None:
    out, _ = bench("bert_instances")
    rows = figures(rf"^1 copy +data bert --workers [12] +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} ", out, count=2)
    assert all(inst > 0 and tokens > 0 and per_s > 0 for inst, tokens, _, per_s, _ in rows)
    assert rows[0][:2] == rows[1][:2]  # the same instances with 1 and 2 workers


@pytest.mark.slow
def test_bench_corpus(bench: TwoAtATime) -> None:
    """The toy size (the sample once, a BPE trained on it): four rows whose rates are their quotients; the GPT
    paths tokenize the same documents, so the same tokens."""
    out, _ = bench("corpus")
    units = "(?:instances|tokens)"
    rows = printed(rf"^\| (BERT|GPT): [^|]+ \| 1 \| {NUM} {units} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$", out, 4)
    assert [r[0] for r in rows] == ["BERT", "BERT", "GPT", "GPT"]
    assert all(number(n) > 0 and is_quotient(rate, n, cpu) for _, n, cpu, _, rate, _ in rows)
    assert rows[2][1] == rows[3][1] and rows[0][5] == rows[2][5] == "1.00"


@pytest.mark.slow
def test_bench_wiki(bench: TwoAtATime) -> None:
    out, _ = bench("wiki")
    ((workers, wall, cpu, articles, *_),) = figures(
        rf"^\| ours \(data.wiki\) \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|", out
    )
    assert workers == 1 and wall > 0 and cpu > 0 and articles > 100
    assert len(figures(rf"^  sample x +1: +{NUM} MB bz2, +{NUM} s, peak RSS {NUM} MiB$", out, 2)) == 2
    ((seconds, mb_s, residue),) = figures(rf"^\| ours clean_wikitext \| {NUM} \| {NUM} \| {NUM} \|$", out)
    assert mb_s > 0 and residue == 0


@pytest.mark.slow
def test_bench_neox_loss(bench: TwoAtATime) -> None:
    out, _ = bench("neox_loss")
    for side in ("ours", "peer"):
        # model MiB, added MiB, best s, median s, cold added MiB, cold s, loss
        ((model_mib, added_mib, step_s, *_, loss),) = figures(rf"^{side}" + rf" +{NUM}" * 7 + "$", out)
        assert model_mib > 0 and added_mib > 0 and step_s > 0 and loss > 0
    for key in ("memory", "time"):
        ((ratio,),) = figures(rf"^ours/peer {key}: {NUM} \(", out)
        assert ratio > 0


@pytest.mark.slow
def test_bench_gpu_readiness(bench: TwoAtATime) -> None:
    """The report's figures for bert-large layer shapes: the varlen operator moves less outside the matmuls than
    the padded kernel, forward and backward; no host sync on the accelerator path; one compiled graph for five
    micro-batch shapes, no break; the flat-partition LANS/LAMB step at most 100 bytes per parameter, under the
    foreach path's."""
    import json

    out, _ = bench("gpu_readiness")
    report = json.loads(out.strip().splitlines()[-1])
    varlen, padded = report["bytes"]["varlen"], report["bytes"]["padded"]
    for phase in ("fwd", "bwd"):
        assert 0 < varlen[f"{phase}_attention"] < varlen[f"{phase}_nonmatmul"] < padded[f"{phase}_nonmatmul"]
    for kernel in ("varlen", "padded"):
        syncs = report["syncs"][kernel]
        assert (syncs["model"], syncs["optimizer"], syncs["impl"]) == (0, 0, "multi"), syncs
    graphs = report["compile"]["varlen"]
    assert graphs == {"after_2": 1, "after_5": 1, "breaks": 0, "whole": 1, "eager_fallback": 0}, graphs
    opt = report["optimizer"]
    for name in ("LANS", "LAMB"):
        assert 0 < opt[f"{name}_multi"] <= 100 and opt[f"{name}_multi"] < opt[f"{name}_foreach"], opt
    printed(rf"^  LANS_multi +{NUM}$", out)
