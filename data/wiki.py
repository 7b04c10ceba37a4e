"""``python -m data wiki``: MediaWiki XML dump(s) -> clean, sentence-split UTF-8 text shards.

Replaces NVIDIA's WikiExtractor + NLTK punkt step. The dump is streamed: bz2 is decompressed on the fly
and ``iterparse`` clears each ``<page>`` once read, so memory does not grow with the dump. The main
process parses XML and filters pages (main namespace, no redirects); worker processes clean wikitext
and split sentences on chunks of pages, with at most ``2 x workers`` chunks in flight, results taken
back in submission order so the output is the same for any ``--workers``.

Output layout (NVIDIA's): one sentence per line, one blank line after each article, in
``wiki_00000.txt ...``; article *k* (in dump order, counting written articles) goes to shard
``k % shards``. ``manifest.json`` records inputs, settings, per-shard counts and sha256, totals.
Every file is written under a temporary name and renamed when complete; the manifest comes last.
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import functools
import hashlib
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.atomic import atomic_path, atomic_write_json
from common.errors import UserError
from common.log import get_logger
from common.outdir import prepare_out_dir, remove_stale
from data.textclean import CLEANER_VERSION, clean_wikitext, is_disambiguation, split_sentences

FORMAT = "wikipretrain-text"
FORMAT_VERSION = 1
SHARD_PATTERN = re.compile(r"^wiki_\d{5,}\.txt$")
MANIFEST = "manifest.json"

# A chunk sent to a worker: about this much wikitext, or this many pages, whichever comes first.
CHUNK_CHARS = 1 << 20
CHUNK_PAGES = 256

log = get_logger("data.wiki")


# --------------------------------------------------------------------------------------------------
# Reading the dump
# --------------------------------------------------------------------------------------------------


class _Page:
    __slots__ = ("title", "ns", "redirect", "text")

    def __init__(self, title: str, ns: int, redirect: bool, text: str) -> None:
        self.title, self.ns, self.redirect, self.text = title, ns, redirect, text


def _check_bz2(path: Path) -> int:
    """Fail early, naming the file, when it is missing, empty or not bz2; return its size."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(3)
    if size == 0:
        raise UserError(f"{path}: empty file (expected a pages-articles .xml.bz2 dump)")
    if magic != b"BZh":
        raise UserError(f"{path}: not a bz2 file (expected a pages-articles .xml.bz2 dump)")
    return size


