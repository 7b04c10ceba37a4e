"""One document reader for every builder (``data text``, ``data bert``, ``data vocab``, ``data gpt``).

A source is one of:

* ``--text``: NVIDIA's layout (``python -m data wiki``'s output): one sentence per line, a blank line
  between documents, in ``.txt`` files (a file or a directory searched recursively);
* ``--dataset``: local files, never a hub, read with ``pyarrow`` in record batches (memory flat):
  parquet, JSON lines (``.jsonl``/``.json``), csv, Arrow (``.arrow``, IPC file or stream) and ``.txt``
  (one document per line), given as a file, a directory or a glob, all of one type; a directory written
  by ``Dataset.save_to_disk`` (it holds ``state.json`` or ``dataset_info.json``; a ``DatasetDict``'s
  holds ``dataset_dict.json`` and ``--split`` picks one); or MediaWiki ``.xml.bz2`` dumps (multistream
  too), read by ``data.wiki``'s streaming parser.

Each :class:`Document` carries its text in one of three forms, which :func:`document_sentences` turns
into the text layout's sentences the same way for every builder:

* ``lines``: the text layout's, one sentence per line;
* ``paragraphs``: plain text as Hugging Face's ``wikimedia/wikipedia`` holds it, paragraphs separated
  by blank lines: each line is split into sentences by ``data.textclean.split_sentences``, and a line
  that looks like a heading (a few words, no sentence-final punctuation) is dropped, as ``data wiki``
  drops headings;
* ``wikitext``: a dump's article, cleaned by ``data.textclean`` first.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import UserError
from data.textclean import clean_wikitext, is_disambiguation, split_sentences
from data.tokenize_text import list_text_files
from data.wiki import _check_bz2, iter_pages

# dataset file suffix -> how it is read
DATASET_TYPES = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
    ".bz2": "dump",
}
SAVED_MARKERS = ("state.json", "dataset_info.json")  # Dataset.save_to_disk's directory
SAVED_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk's directory
BATCH_ROWS = 1024
INSTALL = "pip install 'wikipretrain[datasets]'"
# A line of ``paragraphs`` text with at most this many words and no sentence-final punctuation is a heading.
HEADING_WORDS = 8
_FINAL = ".!?…:;。！？｡।؟"
_CLOSERS = "\"'”’»)]」』）】》〉"
FORMS = ("lines", "paragraphs", "wikitext")


@dataclass(frozen=True)
class Document:
    """One document: its text in ``form`` (one of ``FORMS``), and its id and title where the source has
    them."""

    text: str
    form: str
    id: str | None = None
    title: str | None = None


def is_heading(line: str) -> bool:
    """A few words without sentence-final punctuation: a section heading of plain article text."""
    end = line.rstrip(_CLOSERS)
    return not end or (end[-1] not in _FINAL and len(line.split()) <= HEADING_WORDS)


def paragraph_sentences(text: str) -> list[str]:
    """Plain text (paragraphs separated by blank lines) -> sentences; heading lines dropped."""
    out: list[str] = []
    for line in text.split("\n"):
        s = " ".join(line.split())  # all Unicode spaces -> one ASCII space, as data.textclean tidies
        if s and not is_heading(s):
            out.extend(split_sentences(s))
    return out


def document_sentences(doc: Document, keep_disambiguation: bool = False) -> list[str]:
    """A document's sentences in the text layout (one per line, none empty); [] when nothing is left."""
    if doc.form == "lines":
        return [s for s in (ln.strip() for ln in doc.text.split("\n")) if s]
    if doc.form == "paragraphs":
        return paragraph_sentences(doc.text)
    if not keep_disambiguation and is_disambiguation(doc.title or "", doc.text):
        return []
    return [s for p in clean_wikitext(doc.text).split("\n\n") for s in split_sentences(p)]


def document_text(doc: Document) -> str:
    """A document as one string for a builder that reads running text (``data gpt``): ``paragraphs`` as
    they are, the sentences of the other forms joined by single spaces (the text layout's documents)."""
    if doc.form == "paragraphs":
        return doc.text
    return " ".join(document_sentences(doc))


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where documents come from: exactly one of ``text`` (NVIDIA's layout) and ``dataset`` (local files
    or a saved dataset); ``text_field`` names the field holding a record's text, ``split`` a saved
    ``DatasetDict``'s split."""

    text: str | None = None
    dataset: str | None = None
    text_field: str = "text"
    split: str = "train"

    def __post_init__(self) -> None:
        if (self.text is None) == (self.dataset is None):
            raise UserError("give exactly one source: --text or --dataset")

    @property
    def name(self) -> str:
        return str(self.text if self.text is not None else self.dataset)

    def documents(self) -> Iterator[Document]:
        """Every document of the source, in order; one-line ``UserError`` naming the file on bad input."""
        if self.text is not None:
            return text_layout_documents(self.text)
        assert self.dataset is not None
        return dataset_documents(self.dataset, self.text_field, self.split)

    def check(self) -> None:
        """Fail before anything is written: a missing path, an unreadable file, a missing field, no text."""
        if next(iter(self.documents()), None) is None:
            where = f" with text in field {self.text_field!r}" if self.dataset is not None else ""
            raise UserError(f"{self.name}: empty dataset (no records{where})")


