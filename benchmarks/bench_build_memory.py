"""Peak host memory per rank while building a model for ZeRO-3: ours under ``zero.Init`` beside a full build
and beside ``transformers``' own ZeRO-3 construction, in the same run.

Each side runs in fresh processes under the DeepSpeed launcher (CPU ranks, gloo; a 1-rank side runs as one
process with the launcher's environment, without the launcher), one side after the other:

* ``full``: what train.py did before: the whole model in FP32 on every rank (``model.build.build_model``);
  DeepSpeed partitions it only later, in ``deepspeed.initialize``;
* ``ours``: ``training.zero_init.build_partitioned`` with the run's DeepSpeed config (BF16, stage 3);
* ``hf``: ``AutoModelForCausalLM.from_config`` with ``HfDeepSpeedConfig`` set (transformers' ZeRO-3 path),
  for GPT-NeoX sizes.

Figures per rank: peak RSS (``VmHWM``) over the process's life, RSS before the build (imports and process
group) and the build's wall time. Building is construction and weight initialisation; the optimizer state,
allocated later by ``deepspeed.initialize``, is partitioned in every case and is not measured here.

    python benchmarks/bench_build_memory.py --models neox-760m:2,neox-1.3b:2,neox-2.7b:1
    python benchmarks/bench_build_memory.py --models neox-debug:1                # toy size (CI), seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SIDES = ("full", "ours", "hf")
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True},
}


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(model: str, side: str, out: Path) -> None:
    import deepspeed
    import torch

    from common.process import end_process_group
    from model.build import build_model
    from training.engine import no_shm_all_reduce, quiet
    from training.zero_init import build_partitioned, local_numel

    quiet()
    no_shm_all_reduce()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    try:
        rank = deepspeed.comm.get_rank()
        torch.manual_seed(0)
        before = rss_kib("VmRSS")
        t0 = time.perf_counter()
        if side == "full":
            built = build_model(model)
        elif side == "ours":
            built = build_partitioned(model, DS_CONFIG)
        else:
            from transformers import AutoModelForCausalLM
            from transformers.integrations import HfDeepSpeedConfig

            from model.neox import hf_config
            from model.registry import get_spec

            keep = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  (transformers reads it through a weak reference)
            built = AutoModelForCausalLM.from_config(hf_config(get_spec(model)))
        took = time.perf_counter() - t0
        held, whole = local_numel(built)
        record = {
            "rank": rank,
            "peak_mib": rss_kib("VmHWM") / 1024,
            "before_mib": before / 1024,
            "build_s": took,
            "held": held,
            "whole": whole,
        }
        (out / f"{side}-{rank}.json").write_text(json.dumps(record))
    finally:
        end_process_group()


def run_side(model: str, ranks: int, side: str, work: Path) -> list[dict]:
    from common.net import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    worker = [__file__, "--worker", model, side, str(work)]
    if ranks == 1:  # what the launcher would set, without its two extra processes
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, *worker]
    else:
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(port),
            *worker,
        ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{model} {side} on {ranks} rank(s) failed ({res.returncode}): {res.stderr[-2000:]}")
    return [json.loads((work / f"{side}-{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="neox-760m:2,neox-1.3b:2,neox-2.7b:1", help="NAME:RANKS,...")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "SIDE", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher adds it
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], Path(args.worker[2]))
        return 0
    print(
        f"{'model':<11} {'ranks':>5} {'side':<5} {'peak RSS/rank (MiB)':>20} {'before':>8} "
        f"{'build s':>8} {'params held/rank':>17}"
    )
    for item in args.models.split(","):
        model, ranks = item.split(":")
        for side in args.sides.split(","):
            if side == "hf" and not model.startswith("neox"):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                recs = run_side(model, int(ranks), side, Path(tmp))
            peak = max(r["peak_mib"] for r in recs)
            before = max(r["before_mib"] for r in recs)
            took = max(r["build_s"] for r in recs)
            held = max(r["held"] for r in recs)
            print(
                f"{model:<11} {ranks:>5} {side:<5} {peak:>20,.0f} {before:>8,.0f} {took:>8.2f} {held:>17,}", flush=True
            )
    return 0


if __name__ == "__main__":
    from common.process import exit_fast

    exit_fast(main())  # a worker also leaves without C++ teardown (its group is ended already)
