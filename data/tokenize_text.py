"""Text shards in NVIDIA's layout -> input shards (byte ranges cut at document boundaries) -> token arrays.

Layout: UTF-8 ``.txt`` files, one sentence per line, a blank line between documents. The corpus is
split into N input shards by bytes (cut only at blank lines), each processed independently: output
shard i depends only on input shard i and the seed, never on how many worker processes ran, and a
worker's memory is bounded by one input shard, not by the corpus. Tokenization uses the Rust
``tokenizers`` library in batches (multithreaded), never a Python loop over words.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import UserError
from data.tokenizer import encode_lines

AUTO_SHARD_BYTES = 32 << 20  # --shards 0: one input shard per 32 MiB of text
_BOUNDARY = re.compile(rb"\n[ \t\r\f\v]*\n")
ENCODE_BATCH_LINES = 8192


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one text file."""

    file: str
    start: int
    end: int


@dataclass(frozen=True)
class InputShard:
    index: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.end - s.start for s in self.segments)

    def describe(self) -> str:
        return ";".join(f"{Path(s.file).name}:{s.start}-{s.end}" for s in self.segments)


def list_text_files(text: str | os.PathLike) -> list[Path]:
    """A ``.txt`` file or a directory searched recursively for ``*.txt`` (sorted; hidden/temp files
    skipped)."""
    p = Path(text)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UserError(f"{p}: text file or directory does not exist")
    files = sorted(
        f for f in p.rglob("*.txt") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise UserError(f"{p}: no .txt files in this directory (expected NVIDIA's layout: one sentence per line)")
    return files


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            if block.strip():
                return True
    return False


def _next_boundary(f, pos: int, end: int) -> int:
    """First document boundary (just after the newline that ends a document) at or after ``pos``."""
    f.seek(max(0, pos - 1))
    carry = b""
    base = max(0, pos - 1)
    while base < end:
        block = f.read(min(1 << 16, end - base))
        if not block:
            break
        buf = carry + block
        m = _BOUNDARY.search(buf)
        if m:
            return base - len(carry) + m.start() + 1
        carry = buf[-64:]
        base += len(block)
    return end


def plan_shards(files: list[Path], shards: int) -> list[InputShard]:
    """Split the corpus into ``shards`` byte ranges of about equal size, cut at document boundaries.

    ``shards=0`` picks one shard per ``AUTO_SHARD_BYTES``. Fewer shards come back when documents are
    larger than the target; empty ranges are dropped.
    """
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    if total == 0 or not any(_has_text(f) for f in files if f.stat().st_size):
        where = files[0] if len(files) == 1 else files[0].parent
        raise UserError(f"{where}: empty corpus (no non-blank lines in {len(files)} .txt file(s))")
    if shards < 0:
        raise UserError(f"--shards {shards}: must be >= 0 (0 = automatic)")
    n = shards or max(1, math.ceil(total / AUTO_SHARD_BYTES))
    target = total / n
    out: list[InputShard] = []
    cur: list[Segment] = []
    cur_bytes = 0
    for f, size in zip(files, sizes):
        pos = 0
        with open(f, "rb") as fh:
            while pos < size:
                need = target - cur_bytes
                if len(out) == n - 1 or size - pos <= need:
                    cur.append(Segment(str(f), pos, size))
                    cur_bytes += size - pos
                    break
                cut = _next_boundary(fh, pos + max(1, int(need)), size)
                cur.append(Segment(str(f), pos, cut))
                out.append(InputShard(len(out), tuple(cur)))
                cur, cur_bytes, pos = [], 0, cut
    if cur:
        out.append(InputShard(len(out), tuple(cur)))
    # drop ranges with no text (e.g. a cut that left only blank lines)
    kept = [s for s in out if s.nbytes > 0]
    return [InputShard(i, s.segments) for i, s in enumerate(kept)]


def read_lines(shard: InputShard) -> Iterator[list[str]]:
    """Yield the shard's lines (stripped) in batches; a document ends at a blank line and at a file end."""
    for seg in shard.segments:
        with open(seg.file, "rb") as f:
            f.seek(seg.start)
            data = f.read(seg.end - seg.start)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{seg.file}: not UTF-8 text (byte {seg.start + e.start})") from None
        lines = text.split("\n")
        del text, data
        for i in range(0, len(lines), ENCODE_BATCH_LINES):
            yield [ln.strip() for ln in lines[i : i + ENCODE_BATCH_LINES]]
        yield [""]  # a file (segment) end closes the current document


@dataclass
class TokenizedShard:
    """A shard's tokens: sentences are ``tokens[sent_off[i]:sent_off[i+1]]``, documents are sentence
    ranges."""

    tokens: np.ndarray  # int32 [T]
    sent_off: np.ndarray  # int64 [S+1]
    doc_off: np.ndarray  # int64 [D+1], in sentences
    lines: int

    @property
    def num_docs(self) -> int:
        return len(self.doc_off) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sent_off) - 1


def tokenize_sentences(tokenizer, shard: InputShard) -> TokenizedShard:
    """Tokenize a shard line by line: empty lines end documents, lines with no tokens are skipped (as
    Google's)."""
    tok_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    doc_breaks: list[np.ndarray] = []  # sentence index at which a new document starts
    n_sent = 0
    n_lines = 0
    for lines in read_lines(shard):
        n_lines += len(lines)
        blank = np.fromiter((not ln for ln in lines), dtype=bool, count=len(lines))
        nonblank = [ln for ln in lines if ln]
        if nonblank:
            flat, lens = encode_lines(tokenizer, nonblank)
        else:
            flat, lens = np.zeros(0, np.int32), np.zeros(0, np.int64)
        # map each blank line to the number of non-empty sentences seen before it
        full = np.zeros(len(lines), dtype=np.int64)
        full[~blank] = lens
        kept = full > 0
        before: np.ndarray = np.cumsum(kept) - kept  # sentences before each line (within the batch)
        doc_breaks.append(n_sent + before[blank])
        tok_parts.append(flat)
        len_parts.append(lens[lens > 0])
        n_sent += int(kept.sum())
    tokens = np.concatenate(tok_parts) if tok_parts else np.zeros(0, np.int32)
    lens = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    sent_off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=sent_off[1:])
    breaks = np.unique(np.concatenate([[0], *doc_breaks, [n_sent]]))
    return TokenizedShard(tokens, sent_off, breaks.astype(np.int64), n_lines)
