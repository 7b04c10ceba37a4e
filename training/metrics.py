"""The run's numbers, each defined once.

Conventions (every report in the application uses these functions and nothing else):

* **Throughput** counts *trained* samples: sequences/s = sequences consumed by optimizer steps / wall seconds,
  measured after ``warmup_steps`` steps, with device synchronisation at both ends of the window.
* **Tokens** are the positions the model *computed* (``model.flops.WorkCounter``, per micro-batch on the
  host, summed over the ranks in the step's own collective): unpadded BERT (``model.unpad``, the default)
  computes only its real tokens and counts only them; a padded BERT run (``model.unpad=false``) computes and
  counts every position, padding included, as NVIDIA's reference does; a packed GPT window of ``seq_len``
  inputs counts ``seq_len``. Tokens/s = those tokens / the window's seconds. ``padding_fraction`` is the share
  of padded positions in what the run read, whichever path computed it.
* **Per device** figures divide the job's figure by the number of devices (data-parallel ranks x
  model-parallel size); on CPU one rank stands for one device.
* **TFLOP/s per device** = the training FLOPs of the computed positions (``model.flops``: attention over
  each sequence's real length when unpadded) / the window's seconds / devices. ``flops_per_token`` in a
  summary is that window's FLOPs over its tokens.
* **MFU** = achieved FLOP/s per device / the device's peak (``training.devices.peak_flops``): the dense BF16
  tensor FLOP/s from the vendor's datasheet for an accelerator in ``training.devices.PEAK_FLOPS``; on CPU the
  fastest matmul measured on this CPU in the run's compute dtypes. No known peak, no MFU (None). MFU > 1 is a
  bug in a FLOPs count or a peak, so ``mfu`` raises instead of clamping.
* **Scaling efficiency** of a run = its per-device throughput / the per-device throughput of the smallest run
  (fewest devices) of the same configuration fingerprint. There is no efficiency without such a baseline.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Throughput:
    sequences_per_sec: float
    tokens_per_sec: float
    sequences_per_sec_per_device: float
    tokens_per_sec_per_device: float


def throughput(sequences: int, tokens: float, seconds: float, devices: int) -> Throughput:
    """Throughput over a measured window of ``sequences`` trained sequences holding ``tokens`` computed
    positions, in ``seconds``."""
    if seconds <= 0 or devices <= 0:
        raise ValueError(f"throughput needs seconds > 0 and devices > 0 (got {seconds}, {devices})")
    sps, tps = sequences / seconds, tokens / seconds
    return Throughput(sps, tps, sps / devices, tps / devices)


def flops_per_sec_per_device(flops: float, seconds: float, devices: int) -> float:
    """Achieved model FLOP/s per device (model FLOPs, not hardware FLOPs: recomputation is not counted)."""
    if seconds <= 0 or devices <= 0:
        raise ValueError(f"FLOP/s needs seconds > 0 and devices > 0 (got {seconds}, {devices})")
    return flops / seconds / devices


def mfu(flops_per_sec: float, peak_flops_per_device: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] of ``flops_per_sec`` achieved per device, or None when the device's
    peak is unknown.

    Raises ValueError, naming the figures, when the result exceeds 1: that cannot be right.
    """
    if peak_flops_per_device is None:
        return None
    if peak_flops_per_device <= 0:
        raise ValueError(f"peak FLOP/s must be positive (got {peak_flops_per_device})")
    value = flops_per_sec / peak_flops_per_device
    if value > 1:
        raise ValueError(
            f"MFU {value:.3f} > 1: {flops_per_sec:.6g} model FLOP/s per device exceeds the device peak "
            f"{peak_flops_per_device:.6g} FLOP/s; the FLOPs count or the peak is wrong"
        )
    return value


def scaling_efficiency(per_device_throughput: float, baseline_per_device_throughput: float) -> float:
    """Per-device throughput relative to the baseline run (the smallest run of the same fingerprint)."""
    if baseline_per_device_throughput <= 0:
        raise ValueError("baseline throughput must be positive")
    return per_device_throughput / baseline_per_device_throughput


