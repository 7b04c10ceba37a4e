"""A checkpoint from elsewhere runs no code: real checkpoints of the suite, doctored with one extra pickled object
whose unpickling would create a marker file, through export, ``train.init_from``, resume and the conversion for
another world size. Each is refused with one line naming the file and the global; the marker never appears.
(That every checkpoint the suite writes stays within the allowlist is checked at the end of the session, in
``conftest.py``.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import common, deepspeed, run_python
from training.checkpoint.safeload import allowed_names
from training.checkpoint.storage import UNIVERSAL_DONE, UNIVERSAL_PREFIX, tag_files

pytestmark = pytest.mark.slow

OPTIM0 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class _Planted:
    """Unpickled without restriction, this creates ``path`` (``open(path, "w")``): code run by a load."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


PLANTED_GLOBAL = f"{open.__module__}.{open.__qualname__}"


def doctor(path: Path, marker: Path) -> None:
    """Add the planted object to a checkpoint file, and re-record the tag's file sizes in COMPLETE as a
    doctored copy passed around would (else the resume passes the tag over as damaged)."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own file: trusted
    state["planted"] = _Planted(marker)
    torch.save(state, path)
    complete = path.parent / "COMPLETE"
    if complete.exists():
        complete.write_text(json.dumps({"files": tag_files(path.parent)}))


def refusal_line(path: Path) -> str:
    return f"{path}: refusing to load this checkpoint file: it names {PLANTED_GLOBAL}"


@pytest.fixture
def doctored(straight_run, tmp_path) -> Path:
    """A copy of the straight run's checkpoints (2 ranks, BF16, LANS, steps 4 and 8), to doctor."""
    run = tmp_path / "doctored" / "run"
    shutil.copytree(straight_run / "checkpoints", run / "checkpoints")
    return run


def test_the_planted_object_runs_code_when_unrestricted(straight_run, tmp_path):
    """The control: the doctoring works, so the marker's absence below means something."""
    rng = tmp_path / "doctored" / "rng_rank0.pt"
    rng.parent.mkdir()
    shutil.copy(straight_run / "checkpoints" / "step00000008" / "rng_rank0.pt", rng)
    marker = tmp_path / "ran"
    doctor(rng, marker)
    assert PLANTED_GLOBAL not in allowed_names()
    torch.load(rng, weights_only=False)
    assert marker.exists()


def _export(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return run_python(["-m", "training", "export", str(ckpt), "--out", str(out)])


def test_export_refuses_doctored_optimizer_and_model_states(doctored, tmp_path):
    ckpt, marker = doctored / "checkpoints", tmp_path / "ran"
    tag = ckpt / "step00000008"
    clean = (tag / OPTIM0).read_bytes()
    for name in (OPTIM0, MODEL):  # the optimizer partitions are read first, then the model states
        doctor(tag / name, marker)
        res = _export(ckpt, tmp_path / "out")
        assert res.returncode == 2, res.stderr[-2000:]
        assert refusal_line(tag / name) in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr
        assert not marker.exists()
        assert not (tmp_path / "out").exists()  # nothing written
        (tag / OPTIM0).write_bytes(clean)


def test_resume_refuses_a_doctored_optimizer_partition_and_rng_state(bert_data, doctored, tmp_path):
    """Rank 0's optimizer partition and rank 1's RNG state, doctored in one tag: each rank refuses its own file
    with its own line (DeepSpeed's load, then ours), the job exits 2, and the checkpoints are untouched."""
    ckpt, marker = doctored / "checkpoints", tmp_path / "ran"
    tag = ckpt / "step00000008"
    doctor(tag / OPTIM0, marker)
    doctor(tag / "rng_rank1.pt", marker)
    before = {t.name: tag_files(t) for t in ckpt.iterdir() if t.is_dir()}
    res = deepspeed(common(bert_data, doctored, "train.steps=10"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert refusal_line(tag / OPTIM0) in res.stderr, res.stderr[-3000:]
    assert refusal_line(tag / "rng_rank1.pt") in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not marker.exists()
    assert {t.name: tag_files(t) for t in ckpt.iterdir() if t.is_dir()} == before
    assert (ckpt / "latest").read_text().strip() == "step00000008"


def test_init_from_refuses_doctored_model_states(bert_data, doctored, tmp_path):
    marker = tmp_path / "ran"
    model = doctored / "checkpoints" / "step00000008" / MODEL
    doctor(model, marker)
    res = deepspeed(common(bert_data, tmp_path / "phase2", f"train.init_from={doctored / 'checkpoints'}"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert refusal_line(model) in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not marker.exists()


def _convert(tag: Path, out: Path) -> subprocess.CompletedProcess:
    """The conversion for another world size, as ``training.checkpoint.storage.to_universal`` runs it."""
    return run_python(
        ["-m", "training.checkpoint.safeload", "deepspeed.checkpoint.ds_to_universal"]
        + ["--input_folder", str(tag), "--output_folder", str(out)]
        + ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    )


def test_conversion_and_a_converted_tag_refuse_doctored_files(bert_data, doctored, tmp_path):
    """The conversion's own process refuses a doctored source; a converted tag whose FP32 weights were doctored
    afterwards is refused by the rank that loads it at the new world size (1 rank after 2)."""
    ckpt, marker = doctored / "checkpoints", tmp_path / "ran"
    tag = ckpt / "step00000008"
    out = ckpt / (UNIVERSAL_PREFIX + tag.name)
    clean = (tag / OPTIM0).read_bytes()
    doctor(tag / OPTIM0, marker)
    res = _convert(tag, out)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert refusal_line(tag / OPTIM0) in res.stderr, res.stderr[-2000:]
    assert not marker.exists()

    (tag / OPTIM0).write_bytes(clean)
    (tag / "COMPLETE").write_text(json.dumps({"files": tag_files(tag)}))
    shutil.rmtree(out, ignore_errors=True)
    res = _convert(tag, out)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    shutil.copy2(tag / "client_state.json", out / "client_state.json")
    (out / UNIVERSAL_DONE).write_text("ok\n")
    weights = sorted(out.glob("zero/*/fp32.pt"))
    assert weights, sorted(p.relative_to(out) for p in out.rglob("*"))[:20]
    doctor(weights[0], marker)
    res = deepspeed(common(bert_data, doctored, "train.steps=10"), ranks=1)
    assert res.returncode == 2, res.stderr[-3000:]
    assert refusal_line(weights[0]) in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not marker.exists()
