"""Two-node DeepSpeed jobs across network namespaces: the collective benchmark, then node failures.

Each "node" is a network namespace with its own address (10.77.0.1, 10.77.0.2) and its own DeepSpeed launcher
started with ``--no_ssh --node_rank R`` and one hostfile listing both. gloo is bound to each namespace's veth
with GLOO_SOCKET_IFNAME (otherwise it binds to whatever the host name resolves to, absent in the namespace).

Failure behaviour checked here (and documented in the report):
* node 1's processes killed: the kernel closes their sockets, node 0's gloo call fails at once with
  "Connection closed by peer", its rank exits non-zero, DeepSpeed's per-node launcher kills the node's other
  ranks and exits with that code;
* node 1 cut off (its link down, sockets silent): nothing closes, and node 0 fails only when the collective
  timeout given to ``init_distributed`` (commbench ``--timeout-s``; train.py: DEEPSPEED_TIMEOUT minutes)
  expires.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env
from tests.netns import kill_namespace_processes, two_nodes, unavailable_reason

pytestmark = pytest.mark.slow

_REASON = unavailable_reason()
if _REASON:
    pytest.skip(f"two-node tests need network namespaces: {_REASON}", allow_module_level=True)

PORT = 29500  # each namespace has its own port space: nothing else can hold it


def start_node(node, rank: int, master: str, hostfile: Path, bench_args: list[str], log: Path) -> subprocess.Popen:
    env = run_env()
    env["GLOO_SOCKET_IFNAME"] = node.ifname
    cmd = node.cmd(
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
        "--module",
        "launch",
        "commbench",
        *bench_args,
    )
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_files(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"ranks did not start: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.5)


def _hostfile(tmp_path: Path, a, b) -> Path:
    hf = tmp_path / "hostfile"
    hf.write_text(f"{a.addr} slots=1\n{b.addr} slots=1\n")
    return hf


def test_commbench_across_two_namespaces(tmp_path: Path) -> None:
    with two_nodes("c") as (n0, n1):
        hf = _hostfile(tmp_path, n0, n1)
        info, out = tmp_path / "ranks", tmp_path / "comm.json"
        args = ["--sizes", "4K,256K", "--iters", "5", "--rank-info", str(info), "--out", str(out)]
        procs = [start_node(n, r, n0.addr, hf, args, tmp_path / f"node{r}.log") for r, n in enumerate((n0, n1))]
        rcs = wait_all(procs, timeout=240)
        logs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
        assert rcs == [0, 0], logs
    ranks = {r: json.loads((info / f"rank{r}.json").read_text()) for r in range(2)}
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    assert ranks[0]["address"] == "10.77.0.1" and ranks[1]["address"] == "10.77.0.2"
    assert ranks[0]["node_rank"] == 0 and ranks[1]["node_rank"] == 1
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert {r["address"] for r in result["ranks"]} == {"10.77.0.1", "10.77.0.2"}
    ops = {(r["op"], r["bytes"]) for r in result["results"]}
    assert ops == {(op, s) for op in ("all_reduce", "all_gather", "reduce_scatter") for s in (4096, 262144)}
    assert all(r["busbw_Bps"] > 0 for r in result["results"])
    assert "busbw_MB/s" in logs[0] and "2 ranks on 2 node(s)" in logs[0]


def _start_long_job(tmp_path: Path, n0, n1, timeout_s: int) -> tuple[list[subprocess.Popen], Path]:
    hf = _hostfile(tmp_path, n0, n1)
    info = tmp_path / "ranks"
    args = ["--sizes", "256K", "--ops", "all_reduce", "--iters", "100000000", "--time-budget-s", "0"]
    args += ["--timeout-s", str(timeout_s), "--rank-info", str(info)]
    procs = [start_node(n, r, n0.addr, hf, args, tmp_path / f"node{r}.log") for r, n in enumerate((n0, n1))]
    wait_for_files([info / "rank0.json", info / "rank1.json"], procs, timeout=180)
    time.sleep(2.0)  # inside the all-reduce loop now
    assert all(p.poll() is None for p in procs), "the collective loop ended by itself"
    return procs, tmp_path / "node0.log"


def test_node1_killed_node0_exits_promptly(tmp_path: Path) -> None:
    with two_nodes("k") as (n0, n1):
        procs, log0 = _start_long_job(tmp_path, n0, n1, timeout_s=300)
        killed = kill_namespace_processes(n1)
        assert killed
        t0 = time.monotonic()
        rc0 = wait_all(procs[:1], timeout=60)[0]
        elapsed = time.monotonic() - t0
        wait_all(procs[1:], timeout=10)
    text = log0.read_text()
    print(f"node 0 exited with {rc0} {elapsed:.1f}s after node 1 was killed")
    assert rc0 != 0, text
    assert elapsed < 60
    assert "Connection closed by peer" in text or "Connection reset" in text, text[-3000:]


def test_node1_cut_off_node0_exits_by_timeout(tmp_path: Path) -> None:
    with two_nodes("p") as (n0, n1):
        procs, log0 = _start_long_job(tmp_path, n0, n1, timeout_s=15)
        subprocess.run(["ip", "-n", n1.ns, "link", "set", n1.ifname, "down"], check=True)
        t0 = time.monotonic()
        rc0 = wait_all(procs[:1], timeout=60)[0]
        elapsed = time.monotonic() - t0
        kill_namespace_processes(n1)
        wait_all(procs[1:], timeout=10)
    text = log0.read_text()
    print(f"node 0 exited with {rc0} {elapsed:.1f}s after node 1 was cut off (timeout 15 s)")
    assert rc0 != 0, text
    assert elapsed < 60
    assert "Timed out" in text or "timed out" in text or "Connection" in text, text[-3000:]


FORGER = """
import json, socket, sys
from launch.hosts import registration_token
main, port, claim, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
token = registration_token(secret, "job-7#1", 1, claim, 8)
with socket.create_connection((main, port), timeout=10) as c:
    c.sendall(json.dumps({"index": 1, "ip": claim, "slots": 8, "token": token}).encode() + b"\\n")
    print("reply" if c.recv(1 << 16) else "closed")
