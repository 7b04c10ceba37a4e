"""Scaling sweep with real DeepSpeed ranks (a stand-in for train.py honouring its contract), then the
report."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env

STANDIN = REPO / "tests" / "scripts" / "launch_standin_train.py"


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "standin.yaml"
    cfg.write_text(
        "run: {name: standin}\nmodel: {hidden: 192}\n"
        "train: {micro_batch: 4, global_batch: 16, seq_len: 32, warmup_steps: 2}\n"
    )
    return cfg


def test_dry_run_prints_the_contract_commands(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "sweep",
            "--config",
            str(cfg),
            "--world-sizes",
            "2,1",
            "--steps",
            "7",
            "--out",
            str(tmp_path / "runs"),
            "--threads-per-rank",
            "1",
            "--dry-run",
            "--",
            "train.lr=1e-4",
        ],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cmds = [shlex.split(line) for line in r.stdout.splitlines()]
    assert [c[c.index("--num_gpus") + 1] for c in cmds] == ["1", "2"]
    for c, w in zip(cmds, (1, 2)):
        assert c[0] == "OMP_NUM_THREADS=1" and "train.py" in c
        assert f"run.dir={tmp_path / 'runs' / f'w{w}'}" in c and "train.steps=7" in c
        assert "run.threads_per_rank=1" in c and c[-1] == "train.lr=1e-4"
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_sweep_world_sizes_1_and_2_measures_efficiency(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    runs = tmp_path / "runs"
    png = tmp_path / "scaling.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "sweep",
            "--config",
            str(cfg),
            "--world-sizes",
            "1,2",
            "--steps",
            "8",
            "--out",
            str(runs),
            "--script",
            str(STANDIN),
        ],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    s1 = json.loads((runs / "w1" / "summary.json").read_text())
    s2 = json.loads((runs / "w2" / "summary.json").read_text())
    assert s1["fingerprint"] == s2["fingerprint"] and s2["world_size"] == 2
    assert s1["nodes"] == s2["nodes"] == 1
    measured = s2["sequences_per_sec_per_device"] / s1["sequences_per_sec_per_device"]
    assert 0 < measured < 2
    assert "scaling_efficiency" not in s1 and "scaling_efficiency" not in s2  # each run: its own figures
    assert f"{measured * 100:.1f}%" in r.stdout  # the sweep's own table, computed from the summaries
    rep = subprocess.run(
        [sys.executable, "-m", "launch", "report", str(runs), "--plot", str(png)],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0, rep.stderr
    assert f"{measured * 100:.1f}%" in rep.stdout and "(baseline)" in rep.stdout
    assert "| 1 | 2 |" in rep.stdout and "| n/a |" in rep.stdout  # one node, two ranks; mfu null: n/a
    print(rep.stdout)
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (1100, 420)
    # a second sweep skips the sizes already measured
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "sweep",
            "--config",
            str(cfg),
            "--world-sizes",
            "1,2",
            "--steps",
            "8",
            "--out",
            str(runs),
            "--script",
            str(STANDIN),
        ],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and again.stdout.count("skip ") == 2
