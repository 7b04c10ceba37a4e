"""The HDF5 shard files and their checks, for every format of ``data.formats`` (BERT instances in NVIDIA's
schema, packed GPT windows).

The format records own the schema so the writers (``data.bert``, ``data.gpt``) and the reader (``data.loader``)
cannot drift apart. Shards carry attributes (format, version, vocabulary hash, every setting) so a
loader can refuse a file built for another vocabulary or sequence length, naming the file and both
values. NVIDIA-produced shards (same datasets, no attributes, gzip, int32 or int64) are accepted on
request: what they do not say is inferred from the dataset shapes or treated as unknown.

Format versions. 1: rows chunked by 1,024 (a 64-row read decodes 1,024 rows). 2: rows chunked by the
loader's unit (``UNIT_ROWS``: 64 BERT rows, one GPT window), so a rank reads only the rows it trains on,
and ``manifest.json`` records every shard's size and SHA-256 beside its row count, so a loader needs no
file open to plan and ``python -m data verify`` can check the content. Both are read; ``python -m data
convert`` rewrites version 1 (and NVIDIA's) shards as version 2.

A directory is complete only when its manifest is there: the writers put it in place last.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_write_json
from common.errors import UserError
from common.log import get_logger
from data.formats import BERT, GPT, _View, get_format

log = get_logger("data.h5format")

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SHARD_GLOB = "*.h5"
# Views of the format records (data.formats), by format name
SCHEMAS = _View(lambda f: f.schema)
UNIT_ROWS = _View(lambda f: f.unit_rows)
CONSISTENT_KEYS = _View(lambda f: f.consistent_keys)
BERT_FORMAT, GPT_FORMAT = BERT.format_attr, GPT.format_attr
BERT_SCHEMA, GPT_SCHEMA = dict(BERT.schema), dict(GPT.schema)

# Compression of the shards we write: lzf decodes several times faster than gzip at a similar ratio on
# these small-integer arrays. Rows are chunked by the loader's unit of order (``ShardFormat.unit_rows``, see
# data.loader): a rank's share of a step is whole units, so it decodes no row it does not train on.
COMPRESSION = "lzf"
V1_CHUNK_ROWS = 1024  # what format version 1 used


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


def create_dataset(f: h5py.File, name: str, shape: tuple[int, ...], dtype: str, chunk_rows: int) -> h5py.Dataset:
    """Chunked by ``chunk_rows`` rows (``UNIT_ROWS`` of the kind), lzf compressed."""
    rows = max(1, min(chunk_rows, shape[0]))
    chunks = (rows, *shape[1:]) if shape[0] > 0 else None
    return f.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks, compression=COMPRESSION if chunks else None)


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
    fmt = get_format(kind)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"{path}: not a readable HDF5 file ({e})") from None
    with f:
        rows = None
        shapes = {}
        for name, (rank, _, accepted, _, _) in fmt.schema.items():
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
                raise UserError(f"{path}: dataset {name!r} has {ds.shape[0]} rows, {fmt.lead} has {rows}")
            shapes[name] = ds.shape
        attrs = {k: _attr(v) for k, v in f.attrs.items()}
    has_attrs = "format" in attrs
    if has_attrs and attrs["format"] != fmt.format_attr:
        raise UserError(f"{path}: attribute format={attrs['format']!r}, expected {fmt.format_attr!r}")
    if has_attrs and int(attrs.get("format_version", 0)) > FORMAT_VERSION:
        raise UserError(
            f"{path}: format_version={attrs['format_version']} is newer than this reader "
            f"({FORMAT_VERSION}); update the code"
        )
    # Shapes are the truth for the lengths; a disagreeing attribute means a damaged or hand-edited file.
    inferred = fmt.infer(shapes)
    for name, fld in fmt.schema.items():
        want = fld.row_width(inferred["seq_len"], inferred.get("max_pred", 0))
        if fld.rank == 2 and shapes[name][1] != want:
            raise UserError(f"{path}: dataset {name!r} is {shapes[name][1]} wide, expected {fld.width}={want}")
    for k, v in inferred.items():
        if k in attrs and int(attrs[k]) != v:
            raise UserError(f"{path}: attribute {k}={attrs[k]} but the datasets' shape implies {v}")
        attrs[k] = v
    return ShardInfo(Path(path), int(rows or 0), attrs, has_attrs)


@dataclass
class ShardEntry:
    """One shard as its manifest records it (size and hash only from format version 2)."""

    path: Path
    samples: int
    file_bytes: int | None = None
    sha256: str | None = None


@dataclass
class ShardList:
    """A data set's shards and what is known of them before any is opened.

    ``manifest`` is None for shards read without one (``require_manifest=False``); their counts and
    attributes then come from opening every file. ``data_id`` identifies the data set (shard names,
    counts, sizes, hashes and settings), so a checkpoint can tell it was taken on other data.
    """

    where: str
    kind: str
    entries: list[ShardEntry]
    attrs: dict[str, Any]
    chunk_rows: int | None
    manifest: Path | None
    version: int

    @property
    def files(self) -> list[Path]:
        return [e.path for e in self.entries]

    @property
    def counts(self) -> list[int]:
        return [e.samples for e in self.entries]

    @property
    def data_id(self) -> str:
        listing = [[e.path.name, e.samples, e.file_bytes, e.sha256] for e in self.entries]
        blob = json.dumps([listing, self.attrs], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()


def _no_manifest(where: str) -> UserError:
    return UserError(
        f"{where}: no {MANIFEST}. A directory written by `python -m data bert|gpt` is complete only when its "
        "manifest is there (the writer puts it in place last), so this one was interrupted: run the command "
        "again with --overwrite. Shards made elsewhere (NVIDIA's): run `python -m data convert`, or set "
        "data.require_manifest=false to read them as they are"
    )


def read_manifest(directory: Path, kind: str) -> ShardList:
    """Parse ``directory/manifest.json`` (no shard is opened); errors name the manifest."""
    man = directory / MANIFEST
    expected, count_key = get_format(kind).format_attr, get_format(kind).count_key
    try:
        data = json.loads(man.read_text())
        fmt, version = data["format"], int(data.get("format_version", 1))
        settings = dict(data.get("settings", {}))
        entries = []
        for rec in data["shards"]:
            samples = rec[count_key] if count_key in rec else rec["samples"] if "samples" in rec else rec["instances"]
            entries.append(ShardEntry(directory / rec["file"], int(samples), rec.get("file_bytes"), rec.get("sha256")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{man}: not a valid shard manifest ({type(e).__name__}: {e})") from None
    if fmt != expected:
        raise UserError(f"{man}: format {fmt!r}, expected {expected!r} for {kind} shards")
    if version > FORMAT_VERSION:
        raise UserError(
            f"{man}: format_version={version} is newer than this reader ({FORMAT_VERSION}); update the code"
        )
    if not entries:
        raise UserError(f"{man}: lists no shards")
    chunk_rows = data.get("chunk_rows") or (V1_CHUNK_ROWS if version == 1 else None)
    attrs = {"format": fmt, "format_version": version, **settings}
    return ShardList(str(man), kind, entries, attrs, chunk_rows, man, version)


def glob_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob(SHARD_GLOB)) + sorted(p.glob("*.hdf5"))
        if not files:
            raise UserError(f"{p}: no .h5/.hdf5 shards (and no {MANIFEST}) in this directory")
        return files
    if p.is_file():
        return [p]
    files = sorted(Path(x) for x in glob.glob(str(path)) if Path(x).is_file())
    if not files:
        raise UserError(f"{path}: no such shard file, directory or glob match")
    return files


def list_shards(path: str | os.PathLike, kind: str, *, require_manifest: bool = True) -> ShardList:
    """The shards under ``path``: a directory with ``manifest.json`` (nothing opened), or, only with
    ``require_manifest=False``, a directory of ``*.h5``/``*.hdf5``, one file or a glob (every file opened
    and checked, as shards made elsewhere carry no manifest)."""
    fmt = get_format(kind)
    p = Path(path)
    if p.is_dir() and (p / MANIFEST).exists():
        return read_manifest(p, kind)
    if require_manifest:
        if p.is_dir() or p.is_file():
            raise _no_manifest(str(p))
        glob_files(path)  # a missing path or an empty glob says so first
        raise _no_manifest(str(path))
    infos = [inspect_shard(f, kind) for f in glob_files(path)]
    attrs = check_consistent(infos, fmt.consistent_keys)
    entries = [ShardEntry(i.path, i.num_samples) for i in infos]
    with h5py.File(infos[0].path, "r") as f:
        chunks = f[fmt.lead].chunks
    version = int(attrs.get("format_version", 0) or 0)
    return ShardList(str(path), kind, entries, attrs, chunks[0] if chunks else None, None, version)


def check_listed(shards: ShardList) -> None:
    """Cheap start-up check of a manifest's shards: each exists and has the recorded size (a stat per
    shard, no open). Version 1 manifests record no size: existence only."""
    for e in shards.entries:
        try:
            size = e.path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{shards.where}: lists shard {e.path} which does not exist") from None
        if e.file_bytes is not None and size != e.file_bytes:
            raise UserError(
                f"{e.path}: {size} bytes but {shards.where} records {e.file_bytes}: the shard was changed or "
                f"truncated after it was written; check with `python -m data verify {e.path.parent}`"
            )


def check_shard(shards: ShardList, i: int) -> ShardInfo:
    """Open shard ``i`` and check it against its manifest: schema, row count and the settings."""
    e = shards.entries[i]
    info = inspect_shard(e.path, shards.kind)
    if info.num_samples != e.samples:
        raise UserError(f"{e.path}: {info.num_samples} rows but {shards.where} records {e.samples}")
    if shards.manifest is not None:
        for k in get_format(shards.kind).consistent_keys:
            a, b = shards.attrs.get(k), info.attrs.get(k)
            if a is not None and b is not None and str(a) != str(b):
                raise UserError(f"{e.path}: attribute {k}={b!r} but {shards.where} says {a!r}")
    return info


def chunk_rows_of(f: h5py.File, kind: str) -> int | None:
    chunks = f[get_format(kind).lead].chunks
    return int(chunks[0]) if chunks else None


def shard_record(path: str | os.PathLike) -> dict[str, Any]:
    """What a version-2 manifest records of a written shard beside its counts: size and SHA-256."""
    return {"file_bytes": os.path.getsize(path), "sha256": sha256_file(path)}


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


def write_manifest(out: Path, kind: str, shards: list[dict[str, Any]], settings: Mapping[str, Any]) -> dict[str, int]:
    """``manifest.json``: the shard list with sample counts, the settings and totals (written atomically).

    Returns the totals: every integer field of the shard records summed."""
    totals: dict[str, int] = {}
    for s in shards:
        for k, v in s.items():
            if isinstance(v, int) and k not in ("index", "file_bytes"):
                totals[k] = totals.get(k, 0) + v
    atomic_write_json(
        out / MANIFEST,
        {
            "format": get_format(kind).format_attr,
            "format_version": FORMAT_VERSION,
            "chunk_rows": get_format(kind).unit_rows,
            "settings": dict(settings),
            "shards": shards,
            "totals": totals,
        },
    )
    return totals
