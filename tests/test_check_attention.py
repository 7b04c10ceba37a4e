"""scripts/check_attention.py, the attention operator's device check: its CPU mode runs here (CI), its CUDA mode
on the GPU tier, and bad usage is one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_env, run_python

SCRIPT = "scripts/check_attention.py"
CHECKS = (
    "opcheck_forward",
    "opcheck_backward",
    "dropout_masks_agree",
    "dropout_kept_fraction",
    "dropout_scale",
    "checkpoint_gradients",
    "compiled_graph",
    "compiled_vs_float64",
)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU-mode run (bert-debug's layer): its process and what it wrote to --json."""
    out = tmp_path_factory.mktemp("check_attention") / "opcheck.json"
    p = run_python([SCRIPT, "--device", "cpu", "--size", "bert-debug", "--json", str(out)], timeout=600)
    return p, json.loads(out.read_text()) if out.exists() else None


def test_cpu_mode_passes_every_check_with_its_figures(cpu_run):
    p, record = cpu_run
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert record is not None and record["passed"] is True
    assert record["device"] == "cpu" and record["torch"] == torch.__version__ and record["size"] == "bert-debug"
    assert "cuda" in record and record["dtype"] == "float32"
    checks = {c["name"]: c for c in record["checks"]}
    assert tuple(checks) == CHECKS, list(checks)
    for name, c in checks.items():
        assert c["passed"] is True and c["figure"] is not None and c["figure"] <= c["bound"], c
        assert f"{name} " in p.stdout and "PASS" in p.stdout.split(f"{name} ", 1)[1].splitlines()[0], p.stdout
    assert "FAIL" not in p.stdout
    # the figures say what was compared: opcheck's tests in FP32 and BF16, dropouts 0 and 0.1, both ops
    assert checks["opcheck_forward"]["detail"]["tests"] == checks["opcheck_backward"]["detail"]["tests"] == 16
    assert 0 in checks["opcheck_forward"]["detail"]["lengths"]  # a sequence of length 0
    assert checks["dropout_masks_agree"]["detail"]["probabilities"] == 1_048_576
    assert checks["dropout_masks_agree"]["figure"] == 0 and checks["checkpoint_gradients"]["figure"] == 0
    assert checks["checkpoint_gradients"]["detail"]["another_seed_differs_by"] > 0  # the comparison could fail
    assert checks["compiled_graph"]["detail"]["compiled_graphs"] >= 1 and checks["compiled_graph"]["figure"] == 0
    assert checks["compiled_graph"]["detail"]["fell_back"] is None
    ratios = checks["compiled_vs_float64"]["data"]["ratios"]
    assert "output" in ratios and "attention.self.key.bias.grad" in ratios and len(ratios) == 18  # 16 params


def test_bad_usage_is_one_line(tmp_path):
    """``--device cuda`` where torch sees no CUDA device (hidden here where there is one), and a --json in a
    folder that does not exist: exit 2, one line, no traceback, no check run."""
    env = run_env()
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""
    for args, env_, says in (
        (["--device", "cuda"], env, "--device cuda: torch sees no CUDA device"),
        (["--device", "cpu", "--json", str(tmp_path / "missing" / "x.json")], None, "missing does not exist"),
        (["--device", "tpu"], None, "argument --device: invalid choice"),
    ):
        p = run_python([SCRIPT, *args], timeout=300, env=env_)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
        assert p.stderr.startswith("error: ") and says in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the GPU tier runs on a GPU machine (bash scripts/gpu.sh BUNDLE)",
)
def test_cuda_mode_passes_every_check(tmp_path):
    """The GPU tier: the flash branch in BF16 and bert-large's compiled layer (docs/gpu-notes.md)."""
    out = tmp_path / "opcheck.json"
    p = run_python([SCRIPT, "--device", "cuda", "--json", str(out)], timeout=600)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["device_type"] == "cuda" and record["cuda"] == torch.version.cuda and record["passed"] is True
    assert tuple(c["name"] for c in record["checks"]) == CHECKS
    assert all(c["passed"] and c["figure"] <= c["bound"] for c in record["checks"]), record["checks"]
