"""``python -m data verify DIR``: check a shard directory against its ``manifest.json`` in full.

Every listed shard must exist with the recorded size, open as an HDF5 file of the manifest's kind with
the recorded row count and settings, and hash to the recorded SHA-256 (format version 2; version 1
manifests record no hashes, which is said). The loader does the cheap part of this at every start-up
(sizes, and one open per shard per job); this reads every byte, so it is a separate, explicit step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.errors import UserError
from data import h5format
from data.formats import add_formats_flag, format_of_attr, formats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="shard directory with manifest.json (python -m data bert|gpt|convert)")
    p.add_argument("--no-progress", action="store_true")
    add_formats_flag(p)


def manifest_kind(directory: Path) -> str:
    """The format's name (``bert``, ``gpt``), from the manifest's format attribute (errors name the manifest)."""
    man = directory / h5format.MANIFEST
    if not man.is_file():
        raise UserError(f"{directory}: no {h5format.MANIFEST}; nothing to verify against")
    try:
        fmt = json.loads(man.read_text()).get("format")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{man}: not a valid shard manifest ({e})") from None
    record = format_of_attr(fmt)
    if record is None:
        known = ", ".join(f.format_attr for f in formats())
        raise UserError(
            f"{man}: format {fmt!r} is not a shard format ({known}); a format from outside the package: "
            "--formats MODULE"
        )
    return record.name


def verify_shards(path: str | Path, progress: bool | None = False) -> dict[str, Any]:
    """Check every shard of ``path`` against its manifest; raises ``UserError`` naming the first bad
    shard. Returns a summary: shards, samples, bytes, and whether hashes were checked."""
    directory = Path(path)
    shards = h5format.read_manifest(directory, manifest_kind(directory))
    h5format.check_listed(shards)
    hashed = all(e.sha256 for e in shards.entries)
    total = sum(e.path.stat().st_size for e in shards.entries)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="verify",
        disable=None if progress is None else not progress,
    ) as bar:
        for i, e in enumerate(shards.entries):
            h5format.check_shard(shards, i)
            if e.sha256:
                got = h5format.sha256_file(e.path)
                if got != e.sha256:
                    raise UserError(
                        f"{e.path}: SHA-256 {got[:16]}... but {shards.where} records {e.sha256[:16]}...: the "
                        "content changed after it was written; rebuild the directory or restore the shard"
                    )
            bar.update(e.path.stat().st_size)
    return {
        "dir": str(directory),
        "kind": shards.kind,
        "shards": len(shards.entries),
        "samples": sum(shards.counts),
        "mib": total / 2**20,
        "checked": "sizes, schema, row counts and SHA-256"
        if hashed
        else "sizes, schema and row counts (format version 1 records no hashes: `python -m data convert` "
        "rewrites it as version 2)",
    }


REPORT = "verify: {dir}: {shards} {kind} shard(s), {samples} samples, {mib:.1f} MiB: {checked} match the manifest"


def run(args: argparse.Namespace) -> int:
    summary = verify_shards(args.dir, progress=False if args.no_progress else None)
    print(REPORT.format(**summary), flush=True)
    return 0
