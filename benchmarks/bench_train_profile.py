"""Where the time of our train step goes: a run (``training.start.run``, train.py's) in this process under
``torch.profiler``.

The phases of a training step are labelled (the next batch from the loader, forward, backward, DeepSpeed
``step`` at and between accumulation boundaries) by wrapping public methods only: the DeepSpeed engine's,
``data.loader.PretrainingLoader.__iter__`` and ``Trainer.train_step``; the profiler records the steps after
``logging.warmup_steps``. Prints the wall time per phase per optimizer step and the top operators by self
time; on a GPU also the device's activity, and the top kernels by device time (the phases are host wall
times; each step ends with a synchronisation there, so the step's total holds its kernels). Writes a Chrome
trace when ``--trace`` is given. Same overrides as ``train.py``:

    python benchmarks/bench_train_profile.py --threads 1 -- model.name=bert-10m data.train=DIR data.vocab=V
    ...

Toy size (seconds; shards from ``bench_train.py``'s ``--work``): ``-- model.name=bert-debug train.steps=3
train.global_batch=4 train.micro_batch=2 logging.warmup_steps=1 ...``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from common.errors import run_cli

PHASES = collections.defaultdict(float)
COUNTS = collections.Counter()


def _timed(label: str, fn):
    """Wrap ``fn`` in a profiler range and add its wall time to PHASES[label] (once the profiler runs)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if not STATE["on"]:
            return fn(*a, **kw)
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"## {label}"):
            out = fn(*a, **kw)
        PHASES[label] += time.perf_counter() - t0
        COUNTS[label] += 1
        return out

    return wrapper


STATE = {"on": False, "prof": None, "t0": 0.0, "steps": 0}


def _timed_iter(label: str, iter_fn):
    """Wrap a loader's ``__iter__`` so that each ``next()`` on its iterator is timed as ``label``."""

    @functools.wraps(iter_fn)
    def wrapper(self):
        it = iter_fn(self)
        take = _timed(label, lambda: next(it))
        try:
            while True:
                try:
                    batch = take()
                except StopIteration:
                    return
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:  # the trainer closes its iterator: the DataLoader's workers end now
                close()

    return wrapper


def activities() -> list:
    """What the profiler records: host activity, and on a GPU the device's kernels too."""
    recorded = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        recorded.append(torch.profiler.ProfilerActivity.CUDA)
    return recorded


MATMUL = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = ("flash", "fmha", "attention", "varlen_attn", "efficient_attention")


def time_split(events, on_device: bool) -> dict[str, float]:
    """The shares of the profiled time in matmuls, in attention and in the rest, by each event's self time on
    the device (its kernels and copies; ``on_device``) or on the CPU, classified by name (``MATMUL``,
    ``ATTENTION``: cuBLAS/CUTLASS kernel names and the aten matmul ops; the flash kernels and the attention
    ops)."""
    sums = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for evt in events:
        t = evt.self_device_time_total if on_device else evt.self_cpu_time_total
        name = evt.key.lower()
        kind = (
            "matmul"
            if any(m in name for m in MATMUL)
            else "attention"
            if any(a in name for a in ATTENTION)
            else "other"
        )
        sums[kind] += max(t, 0.0)
    total = sum(sums.values()) or 1.0
    return {kind: t / total for kind, t in sums.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=25, help="operators shown")
    p.add_argument("--trace", default=None, help="write a Chrome trace (chrome://tracing, Perfetto) here")
    p.add_argument("--config", default=None, help="train.py's --config (a recipe name or a YAML file)")
    p.add_argument("--shares", default=None, help="write the time shares (matmul, attention, other) as JSON here")
    p.add_argument("overrides", nargs="*", help="train.py overrides (section.key=value)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_PORT", "29849")

    import deepspeed.runtime.engine as ds_engine

    from data.loader import PretrainingLoader
    from training import ownership, start
    from training.config import load_config
    from training.trainer import Trainer

    cfg = load_config(args.config, [*args.overrides, f"run.threads_per_rank={args.threads}"])
    warm = cfg.logging.warmup_steps
    E = ds_engine.DeepSpeedEngine
    E.forward = _timed("forward (engine)", E.forward)
    E.backward = _timed("backward (engine)", E.backward)
    orig_step = E.step

    def step(self, *a, **kw):
        label = "step: optimizer (boundary)" if self.is_gradient_accumulation_boundary() else "step: non-boundary"
        return _timed(label, orig_step)(self, *a, **kw)

    E.step = step
    PretrainingLoader.__iter__ = _timed_iter("data (next batch)", PretrainingLoader.__iter__)
    orig_train_step = Trainer.train_step

    def train_step(self, *a, **kw):
        if self.state.step == warm and not STATE["on"]:
            prof = torch.profiler.profile(activities=activities(), record_shapes=False)
            prof.__enter__()
            STATE.update(on=True, prof=prof, t0=time.perf_counter())
        if not STATE["on"]:
            return orig_train_step(self, *a, **kw)
        t0 = time.perf_counter()
        with torch.profiler.record_function("## train_step"):
            out = orig_train_step(self, *a, **kw)
            if torch.cuda.is_available():  # the step's kernels inside its wall time (phases stay host times)
                torch.cuda.synchronize()
        PHASES["train_step (total)"] += time.perf_counter() - t0
        STATE["steps"] += 1
        return out

    Trainer.train_step = train_step  # type: ignore[method-assign]
    try:
        rc = start.run(cfg)
    finally:
        ownership.release()  # the run's owner's mark, as train.py's main releases it
    prof = STATE["prof"]
    if prof is None:
        print("the profiler never started: train.steps must exceed logging.warmup_steps")
        return 1
    prof.__exit__(None, None, None)
    n = max(STATE["steps"], 1)
    total = PHASES["train_step (total)"]
    print(f"\n{cfg.model.name}: {n} profiled optimizer steps, {args.threads} thread(s); per optimizer step:")
    for label, secs in sorted(PHASES.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<32} {1000 * secs / n:8.1f} ms  {100 * secs / total:5.1f}%  ({COUNTS[label] or n} calls)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    on_device = torch.cuda.is_available()
    if on_device:  # the GPU's side: kernels (and copies) by the time the device spent in them
        print(f"top {args.top} by device time:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top))
    split = time_split(prof.key_averages(), on_device)
    print(
        f"{'device' if on_device else 'CPU (self)'} time: "
        + ", ".join(f"{kind} {100 * share:.1f}%" for kind, share in split.items())
        + " (other: neither matmul nor attention)"
    )
    if args.shares:
        Path(args.shares).write_text(json.dumps({f"{k}_share": v for k, v in split.items()}) + "\n", encoding="utf-8")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return rc


if __name__ == "__main__":
    sys.exit(run_cli(main))
