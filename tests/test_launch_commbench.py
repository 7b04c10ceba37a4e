"""Collective benchmark: size parsing, nccl-tests bandwidth conventions, and a real 2-rank gloo run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import UserError
from launch.commbench import PUBLISHED_ROW_BYTES, bus_factor, parse_sizes
from tests.conftest import run_env, run_python


def test_size_parsing() -> None:
    assert parse_sizes("1K..16K", 2) == [1024, 2048, 4096, 8192, 16384]
    assert parse_sizes("1K..256M") == sorted({1024 * 4**i for i in range(10)} | {PUBLISHED_ROW_BYTES})
    assert parse_sizes("32M,1K") == [1024, 32 * 1024 * 1024]
    for bad in ("12Q", "8K..1K", ""):
        with pytest.raises(UserError):
            parse_sizes(bad)


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 32) == pytest.approx(2 * 31 / 32)
    assert bus_factor("all_gather", 32) == pytest.approx(31 / 32)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)


def test_outside_the_launcher_is_a_one_line_error() -> None:
    env = run_env()
    env.pop("WORLD_SIZE", None)
    r = run_python(["-m", "launch", "commbench"], env=env)
    assert r.returncode == 2 and "deepspeed --num_gpus N --module launch commbench" in r.stderr


@pytest.mark.slow
def test_two_cpu_ranks_print_the_table(tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    r = run_python(
        [
            "-m",
            "launch",
            "commbench",
            "--launch-local",
            "2",
            "--sizes",
            "4K,64K,32M",
            "--iters",
            "3",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "busbw_MB/s" in r.stdout and "32 MB row" in r.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    assert {x["op"] for x in data["results"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    for x in data["results"]:
        assert x["algbw_Bps"] == pytest.approx(x["bytes"] / x["time_s"])
        assert x["busbw_Bps"] == pytest.approx(x["algbw_Bps"] * bus_factor(x["op"], 2))
        assert x["impl"] in (
            "all_reduce",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
        )  # no fallback on gloo
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before, "the job left /dev/shm files"
    print(r.stdout[r.stdout.index("commbench:") :])
