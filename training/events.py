"""RUN_DIR/events.jsonl: what happened to a run, one JSON object per line, across every start of it.

Kinds (each line also has ``time``, seconds since the epoch, ``rank`` and ``attempt`` where known):

- ``start``: training begins (after start-up and any checkpoint load): ``world_size``, ``nodes``, ``step``
  (where it resumes, 0 for a new run), ``resumed_from`` (a tag or null), ``restart`` (the elastic agent's
  restart count, 0 for a first start), ``startup_s`` (process start to this line), ``tokens`` and ``flops``
  (the run's computed tokens and their FLOPs so far; ``checkpoint``, ``sigterm`` and ``finish`` carry them
  as of their step: ``segments`` reads the work between two events from them);
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
- ``finish``: the run reached ``train.steps``: ``step``, ``samples``, ``tokens``, ``flops``.

Rank 0 writes the run's events; ``failure``, ``sigterm`` and ``launcher_lost`` come from the rank that saw
them, because rank 0 may be the one that is gone, and ``preempted`` from each node's ``launch elastic``.
Each line is one ``write`` to a file opened for appending, so lines from several ranks do not interleave.
``goodput`` reads the file back.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"


def record(run_dir: Path, kind: str, **fields: Any) -> None:
    """Append one event; never raises (the run's own error is the one to report)."""
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


def _at(ev: dict[str, Any]) -> float:
    """When the event's step was done and its stall over (a background save is committed later)."""
    return float(ev.get("done_at", ev["time"]))


def goodput(events: list[dict[str, Any]], end_time: float | None = None) -> dict[str, Any] | None:
    """Goodput of a run from its events: the time spent on steps that survive to the end, over wall time.

    Convention:
    - wall time runs from the first start's process launch (its ``start`` time less ``startup_s``) to the last
      event (or ``end_time``);
    - an attempt's surviving steps are those up to the step the next attempt resumed from (all of them for
      the last attempt); the time spent on them runs from the attempt's ``start`` to the commit of that step,
      less the checkpoint stalls in between, which are reported on their own;
    - each failure's loss is split into re-done work (the attempt's time after its last surviving step) and
      restart (from the attempt's last event to the next attempt's ``start``: detection, rendezvous, process
      start, checkpoint load).

    None when the events hold no start.
    """
    starts = [i for i, ev in enumerate(events) if ev["event"] == "start"]
    if not starts:
        return None
    first = events[starts[0]]
    t_begin = first["time"] - float(first.get("startup_s", 0.0))
    t_end = end_time if end_time is not None else max(ev["time"] for ev in events)
    useful = stall = 0.0
    failures = []
    bounds = [*starts, len(events)]
    for a, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        start, body = events[lo], events[lo + 1 : hi]
        nxt = events[hi] if hi < len(events) else None
        saves = [ev for ev in body if ev["event"] == "checkpoint"]
        if nxt is None:  # the last attempt: every step it trained survives
            keep_until = max([start["time"], *(ev["time"] for ev in body)])
            kept_saves = saves
        else:
            resume = int(nxt.get("step", 0))
            kept = [ev for ev in saves if int(ev["step"]) <= resume]
            keep_until = (
                _at(kept[-1]) if kept and int(kept[-1]["step"]) > int(start.get("step", 0)) else (start["time"])
            )
            kept_saves = [ev for ev in kept if int(ev["step"]) > int(start.get("step", 0))]
        attempt_stall = sum(float(ev.get("save_s", 0.0)) for ev in kept_saves)
        useful += max(0.0, keep_until - start["time"] - attempt_stall)
        stall += sum(float(ev.get("save_s", 0.0)) for ev in saves)
        if nxt is not None:
            seen = [ev["time"] for ev in body if ev["event"] != "world_size_change"]  # the next start's
            last_seen = max([start["time"], *seen])
            ends = ("failure", "launcher_lost", "sigterm", "preempted")
            why = next((ev.get("why") or ev["event"] for ev in body if ev["event"] in ends), "unknown")
            failures.append(
                {
                    "attempt": a + 1,
                    "why": why,
                    "at_step": max([int(start.get("step", 0)), *(int(ev["step"]) for ev in saves)]),
                    "resumed_at_step": int(nxt.get("step", 0)),
                    "redone_s": round(max(0.0, last_seen - keep_until), 3),
                    "restart_s": round(max(0.0, nxt["time"] - last_seen), 3),
                }
            )
    wall = max(t_end - t_begin, 1e-9)
    return {
        "goodput": min(1.0, useful / wall),
        "productive_s": round(useful, 3),
        "wall_s": round(wall, 3),
        "checkpoint_stall_s": round(stall, 3),
        "attempts": len(starts),
        "world_sizes": [events[i].get("world_size") for i in starts],
        "failures": failures,
    }


def segments(
    events: list[dict[str, Any]],
    global_batch: int,
    seq_len: int,
    flops_per_token: float | None = None,
    peak_flops_per_device: float | None = None,
) -> dict[str, Any] | None:
    """Throughput, MFU and scaling efficiency per segment of constant world size, and over the whole run.

    Convention:
    - a segment is one start: from its ``start`` to its last event that names a step it completed (a
      checkpoint, a SIGTERM stop, the finish), less the checkpoint stalls in between. Steps trained after that
      event (lost to a failure) are in neither its sequences nor its time;
    - its sequences are those steps x ``global_batch``, steps that a later start re-did included (its devices
      did that work); its tokens and FLOPs are the run's counts (``tokens``, ``flops``: the positions computed,
      ``training.metrics``' convention) at that event less those at its ``start``; events without them (runs
      older than the convention) count ``seq_len`` tokens per sequence at ``flops_per_token``;
    - throughput and MFU use ``training.metrics``; scaling efficiency is per-device throughput over that of
      the segment with the fewest devices (``launch report``'s convention across runs);
    - the totals divide all segments' sequences by all their time, and per device by their device-seconds.

    None when no segment completed a step.
    """
    from training.metrics import flops_per_sec_per_device, mfu, scaling_efficiency, throughput

    starts = [i for i, ev in enumerate(events) if ev["event"] == "start"]
    bounds = [*starts, len(events)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        start, body = events[lo], events[lo + 1 : hi]
        stepped = [ev for ev in body if ev["event"] in ("checkpoint", "sigterm", "finish") and "step" in ev]
        if not stepped:
            continue
        last = max(stepped, key=lambda ev: (int(ev["step"]), _at(ev)))  # a background save's commit can be
        # recorded after a later step's event (a SIGTERM)
        steps = int(last["step"]) - int(start.get("step", 0))
        stall = sum(float(ev.get("save_s", 0.0)) for ev in body if ev["event"] == "checkpoint" and _at(ev) <= _at(last))
        seconds = _at(last) - start["time"] - stall
        world = int(start.get("world_size", 1))
        if steps <= 0 or seconds <= 0:
            continue
        if all(k in ev for ev in (start, last) for k in ("tokens", "flops")):
            tokens, flops = last["tokens"] - start["tokens"], last["flops"] - start["flops"]
        else:
            tokens = steps * global_batch * seq_len
            flops = tokens * flops_per_token if flops_per_token else None
        tp = throughput(steps * global_batch, tokens, seconds, world)
        out.append(
            {
                "world_size": world,
                "from_step": int(start.get("step", 0)),
                "to_step": int(last["step"]),
                "seconds": round(seconds, 3),
                "tokens": tokens,
                "flops": flops,
                "sequences_per_sec": tp.sequences_per_sec,
                "sequences_per_sec_per_device": tp.sequences_per_sec_per_device,
                "tokens_per_sec_per_device": tp.tokens_per_sec_per_device,
                "mfu": None
                if flops is None
                else mfu(flops_per_sec_per_device(flops, seconds, world), peak_flops_per_device),
            }
        )
    if not out:
        return None
    base = min(out, key=lambda s: s["world_size"])
    for seg in out:
        seg["scaling_efficiency"] = scaling_efficiency(
            seg["sequences_per_sec_per_device"], base["sequences_per_sec_per_device"]
        )
    sequences = sum((s["to_step"] - s["from_step"]) * global_batch for s in out)
    seconds = sum(s["seconds"] for s in out)
    device_s = sum(s["seconds"] * s["world_size"] for s in out)
    tokens = sum(s["tokens"] for s in out)
    flops = None if any(s["flops"] is None for s in out) else sum(s["flops"] for s in out)
    total = throughput(sequences, tokens, seconds, 1)
    per_device = sequences / device_s
    return {
        "segments": out,
        "total": {
            "sequences": sequences,
            "seconds": round(seconds, 3),
            "sequences_per_sec": total.sequences_per_sec,
            "tokens": tokens,
            "sequences_per_sec_per_device": per_device,
            "mfu": None if flops is None else mfu(flops / device_s, peak_flops_per_device),
        },
    }
