"""``python -m data gpt``: documents -> one token stream with end-of-document tokens -> packed HDF5 windows.

Convention (Megatron / GPT-NeoX): sample i holds ``seq_len + 1`` tokens, ``stream[i*seq_len : (i+1)*seq_len +
1]``; the model reads ``[:-1]`` as inputs and ``[1:]`` as targets, so consecutive samples overlap by one token
and no target is lost. There is no padding; the tail of each shard's stream that does not fill a window
is dropped and counted. Each output shard packs its own input shard (bounded memory, independent
workers), so at most ``seq_len`` tokens per shard are dropped.

Documents come from NVIDIA-layout text (``--text``: a document's sentences joined with single spaces)
or from any source of ``data.documents`` (``--dataset``: local parquet/JSON/csv/Arrow/text files or a saved
dataset, each record's text as it is; a dump's articles cleaned and their sentences joined).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_path
from common.errors import UserError
from common.log import get_logger
from data import h5format
from data.documents import Source, add_source_arguments, document_text
from data.formats import GPT, token_dtype
from data.shards import ShardDir, ShardJob, run_from_args, run_shard_jobs
from data.tokenize_text import AUTO_SHARD_BYTES, InputShard, list_text_files, plan_shards, read_lines
from data.tokenizer import load_tokenizer

log = get_logger("data.gpt")
DOC_BATCH = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--tokenizer", required=True, help="tokenizers tokenizer.json with an <|endoftext|> token")
    p.add_argument("--out", required=True, help="output dir for gpt-NNNNN.h5 shards and manifest.json")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample is seq_len + 1")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--shards", type=int, default=0, help="number of output shards (0: one per 32 MiB of text)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def text_documents(shard: InputShard) -> Iterator[str]:
    """Documents of an NVIDIA-layout shard: sentences joined by a space, a blank line ends a document."""
    cur: list[str] = []
    for lines in read_lines(shard):
        for ln in lines:
            if ln:
                cur.append(ln)
            elif cur:
                yield " ".join(cur)
                cur = []
    if cur:
        yield " ".join(cur)


def tokenize_stream(tok, docs: Iterator[str], eod: int) -> tuple[np.ndarray, int]:
    """Batch-encode documents; each is followed by the EOD id; returns (int64 stream, documents)."""
    parts: list[np.ndarray] = []
    n_docs = 0
    batch: list[str] = []

    def flush() -> None:
        encs = (
            tok.encode_batch_fast(batch, add_special_tokens=False)
            if hasattr(tok, "encode_batch_fast")
            else tok.encode_batch(batch, add_special_tokens=False)
        )
        for e in encs:
            parts.append(np.asarray(e.ids, dtype=np.int64))
            parts.append(np.array([eod], dtype=np.int64))
        batch.clear()

    for d in docs:
        if not d.strip():
            continue
        batch.append(d)
        n_docs += 1
        if len(batch) >= DOC_BATCH:
            flush()
    if batch:
        flush()
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return stream, n_docs


def pack(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Windows of seq_len + 1 tokens with a one-token overlap; returns (view [N, seq_len+1], dropped
    tokens)."""
    n = max(0, (len(stream) - 1) // seq_len)
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=stream.dtype), len(stream)
    win = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len][:n]
    return win, len(stream) - (n * seq_len + 1)


