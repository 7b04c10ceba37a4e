"""``python -m data text``: any source -> the text layout (NVIDIA's two-stage pipeline's first stage).

Reads documents through ``data.documents`` (a local dataset such as Hugging Face's ``wikimedia/wikipedia``
parquet, a saved dataset, a dump, or text already in the layout), splits them into sentences in worker
processes (``data.wiki.ChunkPool``: results in input order, so the output does not depend on
``--workers``) and writes ``data wiki``'s layout: one sentence per line, a blank line after each
document, document *k* in ``text_{k % shards:05d}.txt``, and ``manifest.json`` last.

``data bert --dataset`` and ``data vocab --dataset`` run this stage into a temporary folder and read it
back as ``--text``, so their output equals ``data text`` followed by ``data bert --text`` / ``data vocab``
(the shard plan is cut by bytes of this layout).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.atomic import atomic_write_json
from common.errors import UserError
from common.outdir import prepare_out_dir, remove_stale
from data.documents import Document, Source, add_source_arguments, document_sentences, source_from_args
from data.textclean import is_disambiguation
from data.wiki import (
    CHUNK_CHARS,
    CHUNK_PAGES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ChunkPool,
    TextShardWriter,
    write_round_robin,
)

SHARD_PATTERN = re.compile(r"^text_\d{5,}\.txt$")
COUNTS = ("documents", "disambiguation", "empty", "documents_written")


def _chunks(docs: Iterator[Document], counts: dict[str, int]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    chars = 0
    for d in docs:
        counts["documents"] += 1
        chunk.append(d)
        chars += len(d.text)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_PAGES:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _split_chunk(chunk: list[Document], min_chars: int, keep_disambiguation: bool) -> list[tuple[str, str, int, int]]:
    """One chunk -> (status, text block, sentences, chars) per document, as ``data.wiki.process_article``."""
    out = []
    for d in chunk:
        if d.form == "wikitext" and not keep_disambiguation and is_disambiguation(d.title or "", d.text):
            out.append(("disambiguation", "", 0, 0))
            continue
        sentences = document_sentences(d, keep_disambiguation=True)
        chars = sum(len(s) for s in sentences)
        if not sentences or chars < max(1, min_chars):
            out.append(("empty", "", 0, 0))
        else:
            out.append(("ok", "\n".join(sentences) + "\n\n", len(sentences), chars))
    return out


def write_text_files(
    source: Source,
    out_dir: Path,
    *,
    workers: int = 1,
    shards: int = 1,
    min_article_chars: int = 0,
    keep_disambiguation: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Write ``source``'s documents into ``shards`` text files in the existing folder ``out_dir``; returns
    (shard records, counts). Each file appears only when all are complete."""
    if workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    if shards < 1:
        raise UserError(f"--shards {shards}: must be >= 1")
    if min_article_chars < 0:
        raise UserError(f"--min-article-chars {min_article_chars}: must be >= 0")
    counts = dict.fromkeys(COUNTS, 0)
    work = functools.partial(_split_chunk, min_chars=min_article_chars, keep_disambiguation=keep_disambiguation)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ChunkPool(workers, work))
        writers = [TextShardWriter(out_dir / f"text_{i:05d}.txt", stack) for i in range(shards)]
        k = counts["documents_written"] = write_round_robin(
            pool.map(_chunks(source.documents(), counts)), writers, counts
        )
        if k == 0:
            raise UserError(
                f"{source.name}: empty dataset: no text left ({counts['documents']} documents, "
                f"{counts['empty']} empty, {counts['disambiguation']} disambiguation pages)"
            )
        records = [w.record() for w in writers]
    return records, counts


@contextlib.contextmanager
def text_layout(source: Source, near: Path, workers: int = 1) -> Iterator[Path]:
    """The source as text layout: ``source.text`` itself, or a dataset written by :func:`write_text_files`
    into a temporary folder beside ``near`` (removed on leaving)."""
    if source.text is not None:
        yield Path(source.text)
        return
    source.check()
    near.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".text-", suffix=".tmp", dir=near) as tmp:
        write_text_files(source, Path(tmp), workers=workers)
        yield Path(tmp)


def build_text(
    out: str | Path,
    *,
    text: str | None = None,
    dataset: str | None = None,
    text_field: str = "text",
    split: str = "train",
    workers: int = 1,
    shards: int = 1,
    min_article_chars: int = 0,
    keep_disambiguation: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Any source -> text layout shards and ``manifest.json`` under ``out``; returns the summary. Raises
    ``UserError`` on bad input, leaving nothing behind (and ``out`` as it was)."""
    t0 = time.perf_counter()
    source = Source(text, dataset, text_field, split)
    source.check()
    out_dir = Path(out)
    created = prepare_out_dir(out_dir, overwrite)
    try:
        (out_dir / MANIFEST).unlink(missing_ok=True)
        records, counts = write_text_files(
            source,
            out_dir,
            workers=workers,
            shards=shards,
            min_article_chars=min_article_chars,
            keep_disambiguation=keep_disambiguation,
        )
        remove_stale(out_dir, [r["file"] for r in records], SHARD_PATTERN.match)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    totals = {k: sum(r[k] for r in records) for k in ("sentences", "chars", "bytes")}
    seconds = round(time.perf_counter() - t0, 3)
    atomic_write_json(
        out_dir / MANIFEST,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": "UTF-8; one sentence per line; one blank line after each document",
            "source": source.name,
            "settings": {
                "text_field": text_field,
                "split": split,
                "shards": shards,
                "min_article_chars": min_article_chars,
                "keep_disambiguation": keep_disambiguation,
                "assignment": "round-robin: k-th written document -> shard k % shards",
            },
            "counts": counts,
            "shards": records,
            "totals": totals,
            "run": {"workers": workers, "seconds": seconds},
        },
    )
    return {**counts, **totals, "shards": shards, "out": str(out_dir), "seconds": seconds}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--out", required=True, help="output dir for text_NNNNN.txt files and manifest.json")
    p.add_argument("--workers", type=int, default=1, help="sentence-splitting processes (output does not depend)")
    p.add_argument("--shards", type=int, default=1, help="number of output text files (default 1)")
    p.add_argument("--min-article-chars", type=int, default=0, help="drop documents with fewer characters of text")
    p.add_argument("--keep-disambiguation", action="store_true", help="dumps: keep disambiguation pages")
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")


REPORT = (
    "text: {documents} documents -> {documents_written} written ({empty} empty, {disambiguation} disambiguation"
    " dropped), {sentences} sentences, {bytes} bytes in {shards} file(s) under {out} in {seconds:.1f}s"
)


def run(args: argparse.Namespace) -> int:
    src = source_from_args(args)
    summary = build_text(
        args.out,
        text=src.text,
        dataset=src.dataset,
        text_field=src.text_field,
        split=src.split,
        workers=args.workers,
        shards=args.shards,
        min_article_chars=args.min_article_chars,
        keep_disambiguation=args.keep_disambiguation,
        overwrite=args.overwrite,
    )
    print(REPORT.format(**summary), flush=True)
    return 0
