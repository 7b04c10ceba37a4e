"""A shard read that fails while a job trains: retried with backoff when the filesystem may come back, then one
line naming the shard, the rows and the error.

Shared filesystems (NFS, Lustre, FSx) fail a read for a moment and then serve it again: an I/O error, a stale
handle after a server failover, a timeout, or a file that is briefly not there. ``read`` retries such a read
``ReadRetry.retries`` times, waiting twice as long each time, within ``ReadRetry.total_s`` of the first
failure (an ``Outage``, which every read of the reader shares until one succeeds); each retry is a warning
naming the shard and rows. What is still failing then is ``ShardUnavailable``: the rank ends with
``EXIT_PEER_LOST`` (4), the job resumes from its last checkpoint, and ``launch elastic`` restarts it.

A shard whose size is no longer what its manifest records (truncated, rewritten), or whose bytes do not
decode, will not read better later: ``ShardDamaged``, a ``RankError`` (exit 2), at once. Nothing committed
depends on the read, so the resume is exact once the shard is whole again.

Both errors carry a one-line message. Raised in a DataLoader worker, they reach the rank re-raised by torch
with the worker's traceback as their text: ``one_line`` recovers the line (``PretrainingLoader`` re-raises
it so).
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from common.errors import RankError
from common.log import get_logger

log = get_logger("data.loader")

T = TypeVar("T")

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOENT, errno.EAGAIN})
"""I/O error, stale file handle (a server failover), timed out, no such file (vanished for a moment), try again."""


@dataclass(frozen=True)
class ReadRetry:
    """How a failed shard read is retried: ``retries`` more attempts whose waits double and add up to
    ``total_s`` (4 retries over 30 s: 2, 4, 8 and 16 s)."""

    retries: int = 4
    total_s: float = 30.0

    def waits(self) -> list[float]:
        if self.retries <= 0:
            return []
        first = self.total_s / (2**self.retries - 1)
        return [first * 2**i for i in range(self.retries)]


class ShardReadError(Exception):
    """A shard read that failed for good; the message is one line naming the shard, the rows and the error."""

    def one_line(self) -> str:
        """The message, also when torch re-raised it from a DataLoader worker (its text then ends with the
        worker's traceback, whose last line is ``<module>.<class>: <message>``)."""
        text = str(self).strip()
        if "Original Traceback" not in text:
            return text
        last = text.splitlines()[-1]
        _, sep, message = last.partition(f"{type(self).__name__}: ")
        return message if sep else last


class ShardDamaged(ShardReadError, RankError):
    """The shard is not what its manifest records, or does not decode: not retried (exit 2)."""


class ShardUnavailable(ShardReadError):
    """The filesystem kept failing the read through every retry: the job ends with 4 and resumes."""


_ERRNO_IN_TEXT = re.compile(r"errno\s*=\s*(\d+)")


def is_transient(err: BaseException, path: Path, file_bytes: int | None) -> bool:
    """Whether a failed read of ``path`` may succeed later: the file is gone (for now), or the error is one of
    ``TRANSIENT_ERRNOS`` (HDF5 puts the system's errno into its message) and the file still has the size its
    manifest records. A file of another size, or bytes that do not decode, are damage."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return True
    except OSError as e:  # the filesystem cannot even say
        return e.errno in TRANSIENT_ERRNOS
    if file_bytes is not None and size != file_bytes:
        return False
    code = getattr(err, "errno", None)
    if code is None:
        m = _ERRNO_IN_TEXT.search(str(err))
        code = int(m.group(1)) if m else None
    return code in TRANSIENT_ERRNOS


def _first_line(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError):
        return "the file is not there"
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


class Outage:
    """When the reads of one reader began to fail (``None`` while they succeed): the retries of every read
    during one outage share ``ReadRetry.total_s`` from that moment, however many units a micro-batch needs
    and however long each failed attempt blocks, so the rank names the shard before the data watchdog fires."""

    def __init__(self) -> None:
        self.since: float | None = None


def read(
    fn: Callable[[], T],
    path: Path,
    rows: tuple[int, int],
    file_bytes: int | None,
    policy: ReadRetry,
    on_failure: Callable[[], None] = lambda: None,
    outage: Outage | None = None,
) -> T:
    """``fn()``, which reads ``rows`` [a, b) of shard ``path``; a failed read is retried as the module says,
    within the time ``outage`` has left (a new one: the whole ``policy.total_s``). ``on_failure`` runs after
    every failed attempt (the reader drops its file handle: a stale handle is not reused)."""
    where = f"{path}: rows {rows[0]}-{rows[1] - 1}"
    waits = policy.waits()
    outage = outage or Outage()
    for attempt in range(len(waits) + 1):
        try:
            got = fn()
        except (OSError, KeyError, ValueError) as err:  # h5py: OSError; a damaged file: also KeyError/ValueError
            on_failure()
            if not isinstance(err, OSError) or not is_transient(err, path, file_bytes):
                recorded = f", {file_bytes} in its manifest" if file_bytes is not None else ""
                raise ShardDamaged(
                    f"{where}: the shard is damaged ({_size(path)}{recorded}; {_first_line(err)})"
                ) from None
            now = time.monotonic()
            if outage.since is None:
                outage.since = now
            left = outage.since + policy.total_s - now
            if attempt == len(waits) or left <= 0:
                raise ShardUnavailable(
                    f"{where}: the read still failed after {attempt} retries in {now - outage.since:.1f} s "
                    f"(data.read_retry_s={policy.total_s:g}; {_first_line(err)}); the job resumes from its last "
                    "checkpoint once the shard reads"
                ) from None
            wait = min(waits[attempt], left)
            log.warning(
                f"{where}: read failed ({_first_line(err)}); retry {attempt + 1} of {len(waits)} in {wait:.1f} s"
            )
            time.sleep(wait)
        else:
            outage.since = None
            return got
    raise AssertionError("unreachable")


def _size(path: Path) -> str:
    try:
        return f"{os.stat(path).st_size} bytes"
    except OSError as e:
        return f"unreadable: {e.strerror}"
