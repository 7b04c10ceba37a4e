"""Atomic writes: write to a temporary name beside the target, rename into place when complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in the target's directory; on success it is renamed to ``path``.

    On any exception the temporary file (or directory) is removed and ``path`` is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f"{suffix}.tmp", dir=target.parent)
    os.close(fd)
    os.unlink(tmp)  # the writer creates it (h5py, a directory, ...)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        if tmp_path.is_dir():
            shutil.rmtree(tmp_path, ignore_errors=True)
        elif tmp_path.exists():
            tmp_path.unlink()
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
