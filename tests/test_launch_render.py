"""Job templates: valid shell and JSON, values quoted, and no shell injection from paths or arguments."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.net import free_port
from tests.conftest import REPO, run_env, run_python

EVIL = "x; touch {canary}"


def render(tmp_path: Path, kind: str, *args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "launch", "render", kind, *args], timeout=60)


def dry_env(tmp_path: Path) -> dict[str, str]:
    env = run_env()
    env["PATH"] = os.path.dirname(sys.executable) + ":/usr/bin:/bin"  # python of the venv; no srun/scontrol
    env["WP_DRY_RUN"] = "1"
    return env


def dry_run_slurm(script: Path, tmp_path: Path, arg: str, **env_vars: str) -> subprocess.CompletedProcess:
    """A rendered sbatch script, valid bash, run dry (WP_DRY_RUN) with ``arg`` as the extra override."""
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = dry_env(tmp_path)
    env.update(WP_JOB_DIR=str(tmp_path / "job"), **env_vars)
    run = subprocess.run(["bash", str(script), arg], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.parametrize("mode", ["ssh", "srun"])
def test_slurm_script_is_valid_and_injection_safe(tmp_path: Path, mode: str) -> None:
    canary = tmp_path / "pwned"
    evil = EVIL.format(canary=canary)
    out = tmp_path / "job.sbatch"
    r = render(tmp_path, "slurm", "--config", evil, "--nodes", "2", "--mode", mode, "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert shlex.quote(evil) in text and "#SBATCH --nodes=2" in text and "{{" not in text
    run = dry_run_slurm(
        out, tmp_path, "extra=$(touch " + str(canary) + ")", SLURM_JOB_NODELIST="node[01-02]", SLURM_NODEID="0"
    )
    assert not canary.exists()
    ds_line = [line for line in run.stdout.splitlines() if line.startswith("deepspeed ")][-1]
    argv = shlex.split(ds_line)
    assert argv[argv.index("--config") + 1] == evil  # one argument, intact
    assert argv[-1] == "extra=$(touch " + str(canary) + ")"
    assert argv[argv.index("--master_addr") + 1] == "node01"
    if mode == "srun":
        assert argv[1:4] == ["--no_ssh", "--node_rank", "0"]
    assert (tmp_path / "job" / "hostfile").read_text() == "node01 slots=8\nnode02 slots=8\n"
    assert "FI_PROVIDER=efa" in (tmp_path / "job" / "deepspeed_env").read_text()


def test_deepspeed_command_is_quoted(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    out = tmp_path / "run.sh"
    hostfile = str(tmp_path / "my hosts")
    r = render(
        tmp_path,
        "deepspeed",
        "--config",
        EVIL.format(canary=canary),
        "--hostfile",
        hostfile,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    exec_line = [line for line in out.read_text().splitlines() if line.startswith("exec deepspeed")][0]
    argv = shlex.split(exec_line)
    assert argv[argv.index("--hostfile") + 1] == hostfile
    assert argv[argv.index("--config") + 1] == EVIL.format(canary=canary)


def test_bad_job_name_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    r = render(tmp_path, "slurm", "--config", "c.yaml", "--job-name", "a\n#SBATCH --x", "--out", str(out))
    assert r.returncode == 2 and r.stderr.startswith("error: --job-name") and not out.exists()


def test_awsbatch_job_definition_and_entrypoint(tmp_path: Path) -> None:
    out = tmp_path / "jobdef.json"
    r = render(
        tmp_path,
        "awsbatch",
        "--config",
        "configs/bert.yaml",
        "--nodes",
        "4",
        "--image",
        "acct.dkr.ecr/x:1",
        "--out",
        str(out),
        "--",
        "train.steps=10",
    )
    assert r.returncode == 0, r.stderr
    jd = json.loads(out.read_text())
    nodes = jd["nodeProperties"]
    assert jd["type"] == "multinode" and nodes["numNodes"] == 4 and nodes["mainNode"] == 0
    c = nodes["nodeRangeProperties"][0]["container"]
    assert c["instanceType"] == "p5.48xlarge" and {"type": "GPU", "value": "8"} in c["resourceRequirements"]
    assert len(c["linuxParameters"]["devices"]) == 32  # p5.48xlarge: 32 EFA interfaces
    assert c["linuxParameters"]["devices"][0]["hostPath"] == "/dev/infiniband/uverbs0"
    assert {"name": "memlock", "softLimit": -1, "hardLimit": -1} in c["ulimits"]
    assert c["command"][-1] == "train.steps=10"
    assert "{{" not in out.read_text()
    secret = {e["name"]: e["value"] for e in c["environment"]}["WP_REGISTRATION_SECRET"]
    assert len(secret) == 64 and "secrets" not in c  # a fresh random secret per job definition
    arn = "arn:aws:secretsmanager:us-east-1:1:secret:wp"
    r = render(
        tmp_path,
        "awsbatch",
        "--config",
        "configs/bert.yaml",
        "--nodes",
        "2",
        "--image",
        "i",
        "--out",
        str(out),
        "--registration-secret-arn",
        arn,
    )
    c = json.loads(out.read_text())["nodeProperties"]["nodeRangeProperties"][0]["container"]
    assert c["secrets"] == [{"name": "WP_REGISTRATION_SECRET", "valueFrom": arn}]
    assert "WP_REGISTRATION_SECRET" not in {e["name"] for e in c["environment"]}
    entry = tmp_path / "awsbatch_entrypoint.sh"
    assert subprocess.run(["bash", "-n", str(entry)]).returncode == 0


@pytest.mark.parametrize("mode", ["srun", "elastic"])
def test_awsbatch_entrypoint_two_nodes_register_and_get_ranks(tmp_path: Path, mode: str) -> None:
    """Run the rendered entrypoint on two "nodes" (loopback addresses), dry-run: real registration, printed
    launch (one deepspeed launcher per node, or `launch elastic` per node meeting on the main node)."""
    canary = tmp_path / "pwned"
    evil = EVIL.format(canary=canary)
    r = render(
        tmp_path,
        "awsbatch",
        "--config",
        evil,
        "--nodes",
        "2",
        "--image",
        "img",
        "--repo",
        str(REPO),
        "--out",
        str(tmp_path / "jd.json"),
        "--mode",
        mode,
    )
    assert r.returncode == 0, r.stderr
    entry = tmp_path / "awsbatch_entrypoint.sh"
    port = str(free_port())
    procs = []
    for index, ip in ((1, "127.0.0.2"), (0, "127.0.0.1")):
        env = dry_env(tmp_path)
        env.update(
            AWS_BATCH_JOB_NUM_NODES="2",
            AWS_BATCH_JOB_NODE_INDEX=str(index),
            AWS_BATCH_JOB_MAIN_NODE_INDEX="0",
            WP_NODE_IP=ip,
            WP_REGISTRATION_PORT=port,
            AWS_BATCH_JOB_ID=f"j#{index}",
            WP_REGISTRATION_SECRET="s" * 32,
            WP_WORK=str(tmp_path / f"work{index}"),
        )
        if index:
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"
        procs.append(
            subprocess.Popen(
                ["bash", str(entry), "a=1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not canary.exists()
    for (stdout, _), rank in zip(outs, (1, 0)):
        if mode == "elastic":
            line = [ln for ln in stdout.splitlines() if ln.split()[1:4] == ["-m", "launch", "elastic"]]
            assert len(line) == 1 and not any(ln.startswith("deepspeed ") for ln in stdout.splitlines())
            argv = shlex.split(line[0])
            assert argv[argv.index("--nodes") + 1] == "2:2" and argv[argv.index("--max-restarts") + 1] == "3"
            assert argv[argv.index("--rendezvous") + 1] == "127.0.0.1:29500"
            assert argv[argv.index("--job-id") + 1] == "j"  # the same id on every node ("j#1" on node 1)
            assert argv[argv.index("--") + 1 :] == ["--config", evil, "a=1"]
            continue
        argv = shlex.split([line for line in stdout.splitlines() if line.startswith("deepspeed ")][-1])
        assert argv[1:4] == ["--no_ssh", "--node_rank", str(rank)]
        assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"
        assert argv[argv.index("--config") + 1] == evil and argv[-1] == "a=1"
    if mode == "elastic":  # the outer layer: exit 3 (preempted, saved) and a lost host are retried
        jd = json.loads((tmp_path / "jd.json").read_text())
        assert {"onExitCode": "3", "action": "RETRY"} in jd["retryStrategy"]["evaluateOnExit"]
        assert jd["retryStrategy"]["attempts"] >= 2
    assert (tmp_path / "work1" / "hostfile").read_text() == "127.0.0.1 slots=8\n127.0.0.2 slots=8\n"


CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))  # like a rank: save, exit 3
open(sys.argv[1], "w").write("up")
time.sleep(60)
sys.exit(0)
"""


