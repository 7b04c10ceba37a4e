"""RUN_DIR/events.jsonl: what happened to a run, one JSON object per line, across every start of it.

Kinds (each line also has ``time``, seconds since the epoch, ``rank`` and ``attempt`` where known):

- ``start``: training begins (after start-up and any checkpoint load): ``world_size``, ``nodes``, ``step``
  (where it resumes, 0 for a new run), ``resumed_from`` (a tag or null), ``restart`` (the elastic agent's
  restart count, 0 for a first start), ``startup_s`` (process start to this line), ``tokens`` and ``flops``
  (the run's computed tokens and their FLOPs so far; ``checkpoint``, ``sigterm`` and ``finish`` carry them
  as of their step: ``training.metrics.segments`` reads the work between two events from them);
- ``world_size_change``: the run resumes at another data-parallel world size: ``previous``, ``world_size``;
- ``checkpoint``: a committed save: ``step``, ``tag``, ``save_s`` (the training stall it caused); a
  background save (``checkpoint.async_save``) is recorded when committed, some steps after its stall, and
  also has ``write_s`` (its files' writing, overlapped with training) and ``done_at`` (when its stall ended);
- ``failure``: a rank found a peer gone or hung, or its data loader stalled: ``why``; or ``launch elastic``'s
  agent saw a rank of its node die of a signal: ``why``, ``signal``, ``host``, ``local_rank``, ``pid``;
- ``sigterm``: a rank received SIGTERM (a scheduler's preemption, or its elastic agent stopping it for a
  restart): it saves and exits 3; ``launcher_lost``: a rank's launcher died (the rank stops as on SIGTERM);
- ``preempted``: ``launch elastic`` itself was signalled (``signal``, ``host``): the job ends with 3 for the
  scheduler to requeue, and is not restarted in place;
- ``user_error``: the job's input is wrong (exit 2; restarting cannot help): ``message``;
- ``finish``: the run reached ``train.steps``: ``step``, ``samples``, ``tokens``, ``flops``;
- ``owner_acquire``, ``owner_takeover``, ``owner_release``: a job took the run's owner's mark (``token``,
  ``host``, ``pid``, ``role``, ``job``, ``dirs``, ``waited_s``), took it over from a holder that was gone,
  stale or broken by ``run.takeover`` (also ``previous``: each mark replaced, its ``reason`` and holder), or
  released it (``training.ownership``).

Rank 0 writes the run's events; ``failure``, ``sigterm`` and ``launcher_lost`` come from the rank that saw
them, because rank 0 may be the one that is gone, and ``preempted`` from each node's ``launch elastic``.
Each line is one ``write`` to a file opened for appending, so lines from several ranks do not interleave.
``training.metrics``' ``goodput`` and ``segments`` read the file back.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import ownership

EVENTS = "events.jsonl"


@dataclass
class EventLog:
    """Where the events of this start go (rank 0 writes the run's): the run's folder, this start's attempt
    (``training.start.next_attempt``) and the job's nodes."""

    run_dir: Path
    attempt: int
    nodes: int = 1


def record(run_dir: Path, kind: str, **fields: Any) -> None:
    """Append one event; never raises (the run's own error is the one to report). A process whose run was
    taken over by another job writes nothing (``training.ownership.fence``: a rank ends there); one whose
    holder released the run as the job ended still records its own ending (its ``failure``)."""
    if not ownership.fence(released_ok=True):
        return
    line = json.dumps({"event": kind, "time": time.time(), **fields}) + "\n"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events in file order; a torn last line (a writer killed mid-write) is left out."""
    return read_from(run_dir, 0)[0]


def read_from(run_dir: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The events written after byte ``offset`` (a follower's position) and the offset after the last whole
    line; a line still being written is left for the next call."""
    try:
        with open(run_dir / EVENTS, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    whole = data[: data.rfind(b"\n") + 1]
    out = []
    for ln in whole.decode("utf-8", "replace").splitlines():
        try:
            ev = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict) and "event" in ev and "time" in ev:
            out.append(ev)
    return out, offset + len(whole)
