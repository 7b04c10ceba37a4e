"""``python -m data vocab``: train a BERT WordPiece ``vocab.txt`` or a GPT-NeoX-style BPE ``tokenizer.json``.

Both are trained with the ``tokenizers`` library on the text shards written by ``python -m data wiki``.

* ``wordpiece``: BERT conventions: BertNormalizer (lowercase + strip accents by default, ``--cased``
  keeps both), BertPreTokenizer, ``##`` continuation prefix, and bert-base's layout of special tokens:
  ``[PAD]``=0, ``[unused0..98]``=1..99, ``[UNK]``=100, ``[CLS]``=101, ``[SEP]``=102, ``[MASK]``=103, so
  code written for the original vocabulary finds them at the same ids.
* ``bpe``: GPT-NeoX conventions: NFC normalizer, byte-level pre-tokenizer/decoder/post-processor
  (no prefix space), ``<|endoftext|>``=0 and ``<|padding|>``=1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.implementations import BertWordPieceTokenizer

from common.atomic import atomic_write_text
from common.errors import UserError
from common.log import get_logger

log = get_logger("data.vocab")

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# bert-base-uncased layout: [PAD]=0, [unused0..98]=1..99, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103
WORDPIECE_SPECIALS = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NEOX_SPECIALS = ["<|endoftext|>", "<|padding|>"]
MIN_SIZE = {"wordpiece": len(WORDPIECE_SPECIALS) + 152, "bpe": 256 + len(NEOX_SPECIALS) + 1}


def _corpus_files(text_dir: Path) -> list[str]:
    """The text shards in ``text_dir`` (``wiki_*.txt``, else any ``*.txt``); error when there is no text."""
    text_dir = Path(text_dir)
    if not text_dir.exists():
        raise UserError(f"{text_dir}: no such directory")
    if not text_dir.is_dir():
        raise UserError(f"{text_dir}: not a directory (expected the TEXT_DIR of `python -m data wiki`)")
    files = sorted(text_dir.glob("wiki_*.txt")) or sorted(text_dir.glob("*.txt"))
    files = [f for f in files if f.is_file()]
    if not files:
        raise UserError(f"{text_dir}: empty corpus: no .txt shards (run `python -m data wiki` first)")
    has_text = False
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.strip():
                    has_text = True
                    break
        if has_text:
            break
    if not has_text:
        raise UserError(f"{text_dir}: empty corpus: {len(files)} .txt file(s) but no text in them")
    return [str(f) for f in files]


def _check_size(size: int, kind: str) -> None:
    if size < MIN_SIZE[kind]:
        raise UserError(f"--size {size} is too small: a {kind} vocabulary needs at least {MIN_SIZE[kind]} entries")


def train_wordpiece(text_dir: Path, out_path: Path, size: int, lowercase: bool = True, min_frequency: int = 2) -> Path:
    """Train a BERT WordPiece vocabulary of ``size`` entries on ``text_dir``; write ``vocab.txt``
    atomically."""
    _check_size(size, "wordpiece")
    files = _corpus_files(text_dir)
    tok = BertWordPieceTokenizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase
    )
    tok.train(
        files,
        vocab_size=size,
        min_frequency=min_frequency,
        # BERT keeps ~1000 characters; fewer for small vocabularies so words still get learned
        limit_alphabet=min(1000, (size - len(WORDPIECE_SPECIALS)) // 2),
        # the tokenizers stub types this list[str | AddedToken] (invariant), which a list[str] never matches
        special_tokens=WORDPIECE_SPECIALS,  # type: ignore[arg-type]
        show_progress=False,
        wordpieces_prefix="##",
    )
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("tokenizers returned non-contiguous ids")  # a library bug, not user input
    for i, t in enumerate(WORDPIECE_SPECIALS):
        assert tokens[i] == t, (i, t, tokens[i])
    if len(tokens) < size:
        log.warning(f"vocab has {len(tokens)} entries, fewer than --size {size}: the corpus is too small")
    out_path = Path(out_path)
    atomic_write_text(out_path, "".join(t + "\n" for t in tokens))
    case = "uncased" if lowercase else "cased"
    log.info(f"wrote {out_path}: {len(tokens)} WordPiece entries ({case}) from {len(files)} file(s)")
    return out_path


def train_bpe(text_dir: Path, out_path: Path, size: int, min_frequency: int = 2) -> Path:
    """Train a GPT-NeoX-style byte-level BPE of ``size`` entries on ``text_dir``; write ``tokenizer.json``."""
    _check_size(size, "bpe")
    files = _corpus_files(text_dir)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        min_frequency=min_frequency,
        special_tokens=NEOX_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    for i, t in enumerate(NEOX_SPECIALS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    n = tok.get_vocab_size()
    if n < size:
        log.warning(f"tokenizer has {n} entries, fewer than --size {size}: the corpus is too small")
    out_path = Path(out_path)
    atomic_write_text(out_path, tok.to_str(pretty=True))
    log.info(f"wrote {out_path}: byte-level BPE with {n} entries from {len(files)} file(s)")
    return out_path


def load_vocab_checked(path: Path) -> dict[str, int]:
    """Read a BERT ``vocab.txt`` into token -> id; one-line ``UserError`` naming the file when unusable.

    Checks that ``[PAD] [UNK] [CLS] [SEP] [MASK]`` are present and tokens are unique.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such vocab file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a UTF-8 vocab.txt ({e.reason} at byte {e.start})") from None
    if text.lstrip().startswith("{"):
        raise UserError(f"{path}: looks like a tokenizer.json; a BERT vocab.txt (one token per line) is needed")
    vocab: dict[str, int] = {}
    for i, line in enumerate(text.splitlines()):
        tok = line.rstrip("\r")
        if tok in vocab:
            raise UserError(f"{path}: duplicate token {tok!r} on lines {vocab[tok] + 1} and {i + 1}")
        vocab[tok] = i
    if not vocab:
        raise UserError(f"{path}: empty vocab file")
    missing = [t for t in BERT_SPECIALS if t not in vocab]
    if missing:
        raise UserError(f"{path}: not a BERT vocab: missing special token(s) {' '.join(missing)}")
    return vocab


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "text_dir", type=Path, nargs="?", metavar="TEXT_DIR", help="directory of text shards (python -m data wiki)"
    )
    p.add_argument("--dataset", help="instead of TEXT_DIR: any source of `python -m data text --dataset`")
    p.add_argument("--text-field", default="text", help="record field holding the document's text (--dataset)")
    p.add_argument("--split", default="train", help="split of a saved DatasetDict directory (--dataset)")
    p.add_argument("--workers", type=int, default=1, help="sentence-splitting processes (--dataset)")
    p.add_argument("--out", required=True, type=Path, help="vocab.txt (wordpiece) or tokenizer.json (bpe)")
    p.add_argument("--size", required=True, type=int, help="vocabulary size, special tokens included")
    p.add_argument("--kind", choices=("wordpiece", "bpe"), default="wordpiece", help="default: wordpiece")
    case = p.add_mutually_exclusive_group()
    case.add_argument(
        "--lowercase",
        dest="lowercase",
        action="store_true",
        default=None,
        help="lowercase and strip accents (BERT uncased; the wordpiece default)",
    )
    case.add_argument("--cased", dest="lowercase", action="store_false", help="keep case and accents")
    p.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge (default 2)")


def run(args: argparse.Namespace) -> int:
    # on call (start-up time): data.documents and data.text import data.wiki, kept off TEXT_DIR's path
    from data.documents import Source
    from data.text import text_layout  # on call, as data.documents above

    if (args.text_dir is None) == (args.dataset is None):
        raise UserError("give exactly one source: TEXT_DIR or --dataset")
    if args.kind == "bpe" and args.lowercase:
        raise UserError("--lowercase applies to --kind wordpiece only (byte-level BPE is always cased)")
    _check_size(args.size, args.kind)
    source = Source(None if args.text_dir is None else str(args.text_dir), args.dataset, args.text_field, args.split)
    with text_layout(source, Path(args.out).resolve().parent, args.workers) as text_dir:
        if args.kind == "bpe":
            train_bpe(text_dir, args.out, args.size, min_frequency=args.min_frequency)
        else:
            lowercase = True if args.lowercase is None else args.lowercase
            train_wordpiece(text_dir, args.out, args.size, lowercase=lowercase, min_frequency=args.min_frequency)
    print(f"wrote {args.out}", flush=True)
    return 0
