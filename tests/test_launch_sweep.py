"""The scaling sweep's commands (``--dry-run``): train.py's, or a stand-in's that honours its contract. The
real sweep of train.py at 1 and 2 ranks, the rerun that skips them and the report are in test_train.py."""

from __future__ import annotations

import shlex
from pathlib import Path

from tests.conftest import REPO, run_python

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
    r = run_python(
        [
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
    # --script: any program that honours train.py's contract (the real sweep is in test_train.py)
    r = run_python(
        ["-m", "launch", "sweep", "--config", str(cfg), "--world-sizes", "2", "--steps", "7"]
        + ["--out", str(tmp_path / "runs"), "--script", str(STANDIN), "--dry-run"],
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    (cmd,) = [shlex.split(line) for line in r.stdout.splitlines()]
    assert str(STANDIN) in cmd and "train.py" not in cmd
