"""The HDF5 shard formats (BERT instances in NVIDIA's schema, packed GPT windows) and their checks.

One module owns the schema so the writers (``data.bert``, ``data.gpt``) and the reader (``data.loader``)
cannot drift apart. Shards carry attributes (format, version, vocabulary hash, every setting) so a
loader can refuse a file built for another vocabulary or sequence length, naming the file and both
values. NVIDIA-produced shards (same datasets, no attributes, gzip, int32 or int64) are accepted:
what they do not say is inferred from the dataset shapes or treated as unknown.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from common.atomic import atomic_write_json
from common.errors import UserError
from common.log import get_logger

log = get_logger("data.h5format")

BERT_FORMAT = "wikipretrain-bert"
GPT_FORMAT = "wikipretrain-gpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_GLOB = "*.h5"


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


_INTS = ("i1", "i2", "i4", "i8", "u1", "u2", "u4")
# NVIDIA's dataset names, in the order its reader lists them
BERT_SCHEMA: dict[str, Field] = {
    "input_ids": Field(2, "i4", _INTS, "seq_len"),
    "input_mask": Field(2, "i1", _INTS, "seq_len", "attention_mask"),
    "segment_ids": Field(2, "i1", _INTS, "seq_len", "token_type_ids"),
    "masked_lm_positions": Field(2, "i4", _INTS, "max_pred"),
    "masked_lm_ids": Field(2, "i4", _INTS, "max_pred"),
    "next_sentence_labels": Field(1, "i1", _INTS),
}
# Megatron / GPT-NeoX packing: seq_len + 1 tokens per sample (inputs [:-1], targets [1:])
GPT_SCHEMA: dict[str, Field] = {"input_ids": Field(2, "i4", ("u2", "i4", "i8", "u4"), "seq_len+1")}
SCHEMAS = {"bert": BERT_SCHEMA, "gpt": GPT_SCHEMA}

# Compression of the shards we write. The loader reads contiguous blocks of rows; with several data-
# parallel ranks each reads whole blocks and keeps its own rows, so decode speed matters more than disk.
# lzf decodes several times faster than gzip at a similar ratio on these small-integer arrays.
COMPRESSION = "lzf"
CHUNK_ROWS = 1024


def sha256_file(path: str | os.PathLike) -> str:
    """Hash of a vocabulary/tokenizer file: shards record it so a mismatched vocabulary is caught."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_attrs(f: h5py.File, attrs: Mapping[str, Any]) -> None:
    for k, v in attrs.items():
        f.attrs[k] = "" if v is None else v


def create_dataset(f: h5py.File, name: str, shape: tuple[int, ...], dtype: str) -> h5py.Dataset:
    """Chunked by rows (``CHUNK_ROWS``) so block reads touch few chunks; lzf compressed."""
    rows = max(1, min(CHUNK_ROWS, shape[0]))
    chunks = (rows, *shape[1:]) if shape[0] > 0 else None
    return f.create_dataset(
        name, shape=shape, dtype=dtype, chunks=chunks, compression=COMPRESSION if chunks else None
    )


