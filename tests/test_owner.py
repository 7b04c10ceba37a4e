"""One live owner per run (``training.ownership``), with real jobs on one run directory: two started together
(under the DeepSpeed launcher and under ``launch elastic``), a holder that pauses its renewals briefly and
then for longer than the bound (a takeover, and the old holder fenced), the takeover setting, and kill -9 of
every process of a job. The two-node case (a holder on another host) is in test_train_twonode.py.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.conftest import FP32, REPO, common, deepspeed, run_env, run_python, smoke, start_train
from tests.test_elastic import elastic, the_agent, the_rank, wait_for_step
from tests.test_train import last_logged, losses
from training import events, ownership

pytestmark = pytest.mark.slow

STALE_S = 6  # run.owner_stale_s of the single-process jobs below: their holder renews every second


def owner_events(run_dir: Path) -> list[dict]:
    return [e for e in events.read(run_dir) if e["event"].startswith("owner_")]


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_two_jobs_started_together_one_is_refused_and_the_other_runs_as_alone(bert_data, straight_run, tmp_path):
    """Two 2-rank jobs (the straight run's arguments, each on its own MASTER_PORT) on one run directory, started
    within the same second: exactly one trains; the other is refused with one line, exit 2, having written
    nothing, and the first's losses, events, checkpoints and files are those of the straight run. The winner
    waits after taking the run until the other is refused (``ownership.HOLD_ENV``): its 8 steps can take less
    time than the other's start."""
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    env = {**run_env(), ownership.HOLD_ENV: str(hold)}  # the winner waits there until the other is refused
    done: list[tuple[subprocess.CompletedProcess, float]] = []

    def job() -> None:
        t0 = time.monotonic()
        res = deepspeed(common(bert_data, run_dir), env=env)
        done.append((res, time.monotonic() - t0))

    hold.touch()
    jobs = [threading.Thread(target=job) for _ in range(2)]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 120
    while not done and time.monotonic() < deadline:
        time.sleep(0.1)
    hold.unlink()
    for t in jobs:
        t.join()
    (lost, lost_s), (won, _) = done
    assert won.returncode == 0, won.stderr[-3000:]
    assert lost.returncode == 2, lost.stdout[-2000:] + lost.stderr[-3000:]
    print(f"the second job was refused {lost_s:.1f} s after its ranks started")
    assert lost_s < 60, lost.stderr[-3000:]  # 10 s on an idle machine; both jobs start on the same 2 cores here
    acquired, released = owner_events(run_dir)
    assert (acquired["event"], released["event"]) == ("owner_acquire", "owner_release")
    assert acquired["role"] == "train.py rank 0" and acquired["dirs"] == [str(run_dir), str(run_dir / "checkpoints")]
    # one line from the refused job (its rank 0; rank 1 says nothing), naming the directory and the holder
    (line,) = error_lines(lost.stderr)
    want = f"error: {run_dir} is owned by a live job: host {socket.gethostname()}, pid {acquired['pid']} (train.py"
    assert line.startswith(want), line
    assert "since " in line and "last renewal #" in line and "run.owner_stale_s" in line, line
    assert "Traceback" not in lost.stdout + lost.stderr
    # the first job ran as if alone: the straight run's losses, events, attempts and files
    assert losses(run_dir) == losses(straight_run)
    kinds = [e["event"] for e in events.read(run_dir)]
    assert kinds == [e["event"] for e in events.read(straight_run)]  # the owner's events at both ends
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1
    assert tree(run_dir) == tree(straight_run)  # no mark left, no file of the refused job's
    report = run_python(["-m", "launch", "report", str(run_dir)], timeout=120)
    assert report.returncode == 0 and f"- `{run_dir}`: none\n" in report.stdout, report.stdout + report.stderr


def test_two_elastic_jobs_one_is_refused_and_a_rank_killed_restarts_at_once(bert_data, tmp_path):
    """Two ``launch elastic`` jobs on one run directory, started together (each its own rendezvous): one is
    refused with one line and exit 2, and no ``user_error`` event, so the first one's agent goes on. Its rank
    is then killed -9: the agent restarts it under the supervisor's mark, with no wait for the mark (the bound
    here is 120 s), and the job finishes."""
    run_dir = tmp_path / "run"
    stale = "run.owner_stale_s=120"
    argv = [sys.executable, *elastic(run_dir, bert_data, "train.steps=6", stale, restarts=1)]
    procs = [
        subprocess.Popen(argv, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither job ended"
            time.sleep(0.1)
        lost = next(p for p in procs if p.poll() is not None)
        won = next(p for p in procs if p is not lost)
        out, _ = lost.communicate(timeout=30)
        assert lost.returncode == 2, out[-3000:]
        (acquired,) = owner_events(run_dir)
        assert acquired["role"] == "launch elastic" and acquired["pid"] == won.pid
        lines = error_lines(out)
        assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
        line = lines[0]
        assert line.startswith(f"error: {run_dir} is owned by a live job: host {socket.gethostname()}, pid {won.pid}")
        assert "(launch elastic, job wp-elastic)" in line, line
        rank = the_rank(psutil.Process(won.pid))
        agent = the_agent(psutil.Process(won.pid))
        wait_for_step(run_dir, 2, won)
        assert agent.is_running() and won.poll() is None  # the refusal reached nothing of the first job
        rank.kill()
        out, _ = won.communicate(timeout=240)
        assert won.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    evs = events.read(run_dir)
    assert "user_error" not in [e["event"] for e in evs]
    assert [e["event"] for e in evs if e["event"].startswith("owner_")] == ["owner_acquire", "owner_release"]
    failure = next(e for e in evs if e["event"] == "failure")
    restart = next(e for e in evs if e["event"] == "start" and e["restart"] == 1)
    delay = restart["time"] - failure["time"]
    print(f"the elastic restart after the rank's kill -9 started training {delay:.1f} s after the failure")
    assert delay < 120 and restart["resumed_from"] is not None
    assert evs[-1]["event"] == "owner_release" and not (run_dir / ownership.MARK).exists()


def wait_until(cond, jobs: list, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for j in jobs:
            if j.poll() is not None:
                raise AssertionError(f"{what}: a job ended ({j.poll()}): {j.output()[1][-3000:]}")
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step"))


def test_a_holder_pauses_is_taken_over_and_fenced_then_a_takeover_and_a_kill_9(bert_data, tmp_path):
    """One run, single-process jobs (``run.owner_stale_s=6``), each holding the run in turn:

    1. X trains; its renewals pause (the test hook) for less than the bound while a newcomer watches: the
       newcomer is refused, nothing is taken over. A run of another directory on X's ``checkpoint.dir`` is
       refused the same way, creating nothing.
    2. X's renewals pause for good: Y waits out the bound, takes the run over and resumes from X's ``latest``;
       X stops before its next write, with one line and exit 4.
    3. Z starts with ``run.takeover=true``: it breaks Y's live mark at once, saying so, and Y is fenced.
    4. Every process of Z is killed -9: W proceeds at once (Z is provably gone) from ``latest``.
    """
    run_dir, pause = tmp_path / "run", tmp_path / "pause"
    ckpt = run_dir / "checkpoints"

    def args(*extra: str) -> list[str]:
        return smoke(
            bert_data,
            run_dir,
            "train.steps=10000",
            "train.global_batch=4",
            "train.micro_batch=4",
            "logging.every=1",
            "checkpoint.every=2",
            "train.eval_every=0",
            f"run.owner_stale_s={STALE_S}",
            FP32,
            *extra,
        )

    paused = {**run_env(), ownership.PAUSE_ENV: str(pause)}
    started: list = []

    def start(name: str, *extra: str, env: dict | None = None):
        started.append(start_train(args(*extra), tmp_path / name, env))
        return started[-1]

    try:
        # 1. a pause shorter than the bound while a newcomer watches: refused, nothing taken over
        x = start("x", env=paused)
        wait_until(lambda: last_logged(run_dir) >= 2 and (ckpt / "latest").exists(), [x], "X's step 2")
        mark = ownership.read_mark(run_dir).mark
        assert mark is not None and mark.pid == x.pid
        assert ownership.describe_owner(run_dir).startswith(f"host {socket.gethostname()}, pid {x.pid} (train.py")
        pause.touch()
        time.sleep(1.5)  # a renewal under way as the pause began has landed
        threading.Timer(2.0, pause.unlink).start()
        t0 = time.monotonic()
        with pytest.raises(ownership.RunOwned, match=f"{run_dir} is owned by a live job: .* pid {x.pid}"):
            ownership.judge([run_dir], STALE_S)
        waited = time.monotonic() - t0
        assert 1.9 <= waited < STALE_S, waited  # it saw the pause, then a renewal
        other = tmp_path / "other"
        with pytest.raises(ownership.RunOwned, match=f"{ckpt} is owned by a live job"):
            ownership.acquire([other, ckpt], stale_s=STALE_S, takeover=False, role="test")
        assert not other.exists() and x.poll() is None
        # a node of a launch elastic job that does not host its rendezvous, its job's mark not there yet (a
        # requeued job: the same Slurm id, another attempt): refused as its host is
        with pytest.raises(ownership.RunOwned, match=f"pid {x.pid}"):
            ownership.joinable([run_dir, ckpt], STALE_S, "77.1", "10.0.0.1:29400")
        now = ownership.read_mark(run_dir).mark
        assert now is not None and now.token == mark.token  # nothing was taken over

        # 2. a pause past the bound: Y takes over after it, X is fenced before its next write
        pause.touch()
        y = start("y")
        wait_until(lambda: x.poll() is not None, [y], "X fenced", timeout=STALE_S + 120)
        assert x.poll() == 4, x.output()
        (line,) = error_lines(x.output()[1])
        assert line.startswith("error: rank 0: ") and "was taken over by another job (host " in line, line
        assert f"pid {y.pid} (train.py rank 0" in line and "before its next write (exit 4)" in line, line
        take = owner_events(run_dir)[-1]
        assert take["event"] == "owner_takeover" and take["pid"] == y.pid
        assert [(p["reason"], p["token"]) for p in take["previous"]] == [("stale", mark.token)] * 2
        assert STALE_S <= take["waited_s"] < STALE_S + 30, take
        pause.unlink()
        wait_until(lambda: len([e for e in events.read(run_dir) if e["event"] == "start"]) == 2, [y], "Y's start")
        y_start = [e for e in events.read(run_dir) if e["event"] == "start"][-1]
        assert y_start["resumed_from"] is not None

        # 3. the takeover setting breaks Y's live mark at once
        z = start("z", "run.takeover=true")
        wait_until(lambda: y.poll() is not None, [z], "Y fenced")
        assert y.poll() == 4 and f"pid {z.pid} (train.py rank 0" in error_lines(y.output()[1])[0], y.output()
        take = owner_events(run_dir)[-1]
        assert take["pid"] == z.pid and {p["reason"] for p in take["previous"]} == {"forced"}, take
        wait_until(lambda: len([e for e in events.read(run_dir) if e["event"] == "start"]) == 3, [z], "Z's start")

        # 4. kill -9 of every process of Z: the next start proceeds at once
        victims = [psutil.Process(z.pid), *psutil.Process(z.pid).children(recursive=True)]
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(victims, timeout=30)
        curve = run_python(["-m", "launch", "curve", str(run_dir), "--out", str(tmp_path / "curve.png")])
        assert "owner: stale since " in curve.stdout and f"pid {z.pid} on " in curve.stdout, curve.stdout
        step = latest_step(run_dir)
        w = start("w", f"train.stop_at_step={step + 1}")
        wait_until(lambda: w.poll() is not None, [], "W", timeout=180)
        assert w.poll() == 3, w.output()
        assert "(run.takeover)" in z.output()[1] and f"pid {y.pid}" in z.output()[1]
    finally:
        for j in started:
            j.signal(9)
        with contextlib.suppress(FileNotFoundError):
            pause.unlink()
    take, release = owner_events(run_dir)[-2:]
    assert take["pid"] == w.pid and {p["reason"] for p in take["previous"]} == {"gone"}, take
    print(f"the start after kill -9 of every process took the mark over in {take['waited_s']:.3f} s")
    assert take["waited_s"] < 2, take
    start_w = [e for e in events.read(run_dir) if e["event"] == "start"][-1]
    assert start_w["resumed_from"] == f"step{step:08d}"
    assert release["event"] == "owner_release" and not (run_dir / ownership.MARK).exists()
    assert not (ckpt / ownership.MARK).exists()


def test_a_requeued_or_retried_job_is_another_job(monkeypatch) -> None:
    """The job id in a mark carries the scheduler's attempt from the second on: the nodes of a requeued
    ``launch elastic`` job never join under the mark of the instance before them."""
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "AWS_BATCH_JOB_ID", "AWS_BATCH_JOB_ATTEMPT"):
        monkeypatch.delenv(name, raising=False)
    assert ownership.job_id("wp-elastic") == "wp-elastic"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert ownership.job_id("wp-elastic") == "77"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert ownership.job_id() == "77.2"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    monkeypatch.setenv("AWS_BATCH_JOB_ID", "a1b2#3")  # a node of a multi-node job
    monkeypatch.setenv("AWS_BATCH_JOB_ATTEMPT", "1")
    assert ownership.job_id() == "a1b2"
    monkeypatch.setenv("AWS_BATCH_JOB_ATTEMPT", "2")
    assert ownership.job_id() == "a1b2.2"


def test_a_node_of_a_requeued_elastic_job_joins_the_mark_its_host_takes_while_it_watches(tmp_path) -> None:
    """A ``launch elastic`` node that does not host the rendezvous, on a run whose mark names the previous
    instance (another host's, so not provably gone): while it watches, its own host replaces the mark (gone or
    stale there). The change it sees is its host's mark, so it joins; a change to another job's mark refuses."""
    job, rendezvous = "77.1", "10.0.0.1:29400"
    previous = ownership.new_mark("old", "launch elastic", STALE_S, "77", rendezvous)
    previous = replace(previous, host="node9", boot_id="another-boot")  # nothing here can prove it gone
    for d in ("host_takes_it", "another_job"):
        (tmp_path / d).mkdir()
        ownership._create(tmp_path / d, previous)
    host = ownership.new_mark("new", "launch elastic", STALE_S, job, rendezvous)
    threading.Timer(0.5, ownership._replace, (tmp_path / "host_takes_it", host)).start()
    t0 = time.monotonic()
    ownership.joinable([tmp_path / "host_takes_it"], STALE_S, job, rendezvous)
    assert time.monotonic() - t0 < STALE_S  # joined on seeing its host's mark, not after the bound
    other = replace(host, token="other", job="78")
    threading.Timer(0.5, ownership._replace, (tmp_path / "another_job", other)).start()
    with pytest.raises(ownership.RunOwned, match="is owned by a live job"):
        ownership.joinable([tmp_path / "another_job"], STALE_S, job, rendezvous)


def test_renewals_releases_and_takeovers_claim_the_mark_they_read(tmp_path, monkeypatch) -> None:
    """The holder's renewal and release and a newcomer's ``run.takeover`` claim the mark they read the same way
    (``_claim``): a renewal whose read came before the newcomer's write leaves the newcomer's mark; a claim
    another writer holds makes a renewal wait, and a release leave the mark to it; a claim held past
    ``DEAD_CLAIM_S`` (its writer died) is removed and renewals go on; a writer whose claim was taken from it
    writes nothing."""
    monkeypatch.setattr(ownership, "DEAD_CLAIM_S", 0.5)
    d = tmp_path / "run"
    d.mkdir()
    ours = ownership.new_mark("holder", "train.py", STALE_S, None)
    assert ownership._create(d, ours)
    holding = ownership.Holding("holder", [d], owned=True)

    def names() -> list[str]:
        return sorted(p.name for p in d.iterdir())

    # 1. read, then a newcomer breaks the mark, then the renewal's write: the newcomer's mark stays
    seen = ownership.read_mark(d)
    newcomer = ownership.new_mark("newcomer", "train.py", STALE_S, None)
    assert ownership._break(d, ownership.read_mark(d), newcomer)
    assert not holding._renew_one(d, seen, replace(ours, renewals=1))
    assert ownership.read_mark(d).mark.token == "newcomer" and names() == [ownership.MARK]
    # 2. a writer holds the claim: renewals wait, then remove it once held for DEAD_CLAIM_S, and renew
    ownership._replace(d, ours)
    seen = ownership.read_mark(d)
    held = ownership._claim(d, seen)
    held.hardlink_to(d / ownership.MARK)
    assert not holding._renew_one(d, seen, replace(ours, renewals=1))
    assert not holding._renew_one(d, seen, replace(ours, renewals=1))
    assert ownership.read_mark(d).raw == seen.raw and held.exists()
    time.sleep(0.6)
    assert holding._renew_one(d, seen, replace(ours, renewals=1))
    assert ownership.read_mark(d).mark.renewals == 1 and names() == [ownership.MARK]
    # 3. a writer whose claim was taken from it (as a dead one's) writes nothing
    seen = ownership.read_mark(d)
    held.hardlink_to(d / ownership.MARK)
    held.unlink()
    assert not ownership._write_claimed(d, held, seen, newcomer)
    assert ownership.read_mark(d).raw == seen.raw
    # 4. a release while a newcomer holds the claim leaves the mark to it; without one, it removes the mark
    held = ownership._claim(d, seen)
    held.hardlink_to(d / ownership.MARK)
    ownership._remove_if(d, "holder")
    assert ownership.read_mark(d).mark.token == "holder"
    held.unlink()
    ownership._remove_if(d, "holder")
    assert names() == []


def test_a_checkpoint_dir_that_reaches_the_run_dir_through_a_link_is_one_directory(tmp_path) -> None:
    """``checkpoint.dir`` given as a symbolic link to ``run.dir``, as another spelling or another mount of it
    holds one mark, taken and released once; directories not made yet are told apart by their paths."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "ckpt").symlink_to(run)
    spelled = tmp_path / "x" / ".." / "run"
    assert ownership.unique_dirs([run, tmp_path / "ckpt", spelled]) == [run]
    assert ownership.unique_dirs([run, tmp_path / "later", tmp_path / "later"]) == [run, tmp_path / "later"]
    (tmp_path / "bound").mkdir()  # another mount of it: a bind mount (root with CAP_SYS_ADMIN, as CI runs)
    mount = shutil.which("mount")
    bound = None
    if mount:
        bound = subprocess.run([mount, "--bind", run, tmp_path / "bound"], capture_output=True, text=True)
    if bound is not None and bound.returncode == 0:
        try:
            assert ownership.unique_dirs([run, tmp_path / "bound"]) == [run]
        finally:
            subprocess.run(["umount", str(tmp_path / "bound")], check=True)
    else:
        why = bound.stderr.strip() if bound is not None else "no mount command"
        print(f"no bind mount here ({why}): the links and spellings above are what was compared")
    holding = ownership.acquire([run, tmp_path / "ckpt"], stale_s=STALE_S, takeover=False, role="test")
    try:
        assert holding.dirs == [run] and ownership.read_mark(run).mark.token == holding.token
    finally:
        holding.release(None)
    assert not (run / ownership.MARK).exists()
