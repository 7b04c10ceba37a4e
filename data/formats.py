"""The shard formats, one record each, in one registry: what ``data.h5format``, ``data.convert``,
``data.verify`` and the loader ask instead of comparing format names.

A record (:class:`ShardFormat`) holds a format's datasets with their dtypes and widths (``schema``), its
attributes (the ``format`` string, the keys every shard of a data set must agree on), its tokenizer (kind, the
attribute holding its identity, the ``data convert`` flag that names it, the attributes it contributes), whether
it has ``max_pred``, its convert hooks (output dtypes, which datasets hold token ids) and how ``data convert``
recognises its shards. The names ``bert`` and ``gpt`` are the registry's keys and stay on disk (manifests, the
loader state in checkpoints). A new format is one record, registered with :func:`register_format` (the module
that defines it may come from outside the package: :func:`load_formats`), and its builder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from common.errors import UserError
from common.plugins import load_records


class Field(NamedTuple):
    """One dataset of a shard: how it is written, what a reader accepts, and what the loader calls it."""

    rank: int
    dtype: str  # written by our shard writers
    accepted: tuple[str, ...]  # dtypes read: NVIDIA writes int32/int8, TF-converted shards int64
    width: str = ""  # the setting giving a row's width: "seq_len", "max_pred", "seq_len+1"; "" for one value
    batch_key: str = ""  # key in the loader's micro-batches (transformers' names); "" for the dataset name

    def row_width(self, seq_len: int, max_pred: int = 0) -> int:
        return {"": 1, "seq_len": seq_len, "max_pred": max_pred, "seq_len+1": seq_len + 1}[self.width]

    def key(self, name: str) -> str:
        return self.batch_key or name


@dataclass(frozen=True)
class ShardFormat:
    """Everything that differs between shard formats, in one record."""

    name: str
    """Registry key; on disk in the loader state checkpoints hold (``bert``, ``gpt``)."""
    format_attr: str
    """The ``format`` attribute of its shards and manifests (``wikipretrain-bert``)."""
    schema: Mapping[str, Field]
    """Its datasets in packing order (the loader's micro-batch rows), with dtypes and widths."""
    unit_rows: int
    """Rows per HDF5 chunk: the loader's unit of order."""
    consistent_keys: tuple[str, ...]
    """Attributes every shard of a data set must agree on (they define a sample)."""
    tokenizer_kind: str
    """What its tokenizer file is, for messages: ``vocab.txt`` or ``tokenizer.json``."""
    hash_key: str
    """Attribute holding the identity of the tokenizer file (``data.tokenizer.vocab_sha256``)."""
    uses_max_pred: bool
    """Its shards (and the FLOPs of a model on them) depend on ``max_pred``."""
    count_key: str
    """A shard record's row count in the manifest: ``instances`` or ``samples``."""
    tokenizer_flag: str
    """The ``data convert`` flag that names its tokenizer file: ``--vocab`` or ``--tokenizer``."""
    tokenizer_attrs: Callable[[str, bool | None], dict[str, Any]]
    """(tokenizer file, lowercase or None) -> the attributes its shards record of it (hash, size, ...)."""
    tokenizer_keys: tuple[str, ...]
    """The names of those attributes."""
    recognise: Callable[[Any], bool]
    """(an open h5py.File) -> whether it holds this format's shard (``data convert --kind auto``)."""
    token_datasets: tuple[str, ...] = ()
    """Datasets holding token ids, checked against the vocabulary size by ``data convert``."""
    dtypes: Callable[[int], dict[str, str]] | None = None
    """(vocabulary size) -> dtypes ``data convert`` writes where they differ from the schema's."""

    @property
    def lead(self) -> str:
        """Its first dataset: the one a shard's row count and chunking are read from."""
        return next(iter(self.schema))

    def infer(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The lengths the datasets' shapes imply: ``seq_len``, and ``max_pred`` where the format has it."""
        out: dict[str, int] = {}
        for name, fld in self.schema.items():  # the first dataset of each width says it; the others are checked
            if fld.width in ("seq_len", "seq_len+1") and "seq_len" not in out:
                out["seq_len"] = shapes[name][1] - (fld.width == "seq_len+1")
            elif fld.width == "max_pred" and "max_pred" not in out:
                out["max_pred"] = shapes[name][1]
        return out

    def write_dtypes(self, vocab_size: int) -> dict[str, str]:
        return {
            **{name: f.dtype for name, f in self.schema.items()},
            **(self.dtypes(vocab_size) if self.dtypes else {}),
        }


FORMATS: dict[str, ShardFormat] = {}


def register_format(fmt: ShardFormat) -> ShardFormat:
    """Add a format to the registry (a name or ``format`` attribute already taken by another record is refused)."""
    for other in FORMATS.values():
        if other.name != fmt.name and other.format_attr == fmt.format_attr:
            raise UserError(f"shard format {fmt.name!r}: format attribute {fmt.format_attr!r} is {other.name!r}'s")
    if fmt.name in FORMATS and FORMATS[fmt.name] != fmt:
        raise UserError(f"shard format {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> ShardFormat:
    """The record of a format name; one line listing the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise UserError(f"unknown shard format {name!r} (known: {', '.join(FORMATS)})") from None


def format_of_attr(attr: Any) -> ShardFormat | None:
    """The record whose shards carry ``format=attr``, or None."""
    return next((f for f in FORMATS.values() if f.format_attr == attr), None)


def formats() -> Iterator[ShardFormat]:
    return iter(list(FORMATS.values()))


def add_formats_flag(p: Any) -> None:
    """``--formats MODULE...``: a data command that reads shards of a format from outside the package (what
    ``data.formats`` lists at training time) registers the modules named first (``load_formats``)."""
    p.add_argument(
        "--formats",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="modules that define shard formats from outside the package (as data.formats), registered first",
    )


LOADED: list[str] = []
"""The modules ``load_formats`` registered in this process, in order: a writer's worker processes (spawned: they
import the package afresh) register them again as they start (``data.shards.run_shard_jobs``)."""


def load_formats(modules: Iterable[str], setting: str = "data.formats") -> None:
    """The hook by which a format comes in without editing this package: import each named module, which
    defines a ``FORMAT`` record; it is registered. ``setting``: what a module that cannot be loaded is named
    by in the one-line error (the config's ``data.formats``, a command's ``--formats``)."""
    modules = list(modules)
    load_records(modules, setting, "FORMAT", ShardFormat, register_format)
    LOADED.extend(m for m in modules if m not in LOADED)


class _View(Mapping):
    """A read-only mapping of format name -> one field of its record (``h5format.SCHEMAS`` and the like)."""

    def __init__(self, get: Callable[[ShardFormat], Any]) -> None:
        self._get = get

    def __getitem__(self, name: str) -> Any:
        return self._get(FORMATS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(list(FORMATS))

    def __len__(self) -> int:
        return len(FORMATS)


# --------------------------------------------------------------------------------------------------
# The built-in formats
# --------------------------------------------------------------------------------------------------

_INTS = ("i1", "i2", "i4", "i8", "u1", "u2", "u4")


def _bert_tokenizer_attrs(vocab: str, lowercase: bool | None) -> dict[str, Any]:
    # on call (start-up time): tokenizers, which only the writers need
    from data.tokenizer import check_bert_vocab, vocab_sha256

    words = check_bert_vocab(vocab, lowercase)
    return {
        "vocab_sha256": vocab_sha256(vocab),
        "vocab_size": len(words),
        "vocab_file": Path(vocab).name,
        "lowercase": True if lowercase is None else bool(lowercase),
    }


def _gpt_tokenizer_attrs(tokenizer: str, lowercase: bool | None) -> dict[str, Any]:
    from data.tokenizer import load_tokenizer, vocab_sha256  # on call (start-up time): tokenizers

    tok, eod, eod_name = load_tokenizer(tokenizer)
    return {
        "tokenizer_sha256": vocab_sha256(tokenizer),
        "tokenizer_file": Path(tokenizer).name,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eod_id": eod,
        "eod_token": eod_name,
    }


def token_dtype(vocab_size: int) -> str:
    """GPT windows' token dtype: two bytes while the vocabulary fits."""
    return "u2" if vocab_size < 65536 else "i4"


# NVIDIA's dataset names, in the order its reader lists them
BERT = register_format(
    ShardFormat(
        name="bert",
        format_attr="wikipretrain-bert",
        schema={
            "input_ids": Field(2, "i4", _INTS, "seq_len"),
            "input_mask": Field(2, "i1", _INTS, "seq_len", "attention_mask"),
            "segment_ids": Field(2, "i1", _INTS, "seq_len", "token_type_ids"),
            "masked_lm_positions": Field(2, "i4", _INTS, "max_pred"),
            "masked_lm_ids": Field(2, "i4", _INTS, "max_pred"),
            "next_sentence_labels": Field(1, "i1", _INTS),
        },
        # 64 rows (~60 KB decoded over the six datasets; the per-rank share of NVIDIA's phase-1 batch at 1,024 ranks)
        unit_rows=64,
        consistent_keys=("seq_len", "max_pred", "vocab_sha256", "vocab_size", "lowercase"),
        tokenizer_kind="vocab.txt",
        hash_key="vocab_sha256",
        uses_max_pred=True,
        count_key="instances",
        tokenizer_flag="--vocab",
        tokenizer_attrs=_bert_tokenizer_attrs,
        tokenizer_keys=("vocab_sha256", "vocab_size", "vocab_file", "lowercase"),
        recognise=lambda f: "masked_lm_positions" in f,
        token_datasets=("input_ids", "masked_lm_ids"),
    )
)
# Megatron / GPT-NeoX packing: seq_len + 1 tokens per sample (inputs [:-1], targets [1:])
GPT = register_format(
    ShardFormat(
        name="gpt",
        format_attr="wikipretrain-gpt",
        schema={"input_ids": Field(2, "i4", ("u2", "i4", "i8", "u4"), "seq_len+1")},
        unit_rows=1,  # one window (2,049 tokens): any rank count down to one window per rank
        consistent_keys=("seq_len", "tokenizer_sha256", "vocab_size", "eod_id"),
        tokenizer_kind="tokenizer.json",
        hash_key="tokenizer_sha256",
        uses_max_pred=False,
        count_key="samples",
        tokenizer_flag="--tokenizer",
        tokenizer_attrs=_gpt_tokenizer_attrs,
        tokenizer_keys=("tokenizer_sha256", "tokenizer_file", "vocab_size", "eod_id", "eod_token"),
        recognise=lambda f: "input_ids" in f and "masked_lm_positions" not in f,
        token_datasets=("input_ids",),
        dtypes=lambda vocab_size: {"input_ids": token_dtype(vocab_size)},
    )
)
