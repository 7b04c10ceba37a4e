"""The training loop: a thin, stateful trainer around a DeepSpeed engine.

``Trainer.train()`` runs optimizer steps until ``train.steps``, ``train.stop_at_step`` or a stop request
(SIGTERM), logging on rank 0, evaluating and checkpointing every K steps. Everything needed to continue
exactly (step, samples, tokens, loader position, RNG states) goes into the checkpoint; ``close()`` always
runs.

Host synchronisation. Inside a step nothing waits for the device: the micro-batch losses are summed on the
device. At the end of a step one collective carries the step's loss pieces and the stop flag; its result is
copied to the host without blocking and read one step later, when it is long complete. Only logging,
evaluation and checkpoint steps read the current step's values at once (at most once per logging interval).

Time accounting (``Clock``): the throughput window holds only the training steps after the warm-up ones; time
spent evaluating, saving and logging is paused out of it and reported as ``eval_s``, ``save_s`` and ``log_s``.
Waiting for data is counted only inside the window, so ``data_wait_fraction`` lies in [0, 1].
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import EXIT_PEER_LOST
from common.log import get_logger
from training import checkpoint, collectives, events
from training.config import CheckpointSection, LoggingSection, TrainSection
from training.metrics import mfu, tflops_per_device, throughput

log = get_logger("train")

EXIT_PREEMPTED = 3  # SIGTERM or train.stop_at_step: the current step finished, a checkpoint was saved
LAUNCHER_POLL_S = 1.0  # how often a rank checks that its launchers are alive
LOSS_PARTS = ("mlm_loss", "nsp_loss")  # logged beside the total loss when the model returns them


def synchronize() -> None:
    collectives.accelerator().synchronize()


def peak_memory_bytes() -> int:
    """Peak accelerator memory, or on CPU the peak resident set size of this process."""
    acc = collectives.accelerator()
    if acc.device_name() != "cpu":
        return int(acc.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples, "tokens": self.tokens}


@dataclass
class Clock:
    """Where a run's wall time goes. The throughput window is the measured training steps only."""

    warmup_steps: int
    window_s: float = 0.0
    measured_steps: int = 0
    data_wait_s: float = 0.0
    warmup_s: float = 0.0
    eval_s: float = 0.0
    save_s: float = 0.0
    log_s: float = 0.0
    _open: float | None = None

    @property
    def running(self) -> bool:
        return self._open is not None

    def open(self) -> None:
        synchronize()
        self._open = time.perf_counter()

    def close(self) -> None:
        if self._open is not None:
            synchronize()
            self.window_s += time.perf_counter() - self._open
            self._open = None

    def seconds(self) -> float:
        """The window so far (device work included: synchronises when open)."""
        if self._open is None:
            return self.window_s
        synchronize()
        return self.window_s + time.perf_counter() - self._open

    def steps_outside(self, t_loop: float) -> float:
        """Training time since the loop began that no other phase (evaluation, saving, logging) holds."""
        return time.perf_counter() - t_loop - self.eval_s - self.save_s - self.log_s

    def breakdown(self) -> dict[str, float]:
        return {
            "warmup_s": self.warmup_s,
            "train_window_s": self.seconds(),
            "eval_s": self.eval_s,
            "save_s": self.save_s,
            "log_s": self.log_s,
        }


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

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
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
    """Ends this rank when its next training batch does not come within ``deepspeed.timeout_s``.

    A DataLoader worker stuck on a stalled filesystem (or, with ``data.num_workers=0``, the main thread's own
    read) would make the rank wait forever: nothing else bounds that wait, while its peers time out in their
    next collective. A daemon thread watches the wait; past the bound it prints one line naming the data
    loader and the node, records a ``failure`` event and ends the process with ``EXIT_PEER_LOST`` (the job
    resumes from its last checkpoint), without a teardown that would wait on the stuck loader.
    """

    def __init__(self, timeout_s: float, num_workers: int, run_dir: Path, on_stall: Any = None) -> None:
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.run_dir = run_dir
        self.on_stall = on_stall or self._end_rank
        self._since: float | None = None  # time.monotonic() when the current wait began
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        self._since = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="data-watchdog", daemon=True)
            self._thread.start()

    def end(self) -> None:
        self._since = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while True:
            time.sleep(poll)
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.on_stall(self.describe(time.monotonic() - since))
                return

    def describe(self, waited_s: float) -> str:
        who = (f"one of its {self.num_workers} DataLoader worker(s) (data.num_workers={self.num_workers})"
               if self.num_workers > 0 else "its own read (data.num_workers=0)")  # fmt: skip
        return (
            f"its data loader gave no batch for {waited_s:.0f} s (deepspeed.timeout_s={self.timeout_s:g}): "
            f"{who} is stuck, e.g. on a stalled filesystem"
        )

    def _end_rank(self, why: str) -> None:
        import psutil

        rank = collectives.rank()
        events.record(self.run_dir, "failure", rank=rank, why="data loader stalled",
                      waited_s=round(time.monotonic() - (self._since or time.monotonic()), 3))  # fmt: skip
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
        os._exit(EXIT_PEER_LOST)


