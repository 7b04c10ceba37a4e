"""What stops a rank besides its last step: SIGTERM, the loss of its launcher, and a stalled data loader."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from common.errors import EXIT_PEER_LOST
from training import collectives, events, ownership
from training.config import DATA_STALL_SHARE

LAUNCHER_POLL_S = 1.0  # how often a rank checks that its launchers are alive


_LAUNCHER_CMD = re.compile(r"deepspeed\.launcher|/deepspeed\b|\bdeepspeed\s|torchrun|torch\.distributed\.run")


def _proc(pid: int) -> tuple[str, int, str] | None:
    """(command line, parent pid, start time) of a live process, or None (gone, or a zombie)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (cmd, int(fields[1]), fields[19])


def launcher_chain() -> list[tuple[int, str]]:
    """The launcher processes above this rank, nearest first (``deepspeed.launcher.launch`` and the
    ``deepspeed`` command above it, or torchrun), as (pid, start time): the walk stops at the first
    ancestor that is not a launcher (a shell, slurmstepd, a test)."""
    chain, pid = [], os.getppid()
    while pid > 1:
        info = _proc(pid)
        if info is None or not _LAUNCHER_CMD.search(info[0]):
            break
        chain.append((pid, info[2]))
        pid = info[1]
    return chain


class StopRequest:
    """SIGTERM (spot reclaim, batch-job preemption) asks every rank to stop after the current step.

    So does the death of a launcher above the rank: the ``deepspeed`` command, killed alone, does not pass
    the signal on, and its ranks would train on to the last step. A daemon thread looks at the launcher
    chain once a second (``LAUNCHER_POLL_S``); when one has gone, the rank stops as on SIGTERM (save, exit
    code 3), and so does every rank, through the step's stop flag.
    """

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""
        self.at: float | None = None  # time.monotonic() of the request on this rank
        signal.signal(signal.SIGTERM, self._handler)
        chain = launcher_chain()
        if chain:
            threading.Thread(target=self._watch, args=(chain,), name="launcher-watch", daemon=True).start()

    def _handler(self, signum, frame) -> None:  # a signal handler's signature
        self.at = self.at or time.monotonic()
        self.requested = True
        self.reason = self.reason or "SIGTERM"

    def _watch(self, chain: list[tuple[int, str]]) -> None:
        while not self.requested:
            time.sleep(LAUNCHER_POLL_S)
            for pid, started in chain:
                info = _proc(pid)
                if info is None or info[2] != started:
                    self.reason = f"the launcher (pid {pid}) is gone"
                    self.at = self.at or time.monotonic()
                    self.requested = True
                    return


class DataWatchdog:
    """Ends this rank when its next training batch does not come within ``STALL_SHARE`` of
    ``deepspeed.timeout_s``.

    A DataLoader worker stuck on a stalled filesystem (or, with ``data.num_workers=0``, the main thread's own
    read) would make the rank wait forever: nothing else bounds that wait, while its peers time out in their
    next collective. A daemon thread watches the wait; past the bound it prints one line naming the data
    loader and the node, records a ``failure`` event and ends the process with ``EXIT_PEER_LOST`` (the job
    resumes from its last checkpoint), without a teardown that would wait on the stuck loader. The bound is
    below the collectives' own timeout so that the stalled rank names the cause before its peers, which enter
    their next collective at about the moment it starts waiting, time out there with a less useful line.
    """

    STALL_SHARE = DATA_STALL_SHARE

    def __init__(self, timeout_s: float, num_workers: int, run_dir: Path, on_stall: Any = None) -> None:
        self.timeout_s = timeout_s
        self.bound_s = self.STALL_SHARE * timeout_s
        self.num_workers = num_workers
        self.run_dir = run_dir
        self.on_stall = on_stall or self._end_rank
        self._since: float | None = None  # time.monotonic() when the current wait began
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def begin(self) -> None:
        self._since = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="data-watchdog", daemon=True)
            self._thread.start()

    def end(self) -> None:
        self._since = None

    def close(self) -> None:
        """Stop watching (the loop is over); the thread ends within one poll."""
        self._since = None
        self._closed.set()

    def _watch(self) -> None:
        poll = min(1.0, self.bound_s / 10)
        while not self._closed.wait(poll):
            since = self._since
            if since is not None and time.monotonic() - since > self.bound_s:
                self.on_stall(self.describe(time.monotonic() - since))
                return

    def describe(self, waited_s: float) -> str:
        who = (
            f"one of its {self.num_workers} DataLoader worker(s) (data.num_workers={self.num_workers})"
            if self.num_workers > 0
            else "its own read (data.num_workers=0)"
        )
        return (
            f"its data loader gave no batch in {self.bound_s:g} s ({self.STALL_SHARE:g} x deepspeed.timeout_s="
            f"{self.timeout_s:g}; waited {waited_s:.1f} s): {who} is stuck, e.g. on a stalled filesystem"
        )

    def _end_rank(self, why: str) -> None:
        rank = collectives.rank()
        events.record(
            self.run_dir,
            "failure",
            rank=rank,
            why="data loader stalled",
            waited_s=round(time.monotonic() - (self._since or time.monotonic()), 3),
        )
        print(
            f"error: rank {rank} on {socket.gethostname()}: {why}; the job ends here and resumes from its "
            "last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        # The stuck workers would hold the launcher's SIGTERM-then-wait on this rank's process tree (30 s).
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        ownership.release(self.run_dir)  # the run's next start proceeds at once, as after any lost peer
        os._exit(EXIT_PEER_LOST)