def test_slurm_elastic_mode(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    evil = EVIL.format(canary=canary)
    out = tmp_path / "job.sbatch"
    r = render(
        tmp_path,
        "slurm",
        "--config",
        evil,
        "--nodes",
        "4",
        "--mode",
        "elastic",
        "--min-nodes",
        "2",
        "--max-restarts",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "#SBATCH --requeue" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text and "{{" not in text
    run = dry_run_slurm(
        out, tmp_path, "extra=$(touch " + str(canary) + ")", SLURM_JOB_NODELIST="node[01-04]", SLURM_JOB_ID="4242"
    )
    assert not canary.exists()
    lines = run.stdout.splitlines()
    assert any(ln.startswith("srun ") and "--no-kill" in ln for ln in lines), lines  # a lost node: step lives
    argv = shlex.split(next(ln for ln in lines if ln.split()[1:4] == ["-m", "launch", "elastic"]))
    assert argv[argv.index("--nodes") + 1] == "2:4" and argv[argv.index("--max-restarts") + 1] == "5"
    assert argv[argv.index("--procs-per-node") + 1] == "8" and argv[argv.index("--job-id") + 1] == "4242"
    assert argv[argv.index("--rendezvous") + 1] == "node01:29500"
    assert argv[argv.index("--") + 1 :] == ["--config", evil, "extra=$(touch " + str(canary) + ")"]
    r = render(
        tmp_path,
        "slurm",
        "--config",
        "c.yaml",
        "--nodes",
        "4",
        "--mode",
        "elastic",
        "--min-nodes",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --min-nodes must be between 1 and --nodes=4, got 5"


def test_slurm_script_asks_for_the_signal_and_forwards_it(tmp_path: Path) -> None:
    """`--signal=B:TERM@120` brings SIGTERM to the batch shell ahead of the time limit; its ``run`` helper
    passes it to the running launcher and returns the launcher's exit code (3: saved, requeue)."""
    import signal
    import time

    out = tmp_path / "job.sbatch"
    r = render(tmp_path, "slurm", "--config", "configs/bert.yaml", "--nodes", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "#SBATCH --signal=B:TERM@120" in text
    helper = run_helper(text)
    up = tmp_path / "up"
    script = f"{helper}\nrun {shlex.quote(sys.executable)} -c {shlex.quote(CHILD)} {shlex.quote(str(up))}\n"
    shell = subprocess.Popen(["bash", "-c", script + 'exit "$?"'])
    deadline = time.monotonic() + 30
    while not up.exists():
        assert time.monotonic() < deadline and shell.poll() is None
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)
    assert shell.wait(timeout=30) == 3


def run_helper(sbatch: str) -> str:
    """The rendered Slurm script's ``run`` function, under the script's own shell options (``set -e`` ends the
    script at a failing command that ``run`` does not guard)."""
    options = "set -euo pipefail\n"
    assert options in sbatch
    start = sbatch.index("run() {")
    return options + sbatch[start : sbatch.index("\n}\n", start) + 3]


# A command that is up within a millisecond of its start, ends with 3 within 0.02 s of a SIGTERM (sh runs the
# trap once its ``sleep`` ends), and by itself after 10 s.
QUICK_CHILD = 'trap "exit 3" TERM; : > "$0"; i=0; while [ $i -lt 500 ]; do sleep 0.02; i=$((i + 1)); done'


def test_slurm_run_passes_on_a_sigterm_that_comes_as_the_command_starts(tmp_path: Path) -> None:
    """SIGTERM to the batch shell the moment its command is up, 100 times: ``run`` sets its trap before it starts
    the command, so every one reaches the command (with the trap set after the start, 11 in 100 ended the
    shell itself here, with the command left running), and ``run`` returns the command's own exit code, also of
    one that ends at once."""
    import signal
    import time

    out = tmp_path / "job.sbatch"
    r = render(tmp_path, "slurm", "--config", "configs/bert.yaml", "--nodes", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    helper = run_helper(out.read_text())
    codes = []
    for i in range(100):
        up = tmp_path / f"up{i}"
        script = f"{helper}\nrun sh -c {shlex.quote(QUICK_CHILD)} {shlex.quote(str(up))}\n" + 'exit "$?"'
        shell = subprocess.Popen(["bash", "-c", script])  # (started in a session of its own, the race did not show)
        try:
            deadline = time.monotonic() + 10
            while not up.exists() and shell.poll() is None and time.monotonic() < deadline:
                pass
            shell.send_signal(signal.SIGTERM)
            codes.append(shell.wait(timeout=10))
        finally:
            shell.kill()  # (after a failure; its command ends within 10 s by itself)
    assert codes == [3] * 100, {code: codes.count(code) for code in set(codes)}
    for code in (0, 2, 5):  # ended before ``run`` waits on it: its own code, not 0
        r = subprocess.run(["bash", "-c", f"{helper}\nrun sh -c 'exit {code}'\n" + 'exit "$?"'], timeout=10)
        assert r.returncode == code
    # a command that SIGTERM ends (no handler): 128 + 15, as from the command itself
    up = tmp_path / "up-plain"
    plain = ': > "$0"; exec sleep 10'
    script = f"{helper}\nrun sh -c {shlex.quote(plain)} {shlex.quote(str(up))}\n"
    shell = subprocess.Popen(["bash", "-c", script + 'exit "$?"'])
    try:
        deadline = time.monotonic() + 10
        while not up.exists() and shell.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # past the exec
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        shell.kill()
