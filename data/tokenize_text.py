"""Text shards in NVIDIA's layout -> input shards (byte ranges cut at document boundaries) -> token arrays.

Layout: UTF-8 ``.txt`` files, one sentence per line, a blank line between documents. The corpus is
split into N input shards by bytes (cut only at blank lines), each processed independently: output
shard i depends only on input shard i and the seed, never on how many worker processes ran, and a
worker's memory is bounded by one input shard, not by the corpus. Tokenization uses the Rust
``tokenizers`` library in batches (multithreaded), never a Python loop over words.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer

from common.errors import UserError
from data.vocab import load_vocab_checked

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


def check_bert_vocab(vocab: str | os.PathLike) -> list[str]:
    """A WordPiece ``vocab.txt`` as its token list; errors (naming the file) when it lacks a BERT special
    token."""
    index = load_vocab_checked(Path(vocab))
    words = [""] * len(index)
    for w, i in index.items():
        words[i] = w
    return words


def bert_tokenizer(vocab: str | os.PathLike, lowercase: bool):
    """The Rust WordPiece tokenizer with BERT's basic tokenization (same splits as Google's
    tokenization.py)."""
    return BertWordPieceTokenizer(
        str(vocab), lowercase=lowercase, strip_accents=lowercase, clean_text=True, handle_chinese_chars=True
    )._tokenizer


def encode_lines(tokenizer, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Batch-encode lines -> (flat int32 ids, int64 per-line lengths)."""
    if isinstance(tokenizer, CachedBertTokenizer):
        return tokenizer.encode_lines(lines)
    encs = tokenizer.encode_batch(lines, add_special_tokens=False)
    ids = [e.ids for e in encs]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


class CachedBertTokenizer:
    """The `tokenizers` BERT WordPiece tokenizer behind a cache of space-separated chunks; same ids, faster.

    On this 2-core machine the Rust pipeline (normalizer, pre-tokenizer, WordPiece, Encoding objects)
    costs 2-8 us per token (non-ASCII text is slowest), most of the instance builder's time. BERT's
    normalization and pre-tokenization act on each character or split at whitespace, so a space-
    separated chunk of a line tokenizes the same alone as in its line. Each distinct chunk goes through
    the library once (it is Zipf-distributed text: most chunks repeat), the rest is a dict lookup and
    numpy gathers. ``tests/test_data_bert.py`` checks identical ids against the plain library tokenizer.
    """

    MAX_CACHE = 1_000_000  # distinct chunks kept (~100 MB); the cache restarts when full

    def __init__(self, vocab: str | os.PathLike, lowercase: bool) -> None:
        self.hf = bert_tokenizer(vocab, lowercase)
        self._reset()

    def _reset(self) -> None:
        # index 0: line break, 1: empty chunk (two spaces in a row); both have no pieces
        self.chunk_index: dict[str, int] = {"\n": 0, "": 1}
        self.piece_start = [0, 0]
        self.piece_len = [0, 0]
        self.pieces: list[int] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _add(self, chunks: list[str]) -> None:
        for c, e in zip(chunks, self.hf.encode_batch(chunks, add_special_tokens=False)):
            self.chunk_index[c] = len(self.piece_start)
            self.piece_start.append(len(self.pieces))
            self.piece_len.append(len(e.ids))
            self.pieces.extend(e.ids)
        self._arrays = None

    def encode_lines(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Lines (without newlines) -> (flat int32 ids, int64 tokens per line), as the library's
        encode_batch."""
        chunks = " \n ".join(lines).split(" ")
        idx = list(map(self.chunk_index.get, chunks))
        if None in idx:
            if len(self.chunk_index) > self.MAX_CACHE:
                self._reset()
            self._add(list(dict.fromkeys(c for c, i in zip(chunks, idx) if i is None)))
            idx = list(map(self.chunk_index.get, chunks))
        if self._arrays is None:
            self._arrays = (
                np.asarray(self.piece_start, dtype=np.int64),
                np.asarray(self.piece_len, dtype=np.int64),
                np.asarray(self.pieces, dtype=np.int32),
            )
        pstart, plen, pieces = self._arrays
        ci = np.asarray(idx, dtype=np.int64)
        lens = plen[ci]
        line_of_chunk = np.cumsum(ci == 0)  # chunks after the k-th line break belong to line k
        per_line = np.bincount(line_of_chunk, weights=lens, minlength=len(lines)).astype(np.int64)
        offs = np.cumsum(lens) - lens
        flat = pieces[np.repeat(pstart[ci] - offs, lens) + np.arange(int(lens.sum()))]
        return flat, per_line


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
