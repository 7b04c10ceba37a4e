"""Hostfiles: Slurm node-list expansion, validation of host names, AWS Batch registration over real
sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import UserError
from common.net import free_port
from launch.hosts import Host, expand_slurm_nodelist, hostfile_text, parse_hostfile, validate_host
from tests.conftest import REPO, run_env, run_python


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu7", ["gpu7"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("ip-10-0-0-[5-6]", ["ip-10-0-0-5", "ip-10-0-0-6"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node[3-1]", "node]1["])
def test_bad_nodelist_is_a_user_error(bad: str) -> None:
    with pytest.raises(UserError):
        expand_slurm_nodelist(bad)


@pytest.mark.parametrize("bad", ["a b", "x;rm", "$(id)", "`id`", "h'q", 'h"q', "-oProxyCommand=x", "", "a..b"])
def test_invalid_host_names_are_refused(bad: str) -> None:
    with pytest.raises(UserError):
        validate_host(bad)


def test_valid_hosts_and_hostfile_round_trip(tmp_path: Path) -> None:
    hosts = [Host("node01", 8), Host("10.0.0.5", 8), Host("ip-10-0-0-6.ec2.internal", 4), Host("fe80::1", 2)]
    path = tmp_path / "hostfile"
    path.write_text(hostfile_text(hosts))
    assert parse_hostfile(path) == hosts
    with pytest.raises(UserError, match="twice"):
        hostfile_text([Host("a", 1), Host("a", 1)])


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # a test's own environment: a fresh interpreter, not a prefork server started for it alone
    return run_python(["-m", "launch", "hostfile", *args], timeout=120, env=env, fresh=env is not None)


def test_hostfile_from_slurm_environment(tmp_path: Path) -> None:
    env = run_env()
    env["SLURM_JOB_NODELIST"] = "node[01-02,05]"
    env["PATH"] = os.path.dirname(sys.executable) + ":/usr/bin:/bin"  # no scontrol here: our expander runs
    out = tmp_path / "hostfile"
    r = _cli("--from", "slurm", "--slots", "8", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "node01 slots=8\nnode02 slots=8\nnode05 slots=8\n"


def test_hostfile_from_list_rejects_injection_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "hostfile"
    r = _cli("--hosts", "a,b;touch x", "--slots", "1", "--out", str(out))
    assert r.returncode == 2 and r.stderr.startswith("error: invalid host name")
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


SECRET = "a-secret-from-the-job-definition"


def test_awsbatch_registration_three_nodes_on_loopback(tmp_path: Path) -> None:
    """Main node and two children as separate processes talking over real TCP sockets."""
    port = free_port()
    procs = []
    for index, ip in ((0, "127.0.0.1"), (2, "127.0.0.3"), (1, "127.0.0.2")):  # children in any order
        env = run_env()
        env.update(
            AWS_BATCH_JOB_NUM_NODES="3",
            AWS_BATCH_JOB_NODE_INDEX=str(index),
            AWS_BATCH_JOB_MAIN_NODE_INDEX="0",
            AWS_BATCH_JOB_ID=f"job-1#{index}",
            WP_REGISTRATION_SECRET=SECRET,
        )
        if index:
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"
        args = ["--from", "awsbatch", "--slots", "8", "--port", str(port), "--timeout", "60", "--ip", ip]
        args += ["--out", str(tmp_path / f"hf{index}"), "--env-out", str(tmp_path / f"env{index}")]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "launch", "hostfile", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    expected = "127.0.0.1 slots=8\n127.0.0.2 slots=8\n127.0.0.3 slots=8\n"
    for i in range(3):
        assert (tmp_path / f"hf{i}").read_text() == expected
        env_lines = dict(line.split("=") for line in (tmp_path / f"env{i}").read_text().splitlines())
        assert env_lines == {"NUM_NODES": "3", "MASTER_ADDR": "127.0.0.1", "NODE_RANK": str(i)}


def test_awsbatch_main_times_out_when_a_child_never_registers(tmp_path: Path) -> None:
    env = run_env()
    env.update(
        AWS_BATCH_JOB_NUM_NODES="2",
        AWS_BATCH_JOB_NODE_INDEX="0",
        AWS_BATCH_JOB_MAIN_NODE_INDEX="0",
        AWS_BATCH_JOB_ID="job-1#0",
    )
    r = _cli(
        "--from",
        "awsbatch",
        "--slots",
        "8",
        "--port",
        str(free_port()),
        "--timeout",
        "2",
        "--ip",
        "127.0.0.1",
        "--out",
        str(tmp_path / "hf"),
        env=env,
    )
    assert r.returncode == 2 and "WP_REGISTRATION_SECRET is not set" in r.stderr  # no secret: refused
    env["WP_REGISTRATION_SECRET"] = SECRET
    out = tmp_path / "hf"
    r = _cli(
        "--from",
        "awsbatch",
        "--slots",
        "8",
        "--port",
        str(free_port()),
        "--timeout",
        "2",
        "--ip",
        "127.0.0.1",
        "--out",
        str(out),
        env=env,
    )
    assert r.returncode == 2 and "nodes [1] did not register" in r.stderr and not out.exists()