def _attr(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v


@dataclass
class ShardInfo:
    """What a shard says about itself (attributes) plus what its shapes imply."""

    path: Path
    num_samples: int
    attrs: dict[str, Any] = field(default_factory=dict)
    has_attrs: bool = True


def inspect_shard(path: Path, kind: str) -> ShardInfo:
    """Open a shard, check its schema (datasets, rank, dtype, consistent rows) and infer settings.

    Raises UserError naming the file and the problem.
    """
    if kind not in SCHEMAS:
        raise UserError(f"unknown shard kind {kind!r} (expected 'bert' or 'gpt')")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"{path}: not a readable HDF5 file ({e})") from None
    with f:
        rows = None
        shapes = {}
        for name, (rank, _, accepted, _, _) in SCHEMAS[kind].items():
            if name not in f:
                raise UserError(f"{path}: missing dataset {name!r} (not a {kind} pre-training shard)")
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or ds.ndim != rank:
                raise UserError(
                    f"{path}: dataset {name!r} has shape {getattr(ds, 'shape', None)}, expected rank {rank}"
                )
            if ds.dtype.str[1:] not in accepted:
                raise UserError(f"{path}: dataset {name!r} has dtype {ds.dtype}, expected an integer type")
            if rows is None:
                rows = ds.shape[0]
            elif ds.shape[0] != rows:
                raise UserError(f"{path}: dataset {name!r} has {ds.shape[0]} rows, input_ids has {rows}")
            shapes[name] = ds.shape
        attrs = {k: _attr(v) for k, v in f.attrs.items()}
    has_attrs = "format" in attrs
    expected_format = BERT_FORMAT if kind == "bert" else GPT_FORMAT
    if has_attrs and attrs["format"] != expected_format:
        raise UserError(f"{path}: attribute format={attrs['format']!r}, expected {expected_format!r}")
    if has_attrs and int(attrs.get("format_version", 0)) > FORMAT_VERSION:
        raise UserError(
            f"{path}: format_version={attrs['format_version']} is newer than this reader "
            f"({FORMAT_VERSION}); update the code"
        )
    # Shapes are the truth for the lengths; a disagreeing attribute means a damaged or hand-edited file.
    if kind == "bert":
        inferred = {"seq_len": shapes["input_ids"][1], "max_pred": shapes["masked_lm_positions"][1]}
    else:
        inferred = {"seq_len": shapes["input_ids"][1] - 1}
    for name, fld in SCHEMAS[kind].items():
        want = fld.row_width(inferred["seq_len"], inferred.get("max_pred", 0))
        if fld.rank == 2 and shapes[name][1] != want:
            raise UserError(
                f"{path}: dataset {name!r} is {shapes[name][1]} wide, expected {fld.width}={want}"
            )
    for k, v in inferred.items():
        if k in attrs and int(attrs[k]) != v:
            raise UserError(f"{path}: attribute {k}={attrs[k]} but the datasets' shape implies {v}")
        attrs[k] = v
    return ShardInfo(Path(path), int(rows or 0), attrs, has_attrs)


def resolve_shards(path: str | os.PathLike) -> list[Path]:
    """A directory (manifest.json or ``*.h5``), a single ``.h5`` file, or a glob -> sorted shard paths."""
    p = Path(path)
    if p.is_dir():
        man = p / MANIFEST
        if man.exists():
            try:
                data = json.loads(man.read_text())
                files = [p / s["file"] for s in data["shards"]]
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{man}: not a valid shard manifest ({e})") from None
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise UserError(f"{man}: lists shard {missing[0]} which does not exist")
            return files
        files = sorted(p.glob(SHARD_GLOB))
        files += sorted(x for x in p.glob("*.hdf5"))
        if not files:
            raise UserError(f"{p}: no .h5/.hdf5 shards (and no {MANIFEST}) in this directory")
        return files
    if p.is_file():
        return [p]
    files = sorted(Path(x) for x in glob.glob(str(path)) if Path(x).is_file())
    if not files:
        raise UserError(f"{path}: no such shard file, directory or glob match")
    return files


def check_expect(attrs: Mapping[str, Any], expect: Mapping[str, Any] | None, where: str) -> None:
    """``expect`` holds what the caller needs (seq_len, vocab_sha256, ...); known mismatches are errors."""
    for k, want in (expect or {}).items():
        have = attrs.get(k)
        if have is None or have == "":
            continue  # unknown (e.g. an NVIDIA shard without attributes): warned about on open
        if str(have) != str(want):
            raise UserError(f"{where}: attribute {k}={have!r} but expected {want!r}")


def check_consistent(infos: Iterable[ShardInfo], keys: Iterable[str]) -> dict[str, Any]:
    """All shards must agree on the settings that define a sample; returns the common attributes."""
    infos = list(infos)
    first = infos[0]
    keys = list(keys)
    for info in infos[1:]:
        for k in keys:
            a, b = first.attrs.get(k), info.attrs.get(k)
            if a is not None and b is not None and str(a) != str(b):
                raise UserError(f"{info.path}: attribute {k}={b!r} differs from {first.path.name} ({a!r})")
    common = dict(first.attrs)
    for info in infos[1:]:
        for k in list(common):
            if str(info.attrs.get(k)) != str(common[k]):
                common.pop(k)  # per-shard values (source file, instance count) are not common
    return common


def write_manifest(
    out: Path, kind: str, shards: list[dict[str, Any]], settings: Mapping[str, Any]
) -> dict[str, int]:
    """``manifest.json``: the shard list with sample counts, the settings and totals (written atomically).

    Returns the totals: every integer field of the shard records summed."""
    totals: dict[str, int] = {}
    for s in shards:
        for k, v in s.items():
            if isinstance(v, int) and k != "index":
                totals[k] = totals.get(k, 0) + v
    atomic_write_json(
        out / MANIFEST,
        {
            "format": BERT_FORMAT if kind == "bert" else GPT_FORMAT,
            "format_version": FORMAT_VERSION,
            "settings": dict(settings),
            "shards": shards,
            "totals": totals,
        },
    )
    return totals
