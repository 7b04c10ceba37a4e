"""train.py's jobs under faults, each through the real DeepSpeed launcher on 2 CPU ranks: SIGTERM to each part
of a job (it saves, exits with code 3 and resumes exactly), kill -9 of a rank, a hung rank, a stalled data
loader.

Each test's job (``JOBS``) mostly waits: on the launcher's interpreters starting, on a timeout. So the jobs of
the selected tests start with the module's first test, two at a time (the ``jobs`` fixture), each on a port of
its own; each test then checks its job's record and runs what follows (a resume) itself. The timed jobs (a hung
rank, a stalled loader, kill -9) start first and their tests come first, so that only the job beside runs
with them, and the other pytest worker's tests (the README's ``-n 2``; ``tests/conftest.py`` keeps the other
timed modules off it): their bounds leave seconds of slack for both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import FP32, REPO, TwoAtATime, launcher, module_tests, run_env
from tests.conftest import common as bf16_common
from tests.test_train import deepspeed, last_logged, losses
from training import events

pytestmark = pytest.mark.slow


def common(data, run_dir: Path, *extra: str) -> list[str]:
    """The suite's 8-step arguments (``tests.conftest.common``) in FP32 (``tests.conftest.FP32``: these jobs are
    about faults, not BF16 arithmetic)."""
    return bf16_common(data, run_dir, FP32, *extra)


def launcher_and_ranks(proc: subprocess.Popen) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The ``deepspeed.launcher.launch`` process under a ``deepspeed`` command, and its 2 train.py ranks."""
    launchers = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "deepspeed.launcher.launch" in " ".join(p.cmdline())
    ]
    ranks = [p for p in launchers[0].children() if "train.py" in " ".join(p.cmdline())]
    assert len(ranks) == 2, ranks
    return launchers, ranks


_started: list[subprocess.Popen] = []  # every job's deepspeed command: the fixture's teardown ends what is left


