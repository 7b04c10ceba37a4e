"""Scaling report: grouping by fingerprint, efficiency against the smallest run, projections, CSV/Markdown/PNG."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import UserError
from launch.report import annotate_efficiency, build_rows, find_runs, load_recipe
from tests.conftest import REPO, run_env
from training.metrics import config_fingerprint


def write_summary(root: Path, name: str, world: int, seqs_per_s: float, threads: int = 1, model: str = "bert-debug",
                  wall: float = 60.0, seq_len: int = 128) -> Path:  # fmt: skip
    cfg = {
        "model": {"name": model},
        "train": {"global_batch": 32, "seq_len": seq_len},
        "run": {"threads_per_rank": threads},
    }
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = {
        "model": model, "family": "bert", "world_size": world, "nodes": 1, "device_kind": "cpu",
        "device_count": world, "threads_per_rank": threads, "precision": "bf16", "zero_stage": 2, "micro_batch": 8,
        "global_batch": 32, "grad_accum": 32 // (8 * world), "seq_len": seq_len, "steps": 20,
        "sequences_per_sec": seqs_per_s, "tokens_per_sec": seqs_per_s * seq_len,
        "sequences_per_sec_per_device": seqs_per_s / world, "tokens_per_sec_per_device": seqs_per_s * seq_len / world,
        "tflops_per_device": 0.01, "mfu": 0.01, "peak_memory_bytes": 1 << 30, "wall_time_s": wall,
        "fingerprint": config_fingerprint(dict(cfg, world_size=world)), "config": cfg,
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_summary(root, "w1", 1, 100.0)
    write_summary(root, "w2", 2, 180.0)
    write_summary(root, "w4", 4, 300.0)
    write_summary(root, "w2-t2", 2, 250.0, threads=2)  # other threads per rank: another group, alone
    return root


def test_groups_and_efficiency(runs: Path) -> None:
    rows = build_rows(find_runs([runs]))
    by_name = {Path(r["run"]).name: r for r in rows}
    assert by_name["w1"]["fingerprint"] == by_name["w4"]["fingerprint"] != by_name["w2-t2"]["fingerprint"]
    assert by_name["w1"]["scaling_efficiency"] == pytest.approx(1.0) and by_name["w1"]["is_baseline"]
    assert by_name["w2"]["scaling_efficiency"] == pytest.approx(0.9)
    assert by_name["w4"]["scaling_efficiency"] == pytest.approx(0.75)
    assert by_name["w2-t2"]["scaling_efficiency"] is None  # alone: no invented 100%
    assert by_name["w4"]["accelerator_hours"] == pytest.approx(4 * 60 / 3600)


def test_projection_from_recipe_and_profile_price(runs: Path, tmp_path: Path) -> None:
    p1, p2 = tmp_path / "phase1.yaml", tmp_path / "phase2.yaml"
    p1.write_text("train: {steps: 7038, global_batch: 65536}\ndata: {seq_len: 128}\n")
    p2.write_text("train: {steps: 1563, global_batch: 32768}\ndata: {seq_len: 512}\n")
    recipe = load_recipe([str(p1), str(p2)])
    assert recipe.samples == 7038 * 65536 + 1563 * 32768
    rows = build_rows(find_runs([runs]), recipe, price_per_instance_hour=10.0)
    w2 = next(r for r in rows if Path(r["run"]).name == "w2")
    hours = recipe.samples / 180.0 / 3600
    assert w2["projected_hours"] == pytest.approx(hours)
    assert w2["projected_accelerator_hours"] == pytest.approx(2 * hours)
    assert w2["projected_cost"] == pytest.approx(10.0 * hours)  # one node
    assert w2["projection_seq_len_mismatch"]  # phase 2 is at 512, the run at 128
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 10}\n")
    with pytest.raises(UserError, match="global_batch"):
        load_recipe([str(bad)])


def test_cli_writes_markdown_csv_and_png(runs: Path, tmp_path: Path) -> None:
    p1 = tmp_path / "phase1.yaml"
    p1.write_text("train: {steps: 7038, global_batch: 65536}\n")
    md, csv_path, png = tmp_path / "r.md", tmp_path / "r.csv", tmp_path / "r.png"
    r = subprocess.run(
        [sys.executable, "-m", "launch", "report", str(runs), "--markdown", str(md), "--csv", str(csv_path),
         "--plot", str(png), "--recipe", str(p1), "--profile", "efa"],
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "| 1 | 2 | 180.00 | 90.00 | 90.0% |" in r.stdout
    assert "n/a (no baseline)" in r.stdout and "No baseline" in r.stdout
    assert "projected cost" in r.stdout and md.read_text() == r.stdout
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 4 and {float(x["scaling_efficiency"]) for x in rows if x["scaling_efficiency"]} >= {
        0.9,
        0.75,
    }
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] == 420 and img.shape[1] == 1100


def test_report_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "runs" / "x"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text('{"fingerprint": "a", "device_count": 0}')
    r = subprocess.run([sys.executable, "-m", "launch", "report", str(tmp_path / "runs")], cwd=REPO, env=run_env(),
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_annotate_efficiency_writes_only_with_a_smaller_baseline(runs: Path) -> None:
    assert annotate_efficiency(runs / "w1", runs) is None  # the smallest run is nobody's comparison
    assert "scaling_efficiency" not in json.loads((runs / "w1" / "summary.json").read_text())
    assert annotate_efficiency(runs / "w2-t2", runs) is None  # alone in its group
    eff = annotate_efficiency(runs / "w4", runs)
    assert eff == pytest.approx(0.75)
    s = json.loads((runs / "w4" / "summary.json").read_text())
    assert s["scaling_efficiency"] == pytest.approx(0.75) and s["baseline_run"] == str(
        (runs / "w1").resolve()
    )