class _Bz2ThreadReader:
    """A read-only stream of a bz2 file decompressed in a background thread (bz2 releases the GIL).

    Decompression is the slowest step of reading a dump; doing it in a thread overlaps it with XML
    parsing and cleaning. At most ``max_chunks`` decompressed chunks wait in the queue. Handles
    multi-stream files (``pages-articles-multistream``) like ``bz2.BZ2File``; errors (``OSError`` for
    bad data, ``EOFError`` for a truncated file) are raised from ``read``.
    """

    RAW_CHUNK = 1 << 18

    def __init__(self, path: Path, max_chunks: int = 16) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max_chunks)
        self._buf = b""
        self._done = False
        self._stop = threading.Event()
        self.consumed = 0  # compressed bytes read so far
        self._raw = open(path, "rb")  # noqa: SIM115 (closed in close())
        self._thread = threading.Thread(target=self._run, name="bz2-reader", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            dec = bz2.BZ2Decompressor()
            fed = False  # has the current decompressor been given data?
            streams_done = 0
            while not self._stop.is_set():
                if dec.eof:
                    streams_done += 1
                    rest = dec.unused_data
                    dec, fed = bz2.BZ2Decompressor(), False
                    if rest:
                        try:
                            out = dec.decompress(rest)
                        except OSError:
                            break  # trailing garbage after a complete stream is ignored, as bz2.BZ2File does
                        fed = True
                        if out and not self._put(out):
                            return
                        continue
                raw = self._raw.read(self.RAW_CHUNK)
                if not raw:
                    if fed and not dec.eof:
                        raise EOFError("compressed file ended before the end-of-stream marker was reached")
                    break
                self.consumed += len(raw)
                try:
                    out = dec.decompress(raw)
                except OSError:
                    if streams_done:
                        break
                    raise
                fed = True
                if out and not self._put(out):
                    return
            self._put(b"")
        except BaseException as e:  # handed to the reader
            self._put(e)

    def read(self, n: int = -1) -> bytes:
        if self._done:
            return b""
        if not self._buf:
            item = self._q.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if not item:
                self._done = True
                return b""
            self._buf = item
        if n < 0 or n >= len(self._buf):
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._raw.close()


def iter_pages(path: Path, on_progress: Callable[[int], None] | None = None) -> Iterator[_Page]:
    """Stream the pages of one bz2 MediaWiki dump; memory stays at one page.

    ``on_progress`` receives the number of compressed bytes consumed so far.
    """
    stream = _Bz2ThreadReader(path)
    try:
        events = ET.iterparse(stream, events=("start", "end"))
        _, root = next(events)
        uri, _, local = root.tag[1:].partition("}") if root.tag.startswith("{") else ("", "", root.tag)
        if local != "mediawiki":
            raise UserError(f"{path}: not a MediaWiki XML dump (root element is <{local}>, not <mediawiki>)")
        q = f"{{{uri}}}" if uri else ""
        page_tag, title_tag, ns_tag, redirect_tag = q + "page", q + "title", q + "ns", q + "redirect"
        revision_tag, text_tag = q + "revision", q + "text"
        for event, el in events:
            if event != "end" or el.tag != page_tag:
                continue
            revisions = el.findall(revision_tag)
            text_el = revisions[-1].find(text_tag) if revisions else None
            ns_text = (el.findtext(ns_tag) or "0").strip()
            yield _Page(
                title=el.findtext(title_tag) or "",
                ns=int(ns_text) if ns_text.lstrip("-").isdigit() else 0,
                redirect=el.find(redirect_tag) is not None,
                text=(text_el.text or "") if text_el is not None else "",
            )
            root.clear()  # drop the finished page (and all earlier ones) from the tree
            if on_progress is not None:
                on_progress(stream.consumed)
    except EOFError:
        raise UserError(f"{path}: truncated bz2 file (compressed data ended early)") from None
    except OSError as e:
        raise UserError(f"{path}: corrupt bz2 data ({e})") from None
    except ET.ParseError as e:
        msg = str(e)
        if msg.startswith("no element found"):
            raise UserError(f"{path}: incomplete MediaWiki XML (it ends before </mediawiki>)") from None
        raise UserError(f"{path}: not a MediaWiki XML dump (XML error: {msg})") from None
    except StopIteration:
        raise UserError(f"{path}: not a MediaWiki XML dump (no XML inside)") from None
    finally:
        stream.close()


# --------------------------------------------------------------------------------------------------
# Cleaning in workers
# --------------------------------------------------------------------------------------------------


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates us


def process_article(
    title: str, wikitext: str, min_chars: int = 1, keep_disambiguation: bool = False
) -> tuple[str, str, int, int]:
    """One article -> (status, text block, sentences, chars). Status: ok | disambiguation | empty."""
    if not keep_disambiguation and is_disambiguation(title, wikitext):
        return ("disambiguation", "", 0, 0)
    sentences = [s for p in clean_wikitext(wikitext).split("\n\n") for s in split_sentences(p)]
    chars = sum(len(s) for s in sentences)
    if not sentences or chars < max(1, min_chars):
        return ("empty", "", 0, 0)
    return ("ok", "\n".join(sentences) + "\n\n", len(sentences), chars)


def _process_chunk(
    chunk: list[tuple[str, str]], min_chars: int, keep_disambiguation: bool
) -> list[tuple[str, str, int, int]]:
    return [process_article(title, text, min_chars, keep_disambiguation) for title, text in chunk]


class _BoundedOrderedMap:
    """Like ``pool.imap`` but never reads more than ``max_pending`` items ahead of the consumer.

    (``Pool.imap`` drains its input iterator eagerly, which would pull a whole dump into memory.)
    ``settle()`` waits for the work already handed out: ``Pool.terminate()`` can hang for good while
    the pool's task thread is still writing a chunk (larger than a pipe buffer) to workers it has just
    killed (CPython issue 78178). Once every submitted chunk has been taken by a worker, none is being
    written.
    """

    def __init__(self, pool: Any, fn: Callable, max_pending: int) -> None:
        self._pool, self._fn, self._max_pending = pool, fn, max_pending
        self._pending: deque = deque()

    def map(self, items: Iterable) -> Iterator:
        for item in items:
            self._pending.append(self._pool.apply_async(self._fn, (item,)))
            if len(self._pending) >= self._max_pending:
                yield self._pending.popleft().get()
        while self._pending:
            yield self._pending.popleft().get()

    def settle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self._pending:
            self._pending.popleft().wait(max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------------


class TextShardWriter:
    """One output shard, written to a temporary name and renamed into place on success."""

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        self.name = path.name
        tmp = stack.enter_context(atomic_path(path))
        self.f = stack.enter_context(open(tmp, "wb"))  # noqa: SIM115 (closed by the stack)
        self.sha = hashlib.sha256()
        self.articles = self.sentences = self.chars = self.bytes = 0

    def write(self, block: str, sentences: int, chars: int) -> None:
        data = block.encode("utf-8")
        self.f.write(data)
        self.sha.update(data)
        self.articles += 1
        self.sentences += sentences
        self.chars += chars
        self.bytes += len(data)

    def record(self) -> dict[str, Any]:
        return {
            "file": self.name,
            "articles": self.articles,
            "sentences": self.sentences,
            "chars": self.chars,
            "bytes": self.bytes,
            "sha256": self.sha.hexdigest(),
        }


# --------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------

COUNTS = ("pages", "articles", "redirects", "other_namespace", "disambiguation", "empty", "articles_written")

ChunkResult = list[tuple[str, str, int, int]]  # process_article's (status, block, sentences, chars) per page


@dataclass
class _Progress:
    """What the main process has read so far: the page counters and the progress bar over the compressed
    input of all dumps."""

    bar: Any  # tqdm
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    done_bytes: int = 0  # compressed bytes of the dumps read to the end

    def pages(self, path: Path, size: int) -> Iterator[_Page]:
        """The pages of one dump, moving the bar as its compressed bytes are consumed."""
        base = self.done_bytes

        def advance(pos: int) -> None:
            self.bar.update(base + pos - self.bar.n)

        yield from iter_pages(path, advance)
        self.done_bytes = base + size

    def is_article(self, page: _Page) -> bool:
        """Count the page; True for a main-namespace page that is not a redirect."""
        self.counts["pages"] += 1
        if page.ns != 0:
            self.counts["other_namespace"] += 1
            return False
        if page.redirect:
            self.counts["redirects"] += 1
            return False
        self.counts["articles"] += 1
        return True


def _article_chunks(inputs: Sequence[tuple[Path, int]], progress: _Progress) -> Iterator[list[tuple[str, str]]]:
    """(title, wikitext) of the articles of the (dump, size) ``inputs``, in dump order, in chunks of about
    ``CHUNK_CHARS`` of wikitext or ``CHUNK_PAGES`` pages, whichever comes first."""
    chunk: list[tuple[str, str]] = []
    chunk_chars = 0
    for path, size in inputs:
        for page in progress.pages(path, size):
            if not progress.is_article(page):
                continue
            chunk.append((page.title, page.text))
            chunk_chars += len(page.text)
            if chunk_chars >= CHUNK_CHARS or len(chunk) >= CHUNK_PAGES:
                yield chunk
                chunk, chunk_chars = [], 0
    if chunk:
        yield chunk


class ChunkPool:
    """Runs ``work`` on chunks of articles (``data.wiki``'s cleaning, ``data.text``'s sentence splitting): in
    this process for one worker, else in a pool of ``workers`` spawned processes with at most ``2 x workers``
    chunks in flight; results in submission order either way.

    A context manager. On success the pool is closed and joined. On any exception (a bad dump, Ctrl-C) the
    chunks already handed out are waited for first, then the pool is terminated: ``Pool.terminate()`` can
    hang while the pool's task thread is still writing a chunk to a worker it has just killed (CPython issue
    78178; ``_BoundedOrderedMap.settle``).
    """

    def __init__(self, workers: int, work: Callable[[Any], ChunkResult]) -> None:
        self.workers = workers
        self._work = work  # a picklable function of one chunk (a module-level function or a partial of one)
        self._pool: Any = None
        self._ordered: _BoundedOrderedMap | None = None

    def __enter__(self) -> ChunkPool:
        if self.workers > 1:
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_init_worker)
            self._ordered = _BoundedOrderedMap(self._pool, self._work, max_pending=2 * self.workers)
        return self

    def map(self, chunks: Iterable[Any]) -> Iterator[ChunkResult]:
        if self._ordered is None:
            return map(self._work, chunks)
        return self._ordered.map(chunks)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._pool is None:
            return
        if exc_type is None:
            self._pool.close()
        else:
            assert self._ordered is not None
            with contextlib.suppress(BaseException):  # a second Ctrl-C stops the wait, not the clean-up
                self._ordered.settle()
            self._pool.terminate()
        self._pool.join()
        self._pool = self._ordered = None


def write_round_robin(
    results: Iterable[ChunkResult], writers: Sequence[TextShardWriter], counts: dict[str, int]
) -> int:
    """Each chunk's kept blocks into ``writers`` in turn (``ok``), the others counted in ``counts`` by their
    status; returns how many were written."""
    k = 0
    for chunk_result in results:
        for status, block, n_sent, n_chars in chunk_result:
            if status == "ok":
                writers[k % len(writers)].write(block, n_sent, n_chars)
                k += 1
            else:
                counts[status] += 1
    return k


def _write_shards(
    results: Iterable[ChunkResult], out_dir: Path, shards: int, counts: dict[str, int], inputs: Sequence[Path]
) -> list[dict[str, Any]]:
    """Write the cleaned articles round-robin into ``shards`` files, renamed into place only when all of them
    are complete; count the dropped articles and the written ones in ``counts``. Returns the shard records.
    """
    with contextlib.ExitStack() as stack:
        writers = [TextShardWriter(out_dir / f"wiki_{i:05d}.txt", stack) for i in range(shards)]
        k = counts["articles_written"] = write_round_robin(results, writers, counts)
        if k == 0:
            names = ", ".join(str(p) for p in inputs)
            raise UserError(
                f"{names}: empty corpus: no article text left "
                f"({counts['pages']} pages, {counts['articles']} main-namespace articles, "
                f"{counts['redirects']} redirects)"
            )
        records = [w.record() for w in writers]
        (out_dir / MANIFEST).unlink(missing_ok=True)  # invalid from here until the new one is written
    return records


def _check_settings(dumps: Sequence[Path], workers: int, shards: int, min_article_chars: int) -> None:
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if shards < 1:
        raise UserError(f"--shards must be >= 1, got {shards}")
    if min_article_chars < 0:
        raise UserError(f"--min-article-chars must be >= 0, got {min_article_chars}")
    if not dumps:
        raise UserError("no input dump given")


def extract_dump(
    dumps: Sequence[Path],
    out_dir: Path,
    *,
    workers: int = 1,
    shards: int = 1,
    overwrite: bool = False,
    min_article_chars: int = 0,
    keep_disambiguation: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Extract clean sentence-per-line text shards from MediaWiki ``.xml.bz2`` dumps; return the summary.

    Output is byte-identical for any ``workers``. Raises ``UserError`` (nothing written, temporary
    files removed) on a missing, non-bz2, truncated or non-MediaWiki input, an empty corpus, or a
    non-empty ``out_dir`` without ``overwrite``.
    """
    _check_settings(dumps, workers, shards, min_article_chars)
    paths = [Path(d) for d in dumps]
    sizes = [_check_bz2(p) for p in paths]
    out_dir = Path(out_dir)
    created = prepare_out_dir(out_dir, overwrite)
    start = time.perf_counter()
    try:
        show = progress and sys.stderr.isatty()
        with (
            tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="wiki", file=sys.stderr, disable=not show) as bar,
            ChunkPool(
                workers,
                functools.partial(_process_chunk, min_chars=min_article_chars, keep_disambiguation=keep_disambiguation),
            ) as cleaners,
        ):
            read = _Progress(bar)
            results = cleaners.map(_article_chunks(list(zip(paths, sizes)), read))
            shard_records = _write_shards(results, out_dir, shards, read.counts, paths)
        # all shards renamed into place; drop stale ones from an earlier run with more shards
        remove_stale(out_dir, [r["file"] for r in shard_records], SHARD_PATTERN.match)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    seconds = time.perf_counter() - start
    settings = {
        "shards": shards,
        "min_article_chars": min_article_chars,
        "keep_disambiguation": keep_disambiguation,
    }
    summary = _summary(read.counts, shard_records, sum(sizes), seconds, workers, shards, out_dir)
    manifest = _manifest(paths, sizes, settings, read.counts, shard_records, workers, summary["seconds"])
    atomic_write_json(out_dir / MANIFEST, manifest)
    return summary


def _totals(counts: dict[str, int], shard_records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "articles": counts["articles_written"],
        "sentences": sum(r["sentences"] for r in shard_records),
        "chars": sum(r["chars"] for r in shard_records),
        "bytes": sum(r["bytes"] for r in shard_records),
    }


def _summary(
    counts: dict[str, int],
    shard_records: list[dict[str, Any]],
    input_bytes: int,
    seconds: float,
    workers: int,
    shards: int,
    out_dir: Path,
) -> dict[str, Any]:
    """What ``extract_dump`` returns (and ``format_summary`` prints)."""
    totals = _totals(counts, shard_records)
    return {
        **counts,
        "sentences": totals["sentences"],
        "chars": totals["chars"],
        "input_bytes": input_bytes,
        "seconds": round(seconds, 3),
        "articles_per_s": round(counts["articles"] / seconds, 1) if seconds > 0 else 0.0,
        "mb_per_s": round(input_bytes / 1e6 / seconds, 3) if seconds > 0 else 0.0,
        "workers": workers,
        "shards": shards,
        "out_dir": str(out_dir),
    }


def _manifest(
    paths: Sequence[Path],
    sizes: Sequence[int],
    settings: dict[str, Any],
    counts: dict[str, int],
    shard_records: list[dict[str, Any]],
    workers: int,
    seconds: float,
) -> dict[str, Any]:
    """manifest.json: inputs, settings, per-shard counts and sha256, totals."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cleaner_version": CLEANER_VERSION,
        "layout": "UTF-8; one sentence per line; one blank line after each article",
        "inputs": [{"path": str(p.resolve()), "bytes": s} for p, s in zip(paths, sizes)],
        "settings": {
            **settings,
            "assignment": "round-robin: k-th written article -> shard k % shards",
            "namespaces": [0],
            "dropped": [
                "redirects",
                *([] if settings["keep_disambiguation"] else ["disambiguation pages"]),
                "headings",
                "lists",
                "tables",
                "templates",
            ],
        },
        "counts": counts,
        "shards": shard_records,
        "totals": _totals(counts, shard_records),
        "run": {"workers": workers, "seconds": seconds},
    }


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run report, one line per topic."""
    return (
        f"pages {s['pages']}: {s['articles']} articles, {s['redirects']} redirects, "
        f"{s['other_namespace']} other namespaces dropped\n"
        f"articles: {s['articles_written']} written, {s['disambiguation']} disambiguation pages and "
        f"{s['empty']} empty/short dropped\n"
        f"wrote {s['sentences']} sentences, {s['chars']} chars to {s['shards']} shard(s) in {s['out_dir']}\n"
        f"{s['seconds']:.2f} s with {s['workers']} worker(s): {s['articles_per_s']:.1f} articles/s, "
        f"{s['mb_per_s']:.2f} MB/s of compressed input"
    )


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dumps", nargs="+", type=Path, metavar="DUMP.xml.bz2", help="MediaWiki pages-articles dump(s)")
    p.add_argument("--out", required=True, type=Path, metavar="TEXT_DIR", help="output directory for shards")
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="cleaning processes (default: CPUs - 1; output does not depend on it)",
    )
    p.add_argument("--shards", type=int, default=1, help="number of output text files (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace the shards in a non-empty TEXT_DIR")
    p.add_argument(
        "--min-article-chars",
        type=int,
        default=0,
        metavar="K",
        help="drop articles with fewer than K characters of clean text (default 0: only empty ones)",
    )
    p.add_argument(
        "--keep-disambiguation",
        action="store_true",
        help="keep disambiguation pages as articles (WikiExtractor's behaviour; dropped by default)",
    )


def run(args: argparse.Namespace) -> int:
    summary = extract_dump(
        args.dumps,
        args.out,
        workers=args.workers,
        shards=args.shards,
        overwrite=args.overwrite,
        min_article_chars=args.min_article_chars,
        keep_disambiguation=args.keep_disambiguation,
        progress=True,
    )
    print(format_summary(summary), flush=True)
    return 0