def start_job(data, run_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    """A long 2-rank job (``train.steps=10000`` unless ``extra`` says otherwise) through the real launcher on
    MASTER_PORT ``port``, in a process group of its own, its output and errors in one pipe."""
    cmd = [*launcher(2, port=port), "train.py", *common(data, run_dir, "train.steps=10000", *extra)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _started.append(proc)
    return proc


def end_job(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of a job's process group (a failed check leaves its launcher and ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, also: Callable[[], bool] | None = None) -> None:
    """Until the last logged step reaches ``steps`` (and ``also`` holds); fails if the job ends or 180 s pass
    first, with what the job printed (its process group is killed first, so that its pipe ends)."""
    start = time.time()
    while not (last_logged(run_dir) >= steps and (also is None or also())):
        if time.time() - start > 180 or proc.poll() is not None:
            logged = last_logged(run_dir)
            end_job(proc)
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # a process outside its group holds the pipe
                output = "(its output: the pipe stayed open 60 s after the job was killed)"
            raise AssertionError(
                f"training did not reach step {steps} in {time.time() - start:.0f} s (exit code {proc.returncode}, "
                f"step {logged} logged last)\n{output[-4000:]}"
            )
        time.sleep(0.2)


def signal_running_job(data, run_dir: Path, port: int, target: str, *extra: str) -> tuple[int, str]:
    """Start a long 2-rank job, wait for its second step, SIGTERM ``target``: "rank1", "launcher"
    (``deepspeed.launcher.launch``), "runner" (the ``deepspeed`` command alone) or "group" (the job's whole
    process group, as ``scancel`` and a terminal's job control do). Its exit code and output."""
    proc = start_job(data, run_dir, port, *extra)
    try:
        wait_for_steps(proc, run_dir, 2, (lambda: (run_dir / "checkpoints" / "latest").exists()) if extra else None)
        launchers, ranks = launcher_and_ranks(proc)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            victim = {"rank1": ranks[1], "launcher": launchers[0], "runner": psutil.Process(proc.pid)}[target]
            victim.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)  # until every process holding the pipe has ended
        psutil.wait_procs(ranks + launchers, timeout=60)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), "ranks left running"
    finally:
        end_job(proc)
    return proc.returncode, output


def running(procs: list[psutil.Process], within: float) -> list[psutil.Process]:
    """Those of ``procs`` still running (not ended, not a zombie) after up to ``within`` seconds."""
    deadline = time.time() + within

    def alive(p: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        return False

    while (left := [p for p in procs if alive(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return left


@dataclass
class Killed:
    """A job whose rank 1 got SIGKILL: processes left ``took`` seconds after it, and the output."""

    alive: list
    took: float
    output: str


def kill_9_job(data, run_dir: Path, port: int) -> Killed:
    """SIGKILL rank 1 of a job that saves at every step, once it has logged 3 steps, its DataLoader worker
    stuck (SIGSTOP: as one blocked in a read or deadlocked would be)."""
    proc = start_job(data, run_dir, port, "checkpoint.every=1", "train.eval_every=0")
    try:
        wait_for_steps(proc, run_dir, 3)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        _, ranks = launcher_and_ranks(proc)
        workers = [c for c in ranks[1].children() if c.cmdline() == ranks[1].cmdline()]  # forked: the same
        assert workers, "rank 1 has no DataLoader worker to stop"
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        t0 = time.time()
        ranks[1].kill()
        _, alive = psutil.wait_procs(family, timeout=60)
        took = time.time() - t0
        output, _ = proc.communicate(timeout=30)
    finally:
        end_job(proc)
    return Killed(alive, took, output)


@dataclass
class Hung:
    """A job whose rank 1 got SIGSTOP: its exit code, how long rank 0 went on after, whether a rank was left
    running, and the output."""

    returncode: int
    rank0_s: float
    ranks_left: bool
    output: str


def hung_rank_job(data, run_dir: Path, port: int) -> Hung:
    """SIGSTOP rank 1 after 2 steps with deepspeed.timeout_s=12; wait for rank 0 to leave."""
    proc = start_job(data, run_dir, port, "deepspeed.timeout_s=12")
    ranks: list = []
    try:
        wait_for_steps(proc, run_dir, 2)
        _, ranks = launcher_and_ranks(proc)
        t0 = time.time()
        ranks[1].send_signal(signal.SIGSTOP)
        psutil.wait_procs(ranks[:1], timeout=90)
        rank0_s = time.time() - t0  # the rank still answering leaves its collective
        ranks[1].kill()  # rather than wait out the launcher's 30 s grace before its own SIGKILL
        output, _ = proc.communicate(timeout=120)
    finally:
        for p in ranks:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
        left = any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
        end_job(proc)
    return Hung(proc.returncode, rank0_s, left, output)


@dataclass
class Stalled:
    """A job whose rank 1's DataLoader worker got SIGSTOP: its exit code, when rank 1 and the job ended (time
    of day) and the output."""

    returncode: int
    rank1_ended: float
    job_ended: float
    workers_left: int  # rank 1's stopped DataLoader workers still there 10 s after it ended
    output: str


STALL_TIMEOUT_S = 12  # deepspeed.timeout_s of the stalled-loader job


def stalled_loader_job(data, run_dir: Path, port: int) -> Stalled:
    """SIGSTOP rank 1's DataLoader worker once the job logged a step; wait for rank 1, then the job, to end."""
    proc = start_job(
        data,
        run_dir,
        port,
        "train.steps=100000",
        f"deepspeed.timeout_s={STALL_TIMEOUT_S}",
        "data.num_workers=1",
        "data.prefetch=1",  # one transfer (512 rows) queued ahead: the stall shows a few dozen steps later ...
        "train.global_batch=64",  # ... fewer at 32 rows a step per rank (the same rows to compute, fewer steps)
        "train.micro_batch=32",
        "train.eval_every=0",
        "checkpoint.every=0",
    )
    workers: list = []
    try:
        wait_for_steps(proc, run_dir, 1)
        _, ranks = launcher_and_ranks(proc)
        rank1 = next(r for r in ranks if "--local_rank=1" in r.cmdline())
        workers = rank1.children()
        assert workers, "rank 1 has no DataLoader worker"
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        psutil.wait_procs([rank1], timeout=300)  # its queued batches first (a few hundred rows), then the bound
        rank1_ended = time.time()
        left = running(workers, within=10)
        output, _ = proc.communicate(timeout=120)
        job_ended = time.time()
    finally:
        for w in workers:
            with contextlib.suppress(psutil.Error):
                w.kill()
        end_job(proc)
    return Stalled(proc.returncode, rank1_ended, job_ended, len(left), output)


NO_TIME_TO_SAVE = ("checkpoint.every=2", "checkpoint.preempt_grace_s=0.001")

# Each test's job, given the session's BERT data, the job's run directory and its MASTER_PORT; in the order
# they start. The timed ones come first, while the tests wait for them, with nothing of this module running but
# the job beside (the tests that resume a job run theirs later).
JOBS: dict[str, Callable[[dict, Path, int], Any]] = {
    "test_a_hung_rank_ends_the_job_within_the_timeout": hung_rank_job,
    "test_sigterm_to_the_launcher_saves": lambda d, r, p: signal_running_job(d, r, p, "launcher"),
    "test_a_stalled_data_loader_ends_its_rank_with_one_line": stalled_loader_job,
    "test_sigterm_to_the_process_group_saves": lambda d, r, p: signal_running_job(d, r, p, "group"),
    "test_kill_9_of_a_rank_ends_the_job_and_keeps_the_last_commit": kill_9_job,
    "test_sigterm_to_the_deepspeed_command_alone_saves": lambda d, r, p: signal_running_job(d, r, p, "runner"),
    "test_sigterm_without_time_to_save_keeps_the_last_checkpoint": lambda d, r, p: signal_running_job(
        d, r, p, "rank1", *NO_TIME_TO_SAVE
    ),
    "test_sigterm_saves_and_exits_with_distinct_code": lambda d, r, p: signal_running_job(d, r, p, "rank1"),
}


def job_port(index: int) -> int:
    """Job ``index``'s MASTER_PORT: below the ports the kernel hands out to connections (32768 and up), which
    the jobs beside it take while its launcher starts, and apart from every other job's."""
    return 29100 + 10 * index + os.getpid() % 10


@pytest.fixture(scope="module")
def jobs(request, bert_data, tmp_path_factory) -> Iterator[TwoAtATime]:
    """``jobs(name)``: what test ``name``'s job returned, and its run directory. Every selected test's job starts
    with the first of them, two at a time; a job that failed fails its test. At the end (a failure, ^C), what is
    left of any job is killed."""
    selected = module_tests(request, "")
    runs = TwoAtATime("job")
    try:
        for i, (name, job) in enumerate(JOBS.items()):
            if name in selected:
                run_dir = tmp_path_factory.mktemp("job") / "run"
                runs.start(name, run_dir, job, bert_data, run_dir, job_port(i))
        yield runs
    finally:
        runs.close(end=lambda: [end_job(proc) for proc in _started])


def test_every_fault_test_has_its_job() -> None:
    tests = {name for name in globals() if name.startswith("test_")} - {"test_every_fault_test_has_its_job"}
    assert tests == set(JOBS)


@pytest.fixture(scope="module")
def long_run(bert_data, tmp_path_factory):
    """The uninterrupted losses of the signalled jobs' configuration (train.steps=10000) up to a step: one
    run to step 16 at least, run again further only when a job was stopped later than that."""
    have: dict[int, float] = {}

    def upto(step: int) -> dict[int, float]:
        if step > max(have, default=0):
            run_dir = tmp_path_factory.mktemp("long") / "run"
            stop = max(step, 16)
            res = deepspeed(common(bert_data, run_dir, "train.steps=10000", f"train.stop_at_step={stop}"))
            assert res.returncode == 3, res.stderr[-3000:]
            have.clear()
            have.update(losses(run_dir))
        return have

    return upto


def assert_resume_repeats(data, run_dir: Path, long_run) -> None:
    """Resume a signalled job for two steps: its losses are those of the uninterrupted run, exactly."""
    stopped = max(losses(run_dir))
    assert f"step{stopped:08d}" == (run_dir / "checkpoints" / "latest").read_text().strip()
    want = long_run(stopped + 2)
    res = deepspeed(common(data, run_dir, "train.steps=10000", f"train.stop_at_step={stopped + 2}"))
    assert res.returncode == 3, res.stderr[-3000:]
    got = losses(run_dir)
    assert [got[s] for s in (stopped + 1, stopped + 2)] == [want[s] for s in (stopped + 1, stopped + 2)]


def test_a_hung_rank_ends_the_job_within_the_timeout(jobs: TwoAtATime):
    """SIGSTOP one rank mid-run with deepspeed.timeout_s=12: the other rank leaves its collective (ZeRO-2's
    groups included) within the timeout, and the launcher ends the job."""
    job, _ = jobs("test_a_hung_rank_ends_the_job_within_the_timeout")
    output = job.output
    assert job.returncode != 0
    assert job.rank0_s < 12 + 20, f"rank 0 left {job.rank0_s:.0f} s after rank 1 hung (timeout 12 s)\n{output[-3000:]}"
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    want = "error: rank 0: a collective timed out (deepspeed.timeout_s)"
    assert len(errors) == 1 and want in errors[0], f"{errors}\n{output[-3000:]}"
    assert "Traceback" not in output
    assert not job.ranks_left, "ranks left running"


def test_a_stalled_data_loader_ends_its_rank_with_one_line(jobs: TwoAtATime):
    """SIGSTOP rank 1's DataLoader worker mid-run (a worker stuck on a stalled filesystem): once its queued
    batches are used, rank 1 waits for data; its watchdog ends it within deepspeed.timeout_s with one line
    naming its data loader and the node, and records the failure."""
    job, run_dir = jobs("test_a_stalled_data_loader_ends_its_rank_with_one_line")
    output = job.output
    assert job.returncode != 0
    bound = 0.8 * STALL_TIMEOUT_S  # DataWatchdog.STALL_SHARE: before the peers' collectives time out
    line = f"error: rank 1 on {socket.gethostname()}: its data loader gave no batch in {bound:g} s"
    mine = [ln for ln in output.splitlines() if ln.startswith(line)]
    assert len(mine) == 1 and "data.num_workers=1" in mine[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    failures = [e for e in events.read(run_dir) if e["event"] == "failure" and e["rank"] == 1]
    assert len(failures) == 1 and failures[0]["why"] == "data loader stalled", failures
    # the rank waited the bound (and a watchdog poll) for its next batch, then ended at once
    assert bound <= failures[0]["waited_s"] < bound + 5, failures
    assert job.rank1_ended - failures[0]["time"] < 15, job.rank1_ended - failures[0]["time"]
    # its stopped worker was killed with it (a stopped process ignores SIGTERM: the launcher would spend its 30 s
    # grace on it, then SIGKILL it) ...
    assert job.workers_left == 0, f"rank 1's stopped DataLoader worker outlived it\n{output[-4000:]}"
    # ... and rank 0 ended on the launcher's SIGTERM (its collective's peer is gone), well within the 30 s grace
    # the launcher gives it before a SIGKILL
    took = job.job_ended - job.rank1_ended
    print(f"the job ended {took:.1f} s after rank 1")
    assert took < 25, f"the job ended {took:.0f} s after rank 1\n{output[-4000:]}"


def test_kill_9_of_a_rank_ends_the_job_and_keeps_the_last_commit(jobs: TwoAtATime, bert_data):
    """SIGKILL one rank while the job saves at every step, its DataLoader worker stuck: every process of the
    job is gone within 30 s (the stuck worker too: it dies with its rank), the checkpoint ``latest`` names is
    complete and whole, and a restart resumes from it."""
    from training.checkpoint.storage import read_latest, tag_problem

    job, run_dir = jobs("test_kill_9_of_a_rank_ends_the_job_and_keeps_the_last_commit")
    output = job.output
    assert not job.alive and job.took < 30, f"{len(job.alive)} processes left after {job.took:.0f} s\n{output[-3000:]}"
    print(f"every process of the job exited {job.took:.1f} s after the kill")
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "error: rank 0: another rank is gone" in errors[0], output[-3000:]
    assert "Traceback" not in output
    ckpt = run_dir / "checkpoints"
    tag = read_latest(ckpt)
    assert tag is not None and tag_problem(ckpt, tag) is None, tag
    step = int(tag.removeprefix("step"))
    res = deepspeed(common(bert_data, run_dir, "train.steps=10000", f"train.stop_at_step={step + 1}"))
    assert res.returncode == 3, res.stderr[-3000:]
    assert f"resumed from {ckpt / tag} at step {step}" in res.stderr


def test_sigterm_to_the_launcher_saves(jobs: TwoAtATime, bert_data, long_run):
    """The launcher passes SIGTERM to its whole process tree, DataLoader workers included: the workers outlive
    it, the ranks finish the step and save (before, a worker died and the job ended with no checkpoint). The
    resumed job repeats the uninterrupted losses."""
    (_, output), run_dir = jobs("test_sigterm_to_the_launcher_saves")
    assert "SIGTERM: stopping after step" in output and "DataLoader worker" not in output, output[-3000:]
    assert_resume_repeats(bert_data, run_dir, long_run)


def test_sigterm_to_the_process_group_saves(jobs: TwoAtATime, bert_data, long_run):
    """scancel's way: SIGTERM to every process of the job at once (runner, launcher, ranks, DataLoader
    workers). The workers outlive it, the ranks save and exit 3; the resumed job repeats the uninterrupted
    losses."""
    (_, output), run_dir = jobs("test_sigterm_to_the_process_group_saves")
    assert "saving, exit code 3" in output and "DataLoader worker" not in output, output[-3000:]
    assert_resume_repeats(bert_data, run_dir, long_run)


def test_sigterm_to_the_deepspeed_command_alone_saves(jobs: TwoAtATime, bert_data, long_run):
    """The ``deepspeed`` command passes no signal on when killed; its ranks notice their launcher is gone,
    save and exit with code 3 instead of training on as orphans. The resumed job repeats the uninterrupted
    losses."""
    (rc, output), run_dir = jobs("test_sigterm_to_the_deepspeed_command_alone_saves")
    assert rc == -signal.SIGTERM
    assert "is gone); saving, exit code 3" in output, output[-3000:]
    assert "exits with return code = 3" in output, output[-3000:]  # deepspeed.launcher.launch's report
    assert_resume_repeats(bert_data, run_dir, long_run)


def test_sigterm_without_time_to_save_keeps_the_last_checkpoint(jobs: TwoAtATime):
    """With checkpoint.preempt_grace_s shorter than a save, a SIGTERM ends the job (exit 3) without a new
    checkpoint, says so, and the last periodic checkpoint is the resume point."""
    (rc, output), run_dir = jobs("test_sigterm_without_time_to_save_keeps_the_last_checkpoint")
    assert rc == 3, output[-3000:]
    stopped = max(losses(run_dir))
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert int(latest.removeprefix("step")) < stopped
    assert f"SIGTERM: no checkpoint at step {stopped}: the last save took" in output
    assert f"the next start resumes from {latest}" in output


def test_sigterm_saves_and_exits_with_distinct_code(jobs: TwoAtATime, bert_data, long_run):
    """SIGTERM to one rank: the ranks agree to stop together, save and exit with code 3; the resumed job repeats
    the uninterrupted losses, and a changed train.steps applies from the first resumed step."""
    (rc, output), run_dir = jobs("test_sigterm_saves_and_exits_with_distinct_code")
    assert rc == 3, output[-3000:]
    assert_resume_repeats(bert_data, run_dir, long_run)
    stopped_at = max(losses(run_dir))
    res = deepspeed(common(bert_data, run_dir, f"train.steps={stopped_at + 2}"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(run_dir))[-2:] == [stopped_at + 1, stopped_at + 2]
    # train.steps changed on resume: the first resumed step already runs at the new schedule's rate
    from training.optim.schedules import warmup_constant_decay

    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lr" in rec:
            rows[rec["step"]] = rec  # the latest attempt's row for each step
    total = stopped_at + 2
    for step in (stopped_at + 1, stopped_at + 2):
        want = 2e-3 * warmup_constant_decay(step, total_steps=total, warmup=0.05, constant=0.25)
        assert rows[step]["lr"] == pytest.approx(want), step
    assert rows[stopped_at + 1]["attempt"] == 3
