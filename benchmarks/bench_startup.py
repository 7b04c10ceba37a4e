"""Start-up time of a 2-rank CPU launch: ``train.py`` beside the floor (``startup_floor.py``), in the same
run.

CI starts DeepSpeed dozens of times, and a user waits for the first step line. Each side is started through
the DeepSpeed launcher (2 CPU ranks, gloo) ``--repeats`` times, interleaved. Figures per side:

* ``launch->exit``: wall time of the whole ``deepspeed`` command (launcher, two ranks, teardown);
* ``process->first step``: rank 0's age when its first training step begins: ``startup_s`` from train.py's
  summary; for the floor, its age after one full step (so the floor is if anything generous to the peer).

ours runs ``train.steps=1`` of ``bert-debug`` (same shape as the floor's model) on shards built from the
sample.

    python benchmarks/bench_startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def launcher(port: int) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port)]


def build_data(work: Path) -> dict[str, Path]:
    from data.sample import sample_dump_path

    py, out = sys.executable, {"vocab": work / "vocab.txt", "train": work / "bert"}
    if not (out["train"] / "manifest.json").exists():
        for cmd in (
            [py, "-m", "data", "wiki", str(sample_dump_path()), "--out", str(work / "text"), "--workers",
             "2"],
            [py, "-m", "data", "vocab", str(work / "text"), "--out", str(out["vocab"]), "--size", "8000"],
            [py, "-m", "data", "bert", "--text", str(work / "text"), "--vocab", str(out["vocab"]), "--out",
             str(out["train"]), "--seq-len", "128", "--max-pred", "20", "--workers", "2", "--no-progress"],
        ):  # fmt: skip
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return out


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
    args = p.parse_args(argv)
    import os

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
                cmd = [*launcher(29650 + i), "train.py", "--config", "smoke", f"run.dir={run_dir}",
                       f"data.train={data['train']}", "data.eval=null", f"data.vocab={data['vocab']}",
                       "train.steps=1", "logging.warmup_steps=0", "checkpoint.every=0",
                       "checkpoint.resume=never", "deepspeed.precision=fp32"]  # fmt: skip
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                wall, _ = run_once(cmd, env)
                first = json.loads((run_dir / "summary.json").read_text())["startup_s"]
            else:
                wall, out = run_once([*launcher(29660 + i), "benchmarks/startup_floor.py"], env)
                line = next(x for x in out.splitlines() if x.startswith('{"startup_s"'))
                first = json.loads(line)["startup_s"]
            results[side]["wall"].append(wall)
            results[side]["first"].append(first)
            print(f"  {side:<5} launch->exit {wall:6.1f} s   process->first step {first:6.1f} s", flush=True)
    med = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in results.items()}
    print(f"\nmedians of {args.repeats} ({'interleaved'}):")
    print("| | ours (train.py) | floor (bare DeepSpeed) | ratio |\n|---|---|---|---|")
    for key, label in (("wall", "launch -> exit"), ("first", "process -> first step")):
        print(f"| {label} | {med['ours'][key]:.1f} s | {med['floor'][key]:.1f} s | "
              f"{med['ours'][key] / med['floor'][key]:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