class StepReduction:
    """Per step, one collective of [loss pieces..., stop flag, saves written, saves failed]; read on the host
    without stalling the device. The last two count the ranks whose part of a background checkpoint save
    (``checkpoint.async_save``) is durable, or failed: every rank learns at the same step that the save can
    be committed, or that the run must stop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] = []  # "loss" and the pieces the model returns, fixed at the first micro-batch
        self.host: torch.Tensor | None = None
        self.event: Any = None  # the accelerator's Event (DeepSpeed's abstraction: untyped)
        self.pending: int | None = None  # the step whose values are in flight
        self.step = 0  # the newest step whose values are on the host
        self.values: dict[str, float] = {}
        self.stop = False
        self.saves_written = 0  # ranks whose background save was written, as of ``step``
        self.save_failed = False

    def name_pieces(self, out: dict[str, torch.Tensor]) -> list[str]:
        if not self.names:
            self.names = ["loss", *(k for k in LOSS_PARTS if k in out)]
            pinned = self.device.type == "cuda"
            self.host = torch.zeros(len(self.names) + 3, dtype=torch.float64, pin_memory=pinned)
        return self.names

    def launch(self, step: int, sums: torch.Tensor, stop_requested: bool,
               save: checkpoint.BackgroundSave | None = None) -> None:  # fmt: skip
        flags = torch.zeros(3, dtype=torch.float64, device=self.device)  # a fill, not a host-to-device copy
        for i, on in enumerate((stop_requested, save is not None and save.written,
                                save is not None and save.failed)):  # fmt: skip
            if on:
                flags[i] = 1.0
        # the loss sums live on the compute device, the collective on the communication device (the CPU
        # under gloo, also with a GPU): one tensor on the latter
        vec = torch.cat([sums.to(self.device, torch.float64), flags])
        collectives.all_reduce_(vec, "sum")
        self.read()  # the previous step's values: complete by now
        assert self.host is not None
        self.host.copy_(vec, non_blocking=True)
        if self.device.type != "cpu":
            self.event = collectives.accelerator().Event()
            self.event.record()
        self.pending = step

    def read(self) -> None:
        """Bring the pending step's values to the host (waits only if they are still in flight)."""
        if self.pending is None:
            return
        if self.event is not None:
            self.event.synchronize()
        assert self.host is not None
        vals = self.host.tolist()
        self.step, self.values = self.pending, dict(zip(self.names, vals[:-3]))
        self.stop = self.stop or vals[-3] > 0
        self.saves_written, self.save_failed = round(vals[-2]), vals[-1] > 0
        self.pending = None


