"""The GPU calls (``bash scripts/gpu.sh [--dry-run] [--cpu] CALL BUNDLE_DIR``, scripts/gpu_calls.py).

The dry run's totals fit a lent GPU's budget; call 1 runs end to end on the CPU at debug sizes (bert-debug and
neox-debug beside the Trainer, the attention operator's check), each run's record in ``rows.jsonl`` as it
ends; a deadline between two runs keeps what ran and skips the rest with its line; a run cut at its limit
leaves a ``timeout`` record; without ``--cpu`` the script refuses a machine where torch sees no GPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env

COSTS = REPO / "scripts" / "gpu_costs.json"
CALL1_RUNS = [
    ("bert-large-p1", "ours", "lans"),
    ("bert-large-p1", "peer", "adamw_torch_fused"),
    ("neox-1.3b", "ours", "adamw"),
    ("neox-1.3b", "peer", "adamw_torch_fused"),
]


def gpu_sh(*args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu.sh", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**run_env(), "PYTHON": sys.executable, **env},
        timeout=timeout,
    )


def cpu_costs(path: Path, **seconds: float) -> Path:
    """The cost table with every step given 300 s (``seconds``: these steps, by entry, given these instead), as
    ``COSTS`` for a call on the CPU: the table's figures are the GPU's, and each step is cut at twice its figure,
    which a loaded 2-core machine can pass on steps the GPU's 16 cores do in seconds."""
    table = json.loads(COSTS.read_text())
    for key, entry in table["entries"].items():
        entry["seconds"] = seconds.get(key, 300)
    path.write_text(json.dumps(table))
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("call", ["call1", "call2"])
def test_each_call_fits_its_share_of_the_lent_minutes(call, tmp_path):
    """Cold (install and data included), each call's plan is at most 330 s: two calls and a machine start fit
    the 15 minutes with room to run a step again. Every step prints its expected seconds and where they come
    from, and the unmeasured entries are named."""
    res = gpu_sh("--dry-run", call, str(tmp_path), timeout=60)
    assert res.returncode == 0, res.stderr
    steps = re.findall(r"^ +(\d+) s  (.+?)  \[([\w .-]+): (measured|UNMEASURED)", res.stdout, re.MULTILINE)
    table = json.loads(COSTS.read_text())["entries"]
    assert len(steps) >= 8 and {key for _, _, key, _ in steps} <= set(table), res.stdout
    for secs, name, key, source in steps:
        assert source == ("measured" if "measured" in table[key] else "UNMEASURED"), (name, key)
        assert int(secs) >= table[key]["seconds"], (name, key)
    cold, warm = map(int, re.search(r"cold total (\d+) s .*, warm total (\d+) s", res.stdout).groups())
    counted = sum(int(s) for s, name, _, _ in steps if "not in the totals" not in name)
    assert counted == cold <= 330 and warm <= cold, res.stdout
    unmeasured = re.search(r"unmeasured entries: (.+)$", res.stdout, re.MULTILINE).group(1).split(", ")
    assert set(unmeasured) == {key for _, _, key, source in steps if source == "UNMEASURED"}, res.stdout


@pytest.fixture(scope="module")
def call1(tmp_path_factory) -> dict[str, Path | subprocess.CompletedProcess]:
    """Call 1 on the CPU at debug sizes, once for the module: its work folder (shards reused by the deadline
    test), its OUT folder and its output."""
    root = tmp_path_factory.mktemp("call1")
    bundle, work, out = root / "bundle", root / "work", root / "out"
    (bundle / "sample").mkdir(parents=True)  # --cpu installs nothing: the checkout and its venv are the project
    costs = cpu_costs(root / "costs.json")
    res = gpu_sh("--cpu", "call1", str(bundle), OUT=str(out), WORK=str(work), CALL_S="3600", COSTS=str(costs))
    return {"bundle": bundle, "work": work, "out": out, "res": res}


