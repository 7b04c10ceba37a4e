"""Cluster profiles -> .deepspeed_env: every shipped profile loads, values are safe, the file is what
runner.py reads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.errors import UserError
from launch.profiles import available_profiles, load_profile, render_env_file
from tests.conftest import run_python


@pytest.mark.parametrize("name", available_profiles())
def test_every_shipped_profile_loads_and_renders(name: str) -> None:
    prof = load_profile(name)
    assert prof.env, name
    assert all(v.why for v in prof.env)
    text = render_env_file(prof, {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"})
    assert text.endswith("\n") and "\n\n" not in text
    # DeepSpeed's runner splits each line on the first '=' and has no comment handling.
    for line in text.splitlines():
        key, val = line.split("=", 1)
        assert key and not line.startswith("#")


def test_efa_profile_follows_current_aws_guidance() -> None:
    env = {v.name: v.value for v in load_profile("efa").env}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "NCCL_PROTO" not in env  # only for aws-ofi-nccl <= 1.5: efa-legacy
    assert "RDMAV_FORK_SAFE" not in env  # the aws-ofi-nccl cheatsheet says not to use it
    assert load_profile("efa").price_per_instance_hour > 0
    legacy = {v.name: v.value for v in load_profile("efa-legacy").env}
    assert legacy["NCCL_PROTO"] == "simple"


def test_env_file_expands_and_tidies_library_path() -> None:
    prof = load_profile("efa")
    with_path = render_env_file(prof, {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"})
    assert "LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:/usr/local/cuda/lib64\n" in with_path
    without = render_env_file(prof, {})
    assert "LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib\n" in without


def test_env_file_is_sourceable_and_means_the_same_to_bash(tmp_path: Path) -> None:
    out = tmp_path / ".deepspeed_env"
    r = run_python(["-m", "launch", "env", "--profile", "tcp", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    expected = dict(line.split("=", 1) for line in out.read_text().splitlines())
    printed = subprocess.run(
        [
            "bash",
            "-c",
            f'set -a; . {out}; set +a; for k in {" ".join(expected)}; do printf "%s=%s\\n" "$k" "${{!k}}"; done',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert dict(line.split("=", 1) for line in printed.splitlines()) == expected


def test_unsafe_value_is_refused_and_nothing_written(tmp_path: Path) -> None:
    prof_path = tmp_path / "bad.yaml"
    prof_path.write_text("env:\n  FOO:\n    value: 'a; rm -rf x'\n    why: test\n")
    with pytest.raises(UserError, match="FOO"):
        render_env_file(load_profile(str(prof_path)))
    out = tmp_path / "envfile"
    out.write_text("KEEP=1\n")
    r = run_python(["-m", "launch", "env", "--profile", str(prof_path), "--out", str(out)])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert out.read_text() == "KEEP=1\n"


def test_profile_without_why_or_unknown_name_is_a_user_error(tmp_path: Path) -> None:
    p = tmp_path / "nowhy.yaml"
    p.write_text("env:\n  FOO: {value: bar}\n")
    with pytest.raises(UserError, match="why"):
        load_profile(str(p))
    with pytest.raises(UserError, match="not found"):
        load_profile("no-such-profile")
