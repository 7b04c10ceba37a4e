"""A real two-node job: train.py across two network namespaces, then node 1 dies and the job restarts.

Node 0 (10.77.0.1) and node 1 (10.77.0.2) each run their own DeepSpeed launcher with ``--no_ssh --node_rank
R`` and one hostfile; the run directory is shared, as on a cluster with a shared filesystem.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FP32, REPO, run_env, run_python, smoke
from tests.netns import SUBNET, kill_namespace_processes, own_host, two_nodes, unavailable_reason
from tests.test_train import last_logged

pytestmark = pytest.mark.slow

_REASON = unavailable_reason()
if _REASON:
    pytest.skip(f"two-node tests need network namespaces: {_REASON}", allow_module_level=True)

PORT = 29511


def start(
    node, rank: int, master: str, hostfile: Path, args: list[str], log: Path, private: Path | None = None
) -> subprocess.Popen:
    """Node ``rank``'s launcher; ``private``: a directory this node sees as its own empty tmpfs (a mount
    namespace of its own), as a node-local disk would be."""
    env = {**run_env(), "GLOO_SOCKET_IFNAME": node.ifname}
    argv = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--no_ssh",
        "--node_rank",
        str(rank),
        "--master_addr",
        master,
        "--master_port",
        str(PORT),
        "--hostfile",
        str(hostfile),
        "train.py",
        *args,
    ]
    if private is not None:  # the mount lives and dies with the namespace: nothing to unmount
        argv = [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=64m tmpfs "{private}" && exec "$@"',
            "sh",
            *argv,
        ]
    return subprocess.Popen(node.cmd(*argv), cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            out.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            out.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return out


def train_args(data, run_dir: Path, *extra: str) -> list[str]:
    return smoke(
        data,
        run_dir,
        "train.global_batch=16",
        "train.micro_batch=4",
        "logging.every=1",
        "train.eval_every=0",
        "train.eval_samples=32",
        "deepspeed.zero_stage=2",
        "deepspeed.timeout_s=60",
        *extra,
    )


def test_two_node_training_then_node_failure_and_restart(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    with two_nodes("t") as (n0, n1):
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(f"{n0.addr} slots=1\n{n1.addr} slots=1\n")
        logs = [tmp_path / f"node{r}.log" for r in range(2)]

        # 1. A long run across both nodes; node 1 dies mid-run: node 0 must exit within a bounded time, not hang.
        args = train_args(bert_data, run_dir, "train.steps=100000", "checkpoint.every=2", FP32)
        procs = [start(n, r, n0.addr, hostfile, args, logs[r]) for r, n in enumerate((n0, n1))]
        deadline = time.monotonic() + 240
        while last_logged(run_dir) < 8:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.5)
        assert kill_namespace_processes(n1)
        t0 = time.monotonic()
        rc0 = wait(procs[:1], 90)[0]
        elapsed = time.monotonic() - t0
        wait(procs[1:], 10)
        assert rc0 not in (0, None), logs[0].read_text()[-3000:]
        assert elapsed < 90
        last = (run_dir / "checkpoints" / "latest").read_text().strip()
        last_step = int(last.removeprefix("step"))
        assert last_step >= 6

        # 2. Restart on both nodes: resumes from the last complete checkpoint and ends at world size 2, ZeRO-2,
        #    with the replicas identical afterwards.
        args = train_args(bert_data, run_dir, f"train.steps={last_step + 2}", "checkpoint.every=2", FP32)
        rcs = wait([start(n, r, n0.addr, hostfile, args, logs[r]) for r, n in enumerate((n0, n1))], 300)
        text = logs[0].read_text()
        assert rcs == [0, 0], text[-3000:] + logs[1].read_text()[-3000:]
        assert f"resumed from {run_dir / 'checkpoints' / last}" in text
        replicas = [json.loads((run_dir / "replicas" / f"rank{r}.json").read_text()) for r in range(2)]
        assert [r["world_size"] for r in replicas] == [2, 2]
        assert {r["address"] for r in replicas} == {n0.addr, n1.addr}  # both nodes took part
        assert replicas[0]["params_sha256"] == replicas[1]["params_sha256"]  # gradients were synchronised
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["nodes"] == 2  # the deepspeed launcher's node count

        # 3. Node 1 gets a checkpoint directory of its own (node-local storage): refused at start-up on both
        #    nodes, with one line naming the node and the path, before anything is trained or loaded.
        ckpt = run_dir / "checkpoints"
        before = sorted(p.name for p in ckpt.iterdir())
        args = train_args(bert_data, run_dir, f"train.steps={last_step + 4}", "checkpoint.every=2", FP32)
        procs = [
            start(n0, 0, n0.addr, hostfile, args, logs[0]),
            start(n1, 1, n0.addr, hostfile, args, logs[1], private=ckpt),
        ]
        t0 = time.monotonic()
        rcs = wait(procs, 120)
        assert all(rc not in (0, None) for rc in rcs), rcs
        assert time.monotonic() - t0 < 120
        for log in logs:
            errors = [ln for ln in log.read_text().splitlines() if "error:" in ln]
            assert len(errors) == 1, log.read_text()[-4000:]  # one line in each node's log
            assert f"checkpoint.dir {ckpt} is not shared by every rank: node" in errors[-1], errors
            assert "(rank 1) does not see" in errors[-1] and "node-local checkpoint directories" in errors[-1]
        assert sorted(p.name for p in ckpt.iterdir()) == before, "nothing written or removed"


def start_elastic(node, args: list[str], log: Path, nodes: str = "1:2", restarts: int = 2):
    """Node ``node``'s ``launch elastic``: the rendezvous is on node 0 (10.77.0.1)."""
    env = {**run_env(), "GLOO_SOCKET_IFNAME": node.ifname}
    argv = [
        sys.executable,
        "-m",
        "launch",
        "elastic",
        "--nodes",
        nodes,
        "--max-restarts",
        str(restarts),
        "--rendezvous",
        f"{SUBNET}.1:{PORT + 7}",
        "--job-id",
        "elastic-test",
        "--last-call-s",
        "3",
        "--local-addr",
        node.addr,
        "--",
        *args,
    ]
    return subprocess.Popen(node.cmd(*argv), cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def test_elastic_job_loses_a_node_goes_on_alone_and_grows_back(bert_data, tmp_path):
    """bert-debug (ZeRO-2, BF16, LANS) on 2 nodes under the elastic agent. Node 1 dies mid-run: node 0 goes on
    alone from the last checkpoint, nobody acting. Node 1 comes back: the job grows back to 2 nodes at a
    restart. It ends with exactly train.steps x global_batch samples, and events.jsonl tells the story."""
    from training import events
    from training.metrics import goodput

    run_dir, steps = tmp_path / "run", 30
    # BF16, unlike the test above: the steps' length is what its waits and its 30 steps are tuned to
    args = train_args(bert_data, run_dir, f"train.steps={steps}", "checkpoint.every=2", "deepspeed.timeout_s=20")
    logs = [tmp_path / f"node{r}.log" for r in range(2)] + [tmp_path / "node1-back.log"]

    def starts() -> list[dict]:
        return [e for e in events.read(run_dir) if e["event"] == "start"]

    def wait_until(cond, procs: list[subprocess.Popen], what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}: " + logs[0].read_text()[-4000:]
            assert all(p.poll() is None for p in procs), f"{what}: " + logs[0].read_text()[-4000:]
            time.sleep(0.3)

    with two_nodes("e") as (n0, n1):
        procs = [start_elastic(n, args, logs[r]) for r, n in enumerate((n0, n1))]
        wait_until(lambda: last_logged(run_dir) >= 5, procs, "step 5")
        assert kill_namespace_processes(n1)
        wait(procs[1:], 10)

        # node 0 restarts alone at world size 1; once it has saved there, node 1 comes back
        def saved_alone() -> bool:
            s = starts()
            return len(s) == 2 and any(
                e["event"] == "checkpoint" and e["time"] > s[1]["time"] for e in events.read(run_dir)
            )

        wait_until(saved_alone, procs[:1], "node 0 alone")
        back = start_elastic(n1, args, logs[2])
        rcs = wait([procs[0], back], 300)
    text = logs[0].read_text()
    assert rcs == [0, 0], text[-5000:] + logs[2].read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == steps
    assert summary["samples"] == steps * 16  # the global batch was kept: 4 x 2 x 2 on 2 nodes, 4 x 4 x 1 on 1
    owner = [e for e in events.read(run_dir) if e["event"].startswith("owner_")]
    # node 0's launch elastic (it hosts the rendezvous) held the run for the whole job, node 1 ran under it
    assert [(e["event"], e.get("role")) for e in owner] == [
        ("owner_acquire", "launch elastic"),
        ("owner_release", None),
    ]
    evs = [e for e in events.read(run_dir) if not e["event"].startswith("owner_")]
    kinds = [e["event"] for e in evs]
    first, alone, grown = starts()
    assert [s["world_size"] for s in (first, alone, grown)] == [2, 1, 2], kinds
    assert alone["restart"] == 1 and alone["resumed_from"] is not None  # a failure: one restart spent
    failure = next(e for e in evs if e["event"] == "failure")  # the survivor recorded the lost peer
    assert first["time"] < failure["time"] < alone["time"]
    saves_before = [e["step"] for e in evs if e["event"] == "checkpoint" and e["time"] < alone["time"]]
    assert alone["step"] == max(saves_before)  # resumed from the last committed checkpoint
    # growing back: the agent stopped node 0's rank (SIGTERM: it saved where it stopped) and restarted on 2
    stop = next(e for e in evs if e["event"] == "sigterm" and alone["time"] < e["time"] < grown["time"])
    assert grown["step"] == stop["step"] and grown["resumed_from"] == f"step{stop['step']:08d}"
    changes = [(e["previous"], e["world_size"]) for e in evs if e["event"] == "world_size_change"]
    assert changes == [(2, 1), (1, 2)]
    assert kinds[-1] == "finish" and evs[-1]["step"] == steps and evs[-1]["samples"] == steps * 16
    g = goodput(evs)
    assert g is not None and 0 < g["goodput"] < 1 and g["attempts"] == 3 and g["world_sizes"] == [2, 1, 2]
    assert [f["resumed_at_step"] for f in g["failures"]] == [alone["step"], grown["step"]]
    assert all(f["restart_s"] > 0 for f in g["failures"]) and g["failures"][1]["redone_s"] < 5
    assert summary["goodput"]["goodput"] == pytest.approx(g["goodput"], abs=0.05)
    seg = summary["segments"]  # throughput per world size: every segment trained, the totals add up
    assert [s["world_size"] for s in seg["segments"]] == [2, 1, 2]
    assert all(s["sequences_per_sec"] > 0 and 0 < s["mfu"] < 1 for s in seg["segments"])
    assert seg["segments"][1]["scaling_efficiency"] == 1.0  # world size 1 is the baseline
    assert seg["total"]["sequences"] == sum((s["to_step"] - s["from_step"]) * 16 for s in seg["segments"])
    # launch report reads the same figures back
    r = run_python(["-m", "launch", "report", str(run_dir)], timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"- `{run_dir}`: goodput"))
    assert f"goodput {g['goodput'] * 100:.1f}% over 3 start(s) at world size(s) 2 1 2" in line, line


