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
    only, at that start's ``world_size``; ``goodput`` (``training.events.goodput``: productive time over wall
    time, the time each failure cost, checkpoint stalls, the world size of every start) covers all of them,
    and ``segments`` (``training.events.segments``) gives throughput, MFU and scaling efficiency per start
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
    goodput: dict[str, Any] | None = None
    segments: dict[str, Any] | None = None  # training.events.segments: figures per world size, and totals
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
    from training import events

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
        goodput=events.goodput(run_events),
        segments=events.segments(
            run_events, facts.global_batch, facts.seq_len, facts.flops_per_token, facts.peak_flops_per_device
        ),
    )
