"""The committed expected loss curves (tests/expected/loss_*_debug.json), checked against real train.py runs.

Five real single-process train.py runs in fp32: the BERT and NeoX debug curves, which must match the recorded
ones within the recorded tolerance, and three negative controls (a doubled learning rate; a dropped
gradient-accumulation step, for each model), which that tolerance must reject. How the tolerance was
measured: docs/loss-curve.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

pytestmark = pytest.mark.slow


def _load_script():
    spec = importlib.util.spec_from_file_location("loss_curve", REPO / "scripts" / "loss_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lc = _load_script()
PLAN = [("bert", "lr_x2"), ("bert", "dropped_accum_step"), ("neox", "dropped_accum_step")]
EXPECTED = {m: json.loads((lc.EXPECTED_DIR / f"loss_{m}_debug.json").read_text()) for m in lc.MODELS}


@pytest.fixture(scope="module")
def bert_shards(tmp_path_factory, wiki_text_dir, shared_bert_vocab) -> dict[str, Path]:
    """The BERT shards scripts/loss_curve.py trains on, from the session's extraction of the sample dump."""
    return lc.build_bert(Path(wiki_text_dir), Path(shared_bert_vocab), tmp_path_factory.mktemp("curvebert"))


@pytest.fixture(scope="module")
def neox_shards(tmp_path_factory, wiki_text_dir) -> dict[str, Path]:
    """The BPE tokenizer and GPT shards scripts/loss_curve.py trains on (no ../shared needed)."""
    return lc.build_neox(Path(wiki_text_dir), tmp_path_factory.mktemp("curveneox"))


def _forked(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, **_) -> subprocess.CompletedProcess:
    """``lc.train``'s ``python train.py ...``, forked by a prefork server (one for the pinned kernels' env)."""
    assert cmd[0] == sys.executable and Path(cwd) == REPO, cmd
    return run_python(cmd[1:], timeout=timeout, env=env)


def _run(model: str, shards: dict[str, Path], run_dir: Path, **change) -> dict[int, float]:
    return lc.train({**lc.SETTINGS[model], **change}, shards, run_dir, timeout=900, run=_forked)


@pytest.fixture(scope="module")
def bert_curve(bert_shards, tmp_path_factory):
    return _run("bert", bert_shards, tmp_path_factory.mktemp("bertcurve") / "run")


@pytest.fixture(scope="module")
def neox_curve(neox_shards, tmp_path_factory):
    return _run("neox", neox_shards, tmp_path_factory.mktemp("neoxcurve") / "run")


@pytest.mark.parametrize("model", lc.MODELS)
def test_shards_are_the_recorded_build(request, model):
    """The shards this session built from the sample dump are byte-identical to those the curve was recorded
    on (a separate build, in another process and directory): the expected file is valid on this checkout."""
    shards = request.getfixturevalue(f"{model}_shards")
    assert lc.shard_digest(shards["train"]) == EXPECTED[model]["data"]["shards_sha256"]


@pytest.mark.parametrize("model", lc.MODELS)
def test_expected_file_is_consistent(model):
    exp = EXPECTED[model]
    tol = exp["tolerance"]
    # the file records the run the script makes today
    assert exp["overrides"] == lc.SETTINGS[model]
    assert sorted(int(s) for s in exp["losses"]) == list(range(1, lc.STEPS + 1))
    # measured between two kernel paths, and the tolerance within 10x of the spread measured ...
    assert tol["isa_sides"]["a"] != tol["isa_sides"]["b"]
    spread = max(tol["isa_spread"], tol["thread_spread"]) or lc.SPREAD_FLOOR  # the floor only where 0
    assert tol["spread_used"] == spread and tol["spread_factor"] == lc.SPREAD_FACTOR <= 10
    assert 0 < tol["max_rel_diff"] <= 10 * spread * (1 + 1e-3)  # (the file rounds to 3 digits)
    # ... and below what a wrong learning rate or a dropped accumulation step did at recording time
    assert tol["max_rel_diff"] < min(tol["controls_max_rel_diff"].values())
    assert set(tol["controls_max_rel_diff"]) == set(lc.CONTROLS)


def test_bert_curve_matches(bert_curve):
    assert lc.compare(EXPECTED["bert"], bert_curve) == []


def test_neox_curve_matches(neox_curve):
    assert lc.compare(EXPECTED["neox"], neox_curve) == []


@pytest.mark.parametrize("model,name", PLAN)
def test_negative_control_fails_the_comparison(request, tmp_path, model, name):
    """Each control is a real run: BERT at twice the learning rate; BERT and NeoX with global_batch 8 at
    micro_batch 8 (one of the two accumulation steps of every optimizer step dropped). NeoX at twice the
    learning rate is left out: at recording time it was 4x further from the curve than its dropped step."""
    change = lc.CONTROLS[name](lc.SETTINGS[model])
    curve = _run(model, request.getfixturevalue(f"{model}_shards"), tmp_path / "run", **change)
    problems = lc.compare(EXPECTED[model], curve)
    assert problems, f"{name}: a {model} run with {lc.CONTROLS[name](lc.SETTINGS[model])} passed"
    worst = lc.max_rel_diff({int(s): v for s, v in EXPECTED[model]["losses"].items()}, curve)
    assert worst > 2 * EXPECTED[model]["tolerance"]["max_rel_diff"]  # rejected with a margin, not by a hair


def test_compare_rejects_a_missing_step_and_nan():
    exp = EXPECTED["bert"]
    curve = {int(s): v for s, v in exp["losses"].items()}
    assert lc.compare(exp, curve) == []
    assert lc.compare(exp, {**curve, 3: float("nan")}) != []  # NaN compares false with any tolerance
    del curve[lc.STEPS]
    problems = lc.compare(exp, curve)
    assert any(f"step {lc.STEPS}: loss None" in p for p in problems) and "steps" in problems[0]


def test_isa_emulation_changes_the_kernel_path():
    """--record's second instruction set really dispatches ATen to other kernels than this CPU's default."""
    assert lc.cpu_capability(lc.ISA_ENV) == "DEFAULT"
    assert lc.cpu_capability() != "DEFAULT"
