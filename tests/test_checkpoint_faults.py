"""Resume decisions over damaged or foreign checkpoints, on a real 2-rank DeepSpeed checkpoint directory.

``training.checkpoint.resume.find_resume`` and ``check_shared`` run here in the test process as rank 0 of one
(the collectives are then trivial); the launcher-level behaviour (every rank exits with the same line) is in
test_train.py, test_train_faults.py and test_train_twonode.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from common.errors import UserError
from common.net import free_port
from model.registry import get_spec, spec_to_dict
from tests.conftest import common, run_env, run_python
from tests.prefork import SITECUSTOMIZE_ENV
from training.checkpoint import storage as checkpoint
from training.checkpoint.resume import (
    NOT_ARCHITECTURE,
    ResumePoint,
    RunIdentity,
    check_compatible,
    check_shared,
    find_resume,
)
from training.config import CheckpointSection


@pytest.fixture
def ckpt(straight_run, tmp_path) -> Path:
    """A copy of a finished 2-rank run's checkpoints (step4 and step8 complete)."""
    shutil.copytree(straight_run / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run" / "checkpoints"


def decide(ckpt_dir: Path, optimizer: str = "lans", resume: str = "auto") -> ResumePoint | None:
    return find_resume(
        CheckpointSection(resume=resume), ckpt_dir, world=2, global_batch=16, steps=100, optimizer=optimizer
    )


def test_commit_records_every_file(ckpt: Path) -> None:
    record = json.loads((ckpt / "step00000008" / "COMPLETE").read_text())["files"]
    assert "client_state.json" in record and "rng_rank0.pt" in record and "rng_rank1.pt" in record
    assert any(name.endswith("model_states.pt") for name in record)
    assert any("optim_states" in name for name in record)
    assert all((ckpt / "step00000008" / k).stat().st_size == v for k, v in record.items())
    # each rank fsyncs the files it wrote: every file has one owner, and both ranks own some
    owners = {name: checkpoint.owner(name) for name in record}
    assert set(owners.values()) == {0, 1}, owners
    assert owners["rng_rank1.pt"] == 1 and owners["client_state.json"] == 0
    assert [o for n, o in owners.items() if "optim_states" in n] == [0, 1]
    assert decide(ckpt).tag == "step00000008"


def test_latest_garbage_or_outside_the_directory(ckpt: Path, tmp_path: Path, logs) -> None:
    (ckpt / "latest").write_bytes(b"\x89\xff\x00garbage\xfe")
    point = decide(ckpt)
    assert point.tag == "step00000008" and point.ckpt_dir == ckpt
    assert "not a checkpoint tag of this directory" in logs.text and str(ckpt / "latest") in logs.text
    # another run's checkpoint named through a relative path: never followed
    other = tmp_path / "other-run" / "checkpoints"
    shutil.copytree(ckpt, other)
    shutil.rmtree(ckpt / "step00000008")
    (ckpt / "latest").write_text("../../other-run/checkpoints/step00000008\n")
    point = decide(ckpt)
    assert point.ckpt_dir == ckpt and point.tag == "step00000004"


def test_damaged_newest_tag_falls_back_with_a_warning(ckpt: Path, logs) -> None:
    model = next((ckpt / "step00000008").glob("*model_states.pt"))
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size // 2)
    point = decide(ckpt)
    assert point.tag == "step00000004"
    assert f"{model} has" in logs.text and "resuming from step00000004 instead of the damaged step00000008" in (
        logs.text
    )
    # an explicitly chosen damaged tag is refused, not replaced
    with pytest.raises(UserError, match=r"checkpoint.resume=.*step00000008: damaged checkpoint \(.*model_states"):
        decide(ckpt, resume=str(ckpt / "step00000008"))
    # a tag without client_state.json; then nothing loadable left: refused, never a fresh start
    (ckpt / "step00000004" / "client_state.json").unlink()
    with pytest.raises(UserError, match=r"every complete checkpoint is damaged \(newest: .*step00000008\)"):
        decide(ckpt)


def test_other_optimizer_is_refused(ckpt: Path) -> None:
    with pytest.raises(
        UserError,
        match=r"step00000008 was trained with optimizer.name=lans, this run has adamw: "
        r"its optimizer state does not carry over",
    ):
        decide(ckpt, optimizer="adamw")


def rewrite_client_state(tag: Path, saved: dict) -> None:
    """Replace a tag's client state as a save would have written it (COMPLETE records its new size)."""
    (tag / "client_state.json").write_text(json.dumps(saved))
    record = json.loads((tag / checkpoint.COMPLETE).read_text())
    record["files"]["client_state.json"] = (tag / "client_state.json").stat().st_size
    (tag / checkpoint.COMPLETE).write_text(json.dumps(record))


def test_newer_checkpoint_format_is_refused(ckpt: Path) -> None:
    tag = ckpt / "step00000008"
    saved = json.loads((tag / "client_state.json").read_text())
    assert saved["format"] == checkpoint.FORMAT  # what a save writes
    rewrite_client_state(tag, {**saved, "format": checkpoint.FORMAT + 1})
    newer = checkpoint.FORMAT + 1
    with pytest.raises(
        UserError,
        match=rf"step00000008 was written in checkpoint format {newer}; "
        rf"this version reads format {checkpoint.FORMAT} and older",
    ):
        decide(ckpt)
    del saved["format"]  # a checkpoint from before the field: format 1, still resumed
    rewrite_client_state(tag, saved)
    assert checkpoint.FORMAT > 1 or decide(ckpt).tag == "step00000008"


def test_unwritable_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    """A read-only run.dir: a read-only tmpfs mount as root (permissions do not bind root), else mode 0555."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    else:
        ro.chmod(0o555)
    try:
        with pytest.raises(
            UserError,
            match=rf"{ro / 'checkpoints'}: cannot write checkpoints there \(Read-only"
            r"|Permission",
        ):
            check_shared(ro / "checkpoints")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)
    ok = tmp_path / "ok" / "checkpoints"
    check_shared(ok)
    assert ok.is_dir() and not list(ok.iterdir()), "the probe is removed"


FSYNC_RECORDER = """
import json, os
_log = open(os.environ["WIKIPRETRAIN_FSYNC_LOG"], "a", buffering=1)
_fsync, _replace = os.fsync, os.replace
def fsync(fd):
    _fsync(fd)
    _log.write(json.dumps(["fsync", os.readlink(f"/proc/self/fd/{fd}")]) + "\\n")
def replace(src, dst, *a, **kw):
    _replace(src, dst, *a, **kw)
    _log.write(json.dumps(["replace", os.fspath(dst)]) + "\\n")
os.fsync, os.replace = fsync, replace
"""


def test_every_file_and_directory_of_a_commit_is_fsynced(bert_data, tmp_path: Path) -> None:
    """A real single-process run with os.fsync and os.replace wrapped (recorded, then the real call): every
    file of a committed tag and its directory are fsynced before COMPLETE names them, and the checkpoint
    directory after ``latest`` is renamed into it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FSYNC_RECORDER)
    events = tmp_path / "fsync.jsonl"
    env = {**run_env(), SITECUSTOMIZE_ENV: str(hook), "WIKIPRETRAIN_FSYNC_LOG": str(events)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run_dir = tmp_path / "run"
    res = run_python(["train.py", *common(bert_data, run_dir, "train.steps=4", "train.eval_every=0")], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    log = [json.loads(x) for x in events.read_text().splitlines()]
    ckpt = run_dir / "checkpoints"
    tag = ckpt / "step00000004"
    complete_at = log.index(["replace", str(tag / "COMPLETE")])
    latest_at = log.index(["replace", str(ckpt / "latest")])
    synced_before = {p for kind, p in log[:complete_at] if kind == "fsync"}
    files = {str(p) for p in tag.rglob("*") if p.is_file() and p.name != "COMPLETE"}
    dirs = {str(p) for p in tag.rglob("*") if p.is_dir()} | {str(tag)}
    assert files and files <= synced_before, files - synced_before
    assert dirs <= synced_before, dirs - synced_before
    assert ["fsync", str(tag)] in log[complete_at:latest_at], "the tag directory after COMPLETE's rename"
    assert ["fsync", str(ckpt)] in log[latest_at:], "the checkpoint directory after latest's rename"


def _identity_of(saved: dict) -> RunIdentity:
    """The identity a run with exactly this client state's settings would have."""
    return RunIdentity(**{f.name: saved[f.name] for f in dataclasses.fields(RunIdentity)})


def test_resume_identity_is_every_spec_field_but_name_and_dropout(ckpt: Path) -> None:
    """The architecture compared on resume is derived from the spec's fields: another ``model.dropout`` still
    resumes, another NeoX ``rotary_base`` (a field the hand-kept list once missed) is refused in one line."""
    saved = checkpoint.read_client_state(ckpt, "step00000008")
    where = ckpt / "step00000008"
    check_compatible(saved, _identity_of(saved), where)  # itself
    other_dropout = _identity_of(saved)
    other_dropout.model_spec["dropout"] = 0.0
    other_dropout.model_spec["name"] = "renamed"
    check_compatible(saved, other_dropout, where)
    assert {"name", "dropout"} == NOT_ARCHITECTURE

    neox = spec_to_dict(get_spec("neox-debug")) | {"padded_vocab": 50304}
    edited = json.loads(json.dumps(saved)) | {"model_spec": neox | {"rotary_base": 500000.0}}
    current = _identity_of(saved | {"model_spec": neox})
    with pytest.raises(UserError) as e:
        check_compatible(edited, current, where)
    assert str(e.value) == (
        f"{where}: checkpoint has model rotary_base=500000.0 but this run has rotary_base=10000.0; refusing to resume"
    )
    # a spec field an older checkpoint did not record counts at its default; the vocabulary's padding is compared
    older = {k: v for k, v in neox.items() if k != "rotary_base"}
    check_compatible(saved | {"model_spec": older}, current, where)
    with pytest.raises(UserError, match="padded_vocab=50432 but this run has padded_vocab=50304"):
        check_compatible(saved | {"model_spec": neox | {"padded_vocab": 50432}}, current, where)