def _shard_task(
    index: int,
    source: InputShard | list[str],
    describe: str,
    out_file: str,
    tokenizer: str,
    seq_len: int,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    """Tokenize, pack and write one output shard; runs in a worker process (or inline for --workers 1)."""
    t0 = time.perf_counter()
    tok, eod, _ = load_tokenizer(tokenizer)
    docs = text_documents(source) if isinstance(source, InputShard) else iter(source)
    stream, n_docs = tokenize_stream(tok, docs, eod)
    win, dropped = pack(stream, seq_len)
    dtype = token_dtype(int(attrs["vocab_size"]))
    with atomic_path(out_file) as tmp, h5py.File(tmp, "w") as f:
        h5format.write_attrs(
            f,
            {
                **attrs,
                "shard_index": index,
                "source": describe,
                "num_samples": len(win),
                "dropped_tokens": dropped,
            },
        )
        ds = h5format.create_dataset(f, "input_ids", win.shape, dtype, GPT.unit_rows)
        for s in range(0, len(win), 1024):
            ds[s : s + 1024] = win[s : s + 1024].astype(dtype)
    return {
        "index": index,
        "file": Path(out_file).name,
        "samples": len(win),
        **h5format.shard_record(out_file),
        "documents": n_docs,
        "tokens": int(len(stream)),
        "dropped_tokens": int(dropped),
        "source": describe,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _dataset_shards(source: Source, shards: int) -> Iterator[tuple[int, list[str], str]]:
    """Group streamed documents into shards of about equal text size (a counting pass when --shards N)."""
    if shards > 0:
        total = sum(len(document_text(d).encode("utf-8")) for d in source.documents())
        target = max(1, total / shards)
    else:
        target = AUTO_SHARD_BYTES
    name = Path(source.name).name
    cur: list[str] = []
    cur_bytes, index, first = 0, 0, 0
    n = 0
    for doc in source.documents():
        d = document_text(doc)
        cur.append(d)
        cur_bytes += len(d.encode("utf-8"))
        n += 1
        if cur_bytes >= target and (shards <= 0 or index < shards - 1):
            yield index, cur, f"{name}:records {first}-{n}"
            index, cur, cur_bytes, first = index + 1, [], 0, n
    if cur:
        yield index, cur, f"{name}:records {first}-{n}"


def build_gpt_shards(
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    *,
    text: str | os.PathLike | None = None,
    dataset: str | None = None,
    text_field: str = "text",
    split: str = "train",
    seq_len: int = 2048,
    workers: int = 1,
    shards: int = 0,
    overwrite: bool = False,
    progress: bool | None = False,
) -> dict[str, Any]:
    """Documents -> packed ``gpt-NNNNN.h5`` windows and ``manifest.json`` under ``out``; returns the totals.

    Exactly one source: ``text`` (NVIDIA-layout text dir or file) or ``dataset`` (local json/jsonl/
    parquet/csv/arrow/txt file, directory or glob, a saved dataset (``split``), a dump; documents in
    ``text_field``). ``shards=0``: one output shard per
    32 MiB of text. ``progress=None`` shows a bar only on a terminal. Raises ``UserError`` (nothing
    left behind) on bad settings or input, a corpus shorter than one window, or a non-empty ``out``
    without ``overwrite``.
    """
    t0 = time.perf_counter()
    if (text is None) == (dataset is None):
        raise UserError("give exactly one source: --text or --dataset")
    if seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: must be >= 1")
    if workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    if shards < 0:
        raise UserError(f"--shards {shards}: must be >= 0 (0 = automatic)")
    tok, eod, eod_name = load_tokenizer(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    out = Path(out)
    if text is not None:
        plan = plan_shards(list_text_files(text), shards)
        sources: Iterator[tuple[int, Any, str]] = iter([(sh.index, sh, sh.describe()) for sh in plan])
        source_name = str(text)
    else:
        source = Source(None, dataset, text_field, split)
        source.check()  # fail before writing anything on a missing path, an unreadable file or a missing field
        sources = _dataset_shards(source, shards)
        source_name = source.name
    settings = {
        "seq_len": seq_len,
        "tokenizer_sha256": h5format.sha256_file(tokenizer),
        "tokenizer_file": Path(tokenizer).name,
        "vocab_size": vocab_size,
        "eod_id": eod,
        "eod_token": eod_name,
        "source": source_name,
    }
    attrs = {"format": GPT.format_attr, "format_version": h5format.FORMAT_VERSION, **settings}
    with ShardDir(out, GPT.name, overwrite) as dest:
        jobs = (
            ShardJob((index, src, desc, str(dest.path(index)), str(tokenizer), seq_len, attrs))
            for index, src, desc in sources
        )
        results = run_shard_jobs(_shard_task, jobs, workers=workers, desc="gpt windows", progress=progress)
        total_tokens = sum(r["tokens"] for r in results)
        if sum(r["documents"] for r in results) == 0 or sum(r["samples"] for r in results) == 0:
            if total_tokens == 0:
                raise UserError(f"{source_name}: empty corpus (no tokens)")
            raise UserError(
                f"{source_name}: only {total_tokens} tokens, fewer than one window of --seq-len {seq_len} + 1"
            )
        summary = dest.commit(results, settings, t0, rates=("tokens",))
    summary["seq_len"] = seq_len
    summary["dropped_percent"] = 100 * summary["dropped_tokens"] / max(1, total_tokens)
    return summary


REPORT = (
    "gpt: {documents} documents, {tokens} tokens -> {samples} windows of {seq_len}+1 in {shards} shard(s)"
    " under {out}; dropped {dropped_tokens} tail tokens ({dropped_percent:.2f}%) in {seconds:.1f}s"
    " ({tokens_per_s:.0f} tokens/s)"
)


def run(args: argparse.Namespace) -> int:
    """``python -m data gpt``: the flags are :func:`build_gpt_shards`'s parameters."""
    return run_from_args(build_gpt_shards, REPORT, args)
