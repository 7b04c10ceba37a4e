"""``python -m data convert``: rewrite shards made elsewhere (NVIDIA's gzip HDF5) or by format version 1
as format-2 shards with a manifest.

Each input shard becomes one output shard ``bert-NNNNN.h5`` / ``gpt-NNNNN.h5`` in input order (sorted
names, or the input manifest's order): the same rows in the same order, our dtypes, lzf compression,
rows chunked by the loader's unit (``data.h5format.UNIT_ROWS``), and the attributes a loader checks
(format, version, lengths, vocabulary hash). What an NVIDIA shard does not say comes from the flags:
``--vocab`` (BERT; its hash, size and case) or ``--tokenizer`` (GPT). Token ids are checked against the
vocabulary size while copying, so a shard made with another vocabulary is refused, naming it. Rows are
copied in blocks (memory bounded by the block, not the shard), one shard per worker process; gzip
decoding runs near 20k BERT rows/s per core, so use ``--workers``. Like the writers, the output appears
only when every shard converted (``data.shards.ShardDir``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_path
from common.errors import UserError
from data import h5format
from data.formats import add_formats_flag, formats, get_format
from data.shards import ShardDir, ShardJob, run_from_args, run_shard_jobs
from data.verify import manifest_kind

COPY_ROWS = 1 << 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="shard directory (with or without manifest), file or glob")
    p.add_argument("--out", required=True, help="output dir for format-2 shards and manifest.json")
    p.add_argument("--kind", default="auto", help="a shard format's name (bert, gpt); auto: from the shards")
    p.add_argument("--vocab", help="BERT: the vocab.txt the shards were made with (required when they do not say)")
    p.add_argument("--tokenizer", help="GPT: the tokenizer.json the shards were made with (when they do not say)")
    case = p.add_mutually_exclusive_group()
    case.add_argument("--lowercase", dest="lowercase", action="store_true", default=None, help="uncased vocab")
    case.add_argument("--cased", dest="lowercase", action="store_false", help="cased vocab")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_formats_flag(p)


def _detect_kind(src: str) -> str:
    p = Path(src)
    if p.is_dir() and (p / h5format.MANIFEST).exists():
        return manifest_kind(p)
    first = h5format.glob_files(src)[0]
    try:
        with h5py.File(first, "r") as f:
            found = [fmt.name for fmt in formats() if fmt.recognise(f)]
    except OSError as e:
        raise UserError(f"{first}: not a readable HDF5 file ({e})") from None
    if not found:
        raise UserError(f"{first}: not a shard of any known format; give --kind")
    return found[0]


def _vocab_settings(
    src: str,
    kind: str,
    have: dict[str, Any],
    vocab: str | None,
    tokenizer: str | None,
    lowercase: bool | None,
) -> dict[str, Any]:
    """The vocabulary attributes of the output: the input's, or the flags' (which must then agree)."""
    fmt = get_format(kind)
    given = vocab if fmt.tokenizer_flag == "--vocab" else tokenizer
    if given is None:
        if not have.get(fmt.hash_key):
            raise UserError(
                f"{src}: these shards do not record their vocabulary: give {fmt.tokenizer_flag} (the "
                f"{fmt.tokenizer_kind} they were made with)"
            )
        return {k: have[k] for k in fmt.tokenizer_keys if k in have}
    got = fmt.tokenizer_attrs(given, lowercase)
    if have.get(fmt.hash_key) and have[fmt.hash_key] != got[fmt.hash_key]:
        raise UserError(
            f"{src}: the shards record {fmt.hash_key}={have[fmt.hash_key][:16]}... but the given vocabulary "
            f"hashes to {got[fmt.hash_key][:16]}..."
        )
    return got


def _convert_task(index: int, src: str, out_file: str, kind: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """Copy one shard into format 2; runs in a worker process (or inline for --workers 1)."""
    t0 = time.perf_counter()
    info = h5format.inspect_shard(Path(src), kind)
    vocab_size = int(attrs["vocab_size"])
    fmt = get_format(kind)
    schema = fmt.schema
    dtypes = fmt.write_dtypes(vocab_size)
    token_sets = fmt.token_datasets
    n = info.num_samples
    with h5py.File(src, "r") as fin, atomic_path(out_file) as tmp, h5py.File(tmp, "w") as fout:
        h5format.write_attrs(
            fout,
            {
                **attrs,
                **{k: info.attrs[k] for k in ("seq_len", "max_pred") if k in info.attrs},
                "shard_index": index,
                "source": str(src),
                "num_samples": n,
            },
        )
        out = {
            name: h5format.create_dataset(fout, name, fin[name].shape, dtypes[name], fmt.unit_rows) for name in schema
        }
        for a in range(0, n, COPY_ROWS):
            for name in schema:
                rows = fin[name][a : a + COPY_ROWS]
                if name in token_sets and rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
                    raise UserError(
                        f"{src}: dataset {name!r} holds token id {int(rows.max())} outside the "
                        f"vocabulary of {vocab_size}: the shards were made with another vocabulary"
                    )
                info_limits = np.iinfo(np.dtype(dtypes[name]))
                if rows.size and (rows.min() < info_limits.min or rows.max() > info_limits.max):
                    raise UserError(
                        f"{src}: dataset {name!r} holds {int(rows.max())}, which does not fit {dtypes[name]}"
                    )
                out[name][a : a + len(rows)] = rows.astype(dtypes[name])
    return {
        "index": index,
        "file": Path(out_file).name,
        fmt.count_key: n,
        **h5format.shard_record(out_file),
        "source": str(src),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def convert_shards(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    kind: str = "auto",
    vocab: str | None = None,
    tokenizer: str | None = None,
    lowercase: bool | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool | None = False,
) -> dict[str, Any]:
    """Shards under ``src`` -> format-2 shards and a manifest under ``out``; returns the summary."""
    t0 = time.perf_counter()
    if workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    src = str(src)
    kind = _detect_kind(src) if kind == "auto" else kind
    p = Path(src)
    if p.is_dir() and (p / h5format.MANIFEST).exists():
        shards = h5format.read_manifest(p, kind)
        h5format.check_listed(shards)
        have = shards.attrs
    else:
        shards = h5format.list_shards(src, kind, require_manifest=False)
        have = shards.attrs
    if Path(out).resolve() == (p if p.is_dir() else p.parent).resolve():
        raise UserError(f"--out {out}: the same directory as --src; write the converted shards elsewhere")
    fmt = get_format(kind)
    seq = {"seq_len": have["seq_len"], **({"max_pred": have["max_pred"]} if fmt.uses_max_pred else {})}
    settings = {**seq, **_vocab_settings(src, kind, have, vocab, tokenizer, lowercase), "converted_from": src}
    attrs = {
        "format": fmt.format_attr,
        "format_version": h5format.FORMAT_VERSION,
        **settings,
    }
    with ShardDir(out, kind, overwrite) as dest:
        jobs = [
            ShardJob((i, str(f), str(dest.path(i)), kind, attrs), max(1, f.stat().st_size))
            for i, f in enumerate(shards.files)
        ]
        results = run_shard_jobs(
            _convert_task,
            jobs,
            workers=min(workers, len(jobs)),
            desc="convert",
            unit="B",
            total=sum(j.weight for j in jobs),
            progress=progress,
        )
        count_key = fmt.count_key
        summary = dest.commit(results, settings, t0, rates=(count_key,))
    summary.update(kind=kind, src=src, samples=summary[count_key], samples_per_s=summary[f"{count_key}_per_s"])
    return summary


REPORT = (
    "convert: {shards} {kind} shard(s) from {src} -> {out} (format 2): {samples} samples in {seconds:.1f}s "
    "({samples_per_s:.0f} samples/s)"
)


def run(args: argparse.Namespace) -> int:
    """``python -m data convert``: the flags are :func:`convert_shards`'s parameters."""
    return run_from_args(convert_shards, REPORT, args)
