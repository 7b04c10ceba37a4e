"""Scaling report: grouping by fingerprint, efficiency against the smallest run computed when the report reads
the summaries, recipe projections through train.py's config loader, CSV/Markdown/PNG."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from common.errors import UserError
from launch.report import build_rows, device_peak, find_runs, load_recipe
from tests.conftest import REPO, run_python
from training.metrics import RunSummary, config_fingerprint

FLOPS_PER_TOKEN = 1.5e8
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))  # configs/cluster/ holds profiles


def write_summary(
    root: Path,
    name: str,
    world: int,
    seqs_per_s: float,
    threads: int = 1,
    model: str = "bert-debug",
    wall: float = 60.0,
    seq_len: int = 128,
    mfu: float | None = 0.01,
    flops_per_token: float | None = FLOPS_PER_TOKEN,
) -> Path:
    cfg = {
        "model": {"name": model},
        "train": {"global_batch": 32, "seq_len": seq_len},
        "run": {"threads_per_rank": threads},
    }
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = RunSummary(
        model=model,
        family="bert",
        world_size=world,
        nodes=1,
        device_kind="cpu",
        device_count=world,
        threads_per_rank=threads,
        precision="bf16",
        zero_stage=2,
        zero_stage_requested=2,
        optimizer="lans",
        micro_batch=8,
        global_batch=32,
        grad_accum=32 // (8 * world),
        seq_len=seq_len,
        steps=20,
        measured_steps=18,
        samples=20 * 32,
        tokens=20 * 32 * seq_len,
        flops_per_token=flops_per_token,
        peak_flops_per_device=None,
        attempt=1,
        stopped="",
        peak_memory_bytes=1 << 30,
        startup_s=1.0,
        warmup_s=1.0,
        train_window_s=wall - 2.0,
        eval_s=0.0,
        save_s=0.0,
        log_s=0.0,
        wall_time_s=wall,
        final_loss=7.0,
        fingerprint=config_fingerprint(dict(cfg, world_size=world)),
        config=cfg,
        sequences_per_sec=seqs_per_s,
        tokens_per_sec=seqs_per_s * seq_len,
        sequences_per_sec_per_device=seqs_per_s / world,
        tokens_per_sec_per_device=seqs_per_s * seq_len / world,
        tflops_per_device=0.01,
        mfu=mfu,
    )
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict()))
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_summary(root, "w1", 1, 100.0)
    write_summary(root, "w2", 2, 180.0)
    write_summary(root, "w4", 4, 300.0, mfu=None)  # a device without a known peak: mfu null
    write_summary(root, "w2-t2", 2, 250.0, threads=2)  # other threads per rank: another group, alone
    return root


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(["-m", "launch", "report", *args], timeout=180)


def test_groups_and_efficiency(runs: Path) -> None:
    rows = build_rows(find_runs([runs]))
    by_name = {Path(r["run"]).name: r for r in rows}
    assert by_name["w1"]["fingerprint"] == by_name["w4"]["fingerprint"] != by_name["w2-t2"]["fingerprint"]
    assert by_name["w1"]["scaling_efficiency"] == pytest.approx(1.0) and by_name["w1"]["is_baseline"]
    assert by_name["w2"]["scaling_efficiency"] == pytest.approx(0.9)
    assert by_name["w4"]["scaling_efficiency"] == pytest.approx(0.75)
    assert by_name["w2-t2"]["scaling_efficiency"] is None  # alone: no invented 100%
    assert by_name["w4"]["accelerator_hours"] == pytest.approx(4 * 60 / 3600)
    assert by_name["w4"]["mfu"] is None and by_name["w2"]["mfu"] == 0.01


def test_projection_at_the_runs_achieved_flops(runs: Path) -> None:
    recipe = load_recipe(["bert-large-phase1", "bert-large-phase2"])  # phase 2 has no train.seq_len of its own
    assert [(p.steps, p.global_batch, p.seq_len) for p in recipe.phases] == [
        (7038, 65536, 128),
        (1563, 32768, 512),
    ]
    assert recipe.samples == 7038 * 65536 + 1563 * 32768
    assert recipe.tokens == 7038 * 65536 * 128 + 1563 * 32768 * 512
    p1, p2 = recipe.phases
    assert p2.flops_per_token > p1.flops_per_token  # attention grows with the sequence
    rows = build_rows(find_runs([runs]), recipe, price_per_instance_hour=10.0)
    w2 = next(r for r in rows if Path(r["run"]).name == "w2")
    achieved = 180.0 * 128 / 2 * FLOPS_PER_TOKEN  # model FLOP/s per accelerator the run measured
    hours = recipe.flops / (achieved * 2) / 3600
    assert w2["projected_hours"] == pytest.approx(hours)
    assert w2["projected_accelerator_hours"] == pytest.approx(2 * hours)
    assert w2["projected_cost"] == pytest.approx(10.0 * hours)  # one node
    assert w2["projection_extrapolated"]  # bert-large at 128 and 512 from a bert-debug run at 128


def test_an_unpadded_recipe_projects_its_datas_real_tokens(tmp_path: Path) -> None:
    """An unpadding BERT phase costs the positions it computes: its data's mean real length, attention over
    the real lengths (the shards' manifest totals); with model.unpad=false, or without a manifest at hand,
    every position, and the report says which."""
    from model.flops import training_flops_of_sums
    from model.registry import get_spec

    data = tmp_path / "h5"
    data.mkdir()
    totals = {"instances": 1000, "real_tokens": 100_000, "real_tokens_squared": 11_000_000}
    (data / "manifest.json").write_text(json.dumps({"shards": [], "totals": totals}))
    for unpad in ("true", "false"):
        (tmp_path / f"{unpad}.yaml").write_text(
            f"base: {REPO / 'configs' / 'bert-large-phase1.yaml'}\ndata:\n  train: {data}\nmodel:\n  unpad: {unpad}\n"
        )
    on, off, absent = (
        load_recipe([str(tmp_path / "true.yaml")]).phases[0],
        load_recipe([str(tmp_path / "false.yaml")]).phases[0],
        load_recipe(["bert-large-phase1"]).phases[0],  # its data.train is not on this machine
    )
    assert on.padding_fraction == pytest.approx(1 - 100 / 128) and on.note == ""
    assert on.tokens == on.samples * 100
    per_sample = training_flops_of_sums(get_spec("bert-large"), 100.0, 11_000.0, 1, 20)
    assert on.flops == pytest.approx(on.samples * per_sample, rel=1e-12)
    assert off.tokens == absent.tokens == off.samples * 128 and off.flops == pytest.approx(absent.flops)
    assert off.padding_fraction is None and off.note == ""  # padded: counts every position, as it computes
    assert absent.padding_fraction is None and "padding unknown" in absent.note
    assert on.flops < off.flops


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_projects(name: str, tmp_path: Path) -> None:
    recipe = load_recipe([name])
    (phase,) = recipe.phases
    assert phase.seq_len >= 128 and phase.steps > 0 and phase.global_batch > 0
    assert recipe.samples > 0 and recipe.tokens > 0 and phase.flops_per_token > 0 and recipe.flops > 0
    if name.startswith("neox"):
        assert phase.seq_len == 2048  # from neox-125m.yaml, through `base:`
    write_summary(tmp_path, "w8", 8, 40.0, model=phase.model, seq_len=phase.seq_len)
    (row,) = build_rows(find_runs([tmp_path]), recipe)
    assert row["projected_hours"] > 0 and row["projected_accelerator_hours"] > 0
    assert not row["projection_extrapolated"]  # same model and sequence length as the run


def test_recipe_errors_are_user_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {REPO / 'configs' / 'smoke.yaml'}\ntrain: {{steps: 0}}\n")
    with pytest.raises(UserError, match="train.steps"):
        load_recipe([str(bad)])
    with pytest.raises(UserError, match="nosuch"):
        load_recipe(["nosuch"])
    with pytest.raises(UserError, match="no peak FLOP/s known"):
        device_peak("H100")  # exact names only


def test_cli_writes_markdown_csv_and_png_and_leaves_summaries_alone(runs: Path, tmp_path: Path) -> None:
    before = {p: p.read_bytes() for p in runs.rglob("summary.json")}
    md, csv_path, png = tmp_path / "r.md", tmp_path / "r.csv", tmp_path / "r.png"
    r = _report(
        str(runs),
        "--markdown",
        str(md),
        "--csv",
        str(csv_path),
        "--plot",
        str(png),
        "--recipe",
        "smoke",
        "--profile",
        "efa",
    )
    assert r.returncode == 0, r.stderr
    assert "| 1 | 2 | 180.00 | 90.00 | 1.0% | 90.0% |" in r.stdout
    assert "| 1 | 4 | 300.00 | 75.00 | n/a | 75.0% |" in r.stdout  # mfu null
    assert "n/a (no baseline)" in r.stdout and "No baseline" in r.stdout
    assert "projected cost" in r.stdout and "| smoke.yaml | bert-debug | 40 | 32 | 128 |" in r.stdout
    assert md.read_text() == r.stdout
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 4 and {float(x["scaling_efficiency"]) for x in rows if x["scaling_efficiency"]} >= {
        0.9,
        0.75,
    }
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] == 420 and img.shape[1] == 1100
    assert {p: p.read_bytes() for p in runs.rglob("summary.json")} == before  # the report writes no summary


def test_cli_recipe_alone_on_a_device() -> None:
    r = _report("--recipe", "neox-20b", "--device", "NVIDIA H100 80GB HBM3", "--mfu", "0.4", "--accelerators", "96")
    assert r.returncode == 0, r.stderr
    recipe = load_recipe(["neox-20b"])
    accel_hours = recipe.flops / (device_peak("NVIDIA H100 80GB HBM3") * 0.4) / 3600
    assert f"at 40.0% MFU: {accel_hours:,.0f} accelerator-hours" in r.stdout
    assert "| neox-20b.yaml | neox-20b | 150,000 | 1,536 | 2,048 |" in r.stdout


def test_too_short_run_is_left_out(runs: Path) -> None:
    short = runs / "short"
    short.mkdir()
    measured = json.loads((runs / "w1" / "summary.json").read_text())
    unmeasured = {k: v for k, v in measured.items() if "_per_sec" not in k and k not in ("mfu", "tflops_per_device")}
    (short / "summary.json").write_text(json.dumps(unmeasured))  # as train.py writes a run of warm-up steps only
    assert sorted(r.dir.name for r in find_runs([runs])) == ["w1", "w2", "w2-t2", "w4"]


def test_report_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "runs" / "x"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text('{"fingerprint": "a", "device_count": 0, "sequences_per_sec": 1}')
    for args in ([str(tmp_path / "runs")], ["--recipe", "smoke", "--device", "NVIDIA H100 80GB HBM3"], []):
        r = _report(*args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, (
            args,
            r.stderr,
        )
