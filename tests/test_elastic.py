"""``python -m launch elastic`` on one node (the two-node shrink is in test_train_twonode.py) and the goodput
arithmetic of ``training.events``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common.net import free_port
from tests.conftest import FP32, REPO, run_env, run_python, smoke
from training import events, metrics


def elastic(run_dir: Path, data, *extra: str, restarts: int = 2, nodes: str = "1") -> list[str]:
    """The arguments of ``python`` that start ``launch elastic`` of the smoke recipe on ``data``, writing to
    ``run_dir``; in FP32 (``tests.conftest.FP32``: the agent's ways of ending a job are not about BF16
    arithmetic)."""
    return [
        "-m",
        "launch",
        "elastic",
        "--nodes",
        nodes,
        "--max-restarts",
        str(restarts),
        "--rendezvous",
        f"127.0.0.1:{free_port()}",
        "--last-call-s",
        "1",
        "--",
        *smoke(
            data,
            run_dir,
            "train.global_batch=8",
            "train.micro_batch=4",
            "logging.every=1",
            "train.eval_every=0",
            "train.eval_samples=16",
            "checkpoint.every=2",
            "deepspeed.zero_stage=2",
            FP32,
            *extra,
        ),
    ]


def the_rank(agent_parent: psutil.Process, timeout: float = 180) -> psutil.Process:
    """The train.py process the agent started (a grandchild of ``launch elastic``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in agent_parent.children(recursive=True):
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if any(a.endswith("train.py") for a in cmd) and "torch.distributed.run" not in cmd:
                return p
        time.sleep(0.2)
    raise AssertionError("the agent started no rank")


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "checkpoint" and e["step"] >= step for e in events.read(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)


def the_agent(launcher: psutil.Process) -> psutil.Process:
    """torchrun's agent: the child of ``launch elastic`` whose command line names torch.distributed.run."""
    (agent,) = [p for p in launcher.children() if "torch.distributed.run" in p.cmdline()]
    return agent


def saved_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step"))


def finish(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """Its output (stdout and stderr) and the lines of ours in it (``error:``, ``launch elastic:``). Past the
    wait, the failure lists what still runs of the job (its run.dir's processes) and what the launcher said."""
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired as e:
        mine = next((str(a) for a in proc.args if str(a).startswith("run.dir=")), str(proc.args))
        left, procs = [], []
        for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if mine in cmd or p.info["pid"] == proc.pid:
                left.append(f"{p.info['pid']} (parent {p.info['ppid']}, {p.info['status']}): {cmd[:160]}")
                procs.append(p)
        for p in procs:  # nothing of it runs on beside the tests after this one
            with contextlib.suppress(psutil.Error):
                p.kill()
        said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else str(e.output or "")
        raise AssertionError(f"the job did not end: still running {left}; it said: {said[-3000:]}") from None
    return out, [ln for ln in out.splitlines() if ln.startswith(("error:", "launch elastic:"))]


def test_elastic_job_ends_preempted_agent_killed_rank_aborted_budget_spent(bert_data, tmp_path):
    """Three jobs of one run (a start costs some 15 s): ways a job ends that the agent alone gets wrong."""
    run_dir, host = tmp_path / "run", socket.gethostname()
    # 1. The scheduler's SIGTERM reaches `launch elastic`: the agent stops the rank, which saves and exits 3,
    #    and the job ends with 3 for the scheduler to requeue; the agent does not start it again in place.
    proc = subprocess.Popen(
        [sys.executable, *elastic(run_dir, bert_data, "train.steps=400")],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rank = the_rank(psutil.Process(proc.pid))
    # torchrun's agent would give it 1 (SIGABRT on a NCCL error): launch elastic's agent passes 2 on
    assert rank.environ().get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "2"
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, ours = finish(proc)
    assert proc.returncode == 3, out[-4000:]
    assert ours[-1].startswith("launch elastic: SIGTERM: the ranks stopped after saving"), out[-4000:]
    assert "Traceback" not in out, out[-4000:]  # nor torchrun's SignalException
    evs = events.read(run_dir)
    kinds = [e["event"] for e in evs if e["event"] in ("start", "sigterm", "preempted")]
    assert kinds == ["start", "preempted", "sigterm"], kinds
    first = saved_step(run_dir)
    assert first == next(e["step"] for e in evs if e["event"] == "sigterm")  # it saved where it stopped

    # 2. The requeued job resumes and its agent is killed -9 (as by the OOM killer). The rank sees its
    #    launcher gone, saves and exits 3: the job ends with 3 and one line that says what happened.
    proc = subprocess.Popen(
        [sys.executable, *elastic(run_dir, bert_data, "train.steps=400")],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    the_rank(psutil.Process(proc.pid))
    agent = the_agent(psutil.Process(proc.pid))
    wait_for_step(run_dir, first + 2, proc)
    agent.kill()
    out, ours = finish(proc)
    assert proc.returncode == 3 and "Traceback" not in out, out[-4000:]
    (lost,) = [e for e in events.read(run_dir) if e["event"] == "launcher_lost"]
    second = saved_step(run_dir)
    assert lost["step"] == second > first  # it saved where it stopped
    assert ours == [
        f"error: the elastic agent (pid {agent.pid}) on host {host} was killed by SIGKILL (the kernel's OOM "
        f"killer (see dmesg) or a kill -9); its ranks stopped after step {second} and saved it: the job ends "
        f"with code 3 and resumes from step {second} on the next start"
    ], out[-4000:]

    # 3. The requeued job, with 1 restart, resumes. Its rank calls os.abort() as NCCL's watchdog does (no
    #    line, no event of its own): one line and a failure event name the rank, the host and SIGABRT, and
    #    the agent restarts the job from the last checkpoint. Its rank is killed in turn: the budget is
    #    spent, a line and an event for SIGKILL, the final line, exit 1.
    cue = tmp_path / "abort"
    env = {**run_env(), "WP_ABORT_ON_CUE": str(cue)}
    env["PYTHONPATH"] = str(REPO / "tests" / "scripts" / "abort_on_cue") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen(
        [sys.executable, *elastic(run_dir, bert_data, "train.steps=400", restarts=1)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    launcher = psutil.Process(proc.pid)
    aborting = the_rank(launcher)
    wait_for_step(run_dir, second + 2, proc)
    cue.touch()
    deadline = time.monotonic() + 120
    while not (restart := [e for e in events.read(run_dir) if e["event"] == "start" and e["restart"] == 1]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    rank = the_rank(launcher)
    assert rank.pid != aborting.pid
    rank.kill()
    out, ours = finish(proc)
    assert proc.returncode == 1, out[-4000:]
    assert ours == [
        f"error: rank 0 (local rank 0, pid {aborting.pid}) on host {host} died of SIGABRT (an abort: under "
        "NCCL, its watchdog's once a collective failed or timed out: see its lines); the elastic agent "
        "restarts the job from its last checkpoint (restart 1 of 1)",
        f"error: rank 0 (local rank 0, pid {rank.pid}) on host {host} died of SIGKILL (the kernel's OOM "
        "killer (see dmesg) or a kill -9); the elastic agent's restart budget is spent (--max-restarts 1): "
        "the job ends here and resumes from its last checkpoint on the next start",
        "error: the job failed and the elastic agent's restart budget is spent (--max-restarts 1); the "
        f"failures are in {run_dir / events.EVENTS}",
    ], out[-6000:]
    assert "Traceback" not in out, out[-6000:]  # nor torchrun's ChildFailedError
    evs = events.read(run_dir)
    aborted, killed = [e for e in evs if e["event"] == "failure"]  # each restart's failure, the last one too
    assert (aborted["rank"], aborted["signal"], killed["rank"], killed["signal"]) == (
        0,
        "SIGABRT",
        0,
        "SIGKILL",
    )
    assert aborted["why"] == f"died of SIGABRT on host {host} (local rank 0, pid {aborting.pid})"
    saves = [e["step"] for e in evs if e["event"] == "checkpoint" and e["time"] < aborted["time"]]
    # the restart resumed from the last checkpoint committed: the last one with an event, or the save after it
    # (checkpoint.every=2) where the abort, from a thread of its own, landed between that commit and its event
    resumed = restart[0]["step"]
    assert resumed in (max(saves), max(saves) + 2) and resumed > second, (saves, resumed)
    assert [e["step"] for e in evs if e["event"] == "start"] == [0, first, second, resumed]
    g = metrics.goodput(evs)  # the aborted start counts as a failed attempt, with its reason
    assert g is not None and g["attempts"] == 4 and g["failures"][2]["why"] == aborted["why"]


def test_global_batch_that_cannot_be_kept_is_refused_before_the_start(bert_data, tmp_path):
    # 8 = 4 x 2 on 1 node; on 2 nodes 4 x 1 x 2 = 8 fits, on 3 it cannot: refused, nothing started or written
    r = run_python(elastic(tmp_path / "run", bert_data, nodes="1:3"), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: train.global_batch=8 cannot be kept on 3 node(s)"), r.stderr
    assert not (tmp_path / "run").exists()
    r = run_python(elastic(tmp_path / "run", bert_data, "train.grad_accum=2", nodes="1:2"), timeout=60)
    assert r.returncode == 2 and "train.grad_accum=2 is fixed" in r.stderr, r.stderr


def _ev(kind: str, t: float, **kw) -> dict:
    return {"event": kind, "time": t, **kw}


def test_goodput_arithmetic() -> None:
    # attempt 1: starts at 10 (launched at 0), saves step 2 at 20 (1 s stall) and step 4 at 30 (1 s), trains
    # on to 38 and fails; attempt 2 starts at 50 from step 4, saves step 6 at 60 (1 s) and finishes at 62.
    evs = [
        _ev("start", 10, world_size=2, step=0, startup_s=10),
        _ev("checkpoint", 20, step=2, save_s=1.0),
        _ev("checkpoint", 30, step=4, save_s=1.0),
        _ev("failure", 38, rank=0, why="another rank is gone"),
        _ev("world_size_change", 49, previous=2, world_size=1),
        _ev("start", 50, world_size=1, step=4, startup_s=5),
        _ev("checkpoint", 60, step=6, save_s=1.0),
        _ev("finish", 62, step=6, samples=48),
    ]
    g = metrics.goodput(evs)
    assert g is not None
    assert g["wall_s"] == 62  # from the first launch (10 - 10) to the last event
    assert g["productive_s"] == pytest.approx((30 - 10 - 2) + (62 - 50 - 1))  # surviving steps, stalls out
    assert g["goodput"] == pytest.approx(29 / 62)
    assert g["checkpoint_stall_s"] == 3.0 and g["attempts"] == 2 and g["world_sizes"] == [2, 1]
    (f,) = g["failures"]
    assert f == {
        "attempt": 1,
        "why": "another rank is gone",
        "at_step": 4,
        "resumed_at_step": 4,
        "redone_s": 8.0,
        "restart_s": 12.0,
    }
    assert metrics.goodput([]) is None

    # per segment of constant world size: start 1 trained steps 0-4 on 2 devices in 30 - 10 - 2 s of stalls,
    # start 2 steps 4-6 on 1 device in 62 - 50 - 1 s; global batch 8, 128 tokens a sequence
    seg = metrics.segments(evs, global_batch=8, seq_len=128, flops_per_token=1e6, peak_flops_per_device=1e9)
    assert seg is not None
    one, two = seg["segments"]
    assert (one["world_size"], one["from_step"], one["to_step"], one["seconds"]) == (2, 0, 4, 18.0)
    assert (two["world_size"], two["from_step"], two["to_step"], two["seconds"]) == (1, 4, 6, 11.0)
    assert one["sequences_per_sec"] == pytest.approx(32 / 18)
    assert two["sequences_per_sec"] == pytest.approx(16 / 11)
    assert one["mfu"] == pytest.approx(16 / 18 * 128 * 1e6 / 1e9)
    assert two["scaling_efficiency"] == 1.0  # the segment with the fewest devices is the baseline
    assert one["scaling_efficiency"] == pytest.approx((16 / 18) / (16 / 11))
    total = seg["total"]
    assert total["sequences"] == 48 and total["seconds"] == 29.0
    assert total["sequences_per_sec_per_device"] == pytest.approx(48 / (18 * 2 + 11))  # per device-second
    assert total["mfu"] == pytest.approx(48 / 47 * 128 * 1e6 / 1e9)
    assert metrics.segments([], 8, 128) is None
    assert events.read(Path("/nonexistent")) == []  # a run with no events file yet

    # events that carry the run's computed tokens and FLOPs (an unpadded run computes fewer than 128 a
    # sequence): the segments count those, not global_batch x seq_len, and the MFU follows them
    counted = [dict(ev) for ev in evs]
    work = {0: (0, 0.0), 2: (1500, 1.5e9), 4: (3000, 3.0e9), 6: (4400, 4.5e9)}  # tokens and FLOPs at each step
    for ev in counted:
        if "step" in ev and ev["event"] in ("start", "checkpoint", "finish"):
            ev["tokens"], ev["flops"] = work[int(ev["step"])]
    seg = metrics.segments(counted, global_batch=8, seq_len=128, flops_per_token=1e6, peak_flops_per_device=1e9)
    assert seg is not None
    one, two = seg["segments"]
    assert (one["tokens"], one["flops"], two["tokens"], two["flops"]) == (3000, 3.0e9, 1400, 1.5e9)
    assert one["sequences_per_sec"] == pytest.approx(32 / 18)  # sequences are still steps x global batch
    assert one["tokens_per_sec_per_device"] == pytest.approx(3000 / 18 / 2)
    assert one["mfu"] == pytest.approx(3.0e9 / 18 / 2 / 1e9) and two["mfu"] == pytest.approx(1.5e9 / 11 / 1e9)
    assert seg["total"]["tokens"] == 4400 and seg["total"]["mfu"] == pytest.approx(4.5e9 / 47 / 1e9)


def test_goodput_counts_a_background_save_from_its_stall_not_its_commit() -> None:
    """A background save of step 4 stalls training until 30 and is committed at 33 (``done_at`` 30): the steps
    kept are those up to 30, as for a synchronous save that ended at 30; its stall (0.2 s) counts, its writing
    (overlapped with training) does not."""
    evs = [
        _ev("start", 10, world_size=2, step=0, startup_s=10),
        _ev("checkpoint", 33, step=4, save_s=0.2, write_s=2.5, done_at=30.0),
        _ev("failure", 38, rank=0, why="another rank is gone"),
        _ev("start", 50, world_size=2, step=4, startup_s=5),
        _ev("finish", 62, step=6, samples=48),
    ]
    g = metrics.goodput(evs)
    assert g is not None
    assert g["productive_s"] == pytest.approx((30 - 10 - 0.2) + (62 - 50))
    assert g["failures"][0]["redone_s"] == pytest.approx(8.0)  # 30 to 38, not 33 to 38
    assert g["checkpoint_stall_s"] == pytest.approx(0.2)
    seg = metrics.segments(evs, global_batch=8, seq_len=128)
    assert seg is not None
    assert seg["segments"][0]["seconds"] == pytest.approx(30 - 10 - 0.2)

    # SIGTERM after step 6 of a start at step 4: step 5's background save is committed after the sigterm event
    # is written; the segment still ends at step 6
    stopped = [
        _ev("start", 10, world_size=2, step=4, startup_s=10),
        _ev("sigterm", 40, rank=1, step=6, why="SIGTERM"),
        _ev("checkpoint", 41, step=5, save_s=0.5, write_s=2.0, done_at=35.0),
    ]
    seg = metrics.segments(stopped, global_batch=8, seq_len=128)
    assert seg is not None
    (only,) = seg["segments"]
    assert only["to_step"] == 6 and only["seconds"] == pytest.approx(40 - 10 - 0.5)


def test_events_file_round_trip_and_torn_line(tmp_path: Path) -> None:
    events.record(tmp_path, "start", step=0, world_size=1, startup_s=1.0)
    events.record(tmp_path, "finish", step=3, samples=24)
    with open(tmp_path / events.EVENTS, "a") as f:
        f.write('{"event": "checkpoi')
    got = events.read(tmp_path)
    assert [e["event"] for e in got] == ["start", "finish"] and got[1]["samples"] == 24
    assert json.loads((tmp_path / events.EVENTS).read_text().splitlines()[0])["world_size"] == 1


def test_bad_input_is_not_retried(bert_data, tmp_path):
    """The data directory is missing: every start would fail the same way, so the job ends at the first, exit 2.
    Started outside the repository with a relative run.dir: the ranks write the events this process reads."""
    argv = elastic(Path("run"), bert_data, f"data.train={tmp_path / 'nope'}", restarts=3)
    r = run_python(argv, timeout=180, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-3000:]  # the agent is ended without its own report
    line = f"error: data.train={tmp_path / 'nope'}: directory does not exist"
    assert r.stderr.strip().splitlines() == [line], r.stderr[-3000:]
    kinds = [e["event"] for e in events.read(tmp_path / "run")]  # launch elastic held the run throughout
    assert kinds[:2] == ["owner_acquire", "user_error"] and kinds[-1] == "owner_release", kinds


def test_youngs_interval() -> None:
    from training.checkpoint.checkpointer import young_interval

    # C = 30 s, MTBF = 3 h: sqrt(2 x 30 x 10800) = 804.98 s; at 2 s a step, 402 steps, 402 s lost per failure
    plan = young_interval(30.0, 2.0, 3 * 3600.0)
    assert plan["interval_s"] == pytest.approx(804.984, abs=1e-3)
    assert plan["steps"] == 402 and plan["expected_loss_s"] == pytest.approx(402.0)
    assert young_interval(0.0, 100.0, 60.0)["steps"] == 1  # never below one step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["checkpoint.every=auto"], "checkpoint.every=auto needs checkpoint.mtbf_hours > 0"),
        (["checkpoint.every=auto", "checkpoint.mtbf_hours=0"], "needs checkpoint.mtbf_hours > 0 (one node"),
        (["checkpoint.every=-2"], "checkpoint.every must be >= 0 or auto, got -2"),
        (["checkpoint.every=often"], "checkpoint.every: expected int or 'auto', got 'often'"),
    ],
)
def test_checkpoint_every_bad_values(overrides: list[str], message: str) -> None:
    from common.errors import UserError
    from training.config import load_config

    with pytest.raises(UserError) as e:
        load_config("smoke", overrides)
    assert message in str(e.value)


def test_checkpoint_every_auto_saves_at_youngs_interval(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    data = bert_data
    argv = [
        "train.py",
        *smoke(
            data,
            run_dir,
            "train.global_batch=8",
            "train.micro_batch=4",
            "train.steps=14",
            "train.eval_every=0",
            "train.eval_samples=16",
            "logging.warmup_steps=2",
            "checkpoint.every=auto",
            "checkpoint.mtbf_hours=0.01",
            "checkpoint.keep=20",
        ),
    ]
    r = run_python(argv, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = events.read(run_dir)
    saves = [e["step"] for e in evs if e["event"] == "checkpoint"]
    plans = [e for e in evs if e["event"] == "checkpoint_interval"]
    assert saves[0] == 3  # right after the 2 warm-up steps: it measures the save cost
    assert plans and plans[0]["step"] == 3 and plans[0]["job_mtbf_s"] == 36.0  # 0.01 h on one node
    for plan in plans:  # each plan is Young's interval of what the run measured, and the next save keeps it
        expect = (2 * plan["save_s"] * plan["job_mtbf_s"]) ** 0.5
        assert plan["interval_s"] == pytest.approx(expect, rel=1e-3)
        assert plan["every_steps"] == max(1, round(plan["interval_s"] / plan["step_s"]))
        nxt = plan["step"] + plan["every_steps"]
        assert nxt in saves or nxt >= 14, (plan, saves)
    assert saves[-1] == 14  # the final save
    assert "checkpoint.every=auto: save" in r.stderr and "expected loss per failure" in r.stderr


def test_node_mtbf_comes_from_the_cluster_profile(tmp_path: Path) -> None:
    # `launch env --profile efa` writes WP_NODE_MTBF_HOURS for every node; the config takes it as default
    from common.errors import UserError
    from training.config import MTBF_ENV, node_mtbf_from_env

    out = tmp_path / "env"
    r = run_python(["-m", "launch", "env", "--profile", "efa", "--out", str(out)], timeout=60)
    assert r.returncode == 0, r.stderr
    value = dict(ln.split("=", 1) for ln in out.read_text().splitlines())[MTBF_ENV]
    env = {**run_env(), MTBF_ENV: value}
    code = "from training.config import load_config; print(load_config('smoke', %r).checkpoint.mtbf_hours)"
    cases = ((["checkpoint.every=auto"], float(value)), (["checkpoint.mtbf_hours=12"], 12.0))
    for overrides, expect in cases:  # the profile's value is the default; an explicit one wins
        r = run_python(["-c", code % overrides], timeout=60, env=env)
        assert r.returncode == 0 and float(r.stdout) == expect, r.stderr
    assert node_mtbf_from_env({}) is None
    with pytest.raises(UserError) as e:
        node_mtbf_from_env({MTBF_ENV: "soon"})
    assert str(e.value) == f"{MTBF_ENV}='soon' (the cluster profile's env): not a positive number of hours"
