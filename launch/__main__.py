"""``python -m launch {env,hostfile,render,elastic,sweep,report,commbench,curve,bundle} ...``: scale-out
command line.

Under the DeepSpeed launcher, ``deepspeed --num_gpus 2 --module launch commbench ...`` runs
``python -m launch --local_rank=0 commbench ...`` in every rank: the top-level ``--local_rank`` is accepted
and ignored (ranks read LOCAL_RANK from the environment).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from common.errors import run_cli

# Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS = {
    "env": (
        "launch.profiles",
        "write .deepspeed_env (variables forwarded to every node) from a cluster profile",
    ),
    "hostfile": (
        "launch.hosts",
        "write a DeepSpeed hostfile from Slurm, an AWS Batch multi-node job or a list",
    ),
    "render": (
        "launch.render",
        "render a Slurm sbatch script, an AWS Batch job definition or a deepspeed command",
    ),
    "elastic": (
        "launch.elastic",
        "train.py under torch's elastic agent: restarts after failures, shrinks and grows with the nodes",
    ),
    "sweep": ("launch.sweep", "run one configuration at several world sizes (scaling runs)"),
    "report": (
        "launch.report",
        "scaling table, efficiency, projections and plot from runs' summary.json files",
    ),
    "commbench": (
        "launch.commbench",
        "all-reduce / all-gather / reduce-scatter bandwidth (run under deepspeed)",
    ),
    "curve": ("launch.curves", "a run's learning curve (PNG) and the held-out MLM baseline it must beat"),
    "bundle": ("launch.bundle", "folder of wheels that installs the project offline (pip --no-index)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch", description=__doc__)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" goes, untouched, to the training script (config overrides).
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    args.passthrough = passthrough
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