def test_call1_on_the_cpu_records_each_run_as_it_ends(call1):
    res, out = call1["res"], call1["out"]
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "opcheck.json", "rows.jsonl", "versions.txt"]
    rows = records(out)
    assert [(r["row"], r["side"], r["optimizer"]) for r in rows] == CALL1_RUNS
    for r in rows:
        assert r["status"] == "ok" and r["micro_batch"] == 2 and r["global_batch"] == 4, r
        assert r["sequences_per_sec"] > 0 and r["tokens_per_sec"] > 0 and 0 < r["mfu"] <= 1, r
        assert r["peak_memory_bytes"] > 0 and r["measured_steps"] == 2 and r["wall_s"] > 0, r
        assert r["command"].startswith(sys.executable) and r["device"], r
    kernels = [r["attention_kernel"] for r in rows]
    assert kernels == ["varlen-cpu", "sdpa-padded", None, None], kernels
    # each record appended as its run ended: the call's log counts them after every run, one more each time
    counts = [int(n) for n in re.findall(r"rows\.jsonl: (\d+) records", res.stdout)]
    assert counts == [1, 2, 3, 4], res.stdout
    order = re.findall(r"== (bert-large-p1|neox-1\.3b) (ours:\w+|peer)(?: \(|:)", res.stdout)
    assert [f"{row} {only}" for row, only in order[::2]] == [
        "bert-large-p1 ours:lans",
        "bert-large-p1 peer",
        "neox-1.3b ours:adamw",
        "neox-1.3b peer",
    ], res.stdout
    check = json.loads((out / "opcheck.json").read_text())
    assert check["checks"] and all(c["passed"] for c in check["checks"]), check
    assert re.search(r"^torch \S+ cuda None deepspeed \S+ transformers \S+", (out / "versions.txt").read_text(), re.M)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/call1.log" in names and any(n.startswith("bench-logs/") for n in names), names


def test_a_deadline_between_two_runs_keeps_the_first_record_and_skips_the_rest(call1, tmp_path):
    """A cost table whose second run cannot fit before the deadline: the first run (given 8 s, so cut at its
    own 1 s limit: a ``timeout`` record) keeps its record, the rest are skipped, each with its line and a
    ``skipped`` record. The shards of the module's call are reused (already done)."""
    never = {key: 10**6 for key in ("opcheck", "bert-large-p1 peer", "neox-1.3b ours", "neox-1.3b peer")}
    costs = cpu_costs(tmp_path / "costs.json", **never, **{"bert-large-p1 ours": 8})
    out = tmp_path / "out"
    env = {"OUT": str(out), "WORK": str(call1["work"]), "CALL_S": "3600", "COSTS": str(costs)}
    res = gpu_sh("--cpu", "call1", str(call1["bundle"]), timeout=300, **env)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-3000:]
    rows = records(out)
    assert [(r["row"], r["side"], r["status"]) for r in rows] == [
        ("bert-large-p1", "ours", "timeout"),
        ("bert-large-p1", "peer", "skipped"),
        ("neox-1.3b", "ours", "skipped"),
        ("neox-1.3b", "peer", "skipped"),
    ], rows
    assert rows[0].get("sequences_per_sec") is None and "time limit" in rows[0]["error"], rows[0]
    for name in ("attention operator check", "bert-large-p1 peer", "neox-1.3b ours:adamw", "neox-1.3b peer"):
        assert re.search(
            rf"== {re.escape(name)} skipped: expects 1000000 s, \d+ s left before the deadline", res.stdout
        )
    assert "== bert-large-p1 shards: done" in res.stdout and "== logs archive: done" in res.stdout


def test_without_cpu_it_stops_first_where_torch_sees_no_gpu(tmp_path):
    """Without ``--cpu`` the script checks that the interpreter's torch sees a GPU before it installs anything:
    here (a CPU build) one line and exit 2, and nothing written."""
    bundle, out = tmp_path / "bundle", tmp_path / "out"
    (bundle / "sample").mkdir(parents=True)
    res = gpu_sh("call1", str(bundle), OUT=str(out), WORK=str(tmp_path / "work"), timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    why = "import torch sees no CUDA device (torch missing, a CPU build, or no GPU visible)"
    assert res.stderr == f"error: {sys.executable}: {why}\n" and res.stdout == ""
    assert not out.exists() and not (tmp_path / "work").exists()
