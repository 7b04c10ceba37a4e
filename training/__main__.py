"""``python -m training export CKPT --out DIR [--families MODULE...]``: a checkpoint -> a Hugging Face model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common.errors import run_cli


def cmd_export(args: argparse.Namespace) -> int:
    from training.checkpoint.export import (
        export_checkpoint,  # deferred: torch and DeepSpeed take seconds; --help does not
    )
    from training.checkpoint.safeload import restrict  # deferred, as above

    restrict()  # a checkpoint from elsewhere runs no code here either

    out = export_checkpoint(
        args.checkpoint,
        args.out,
        tag=args.tag,
        tokenizer=args.tokenizer,
        overwrite=args.overwrite,
        families=args.families,
    )
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_docs.py parses the docs' commands)."""
    parser = argparse.ArgumentParser(prog="python -m training", description="Tools for trained checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="consolidate a DeepSpeed checkpoint into a Hugging Face model directory")
    p.add_argument("checkpoint", help="checkpoint directory (the run's checkpoint dir, or one tag inside it)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the latest complete one)")
    p.add_argument("--tokenizer", default=None, help="vocab.txt / tokenizer.json (default: the one the run used)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument(
        "--families",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="modules defining the checkpoint's model family when it is not built in (as model.families at "
        "training time); those its config lists are never imported unasked",
    )
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
