"""``python -m model list [--json]``: the named sizes. (Export: ``python -m training export``.)"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from common.errors import run_cli


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_list(args: argparse.Namespace) -> int:
    from model.build import list_models  # on call (start-up time): --help loads no torch nor transformers

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<12} {'family':<6} {'layers':>6} {'hidden':>6} {'heads':>5} {'params':>9} {'tied':>9}")
    for r in rows:
        print(
            f"{r['name']:<12} {r['family']:<6} {r['layers']:>6} {r['hidden']:>6} {r['heads']:>5} "
            f"{_human(r['params']):>9} {_human(r['params_tied']):>9}"
        )
    print("params: every parameter as built (GPT-NeoX: untied input and output embeddings);")
    print("tied: the vocabulary matrix counted once (the convention of nominal names such as neox-125m).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_docs.py parses the docs' commands)."""
    parser = argparse.ArgumentParser(
        prog="python -m model",
        description="Model registry. Export a checkpoint with `python -m training export`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="named sizes with parameter counts (meta device)")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
