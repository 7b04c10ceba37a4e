"""Scaling sweep: the same configuration at several sizes, one run directory per size, then the report.

Contract with ``train.py`` (each size is one DeepSpeed job)::

    deepspeed --num_gpus W [--master_port P] train.py --config X.yaml \
        run.dir=RUNS/wW train.steps=N run.threads_per_rank=T [overrides...]

on one machine (``--world-sizes``; on CPU a rank stands for an accelerator and OMP_NUM_THREADS=T), or::

    deepspeed --hostfile H --num_nodes n --num_gpus G train.py --config X.yaml run.dir=RUNS/nNxG
    train.steps=N ...

on a cluster (``--nodes`` with ``--hostfile``). train.py writes its own ``summary.json`` in run.dir (keys
in ``launch.report``); the sweep then prints ``launch.report``'s table, which computes scaling efficiency
from the summaries (no run writes another's figures). A size whose run directory already has a
``summary.json`` is skipped (``--rerun`` to run it again), so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from common.errors import UserError
from common.log import get_logger
from common.net import free_port
from launch import report
from launch.hosts import parse_hostfile

log = get_logger("launch.sweep")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma list of integers (got {text!r})") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{flag} must list positive integers (got {text!r})")
    return sorted(set(vals))


def plan(args: argparse.Namespace) -> list[tuple[Path, list[str], dict[str, str]]]:
    """(run dir, command, extra environment) for every size, in increasing order."""
    if not Path(args.config).is_file():
        raise UserError(f"config {args.config} not found")
    if args.steps <= 0:
        raise UserError(f"--steps must be positive (got {args.steps})")
    runner = [sys.executable, "-m", "deepspeed.launcher.runner"]
    out = Path(args.out)
    base_overrides = [f"train.steps={args.steps}"]
    jobs: list[tuple[Path, list[str], dict[str, str]]] = []
    if args.nodes:
        if not args.hostfile:
            raise UserError("--nodes needs --hostfile (the cluster's hosts)")
        if not Path(args.hostfile).is_file():
            raise UserError(f"hostfile {args.hostfile} not found")
        available = len(parse_hostfile(args.hostfile))
        for n in _int_list(args.nodes, "--nodes"):
            if n > available:
                raise UserError(f"--nodes {n} but {args.hostfile} lists only {available} host(s)")
            run_dir = out / f"n{n}x{args.gpus_per_node}"
            cmd = runner + [
                "--hostfile",
                args.hostfile,
                "--num_nodes",
                str(n),
                "--num_gpus",
                str(args.gpus_per_node),
            ]
            cmd += ["--master_port", str(args.master_port or 29500), args.script, "--config", args.config]
            cmd += [f"run.dir={run_dir}", *base_overrides, *getattr(args, "passthrough", [])]
            jobs.append((run_dir, cmd, {}))
        return jobs
    threads = args.threads_per_rank
    if threads <= 0:
        raise UserError(f"--threads-per-rank must be positive (got {threads})")
    for w in _int_list(args.world_sizes, "--world-sizes"):
        cores = os.cpu_count() or 1
        if w * threads > cores:
            log.warning(
                f"world size {w} x {threads} thread(s) > {cores} cores: the run measures oversubscription, not scaling"
            )
        run_dir = out / f"w{w}"
        cmd = runner + [
            "--num_gpus",
            str(w),
            "--master_port",
            str(args.master_port or free_port()),
            args.script,
        ]
        cmd += [
            "--config",
            args.config,
            f"run.dir={run_dir}",
            *base_overrides,
            f"run.threads_per_rank={threads}",
        ]
        cmd += list(getattr(args, "passthrough", []))
        jobs.append((run_dir, cmd, {"OMP_NUM_THREADS": str(threads)}))
    return jobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="training config YAML (the same for every size)")
    parser.add_argument("--world-sizes", default="1,2", help="local: ranks per run, comma list (default 1,2)")
    parser.add_argument("--nodes", default=None, help="cluster: node counts, comma list (with --hostfile)")
    parser.add_argument("--hostfile", default=None, help="cluster hostfile (python -m launch hostfile)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="cluster: accelerators per node")
    parser.add_argument("--steps", type=int, required=True, help="train.steps for every run")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="local CPU runs: threads per rank")
    parser.add_argument("--out", required=True, help="runs directory; each size gets a subdirectory")
    parser.add_argument("--script", default="train.py", help="training entry point (default train.py)")
    parser.add_argument("--master-port", type=int, default=None, help="default: a free port (local)")
    parser.add_argument("--rerun", action="store_true", help="run sizes that already have a summary.json")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.epilog = "Arguments after -- are config overrides passed to every run."


def run(args: argparse.Namespace) -> int:
    jobs = plan(args)
    failed = []
    for run_dir, cmd, extra_env in jobs:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items())
        shown = (shown + " " if shown else "") + shlex.join(cmd)
        if args.dry_run:
            print(shown)
            continue
        if (run_dir / "summary.json").exists() and not args.rerun:
            print(f"skip {run_dir}: summary.json exists (--rerun to run it again)")
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"run  {shown}", flush=True)
        env = dict(os.environ, **extra_env)
        with open(run_dir / "launch.log", "w") as logf:
            rc = subprocess.call(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        if rc != 0 or not (run_dir / "summary.json").exists():
            print(f"FAILED {run_dir} (exit {rc}); log: {run_dir / 'launch.log'}", flush=True)
            failed.append(run_dir)
    if args.dry_run:
        return 0
    runs = report.find_runs([Path(args.out)]) if Path(args.out).is_dir() else []
    if runs:
        print(report.markdown(report.build_rows(runs)), end="")
    if failed:
        raise UserError(f"{len(failed)} run(s) failed: {', '.join(str(f) for f in failed)}")
    return 0
