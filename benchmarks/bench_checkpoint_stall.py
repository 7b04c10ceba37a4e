"""Training stall of a checkpoint save: ``checkpoint.async_save`` beside the synchronous save (DeepSpeed's own
``save_checkpoint`` writing every file before training goes on), measured in the same run.

Each side trains the same model on ``--ranks`` CPU ranks (default 2, under the DeepSpeed launcher, gloo; 1:
one ``train.py`` process) and saves every ``--every`` steps; the figures come from each run's
RUN_DIR/events.jsonl: ``save_s`` is the time a save kept training waiting, ``write_s`` (background saves)
the time the files took to be written and committed meanwhile. The last save of a run is synchronous on
both sides and left out of the medians. ``all stalls`` is the run's whole checkpoint stall (summary.json
``save_s``: every save, the last one and any wait for a background save included) and ``sequences/s`` its
training throughput outside saves, evaluation and logging (the writer thread shares the CPU with training
here).

    python benchmarks/bench_checkpoint_stall.py --model bert-10m --steps 14 --every 2

Toy size (CI, seconds): ``--model bert-debug --steps 4 --every 2 --ranks 1 --global-batch 4 --micro-batch 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/bench_train", help="data (shared with bench_train.py) and runs")
    p.add_argument("--model", default="bert-10m")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--ckpt-root", default=None, help="where checkpoints go (default: under --work)")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks (1: train.py alone, no launcher)")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args(argv)
    if args.steps <= args.every:
        raise SystemExit(f"error: --steps {args.steps} must exceed --every {args.every} (the last save is left out)")

    from bench_train import build_data  # a sibling: a script's directory is on sys.path

    from common.net import free_port
    from training import events

    work = Path(args.work)
    data = build_data(work, argparse.Namespace(bert_seq=128, max_pred=20, gpt_seq=128, rebuild=False), kinds=("bert",))
    rows = {}
    for side, flag in (("sync (DeepSpeed save_checkpoint)", "false"), ("async (ours)", "true")):
        run_dir = work / "runs" / f"stall-{flag}"
        ckpt = Path(args.ckpt_root) / f"stall-{flag}" if args.ckpt_root else run_dir / "checkpoints"
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        port = free_port()
        start = (
            [
                sys.executable,
                "-m",
                "deepspeed.launcher.runner",
                "--num_gpus",
                str(args.ranks),
                "--master_port",
                str(port),
            ]
            if args.ranks > 1
            else [sys.executable]
        )
        cmd = [
            *start,
            "train.py",
            "--config",
            "smoke",
            f"run.dir={run_dir}",
            f"checkpoint.dir={ckpt}",
            f"model.name={args.model}",
            f"data.train={data['bert']}",
            f"data.eval={data['bert']}",
            f"data.vocab={data['vocab']}",
            f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}",
            f"train.micro_batch={args.micro_batch}",
            "train.eval_every=0",
            "train.eval_samples=16",
            f"checkpoint.every={args.every}",
            f"checkpoint.async_save={flag}",
            f"checkpoint.keep={args.steps}",
        ]
        env = {**os.environ, "MASTER_PORT": str(port)}
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        saves = [e for e in events.read(run_dir) if e["event"] == "checkpoint" and e["step"] < args.steps]
        size = sum(f.stat().st_size for f in (ckpt / f"step{args.every:08d}").rglob("*") if f.is_file())
        summary = json.loads((run_dir / "summary.json").read_text())
        rows[side] = {
            "saves": len(saves),
            "stall_total_s": summary["save_s"],
            "sequences_per_s": summary["sequences_per_sec"],
            "stall_s": statistics.median(e["save_s"] for e in saves),
            "write_s": statistics.median(e["write_s"] for e in saves) if flag == "true" else None,
            "checkpoint_mb": size / 1e6,
        }
    print(
        f"{args.model}, {args.ranks} CPU rank(s), a save every {args.every} steps; medians of the saves before the last"
    )
    print(
        f"{'side':34} {'saves':>5} {'stall (s)':>10} {'written in (s)':>15} {'checkpoint (MB)':>16} "
        f"{'all stalls (s)':>15} {'sequences/s':>12}"
    )
    for side, r in rows.items():
        written = "" if r["write_s"] is None else f"{r['write_s']:.3f}"
        print(
            f"{side:34} {r['saves']:>5} {r['stall_s']:>10.3f} {written:>15} {r['checkpoint_mb']:>16.1f} "
            f"{r['stall_total_s']:>15.3f} {r['sequences_per_s']:>12.2f}"
        )
    sync, ours = rows["sync (DeepSpeed save_checkpoint)"], rows["async (ours)"]
    print(f"stall ratio async / sync: {ours['stall_s'] / sync['stall_s']:.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