def add_source_arguments(p: argparse.ArgumentParser, required: bool = True) -> argparse._MutuallyExclusiveGroup:
    """``--text`` / ``--dataset`` (exclusive), ``--text-field`` and ``--split``: every builder's source flags."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--text", help="text dir (or .txt file) in NVIDIA's layout: one sentence per line")
    src.add_argument(
        "--dataset",
        help="local parquet/jsonl/json/csv/arrow/txt file, directory or glob, a save_to_disk directory, or "
        ".xml.bz2 dump(s)",
    )
    p.add_argument("--text-field", default="text", help="record field holding the document's text (--dataset)")
    p.add_argument("--split", default="train", help="split of a saved DatasetDict directory (--dataset)")
    return src


def source_from_args(args: argparse.Namespace) -> Source:
    return Source(args.text, args.dataset, args.text_field, args.split)


def text_layout_documents(text: str | os.PathLike) -> Iterator[Document]:
    """The documents of NVIDIA-layout text: a blank line or a file's end closes a document."""
    for f in list_text_files(text):
        cur: list[str] = []
        try:
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    s = line.strip()
                    if s:
                        cur.append(s)
                    elif cur:
                        yield Document("\n".join(cur), "lines")
                        cur = []
        except UnicodeDecodeError as e:
            raise UserError(f"{f}: not UTF-8 text ({e.reason})") from None
        if cur:
            yield Document("\n".join(cur), "lines")


# --------------------------------------------------------------------------------------------------
# Local datasets
# --------------------------------------------------------------------------------------------------


def _pyarrow() -> Any:
    try:
        import pyarrow  # on call: optional (the [datasets] extra)
    except ImportError:
        raise UserError(f"--dataset needs the optional 'pyarrow' package: {INSTALL}") from None
    return pyarrow


