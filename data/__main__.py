"""``python -m data {wiki,text,vocab,bert,gpt,convert,verify} ...``: the data pipeline's command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from common.errors import run_cli

# Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS = {
    "wiki": ("data.wiki", "Wikipedia XML dump(s) -> clean, sentence-split text shards"),
    "text": ("data.text", "any source (a local dataset, a dump, text) -> the text layout: one sentence per line"),
    "vocab": ("data.vocab", "train a WordPiece vocab.txt or a byte-level BPE tokenizer.json on text shards"),
    "bert": ("data.bert", "text shards -> BERT MLM/NSP instances in NVIDIA's HDF5 schema"),
    "gpt": ("data.gpt", "text shards or a local dataset -> packed GPT-NeoX token windows in HDF5"),
    "convert": ("data.convert", "NVIDIA's (or format-1) HDF5 shards -> format-2 shards with a manifest"),
    "verify": ("data.verify", "check a shard directory against its manifest: sizes, schema, rows, SHA-256"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "formats", None):  # convert, verify: formats from outside the package, before any is looked up
        from data.formats import load_formats  # on call, as each subcommand's module

        load_formats(args.formats, "--formats")
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