# Keys that legitimately change between runs of one configuration at different scales; they are left out
# of the fingerprint so that such runs group together. Threads per rank stays in: on CPU, runs with
# different thread counts are not comparable.
SCALE_DEPENDENT_KEYS = frozenset(
    {
        "world_size",
        "nodes",
        "gradient_accumulation_steps",
        "run.dir",
        "run.name",
        "run.owner_stale_s",
        "run.takeover",
        "checkpoint.dir",
        "checkpoint.resume",
        "logging.wandb.name",
        "train.grad_accum",
    }
)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_fingerprint(resolved_config: dict[str, Any]) -> str:
    """A short stable hash of a resolved configuration, ignoring keys that change with scale."""
    flat = {k: v for k, v in _flatten(resolved_config).items() if k not in SCALE_DEPENDENT_KEYS}
    blob = json.dumps(flat, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# --------------------------------------------------------------------------- the run summary


@dataclass
class RunSummary:
    """RUN_DIR/summary.json: what a finished run reports, read back by ``launch report``.

    Time convention: ``startup_s`` (process start to the first step) + ``warmup_s`` (steps left out of the
    throughput window) + ``train_window_s`` (the measured steps) + ``eval_s`` + ``save_s`` + ``log_s`` account
    for ``wall_time_s`` up to the few milliseconds spent writing this summary. Throughput, MFU and
    ``data_wait_fraction`` are over ``train_window_s`` only.

    A run that restarted (``attempt`` > 1) reports throughput, MFU and the times above for its last start
    only, at that start's ``world_size``; ``goodput`` (``training.metrics.goodput``: productive time over wall
    time, the time each failure cost, checkpoint stalls, the world size of every start) covers all of them,
    and ``segments`` (``training.metrics.segments``) gives throughput, MFU and scaling efficiency per start
    and for the whole run.
    """

    model: str
    family: str
    world_size: int
    nodes: int
    device_kind: str
    device_count: int
    threads_per_rank: int
    precision: str
    zero_stage: int  # the stage the DeepSpeed engine runs (bf16 at requested stage 0 runs as 1)
    zero_stage_requested: int
    optimizer: str
    micro_batch: int
    global_batch: int
    grad_accum: int
    seq_len: int
    steps: int
    measured_steps: int
    samples: int
    tokens: int
    flops_per_token: float | None  # the window's FLOPs per computed token (None: runs that could not count them)
    peak_flops_per_device: float | None
    attempt: int
    stopped: str  # "" (finished), "sigterm" or "stop_at_step"
    peak_memory_bytes: int
    startup_s: float
    warmup_s: float
    train_window_s: float
    eval_s: float
    save_s: float
    log_s: float
    wall_time_s: float
    final_loss: float | None
    fingerprint: str
    config: dict[str, Any]
    sequences_per_sec: float | None = None
    tokens_per_sec: float | None = None
    sequences_per_sec_per_device: float | None = None
    tokens_per_sec_per_device: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    data_wait_fraction: float | None = None
    padding_fraction: float | None = None  # padded positions / positions read, this start (model.flops.Work)
    first_step_s: float | None = None  # this start's first step, compilation included (outside the window)
    # the attention kernel the model ran over its packed tokens (model.unpad.RECORDED_KERNELS: varlen-flash,
    # varlen-cpu, padded, jagged), resolved at run time from the device and dtype; None for a model that does not
    # unpad (GPT-NeoX, BERT with model.unpad=false). What was asked is the config's model.unpad_attention.
    attention_kernel: str | None = None
    attention_kernel_reason: str | None = None  # why auto fell back from the varlen kernel, e.g. FP32 on CUDA
    goodput: dict[str, Any] | None = None
    segments: dict[str, Any] | None = None  # training.metrics.segments: figures per world size, and totals
    evaluation: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON: the evaluation figures (``eval_*``) sit at the top level."""
        out = {k: v for k, v in asdict(self).items() if k != "evaluation"}
        out.update(self.evaluation)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSummary:
        """A summary read back from JSON; ValueError naming the fields a summary.json lacks."""
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in d.items() if k in names and k != "evaluation"}
        known["evaluation"] = {k: v for k, v in d.items() if k.startswith("eval_") and k not in names}
        return cls(**known)


@dataclass(frozen=True)
class RunFacts:
    """What one start of a run is, fixed before its first step; its summary records it beside the figures."""

    model: str
    family: str
    world_size: int
    nodes: int
    device_kind: str
    threads_per_rank: int
    precision: str
    zero_stage: int
    zero_stage_requested: int
    optimizer: str
    micro_batch: int
    global_batch: int
    grad_accum: int
    seq_len: int
    flops_per_token: float | None
    """At full ``seq_len`` rows (``model.flops.training_flops_per_token``); the summary records the measured
    window's own (unpadded BERT's real lengths) when there is one."""
    peak_flops_per_device: float | None
    attempt: int
    config: dict[str, Any]


def summarize(
    facts: RunFacts,
    counters: dict[str, int],
    perf: dict[str, Any],
    run_events: list[dict[str, Any]],
    *,
    peak_memory_bytes: int,
    startup_s: float,
    wall_time_s: float,
    final_loss: float | None,
    evaluation: dict[str, float],
) -> RunSummary:
    """The run summary: ``facts``, the step counters (``steps``, ``samples``, ``tokens``), the trainer's
    figures (``perf``: throughput, MFU, FLOPs per token, the time breakdown, ``stopped``; over ``facts``) and,
    from the run's events, its goodput and per-segment figures."""
    return RunSummary(
        **{**asdict(facts), **perf},
        device_count=facts.world_size,
        steps=counters["step"],
        samples=counters["samples"],
        tokens=counters["tokens"],
        peak_memory_bytes=peak_memory_bytes,
        startup_s=startup_s,
        wall_time_s=wall_time_s,
        final_loss=final_loss,
        fingerprint=config_fingerprint({**facts.config, "threads_per_rank": facts.threads_per_rank}),
        evaluation=evaluation,
        goodput=goodput(run_events),
        segments=segments(
            run_events, facts.global_batch, facts.seq_len, facts.flops_per_token, facts.peak_flops_per_device
        ),
    )


# ---------------------------------------------------------------------------------------------------------
# From a run's events (``training.events``, RUN_DIR/events.jsonl): goodput, and the figures of each start.
# ---------------------------------------------------------------------------------------------------------


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

    The owner's events (``owner_*``: a job taking or releasing the run) are not the run's time and are left out.

    None when the events hold no start.
    """
    events = [ev for ev in events if not str(ev["event"]).startswith("owner_")]
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