def _saved_files(d: Path, split: str) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory (a ``DatasetDict``'s: of ``split``)."""
    if (d / SAVED_DICT).is_file():
        try:
            splits = list(json.loads((d / SAVED_DICT).read_text())["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{d / SAVED_DICT}: not a saved DatasetDict ({type(e).__name__}: {e})") from None
        if split not in splits:
            raise UserError(f"{d}: saved DatasetDict has no split {split!r} (splits: {', '.join(splits)}); use --split")
        d = d / split
    state = d / "state.json"
    if not state.is_file():
        raise UserError(f"{d}: a saved dataset directory without state.json (write it with Dataset.save_to_disk)")
    try:
        names = [rec["filename"] for rec in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{state}: not a saved dataset's state ({type(e).__name__}: {e})") from None
    files = [d / n for n in names]
    for f in files:
        if not f.is_file():
            raise UserError(f"{state}: lists {f.name}, which does not exist")
    if not files:
        raise UserError(f"{state}: lists no data files")
    return files


def dataset_files(spec: str, split: str = "train") -> tuple[str, list[Path]]:
    """(type, files) of a ``--dataset`` spec: a file, a directory, a glob, or a saved dataset directory."""
    p = Path(spec)
    if p.is_dir() and ((p / SAVED_DICT).is_file() or any((p / m).is_file() for m in SAVED_MARKERS)):
        return "saved", _saved_files(p, split)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and f.suffix in DATASET_TYPES and not any(s.startswith(".") for s in f.relative_to(p).parts)
        )
        if not files:
            raise UserError(f"{spec}: no dataset files in this directory (types: {', '.join(DATASET_TYPES)})")
    else:
        files = sorted(Path(f) for f in glob.glob(spec) if Path(f).is_file())
        if not files:
            raise UserError(f"{spec}: no such dataset file, directory or glob match")
    bad = [f for f in files if f.suffix not in DATASET_TYPES]
    if bad:
        raise UserError(f"{bad[0]}: unsupported dataset file type (use {', '.join(DATASET_TYPES)})")
    kinds = sorted({DATASET_TYPES[f.suffix] for f in files})
    if len(kinds) > 1:
        raise UserError(f"{spec}: mixes dataset file types ({', '.join(kinds)}); give one type at a time")
    return kinds[0], files


def _check_field(f: Path, schema: Any, field: str) -> list[str]:
    """The columns to read (the text, and id/title when there): one line naming the file when ``field``
    is missing or not text."""
    pa = _pyarrow()
    names = list(schema.names)
    if field not in names:
        raise UserError(f"{f}: no field {field!r} (fields: {', '.join(names) or 'none'}); use --text-field")
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
        raise UserError(f"{f}: field {field!r} holds {typ}, not text; use --text-field to name the text")
    return [field] + [c for c in ("id", "title") if c in names and c != field]


def _json_batches(f: Path) -> Iterator[Any]:
    """Record batches of a JSON file: JSON lines streamed by pyarrow, or one JSON array of records."""
    pa = _pyarrow()
    import pyarrow.json as pj  # on call: optional (the [datasets] extra)

    with open(f, "rb") as fh:
        head = fh.read(4096).lstrip()
    if not head:
        return  # an empty file: no records
    if head.startswith(b"["):
        try:
            rows = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{f}: not valid JSON ({e})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise UserError(f"{f}: a JSON array of records (objects) is needed")
        yield pa.Table.from_pylist(rows).to_batches(BATCH_ROWS) if rows else []
        return
    yield pj.open_json(f, read_options=pj.ReadOptions(block_size=1 << 22))


def _batch_readers(kind: str, f: Path, field: str) -> Iterator[Any]:
    """Iterables of record batches for one file (pyarrow objects)."""
    pa = _pyarrow()
    if kind == "parquet":
        import pyarrow.parquet as pq  # on call: optional (the [datasets] extra)

        pf = pq.ParquetFile(f)
        cols = _check_field(f, pf.schema_arrow, field)
        yield pf.iter_batches(batch_size=BATCH_ROWS, columns=cols)
    elif kind == "json":
        yield from _json_batches(f)
    elif kind == "csv":
        import pyarrow.csv as pc  # on call: optional (the [datasets] extra)

        yield pc.open_csv(
            f,
            parse_options=pc.ParseOptions(newlines_in_values=True),
            convert_options=pc.ConvertOptions(column_types={field: pa.string()}, strings_can_be_null=True),
        )
    elif kind in ("arrow", "saved"):
        source = pa.memory_map(str(f))
        try:
            yield pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            yield pa.ipc.open_stream(source)


def _batches(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "num_record_batches"):  # an IPC file: random access
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _file_documents(kind: str, f: Path, field: str) -> Iterator[Document]:
    pa = _pyarrow()
    for reader in _batch_readers(kind, f, field):
        checked = False
        for batch in _batches(reader):
            if not checked:
                _check_field(f, batch.schema, field)
                checked = True
            texts = batch.column(field).to_pylist()
            ids = batch.column("id").cast(pa.string()).to_pylist() if "id" in batch.schema.names else None
            titles = batch.column("title").to_pylist() if "title" in batch.schema.names else None
            for i, t in enumerate(texts):
                if t:
                    yield Document(t, "paragraphs", ids[i] if ids else None, titles[i] if titles else None)


def _text_documents(f: Path) -> Iterator[Document]:
    """A ``.txt`` dataset file: one document per line (as ``datasets``' text builder reads it)."""
    try:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield Document(line.rstrip("\n"), "paragraphs")
    except UnicodeDecodeError as e:
        raise UserError(f"{f}: not UTF-8 text ({e.reason})") from None


def _dump_documents(f: Path) -> Iterator[Document]:
    """A MediaWiki dump's articles (main namespace, no redirects) as wikitext."""
    _check_bz2(f)
    for page in iter_pages(f):
        if page.ns == 0 and not page.redirect:
            yield Document(page.text, "wikitext", None, page.title)


def dataset_documents(spec: str, field: str = "text", split: str = "train") -> Iterator[Document]:
    """Stream the documents of local dataset files (records without text are skipped)."""
    kind, files = dataset_files(spec, split)
    for f in files:
        if kind == "text":
            yield from _text_documents(f)
            continue
        if kind == "dump":
            yield from _dump_documents(f)
            continue
        pa = _pyarrow()
        try:
            yield from _file_documents(kind, f, field)
        except (pa.ArrowException, OSError, ValueError) as e:
            what = "a saved dataset's Arrow file" if kind == "saved" else kind
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"{f}: cannot read as {what} ({first})") from None
