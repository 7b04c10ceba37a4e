"""Start-up time of a 2-rank CPU launch: ``train.py`` beside the floor (``startup_floor.py``), in the same
run.

CI starts DeepSpeed dozens of times, and a user waits for the first step line. Each side is started through
the DeepSpeed launcher (``--ranks`` CPU ranks, default 2, gloo) ``--repeats`` times, interleaved. Figures
per side:

* ``launch->exit``: wall time of the whole ``deepspeed`` command (launcher, ranks, teardown);
* ``process->first step``: rank 0's age when its first training step begins: ``startup_s`` from train.py's
  summary; for the floor, its age after one full step (so the floor is if anything generous to the peer).

ours runs ``train.steps=1`` of ``bert-debug`` (same shape as the floor's model) on shards built from the
sample (``bench_train.py``'s, in ``--work``).

    python benchmarks/bench_startup.py --repeats 3
    python benchmarks/bench_startup.py --repeats 1 --ranks 1 --no-shm          # toy size (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.net import free_port

REPO = Path(__file__).resolve().parents[1]


def launcher(ranks: int, port: int) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port)]


def build_data(work: Path) -> dict[str, Path]:
    """BERT shards (seq 128, max_pred 20, the smoke recipe's) and their vocabulary: ``bench_train.py``'s."""
    from bench_train import build_data as build  # a sibling: a script's directory is on sys.path

    args = argparse.Namespace(bert_seq=128, max_pred=20, gpt_seq=128, rebuild=False)
    paths = build(work, args, kinds=("bert",))
    return {"vocab": paths["vocab"], "train": paths["bert"]}


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[-4:])} failed ({res.returncode}): {res.stderr[-2000:]}")
    return time.perf_counter() - t0, res.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_startup")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks of each launch")
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="the floor, like train.py, does not build or map DeepSpeed's shared-memory all-reduce op (CI: "
        "no C++ build on a fresh machine, nothing left in /dev/shm)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or args.ranks < 1:
        raise SystemExit(f"error: --repeats and --ranks must be >= 1 (got {args.repeats}, {args.ranks})")

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    data = build_data(args.work)
    results: dict[str, dict[str, list[float]]] = {
        "ours": {"wall": [], "first": []},
        "floor": {"wall": [], "first": []},
    }
    for i in range(args.repeats):
        for side in ("ours", "floor") if i % 2 == 0 else ("floor", "ours"):
            if side == "ours":
                run_dir = args.work / f"run{i}"
                cmd = [
                    *launcher(args.ranks, free_port()),
                    "train.py",
                    "--config",
                    "smoke",
                    f"run.dir={run_dir}",
                    f"data.train={data['train']}",
                    "data.eval=null",
                    f"data.vocab={data['vocab']}",
                    "train.steps=1",
                    "logging.warmup_steps=0",
                    "checkpoint.every=0",
                    "checkpoint.resume=never",
                    "deepspeed.precision=fp32",
                ]
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                wall, _ = run_once(cmd, env)
                first = json.loads((run_dir / "summary.json").read_text())["startup_s"]
            else:
                floor = ["benchmarks/startup_floor.py", *(["--no-shm"] if args.no_shm else [])]
                wall, out = run_once([*launcher(args.ranks, free_port()), *floor], env)
                line = next(x for x in out.splitlines() if x.startswith('{"startup_s"'))
                first = json.loads(line)["startup_s"]
            results[side]["wall"].append(wall)
            results[side]["first"].append(first)
            print(f"  {side:<5} launch->exit {wall:6.1f} s   process->first step {first:6.1f} s", flush=True)
    med = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in results.items()}
    print(f"\nmedians of {args.repeats} ({'interleaved'}):")
    print("| | ours (train.py) | floor (bare DeepSpeed) | ratio |\n|---|---|---|---|")
    for key, label in (("wall", "launch -> exit"), ("first", "process -> first step")):
        print(
            f"| {label} | {med['ours'][key]:.1f} s | {med['floor'][key]:.1f} s | "
            f"{med['ours'][key] / med['floor'][key]:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