"""


def test_awsbatch_registration_admits_only_the_jobs_nodes(tmp_path: Path) -> None:
    """The main node (namespace 0) refuses a registration from node 1's address that claims another address,
    and one with a token made under another secret; node 1's real registration then completes the job."""
    secret = "the-job-definitions-secret"
    with two_nodes("r") as (n0, n1):
        env = {
            **run_env(),
            "AWS_BATCH_JOB_NUM_NODES": "2",
            "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
            "WP_REGISTRATION_SECRET": secret,
        }
        main_out = tmp_path / "hf0"
        main = subprocess.Popen(
            n0.cmd(
                sys.executable,
                "-m",
                "launch",
                "hostfile",
                "--from",
                "awsbatch",
                "--slots",
                "8",
                "--port",
                "29499",
                "--timeout",
                "60",
                "--ip",
                n0.addr,
                "--out",
                str(main_out),
            ),
            cwd=REPO,
            env={**env, "AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_ID": "job-7#0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            forged = []
            for claim, key in ((f"{n1.addr[:-1]}9", secret), (n1.addr, "another-secret-altogether")):
                deadline = time.monotonic() + 30
                while True:  # until the main node listens
                    r = subprocess.run(
                        n1.cmd(sys.executable, "-c", FORGER, n0.addr, "29499", claim, key),
                        cwd=REPO,
                        env=run_env(),
                        capture_output=True,
                        text=True,
                    )
                    if r.returncode == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
                forged.append(r.stdout.strip())
            assert forged == ["closed", "closed"], forged  # refused: no hostfile sent back
            child = subprocess.run(
                n1.cmd(
                    sys.executable,
                    "-m",
                    "launch",
                    "hostfile",
                    "--from",
                    "awsbatch",
                    "--slots",
                    "8",
                    "--port",
                    "29499",
                    "--timeout",
                    "60",
                    "--ip",
                    n1.addr,
                    "--out",
                    str(tmp_path / "hf1"),
                ),
                cwd=REPO,
                env={
                    **env,
                    "AWS_BATCH_JOB_NODE_INDEX": "1",
                    "AWS_BATCH_JOB_ID": "job-7#1",
                    "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": n0.addr,
                },
                capture_output=True,
                text=True,
                timeout=90,
            )
            _, err = main.communicate(timeout=60)
        finally:
            if main.poll() is None:
                main.kill()
        assert child.returncode == 0 and main.returncode == 0, (child.stderr, err)
        assert f"rejected registration from {n1.addr}: claims address {n1.addr[:-1]}9 but connects from" in err
        assert f"rejected registration from {n1.addr}: wrong token" in err
        hostfile = f"{n0.addr} slots=8\n{n1.addr} slots=8\n"
        assert main_out.read_text() == (tmp_path / "hf1").read_text() == hostfile
