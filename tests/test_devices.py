"""Device names, the peak FLOP/s table and its sources, the measured CPU peak and its cache, and MFU."""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_env, run_python
from training import devices
from training.devices import (
    PEAK_FLOPS,
    cache_path,
    cpu_cache_key,
    cpu_matmul_rates,
    device_name,
    normalise_name,
    peak_flops,
)
from training.metrics import mfu


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


# --------------------------------------------------------------------------------------------- table


def test_each_device_name_maps_to_its_own_entry():
    expected = {
        "NVIDIA H100 80GB HBM3": 989.5e12,
        "NVIDIA H100 PCIe": 756.5e12,
        "NVIDIA H100 NVL": 835.5e12,
        "NVIDIA H200": 989.5e12,
        "NVIDIA H200 NVL": 835.5e12,
        "NVIDIA GH200 480GB": 990e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100-SXM4-40GB": 312e12,
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA A10": 125e12,
        "NVIDIA L4": 121e12,
        "NVIDIA L40": 181.05e12,
        "NVIDIA L40S": 362.05e12,
        "GAUDI": 60e12,
        "GAUDI2": 432e12,
        "GAUDI3": 1835e12,
    }
    for name, peak in expected.items():
        assert peak_flops(name) == peak, name
    # L4, L40 and L40S are three devices; so are H200 and H200 NVL, and the three H100s
    assert len({peak_flops(n) for n in ("NVIDIA L4", "NVIDIA L40", "NVIDIA L40S")}) == 3
    assert peak_flops("NVIDIA H200 NVL") < peak_flops("NVIDIA H200")
    assert len({peak_flops(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL")}) == 3


def test_names_are_normalised_but_never_substring_matched(logs):
    assert peak_flops("  nvidia   l40s ") == peak_flops("L40S") == PEAK_FLOPS["NVIDIA L40S"]
    assert peak_flops("Gaudi2") == PEAK_FLOPS["GAUDI2"]
    assert normalise_name("NVIDIA\tH200  NVL") == "h200 nvl"
    for near_miss in ("NVIDIA L40S-X", "NVIDIA H100", "NVIDIA H200 NVL 2", "NVIDIA A10GX", "GAUDI4"):
        logs.clear()
        assert peak_flops(near_miss) is None
        warnings = [r for r in logs.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and repr(near_miss) in warnings[0].getMessage()
    logs.clear()
    assert peak_flops("NVIDIA H100") is None  # asked again: no second warning
    assert not [r for r in logs.records if r.levelno == logging.WARNING]


def test_every_table_entry_cites_its_source_and_figure():
    """Each entry has a comment right above it that names a document and prints the entry's figure."""
    source = Path(devices.__file__).read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    table = next(
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "PEAK_FLOPS"
    )
    assert len(table.keys) == len(PEAK_FLOPS) >= 16
    for key in table.keys:
        name = key.value
        comment, i = [], key.lineno - 2  # 0-based index of the line above the key
        while lines[i].strip().startswith("#"):
            comment.insert(0, lines[i].strip().lstrip("# "))
            i -= 1
        text = " ".join(comment).replace(",", "")
        assert comment, f"{name} has no source comment"
        assert re.search(r"datasheet|table", text, re.I), f"{name}: the comment names no document"
        tflops = PEAK_FLOPS[name] / 1e12
        figures = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}
        # NVIDIA prints BF16 with sparsity: the dense figure is half of it
        assert figures & {round(tflops, 2), round(2 * tflops, 2)}, f"{name}: {tflops} TF is not in {text!r}"


# ----------------------------------------------------------------------------------------------- CPU


def test_device_name_follows_deepspeeds_accelerator():
    from deepspeed.accelerator import get_accelerator

    name = device_name()
    if get_accelerator().device_name() == "cpu":
        assert name == "cpu"
    else:
        assert name != "cpu" and name == name.strip()


def test_cpu_peak_cache_is_written_reread_and_never_decreases(cache_home, logs):
    rate = cpu_matmul_rates(["float32"])["float32"]
    path = cache_path()
    assert path == cache_home / "wikipretrain" / "cpu_matmul_peak.json"
    assert sum("measuring CPU matmul peak" in r.getMessage() for r in logs.records) == 1
    key = cpu_cache_key()
    assert f"threads={torch.get_num_threads()}" in key and torch.__version__ in key
    assert json.loads(path.read_text())[key]["float32"] == rate > 0
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []

    # Re-read, not re-measured: a larger figure in the file (an earlier run on an idle machine) is returned.
    data = json.loads(path.read_text())
    data[key]["float32"] = rate * 1000
    path.write_text(json.dumps(data))
    logs.clear()
    assert cpu_matmul_rates(["float32"])["float32"] == rate * 1000
    assert not any("measuring" in r.getMessage() for r in logs.records)
    # A new measurement cannot lower it ...
    assert cpu_matmul_rates(["float32"], remeasure=True)["float32"] == rate * 1000
    assert json.loads(path.read_text())[key]["float32"] == rate * 1000
    # ... but replaces a smaller one (a measurement taken under load).
    data[key]["float32"] = rate * 1e-6
    path.write_text(json.dumps(data))
    again = cpu_matmul_rates(["float32"], remeasure=True)["float32"]
    assert again > rate * 1e-6 and json.loads(path.read_text())[key]["float32"] == again


def test_cpu_cache_key_separates_thread_counts():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_cache_key()
        torch.set_num_threads(2)
        assert cpu_cache_key() != one and "threads=1" in one
    finally:
        torch.set_num_threads(threads)


def test_cpu_peak_rejects_unknown_dtypes(cache_home):
    with pytest.raises(ValueError, match="int8"):
        peak_flops("cpu", ("int8",))


def _run_check(cache: Path, extra_env: dict[str, str]) -> dict:
    env = {**run_env(), "XDG_CACHE_HOME": str(cache), **extra_env}
    # fresh: the instruction-set variables are read when torch loads
    out = run_python([str(REPO / "tests" / "scripts" / "cpu_peak_check.py")], timeout=300, env=env, fresh=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


WEAK_ISA = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
}


@pytest.mark.parametrize("isa", ["default env", "weaker ISA"])
def test_cpu_peak_bounds_any_matmul_the_run_computes(tmp_path, isa):
    """The peak is >= what a quick BF16 or FP32 matmul reaches at the same thread count (to the timing noise
    between two samples of one rate, ``cpu_peak_check.NOISE``), so MFU <= 1."""
    r = _run_check(tmp_path, WEAK_ISA if isa == "weaker ISA" else {})
    if isa == "weaker ISA":
        assert "isa=DEFAULT" in r["key"]  # ATen really ran its baseline kernels, and the key says so
    assert r["first"] > 0 and r["attempts"] <= 10
    for name in ("bfloat16", "float32"):
        assert r["peaks"][name] >= r["noise"] * r["quick"][name] > 0, (name, r)
        assert r["cached"][name] == r["peaks"][name]
    assert r["both"] == max(r["peaks"].values())
    assert r["first"] <= r["both"]  # later measurements only ever raised it


_NATIVE_CHECK = """
import json, sys
from training.devices import bf16_is_native, cache_path, cpu_cache_key, peak_flops
bf16, fp32 = float(sys.argv[1]), float(sys.argv[2])
cache_path().parent.mkdir(parents=True)
cache_path().write_text(json.dumps({cpu_cache_key(): {"bfloat16": bf16, "float32": fp32}}))
native = bf16_is_native()
print(json.dumps([native, peak_flops("cpu", ("bfloat16",)), peak_flops("cpu", ("bfloat16", "float32"))]))
"""


@pytest.mark.parametrize("bf16,fp32", [(1e9, 100e9), (60e9, 100e9)])
def test_bf16_emulation_is_reported_once_from_the_cached_rates(tmp_path, bf16, fp32):
    env = {**run_env(), "XDG_CACHE_HOME": str(tmp_path)}
    out = run_python(["-c", _NATIVE_CHECK, str(bf16), str(fp32)], timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    native, peak_bf16, peak_both = json.loads(out.stdout.strip().splitlines()[-1])
    assert native is (bf16 >= 0.25 * fp32)
    assert (peak_bf16, peak_both) == (bf16, fp32)  # cached rates, no measurement
    assert "measuring" not in out.stderr
    warnings = [line for line in out.stderr.splitlines() if "emulated" in line]
    if native:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "1 GFLOP/s" in warnings[0] and "100 GFLOP/s" in warnings[0]


# ----------------------------------------------------------------------------------------------- MFU


def test_mfu_is_none_without_a_peak_and_raises_above_one():
    assert mfu(6e12, None) is None
    assert mfu(6e12, 12e12) == pytest.approx(0.5)
    assert mfu(12e12, 12e12) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"MFU 3\.740 > 1.*4\.488e\+13 model FLOP/s.*1\.2e\+13 FLOP/s"):
        mfu(7480.0 * 6e9, 12e12)
    with pytest.raises(ValueError, match="positive"):
        mfu(6e12, 0.0)


def test_out_of_memory_line_names_the_micro_batch_the_peak_and_half() -> None:
    """The line a micro-batch that ran out of device memory ends with (the GPU tier runs it for real): a
    RankError (each rank that hits it prints it)."""
    from common.errors import RankError
    from training.devices import out_of_memory

    err = out_of_memory(48)
    assert isinstance(err, RankError)
    text = str(err)
    assert text.startswith("train.micro_batch=48 runs out of device memory on rank ") and "\n" not in text
    assert " GiB of " in text and text.endswith("; try train.micro_batch=24")
    assert str(out_of_memory(1)).endswith("try train.micro_batch=1")
    assert str(out_of_memory(8, "evaluation")).startswith(
        "train.micro_batch=8 runs out of device memory in evaluation on"
    )
