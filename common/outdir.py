"""Output directories of the data commands: one rule for ``--overwrite``.

A run refuses a directory that holds anything but its own leftover temporaries unless ``--overwrite``.
With it, the previous output stays until the new one is complete (a failed rerun loses nothing): each new
file replaces its namesake atomically (``common.atomic``), and only after success does ``remove_stale``
delete the previous run's outputs that the new run did not write (a rerun with fewer shards). Files that are
not outputs of the command (a README the user keeps there) are never deleted.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from common.errors import UserError


def is_temporary(path: Path) -> bool:
    """A file or directory that ``common.atomic.atomic_path`` left behind when its writer was killed."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def prepare_out_dir(out: Path, overwrite: bool) -> bool:
    """Make ``out`` ready to write into; return True when it was created here (remove it again on failure).

    Leftover temporaries of an interrupted run are removed. Anything else makes a one-line ``UserError``
    unless ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: output path exists and is not a directory")
    if not out.exists():
        out.mkdir(parents=True)
        return True
    entries = 0
    for p in out.iterdir():
        if is_temporary(p):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            entries += 1
    if entries and not overwrite:
        raise UserError(f"{out}: output directory is not empty ({entries} entries); pass --overwrite to replace it")
    return False


def remove_stale(out: Path, written: Iterable[str], is_output: Callable[[str], object]) -> list[str]:
    """After a successful run, delete the files named like its outputs (``is_output``) that it did not write.

    Returns the names removed, sorted.
    """
    keep = set(written)
    stale = sorted(p.name for p in Path(out).iterdir() if p.is_file() and is_output(p.name) and p.name not in keep)
    for name in stale:
        (Path(out) / name).unlink()
    return stale