def start_alone(node, args: list[str], log: Path, host: str | None = None) -> subprocess.Popen:
    """A one-process train.py job on ``node``; ``host``: as a host of its own (``tests.netns.own_host``)."""
    env = {**run_env(), "GLOO_SOCKET_IFNAME": "lo"}  # its process group is its own: on the node's loopback
    argv = [sys.executable, "train.py", *args]
    return subprocess.Popen(
        node.cmd(*(own_host(host, argv) if host else argv)),
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def test_a_run_held_on_another_node_is_refused_then_taken_over_once_stale(bert_data, tmp_path):
    """Node 1 is a host of its own (its own host name and PID namespace) and holds a run on the shared
    directory: a job on node 0 is refused while node 1's renews its mark (its pid means nothing on node 0).
    Node 1 dies without a word: node 0's next job waits out the staleness bound (``run.owner_stale_s=6``),
    takes the run over and resumes from ``latest``."""
    from training import events, ownership

    run_dir, stale = tmp_path / "run", 6
    args = train_args(bert_data, run_dir, "train.steps=100000", "train.global_batch=4", "checkpoint.every=2", FP32) + [
        f"run.owner_stale_s={stale}"
    ]
    logs = [tmp_path / f"{name}.log" for name in ("holder", "refused", "after")]
    with two_nodes("o") as (n0, n1):
        holder = start_alone(n1, args, logs[0], host="node1")
        deadline = time.monotonic() + 240
        while not (last_logged(run_dir) >= 2 and (run_dir / "checkpoints" / "latest").exists()):
            assert time.monotonic() < deadline and holder.poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        mark = ownership.read_mark(run_dir).mark
        assert mark is not None and mark.host == "node1" and mark.pid_ns != ownership.pid_namespace()

        t0 = time.monotonic()
        rc = wait([start_alone(n0, args, logs[1])], 120)[0]
        refused_s = time.monotonic() - t0
        text = logs[1].read_text()
        assert rc == 2, text[-3000:]
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and f"{run_dir} is owned by a live job: host node1, pid {mark.pid}" in errors[0]
        print(f"node 0's job was refused {refused_s:.1f} s after it started")
        assert holder.poll() is None  # untouched

        assert kill_namespace_processes(n1)
        killed = time.time()
        wait([holder], 30)
        step = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step"))
        rc = wait([start_alone(n0, [*args, f"train.stop_at_step={step + 1}"], logs[2])], 240)[0]
    text = logs[2].read_text()
    assert rc == 3, text[-3000:]
    take = next(e for e in events.read(run_dir) if e["event"] == "owner_takeover")
    assert {(p["reason"], p["host"]) for p in take["previous"]} == {("stale", "node1")}, take
    assert stale <= take["waited_s"] < stale + 30, take
    print(f"node 0's next job took the run over {take['time'] - killed:.1f} s after node 1 was killed")
    assert f"resumed from {run_dir / 'checkpoints' / f'step{step:08d}'}" in text