class Trainer:
    def __init__(
        self,
        engine,
        loader,
        *,
        train: TrainSection,
        logging: LoggingSection,
        ckpt: CheckpointSection,
        grad_accum: int,
        seq_len: int,
        flops_per_token: float,
        peak_flops: float | None,
        run_dir: Path,
        ckpt_dir: Path,
        client_static: dict[str, Any],
        eval_set=None,
        attempt: int = 1,
        nodes: int = 1,
        data_watchdog: DataWatchdog | None = None,
    ) -> None:
        self.engine = engine
        self.loader = loader
        self.eval_set = eval_set
        self.cfg = train
        self.logging = logging
        self.ckpt = ckpt
        self.grad_accum = grad_accum
        self.seq_len = seq_len
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.run_dir = run_dir
        self.ckpt_dir = ckpt_dir
        self.client_static = client_static
        self.attempt = attempt
        self.wandb_run = None
        self.world = collectives.world_size()
        self.rank = collectives.rank()
        self.state = TrainState()
        self.clock = Clock(logging.warmup_steps)
        self.stop = StopRequest()
        self.last_save_s: float | None = None  # the training stall of the newest save
        self.full_save_s: float | None = None  # a whole save's duration (the grace check after SIGTERM)
        self.pending_save: checkpoint.BackgroundSave | None = None
        self.device = engine.device
        self._iter: Iterator[dict[str, torch.Tensor]] | None = None
        self.last_eval: dict[str, float] = {}
        self.last_loss: float | None = None
        self.metrics_file = run_dir / "metrics.jsonl"
        self._last_saved = -1
        self.nodes = nodes
        self.data_watchdog = data_watchdog
        self._auto_next: int | None = None  # checkpoint.every=auto: the step of the next save
        self._auto_mark = (0.0, 0)  # (perf_counter, step) at the end of the newest save

    def _save_due(self, step: int) -> bool:
        every = self.ckpt.every
        if every == "auto":
            return self._auto_next is not None and step >= self._auto_next
        return bool(every) and step % every == 0

    def _plan_next_save(self, save_started: float) -> None:
        """checkpoint.every=auto: Young's interval from this run's save cost and step time (every rank agrees
        on the worst of them: a save is collective)."""
        t_mark, s_mark = self._auto_mark
        step = self.state.step
        if step > s_mark and self.last_save_s is not None and self.ckpt.mtbf_hours:
            local_step_s = (save_started - t_mark) / (step - s_mark)
            save_s, step_s = collectives.all_reduce_values([self.last_save_s, local_step_s], "max")
            job_mtbf_s = self.ckpt.mtbf_hours * 3600.0 / max(1, self.nodes)
            plan = checkpoint.young_interval(save_s, step_s, job_mtbf_s)
            self._auto_next = step + int(plan["steps"])
            if self.rank == 0:
                log.info(
                    f"checkpoint.every=auto: save {save_s:.2f} s, step {step_s:.3f} s, job MTBF "
                    f"{job_mtbf_s / 3600:.1f} h ({self.ckpt.mtbf_hours:g} h per node / {self.nodes} nodes): "
                    f"every {int(plan['steps'])} steps ({plan['interval_s'] / 60:.1f} min); expected loss "
                    f"per failure {plan['expected_loss_s'] / 60:.1f} min of re-done steps plus the restart"
                )
                events.record(self.run_dir, "checkpoint_interval", attempt=self.attempt, rank=0, step=step,
                              every_steps=int(plan["steps"]), interval_s=round(plan["interval_s"], 3),
                              save_s=round(save_s, 4), step_s=round(step_s, 4),
                              job_mtbf_s=round(job_mtbf_s, 1),
                              expected_loss_s=round(plan["expected_loss_s"], 3))  # fmt: skip
        self._auto_mark = (time.perf_counter(), step)

    # ------------------------------------------------------------------ state
    def client_state(self) -> dict[str, Any]:
        return {**self.client_static, **self.state.to_dict(), "loader": self.loader.state_dict()}

    def load_client_state(self, client: dict[str, Any]) -> None:
        self.state = TrainState(client["step"], client["samples"], client["tokens"])
        self.loader.load_state_dict(client["loader"])
        self._iter = None
        self._last_saved = self.state.step

    # ------------------------------------------------------------------ steps
    def _next_batch(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        watchdog = self.data_watchdog
        if watchdog is not None:
            watchdog.begin()
        try:
            # Loading must not touch the global RNG that dropout draws from: starting the loader's workers
            # draws a base seed, and a resumed run starts them at a different step than an uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                if self._iter is None:
                    self._iter = iter(self.loader)
                batch = next(self._iter)
        finally:
            if watchdog is not None:
                watchdog.end()
        if self.clock.running:
            self.clock.data_wait_s += time.perf_counter() - t0
        if self.device.type == "cuda":  # a copy from pinned memory does not make the host wait for the device
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, reduction: StepReduction) -> float:
        """One optimizer step: grad_accum micro-batches, then DeepSpeed's step (clip, optimizer, schedule).

        Returns the learning rate the step used; the loss pieces arrive through ``reduction``.
        """
        self.engine.train()
        lr = float(self.engine.get_lr()[0])
        sums: torch.Tensor | None = None
        for _ in range(self.grad_accum):
            out = self.engine(**self._next_batch())
            self.engine.backward(out["loss"])
            self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            pieces = torch.stack([out[k].detach().float() for k in reduction.name_pieces(out)])
            sums = pieces if sums is None else sums + pieces
        assert sums is not None
        self.state.step += 1
        self.state.samples += self.cfg.global_batch
        self.state.tokens += self.cfg.global_batch * self.seq_len
        # Mean over the global batch: every micro-batch of every rank weighs the same.
        reduction.launch(self.state.step, sums / (self.grad_accum * self.world), self.stop.requested,
                         self.pending_save)  # fmt: skip
        return lr

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The same held-out samples every time, whatever the world size: sums over all ranks, one collective.

        BERT: MLM and NSP loss and accuracy; GPT-NeoX: validation loss and perplexity.
        """
        if self.eval_set is None:
            return {}
        self.engine.eval()
        keys = ("n", "loss_x_n", "mlm_loss_x_n", "nsp_loss_x_n", "mlm_correct", "mlm_count", "nsp_correct",
                "nsp_count", "tokens", "lm_loss_x_tokens")  # fmt: skip
        sums = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        for batch in self.eval_set:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            out = self.engine(**batch)
            n = float(batch["input_ids"].size(0))
            pieces = {"n": n, "loss_x_n": out["loss"].double() * n}
            for k in ("mlm_loss", "nsp_loss"):
                if k in out:
                    pieces[f"{k}_x_n"] = out[k].double() * n
            for k in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens"):
                if k in out:
                    pieces[k] = out[k]
            if "tokens" in out:
                pieces["lm_loss_x_tokens"] = out["lm_loss"].double() * out["tokens"].double()
            for i, k in enumerate(keys):
                if k in pieces:
                    sums[i] += pieces[k]
        sums = sums.to(collectives.comm_device())
        collectives.all_reduce_(sums, "sum")
        total = dict(zip(keys, sums.tolist()))
        self.engine.train()
        if total["n"] == 0:
            return {}
        result = {"eval_loss": total["loss_x_n"] / total["n"]}
        if total["mlm_count"] > 0:
            result["eval_mlm_loss"] = total["mlm_loss_x_n"] / total["n"]
            result["eval_nsp_loss"] = total["nsp_loss_x_n"] / total["n"]
            result["eval_mlm_accuracy"] = total["mlm_correct"] / total["mlm_count"]
            result["eval_nsp_accuracy"] = total["nsp_correct"] / max(total["nsp_count"], 1.0)
        if total["tokens"] > 0:
            lm = total["lm_loss_x_tokens"] / total["tokens"]
            result["eval_loss"] = lm
            result["eval_perplexity"] = math.exp(min(lm, 50.0))
        result["eval_samples"] = total["n"]
        return result

    # ------------------------------------------------------------------ reporting
    def performance(self) -> dict[str, Any]:
        """Throughput over the measured window (training steps only), with its MFU and data-wait fraction."""
        seconds = self.clock.seconds()
        if self.clock.measured_steps <= 0 or seconds <= 0:
            return {}
        tp = throughput(self.clock.measured_steps * self.cfg.global_batch, seconds, self.seq_len, self.world)
        return {
            "sequences_per_sec": tp.sequences_per_sec,
            "tokens_per_sec": tp.tokens_per_sec,
            "sequences_per_sec_per_device": tp.sequences_per_sec_per_device,
            "tokens_per_sec_per_device": tp.tokens_per_sec_per_device,
            "tflops_per_device": tflops_per_device(tp.tokens_per_sec_per_device, self.flops_per_token),
            "mfu": mfu(tp.tokens_per_sec_per_device, self.flops_per_token, self.peak_flops),
            "data_wait_fraction": self.clock.data_wait_s / seconds,
        }

    def _write_record(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        record = {"attempt": self.attempt, **record}
        with open(self.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self.wandb_run.log(numbers, step=record["step"])
        if self.engine.monitor is not None and self.engine.monitor.enabled:
            events = [(f"train/{k}", v, record["step"]) for k, v in record.items() if isinstance(v, float)]
            self.engine.monitor.write_events(events)

    def _console(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        parts = [f"step {record['step']}/{self.cfg.steps}"]
        if "loss" in record:
            parts.append(f"loss {record['loss']:.4f}")
            parts += [f"{k.replace('_loss', '').upper()} {record[k]:.4f}" for k in LOSS_PARTS if k in record]
            parts.append(f"lr {record['lr']:.3e}")
        if "sequences_per_sec" in record:
            parts += [f"{record['sequences_per_sec']:.1f} seq/s", f"{record['tokens_per_sec']:.0f} tok/s",
                      f"{record['tflops_per_device']:.3f} TFLOP/s/dev"]  # fmt: skip
            if record.get("mfu") is not None:
                parts.append(f"MFU {100 * record['mfu']:.1f}%")
        labels = (("eval_loss", "eval loss"), ("eval_mlm_accuracy", "eval MLM acc"),
                  ("eval_nsp_accuracy", "eval NSP acc"), ("eval_perplexity", "eval ppl"))  # fmt: skip
        parts += [f"{label} {record[k]:.4f}" for k, label in labels if k in record]
        log.info(" | ".join(parts))

    def _save_fits(self, stopped: str) -> bool:
        """After SIGTERM: whether a save can finish in what remains of ``checkpoint.preempt_grace_s``,
        judged by the previous save's duration (unknown: try). Rank 0 decides for every rank (a save is
        collective)."""
        if stopped != "sigterm":
            return True
        now = time.monotonic()
        remaining = self.ckpt.preempt_grace_s - (now - (self.stop.at or now))
        fits = self.full_save_s is None or self.full_save_s <= remaining
        if not collectives.broadcast_object(fits):
            latest = checkpoint.latest_complete(self.ckpt_dir)
            log.warning(
                f"SIGTERM: no checkpoint at step {self.state.step}: the last save took "
                f"{self.full_save_s or 0:.1f} s and {max(0.0, remaining):.1f} s of "
                f"checkpoint.preempt_grace_s={self.ckpt.preempt_grace_s:g} remain; the next start resumes "
                f"from {latest or 'the beginning'}"
            )
            return False
        return True

    def save(self, background: bool = False) -> str:
        """Save at this step: synchronously, or (``background``, ``checkpoint.async_save``) with the files
        written while training goes on and committed once every rank reports them durable. A save first
        finishes the background one still in flight."""
        t0 = time.perf_counter()
        self.finish_pending_save()  # its wait is part of this save's stall (and of checkpoint.every=auto's C)
        t1 = time.perf_counter()
        step = self.state.step
        pending = None
        if background:
            pending = checkpoint.save_in_background(self.engine, self.ckpt_dir, step, self.client_state())
            tag = pending.tag
        else:
            tag = checkpoint.save(self.engine, self.ckpt_dir, step, self.client_state(), self.ckpt.keep)
        self.last_save_s = time.perf_counter() - t0
        self.clock.save_s += time.perf_counter() - t1  # the wait above is counted where it happened
        self._last_saved = step
        if pending is not None:
            pending.stall_s, pending.done_at = self.last_save_s, time.time()
            self.pending_save = pending
        else:
            self.full_save_s = self.last_save_s
            log.info(f"saved checkpoint {self.ckpt_dir / tag}")
            if self.rank == 0:
                events.record(self.run_dir, "checkpoint", attempt=self.attempt, rank=0, step=step, tag=tag,
                              save_s=round(self.last_save_s, 4))  # fmt: skip
        return tag

    def _committed(self, pending: checkpoint.BackgroundSave) -> None:
        self.full_save_s = pending.stall_s + pending.write_s
        log.info(
            f"saved checkpoint {self.ckpt_dir / pending.tag} (written in the background in "
            f"{pending.write_s:.2f} s)"
        )
        if self.rank == 0:
            events.record(self.run_dir, "checkpoint", attempt=self.attempt, rank=0, step=pending.step,
                          tag=pending.tag, save_s=round(pending.stall_s, 4),
                          write_s=round(pending.write_s, 4), done_at=pending.done_at)  # fmt: skip

    def _follow_pending_save(self, reduction: StepReduction, step: int) -> bool:
        """What the step's collective says of the background save in flight: every rank's files are durable
        (rank 0 commits now), the commit stood (the save is done), or a rank failed: False, and every rank
        stops at this step (``finish_pending_save`` raises the line)."""
        pending = self.pending_save
        if pending is None or reduction.step <= pending.reported_step:
            return True
        if reduction.save_failed:
            log.warning(f"stopping after step {step}: a background checkpoint save failed")
            return False
        if pending.committed:  # and no rank reported the commit failed
            self.pending_save = None
        elif reduction.saves_written == self.world:
            was_running = self.clock.running
            self.clock.close()  # rank 0's commit (COMPLETE, latest, old tags removed) is not training time
            t0 = time.perf_counter()
            if pending.commit(self.ckpt.keep):
                self._committed(pending)
            self.clock.save_s += time.perf_counter() - t0
            pending.reported_step = step  # the next collective says whether the commit stood
            if was_running:
                self.clock.open()
        return True

    def finish_pending_save(self) -> None:
        """Every rank at the same point: wait for the background save in flight (if any) and commit it, or
        raise its failure (the same line on every rank)."""
        pending, self.pending_save = self.pending_save, None
        if pending is None:
            return
        t0 = time.perf_counter()
        already = pending.committed
        pending.finish(self.ckpt.keep)
        self.clock.save_s += time.perf_counter() - t0  # waiting for it stalls training too
        if not already:
            self._committed(pending)

    def _timed_eval(self) -> dict[str, float]:
        t0 = time.perf_counter()
        result = self.evaluate()
        self.clock.eval_s += time.perf_counter() - t0
        return result

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        """Run to ``train.steps``; returns the performance figures and whether the run stopped early."""
        cfg = self.cfg
        start_step = self.state.step
        warm_until = start_step + self.clock.warmup_steps
        reduction = StepReduction(collectives.comm_device())
        stopped = ""
        t_loop = time.perf_counter()
        if self.ckpt.every == "auto":  # a first save right after the warm-up measures the save cost
            self._auto_next = start_step + self.clock.warmup_steps + 1
            self._auto_mark = (t_loop, start_step)
        while self.state.step < cfg.steps:
            if not self.clock.running and self.state.step >= warm_until:
                self.clock.open()
                self.clock.warmup_s = self.clock.steps_outside(t_loop)
            lr = self.train_step(reduction)
            step = self.state.step
            if not self._follow_pending_save(reduction, step):
                stopped = "save_failed"  # every rank at this step; finish_pending_save raises the line
                break
            if self.clock.running:
                self.clock.measured_steps += 1
            do_eval = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.steps
            # a stopping run saves once, after the loop, within the preemption grace
            do_save = self._save_due(step) and step < cfg.steps
            do_save = do_save and not reduction.stop
            do_log = step % self.logging.every == 0 or step == cfg.steps or do_eval
            stop_here = step == cfg.stop_at_step
            if do_log or do_eval or do_save or stop_here:
                was_running = self.clock.running
                self.clock.close()  # the window holds training steps only
                reduction.read()
                if do_eval:
                    self.last_eval = self._timed_eval()
                if do_log:
                    t0 = time.perf_counter()
                    record = {"step": step, **reduction.values, "lr": lr, "grad_norm": self._grad_norm(),
                              "samples": self.state.samples, "tokens": self.state.tokens,
                              **(self.last_eval if do_eval else {}), **self.performance(),
                              "peak_memory_bytes": peak_memory_bytes()}  # fmt: skip
                    self._write_record(record)
                    self._console(record)
                    self.clock.log_s += time.perf_counter() - t0
                if do_save:
                    save_started = time.perf_counter()
                    self.save(background=self.ckpt.async_save)
                    if self.ckpt.every == "auto":
                        self._plan_next_save(save_started)
                if was_running:
                    self.clock.open()
            if stop_here:
                log.info(f"train.stop_at_step={step}: saving and exiting with code {EXIT_PREEMPTED}")
                stopped = "stop_at_step"
                break
            if reduction.stop:
                why = self.stop.reason or "another rank's SIGTERM or launcher loss"
                if self.stop.reason:  # this rank's own signal or launcher: recorded by the rank that saw it
                    kind = "sigterm" if self.stop.reason == "SIGTERM" else "launcher_lost"
                    events.record(self.run_dir, kind, attempt=self.attempt, rank=collectives.rank(),
                                  step=step, why=self.stop.reason)  # fmt: skip
                log.warning(
                    f"SIGTERM: stopping after step {step} ({why}); saving, exit code {EXIT_PREEMPTED}"
                )
                stopped = "sigterm"
                break
        if self.clock.measured_steps == 0:  # every step was a warm-up step
            self.clock.warmup_s = self.clock.steps_outside(t_loop)
        self.clock.close()
        reduction.read()
        if reduction.values and reduction.step == self.state.step:
            self.last_loss = reduction.values["loss"]
        perf = self.performance()
        self.finish_pending_save()  # committed before the run ends, or its failure raised on every rank
        if not stopped and self.eval_set is not None:
            self.last_eval = self._timed_eval()
            if self.last_eval:
                log.info("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items()))
                self._write_record({"step": self.state.step, **self.last_eval})
        if self.state.step != self._last_saved and self._save_fits(stopped):
            self.save()
        return {**perf, **self.clock.breakdown(), "measured_steps": self.clock.measured_steps,
                "stopped": stopped}  # fmt: skip

    def _grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def close(self) -> None:
        """Release the loader's workers and finish wandb; safe to call more than once."""
        if self._iter is not None:  # end the iteration: the DataLoader shuts its workers down now
            close_iter = getattr(self._iter, "close", None)
            if close_iter is not None:
                close_iter()
            self._iter = None
        for obj in (self.loader, self.eval_set):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def next_attempt(run_dir: Path, rank: int) -> int:
    """This start's attempt number, counted from the run's first start (RUN_DIR/attempts.jsonl, rank 0).

    Every row of metrics.jsonl carries it, so the steps a restart re-does are visible and readers can take the
    latest attempt's row for each step.
    """
    number = 0
    if rank == 0:
        path = run_dir / "attempts.jsonl"
        number = 1 + (len(path.read_text().splitlines()) if path.exists() else 0)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"attempt": number, "time": time.time(), "host": socket.gethostname()}) + "\n")
    return int(collectives.broadcast_object(number))


def exit_code(perf: dict[str, Any]) -> int:
    return EXIT_PREEMPTED if perf.get("stopped") else 0


def write_replica_digest(run_dir: Path, module: torch.nn.Module, rank: int, world: int) -> None:
    """Each rank records a hash of its parameters and where it ran: a cheap cross-node consistency check."""
    from common.atomic import atomic_write_json
    from common.net import own_address

    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    info = {
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "params_sha256": h.hexdigest(),
        "address": own_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
    }
    atomic_write_json(run_dir / "replicas" / f"rank{rank}.json", info)
