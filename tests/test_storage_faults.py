"""A filesystem that fails under a running job: a shard truncated at rows not read yet ends the job with one
line and a resume that is exact once the shard is back; a read that fails once is retried with identical
losses; a shard that stays unreadable ends the rank with one line after the bounded retries (``data.reads``).

The job-level faults come from a test-only ``sitecustomize`` (tests/scripts/read_faults): the truncation is a
real ``os.truncate`` of the real shard, the reads that then fail are h5py's own."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

from common.errors import UserError
from data.loader import EvalSet, PretrainingLoader
from data.reads import ReadRetry, ShardDamaged, ShardUnavailable, is_transient
from tests.conftest import REPO, common, deepspeed, run_env
from tests.prefork import SITECUSTOMIZE_ENV
from tests.test_train import losses
from training import events
from training.config import load_config, read_retry_s

FAULTS = REPO / "tests" / "scripts" / "read_faults"


def _copy_data(bert_data: dict[str, Path], where: Path) -> dict[str, Path]:
    data = dict(bert_data)
    data["train"] = where / "train"
    shutil.copytree(bert_data["train"], data["train"])
    return data


def _fault_env(fault: str) -> dict[str, str]:
    return {**run_env(), SITECUSTOMIZE_ENV: str(FAULTS), "WIKIPRETRAIN_TEST_READ_FAULT": fault}


@pytest.mark.slow
def test_shard_truncated_under_the_job_then_a_read_that_fails_once(bert_data, straight_run, tmp_path):
    """1. Two ranks reading in-process (``data.num_workers=0``: the reads happen at their steps): each truncates
    its shard at rows it has not read yet, at step 5 (its first read after step 4's checkpoint: a unit of 64
    rows serves 4 steps). The job ends 2 with one line
    per rank naming the shard, the rows and the sizes, no traceback, and a ``failure`` event; step 4 stands.
    2. The shard back, the job resumes with DataLoader workers, the first read of which fails once (EIO): the
    retry is logged with the shard and rows, and steps 5-8 have the straight run's losses exactly."""
    data = _copy_data(bert_data, tmp_path)
    shard = data["train"] / "bert-00000.h5"
    whole = shard.read_bytes()
    run_dir = tmp_path / "run"
    first = deepspeed(
        common(data, run_dir, "data.num_workers=0"),
        env=_fault_env(f"truncate:{4 * 16}:{tmp_path / 'truncated'}"),
    )
    out = first.stdout + first.stderr
    assert first.returncode == 2, out[-4000:]
    assert "read_faults: truncated" in out, out[-4000:]
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("error:")]
    assert lines, out[-4000:]
    print("\n".join(lines))
    for line in lines:
        assert line.startswith(f"error: {shard}: rows "), line
        assert f"the shard is damaged ({shard.stat().st_size} bytes, {len(whole)} in its manifest" in line, line
    assert "Traceback" not in out, out[-4000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000004"
    failures = [e for e in events.read(run_dir) if e["event"] == "failure"]
    assert failures and str(shard) in failures[0]["why"], failures
    # each rank's own: one that ends after rank 0 released the run's mark too (the mark gone is no takeover)
    assert len({e["rank"] for e in failures}) == len(failures) == len(lines), (failures, lines)

    shard.write_bytes(whole)
    second = deepspeed(common(data, run_dir), env=_fault_env(f"fail_once:0:{tmp_path / 'failed-once'}"))
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert (tmp_path / "failed-once").exists()  # the fault was injected
    assert f"{shard}: rows " in out and "read failed (" in out and "injected I/O error" in out, out[-4000:]
    assert "retry 1 of 4 in " in out, out[-4000:]
    print("\n".join(ln for ln in out.splitlines() if "read failed" in ln))
    assert f"resumed from {run_dir / 'checkpoints' / 'step00000004'} at step 4" in out
    a, b = losses(straight_run), losses(run_dir)
    assert [b[s] for s in range(5, 9)] == [a[s] for s in range(5, 9)]


@pytest.mark.slow
def test_a_shard_gone_under_the_job_ends_it_with_exit_4(bert_data, tmp_path):
    """A transient fault that outlasts the retries: one line, a ``failure`` event and exit 4 (the exit a
    restart follows)."""
    data = _copy_data(bert_data, tmp_path)
    shard = data["train"] / "bert-00000.h5"
    run_dir = tmp_path / "run"
    res = deepspeed(
        common(data, run_dir, "data.num_workers=0", "data.read_retries=2", "data.read_retry_s=2"),
        ranks=1,
        env=_fault_env(f"vanish:0:{tmp_path / 'away.h5'}"),
    )
    out = res.stdout + res.stderr
    assert res.returncode == 4, out[-4000:]
    assert (tmp_path / "away.h5").exists()
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: rank 0: {shard}: rows "), line
    assert re.search(
        r"the read still failed after 2 retries in [0-9.]+ s \(data.read_retry_s=2; the file is not there\)", line
    ), line
    assert out.count("read failed (the file is not there); retry") == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    failures = [e for e in events.read(run_dir) if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["why"] == line.removeprefix("error: rank 0: "), failures


def _loader(path: Path, workers: int, retry: ReadRetry) -> PretrainingLoader:
    return PretrainingLoader(
        path, "bert", micro_batch=4, grad_accum=1, dp_rank=0, dp_world=1, num_workers=workers, read_retry=retry
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_that_stays_gone_ends_in_one_line_after_the_retries(bert_data, tmp_path, workers, logs):
    """A vanished shard (a transient error) is retried, each retry logged; then one line, also from a DataLoader
    worker (torch re-raises a worker's error with its traceback as the text)."""
    data = _copy_data(bert_data, tmp_path)
    shard = data["train"] / "bert-00000.h5"
    retry = ReadRetry(retries=2, total_s=2.0)  # waits of 0.7 and 1.3 s: the second retry has 1.3 s to spare
    loader = _loader(data["train"], workers, retry)
    shard.rename(tmp_path / "away.h5")
    with pytest.raises(ShardUnavailable) as e:
        next(iter(loader))
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"{shard}: rows ") and "the read still failed after 2 retries in " in line, line
    assert "resumes from its last checkpoint" in line
    if workers == 0:  # a worker's log lines go to its own stderr, not to this process's handlers
        retries = [r.getMessage() for r in logs.records if "read failed" in r.getMessage()]
        assert len(retries) == 2 and retries[0].startswith(f"{shard}: rows "), retries
    loader.close()


def test_a_damaged_shard_is_not_retried_and_eval_reads_alike(bert_data, tmp_path, logs):
    data = _copy_data(bert_data, tmp_path)
    shard = data["train"] / "bert-00000.h5"
    size = shard.stat().st_size
    loader = _loader(data["train"], 0, ReadRetry(retries=3, total_s=60))  # a retry would take seconds
    os.truncate(shard, size // 2)
    with pytest.raises(ShardDamaged, match=rf"the shard is damaged \({size // 2} bytes, {size} in its manifest; "):
        next(iter(loader))
    assert not [r for r in logs.records if "read failed" in r.getMessage()]
    loader.close()
    # evaluation reads the same way: a vanished eval shard is retried, then one line
    ev_dir = tmp_path / "eval"
    shutil.copytree(bert_data["eval"], ev_dir)
    ev = EvalSet(ev_dir, "bert", 32, micro_batch=4, dp_rank=0, dp_world=1, read_retry=ReadRetry(1, 0.3))
    (ev_dir / "bert-00000.h5").rename(tmp_path / "eval-away.h5")
    with pytest.raises(ShardUnavailable, match=r"eval/bert-00000.h5: rows 0-31: the read still failed after 1 "):
        next(iter(ev))


def test_which_failures_are_transient(tmp_path):
    f = tmp_path / "shard.h5"
    f.write_bytes(b"x" * 100)
    assert is_transient(OSError(errno.EIO, "I/O error"), f, 100)
    assert is_transient(
        OSError("Can't read data (file read failed: ..., errno = 116, error message = 'Stale')"), f, 100
    )
    assert is_transient(OSError(errno.ETIMEDOUT, "timed out"), f, None)
    assert is_transient(OSError(errno.EIO, "I/O error"), tmp_path / "gone.h5", 100)  # vanished, for now
    assert not is_transient(OSError(errno.EIO, "I/O error"), f, 99)  # not the size the manifest records
    assert not is_transient(OSError("Can't synchronously read data (filter returned failure during read)"), f, 100)
    assert ReadRetry(4, 30).waits() == pytest.approx([2, 4, 8, 16])
    assert ReadRetry(0, 30).waits() == []


def test_retry_budget_stays_below_the_data_watchdog():
    assert read_retry_s(load_config("smoke", [])) == 30.0
    assert read_retry_s(load_config("smoke", ["deepspeed.timeout_s=5"])) == pytest.approx(2.0)  # half of 0.8 x 5
    assert read_retry_s(load_config("smoke", ["data.read_retry_s=100"])) == 100.0
    with pytest.raises(UserError, match=r"data.read_retry_s=500 must be below the data watchdog's bound, 0.8 x "):
        load_config("smoke", ["data.read_retry_s=500"])
    with pytest.raises(UserError, match=r"data.read_retries must be within \[0, 16\]"):
        load_config("smoke", ["data.read_retries=2000"])
