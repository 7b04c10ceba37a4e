"""The tokenizers the shard builders use, in one module: GPT's ``tokenizer.json`` (byte-level BPE with an
end-of-document token) and BERT's WordPiece vocabulary, each loaded with a one-line error naming the file.

The shard builders (``data.bert``, ``data.gpt``), ``data.convert`` and the model families' Hugging Face
exports (``model.bert``, ``model.neox``) all load them from here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer, Tokenizer

from common.errors import UserError
from data.vocab import BERT_SPECIALS, load_vocab_checked

EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>")


def load_tokenizer(path: str | os.PathLike):
    """Load tokenizer.json and find its end-of-document id (error naming the file when there is none)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: tokenizer file does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a plain Exception on bad JSON
        raise UserError(f"{p}: not a `tokenizers` tokenizer.json ({str(e).splitlines()[0]})") from None
    for name in EOD_TOKENS:
        eod = tok.token_to_id(name)
        if eod is not None:
            return tok, int(eod), name
    raise UserError(f"{p}: tokenizer has no end-of-document token (looked for {', '.join(EOD_TOKENS)})")


def _wordpiece_json(path: Path, lowercase: bool | None) -> list[str]:
    """A Hugging Face ``tokenizer.json`` with BERT's WordPiece pipeline as its token list; anything that would
    tokenize otherwise than ``bert_tokenizer`` over the same tokens is refused in one line."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model, norm, pre = spec["model"], spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
        vocab = model.get("vocab")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a `tokenizers` tokenizer.json ({type(e).__name__}: {e})") from None
    if model.get("type") != "WordPiece" or not isinstance(vocab, dict):
        raise UserError(f"{path}: a {model.get('type')} tokenizer.json; BERT needs a WordPiece model (or a vocab.txt)")
    settings = {
        "unk_token": model.get("unk_token"),
        "continuing_subword_prefix": model.get("continuing_subword_prefix"),
        "max_input_chars_per_word": model.get("max_input_chars_per_word"),
    }
    if settings != {"unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100}:
        raise UserError(f"{path}: WordPiece model settings {settings} are not BERT's ([UNK], ##, 100)")
    if norm.get("type") != "BertNormalizer" or not (norm.get("clean_text") and norm.get("handle_chinese_chars")):
        raise UserError(f"{path}: normalizer {norm.get('type')} is not BERT's (BertNormalizer with clean_text)")
    lower = bool(norm.get("lowercase"))
    accents = norm.get("strip_accents")
    if accents is not None and bool(accents) != lower:
        raise UserError(f"{path}: strip_accents={accents} with lowercase={lower} is neither BERT uncased nor cased")
    if pre.get("type") != "BertPreTokenizer":
        raise UserError(f"{path}: pre-tokenizer {pre.get('type')} is not BERT's (BertPreTokenizer)")
    if lowercase is not None and lower != lowercase:
        want, flag = ("uncased", "--lowercase") if lowercase else ("cased", "--cased")
        raise UserError(f"{path}: normalizer lowercase={lower} but {flag} asks for a {want} vocabulary")
    words = sorted(vocab, key=vocab.__getitem__)
    if sorted(vocab.values()) != list(range(len(words))):
        raise UserError(f"{path}: WordPiece ids are not 0..{len(words) - 1} without gaps")
    missing = [t for t in BERT_SPECIALS if t not in vocab]
    if missing:
        raise UserError(f"{path}: not a BERT vocab: missing special token(s) {' '.join(missing)}")
    return words


def check_bert_vocab(vocab: str | os.PathLike, lowercase: bool | None = None) -> list[str]:
    """A BERT vocabulary as its ordered token list: a WordPiece ``vocab.txt``, or a Hugging Face ``tokenizer.json``
    with BERT's WordPiece pipeline (as ``bert-base-uncased`` ships) whose lowercasing agrees with ``lowercase``
    (None: not checked). Errors name the file: a missing BERT special token, another pipeline."""
    path = Path(vocab)
    if path.suffix == ".json" and path.is_file():
        return _wordpiece_json(path, lowercase)
    index = load_vocab_checked(path)
    words = [""] * len(index)
    for w, i in index.items():
        words[i] = w
    return words


def vocab_sha256(path: str | os.PathLike) -> str:
    """What shards record as their vocabulary's identity (``vocab_sha256``, ``tokenizer_sha256``).

    A BERT WordPiece ``tokenizer.json`` is identified by its ordered token list: the SHA-256 of the tokens one per
    line, which is the SHA-256 of the ``vocab.txt`` holding the same vocabulary, so shards made from either train
    with either. Any other file (a ``vocab.txt``, a BPE ``tokenizer.json``) by its bytes, as shards always did.
    """
    p = Path(path)
    if p.suffix == ".json":
        try:
            model = json.loads(p.read_text(encoding="utf-8")).get("model", {})
        except (OSError, ValueError, AttributeError):
            model = {}
        if isinstance(model, dict) and model.get("type") == "WordPiece":
            words = check_bert_vocab(p)
            return hashlib.sha256("".join(w + "\n" for w in words).encode("utf-8")).hexdigest()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def bert_tokenizer(vocab: str | os.PathLike, lowercase: bool):
    """The Rust WordPiece tokenizer with BERT's basic tokenization (same splits as Google's
    tokenization.py), over a ``vocab.txt`` or a WordPiece ``tokenizer.json``'s tokens."""
    words = check_bert_vocab(vocab, lowercase)
    return BertWordPieceTokenizer(
        {w: i for i, w in enumerate(words)},
        lowercase=lowercase,
        strip_accents=lowercase,
        clean_text=True,
        handle_chinese_chars=True,
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
