"""The training loop: a thin, stateful trainer around a DeepSpeed engine.

``Trainer.train()`` runs optimizer steps until ``train.steps``, ``train.stop_at_step`` or a stop request
(SIGTERM, a launcher gone: ``training.watch``), logging on rank 0 (``training.logbook``), evaluating and
handing the checkpoints to its ``Checkpointer`` (``flags()`` and ``after_step()`` each step, ``close()`` once).
Everything needed to continue exactly (step, samples, tokens, loader position, RNG states) is its
``training.state.TrainState``, which the checkpointer saves and restores; ``close()`` always runs.

Host synchronisation. Inside a step nothing waits for the device: the micro-batch losses are summed on the
device. At the end of a step one collective (``StepReduction``) carries the step's loss pieces and the named
flags, and what the ranks have computed so far (``model.flops.Work``: tokens and FLOPs, counted on the host
from each micro-batch, so the job's token and FLOP counts cost no collective of their own); its result is
copied to the host without blocking and read one step later, when it is long complete. Only logging,
evaluation, checkpoint and stopping steps read the current step's values at once.

Time accounting (``training.clock.Clock``): the throughput window holds only the training steps after the
warm-up ones; time spent evaluating, saving and logging is paused out of it and reported as ``eval_s``,
``save_s`` and ``log_s``. Waiting for data is counted only inside the window, so ``data_wait_fraction`` lies
in [0, 1].
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple
from typing import TYPE_CHECKING, Any

import torch

from common.errors import EXIT_PREEMPTED
from common.log import get_logger
from model.compile import compile_stats
from model.family import Family
from model.flops import NO_WORK, Work, WorkCounter
from training import collectives, events
from training.checkpoint.checkpointer import Checkpointer
from training.clock import Clock, peak_memory_bytes, synchronize
from training.config import TrainSection
from training.devices import out_of_memory, to_device
from training.evaluate import evaluate
from training.events import EventLog
from training.logbook import Logbook
from training.metrics import flops_per_sec_per_device, mfu, throughput
from training.state import TrainState
from training.watch import DataWatchdog, StopRequest

if TYPE_CHECKING:
    from model.unpad import AttentionKernel

log = get_logger("train")


class StepReduction:
    """Per step, one collective of the loss pieces, the stop flag, the checkpointer's numbers and the work
    counts; read on the host without stalling the device. ``stop``: a rank asked to stop (SIGTERM, its launcher
    gone). ``carried``: ``n_carried`` numbers the trainer does not read, summed over the ranks (the
    checkpointer's ``flags()``: every rank learns at the same step what its background save's ranks report)."""

    def __init__(self, device: torch.device, n_carried: int = 0, loss_parts: Sequence[str] = ()) -> None:
        self.device = device
        self.n_carried = n_carried
        self.loss_parts = loss_parts  # the model family's outputs summed beside the loss, where it returns them
        self.names: list[str] = []  # "loss" and the pieces the model returns, fixed at the first micro-batch
        self.host: torch.Tensor | None = None
        self.event: Any = None  # the accelerator's Event (DeepSpeed's abstraction: untyped)
        self.pending: int | None = None  # the step whose values are in flight
        self.counts: list[float] = []  # the trainer's cumulative counts, summed over the ranks, as of ``step``
        self.step = 0  # the newest step whose values are on the host
        self.values: dict[str, float] = {}
        self.carried = [0.0] * n_carried  # summed over the ranks, as of ``step``
        self.stop = False  # sticky: once a rank asked, every rank stops

    def name_pieces(self, out: dict[str, torch.Tensor]) -> list[str]:
        if not self.names:
            self.names = ["loss", *(k for k in self.loss_parts if k in out)]
            pinned = self.device.type == "cuda"
            size = len(self.names) + 1 + self.n_carried + self.n_counts
            self.host = torch.zeros(size, dtype=torch.float64, pin_memory=pinned)
        return self.names

    n_counts = 2 * len(astuple(NO_WORK))

    def launch(
        self,
        step: int,
        sums: torch.Tensor,
        counts: list[float] | None = None,
        *,
        stop: bool = False,
        carried: Sequence[float] = (),
    ) -> None:
        """Start the step's collective: ``sums`` (the loss pieces), this rank's ``counts`` (``n_counts``
        numbers; none: zeros), its stop request and its ``carried`` numbers (``n_carried``; none: zeros)."""
        counts = [0.0] * self.n_counts if counts is None else counts
        carried = carried or [0.0] * self.n_carried
        assert len(counts) == self.n_counts and len(carried) == self.n_carried, (counts, carried)
        # the host's numbers in one copy, from pinned memory on CUDA: the host does not wait for the device
        host = [float(stop), *map(float, carried), *map(float, counts)]
        on = torch.tensor(host, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        on = on.to(self.device, non_blocking=True)
        # the loss sums live on the compute device, the collective on the communication device (the CPU
        # under gloo, also with a GPU): one tensor on the latter
        vec = torch.cat([sums.to(self.device, torch.float64), on])
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
        n = len(self.names)
        self.step, self.values = self.pending, dict(zip(self.names, vals[:n]))
        self.stop = self.stop or vals[n] > 0
        self.carried = vals[n + 1 : n + 1 + self.n_carried]
        self.counts = vals[n + 1 + self.n_carried :]
        self.pending = None


class Trainer:
    def __init__(
        self,
        engine,
        loader,
        *,
        state: TrainState,
        train: TrainSection,
        checkpointer: Checkpointer,
        logbook: Logbook,
        events_to: EventLog,
        grad_accum: int,
        count: WorkCounter,
        peak_flops: float | None,
        clock: Clock,
        log_every: int,
        family: Family,
        eval_set=None,
        data_watchdog: DataWatchdog | None = None,
    ) -> None:
        self.engine, self.loader, self.eval_set = engine, loader, eval_set
        self.cfg, self.grad_accum, self.count, self.peak_flops = train, grad_accum, count, peak_flops
        self.checkpointer, self.logbook, self.log_every = checkpointer, logbook, log_every
        self.events_to = events_to
        self.data_watchdog = data_watchdog
        self.family = family  # the model family's record: its logged loss parts and its evaluation
        self.world = collectives.world_size()
        self.state = state  # the checkpointer's too: it saves and restores it
        self.clock = clock  # the checkpointer's too: it pauses its saves out of the throughput window
        self.stop = StopRequest()
        self.device = engine.device
        self._iter: Iterator[dict[str, torch.Tensor]] | None = None
        self.last_eval: dict[str, float] = {}
        self.last_loss: float | None = None
        # what this start computed, as model.flops.Work: this rank's (all steps; the window's), and every
        # rank's as of the reduction's newest step
        self.work, self.window_work = NO_WORK, NO_WORK
        self.job_work, self.job_window_work = NO_WORK, NO_WORK
        self._base = (0, 0.0)  # tokens and FLOPs before this start (from the checkpoint)
        # this start's first step (compilation included): outside the window unless logging.warmup_steps=0
        self.first_step_s: float | None = None

    @property
    def attention_kernel(self) -> AttentionKernel | None:
        """The attention kernel the model's last forward ran over its packed tokens (the family record's
        ``attention_kernel``: resolved in the model's eager code from the runtime device and dtype), None for a
        model that does not unpad; each metrics row and the summary record its name."""
        return self.family.kernel_ran(self.engine.module)

    def _kernel_record(self) -> dict[str, Any]:
        ran = self.attention_kernel
        return {"attention_kernel": None if ran is None else ran.name}

    def _announce_kernel(self) -> None:
        """After this start's first step, the kernel that ran beside the one asked for (and why auto fell back)."""
        ran = self.attention_kernel
        if ran is not None:
            why = f"; {ran.reason}" if ran.reason else ""
            log.info(
                f"model.unpad: {self.family.title} computes its real tokens only, {ran.name} attention kernel "
                f"(model.unpad_attention={ran.asked}{why})"
            )

    # ------------------------------------------------------------------ steps
    def _next_batch(self) -> tuple[dict[str, torch.Tensor], Work]:
        """The next micro-batch on the device, and its work counted on the host."""
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
        return to_device(batch, self.device), self.count(batch)

    def train_step(self, reduction: StepReduction) -> float:
        """One optimizer step: grad_accum micro-batches, then DeepSpeed's step (clip, optimizer, schedule).

        Returns the learning rate the step used; the loss pieces arrive through ``reduction``.
        """
        self.engine.train()
        lr = float(self.engine.get_lr()[0])
        sums: torch.Tensor | None = None
        work = NO_WORK
        for _ in range(self.grad_accum):
            batch, counted = self._next_batch()
            work += counted
            try:
                out = self.engine(**batch)
                self.engine.backward(out["loss"])
                self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            except torch.OutOfMemoryError:
                raise out_of_memory(self.cfg.micro_batch) from None
            pieces = torch.stack([out[k].detach().float() for k in reduction.name_pieces(out)])
            sums = pieces if sums is None else sums + pieces
        assert sums is not None
        self.state.step += 1
        self.state.samples += self.cfg.global_batch
        self.work += work
        if self.clock.running:  # the step is in the throughput window
            self.window_work += work
        # Mean over the global batch: every micro-batch of every rank weighs the same.
        reduction.launch(
            self.state.step,
            sums / (self.grad_accum * self.world),
            [*astuple(self.work), *astuple(self.window_work)],
            stop=self.stop.requested,
            carried=self.checkpointer.flags(),
        )
        return lr

    def _read(self, reduction: StepReduction) -> None:
        """The step's collective read on the host, and the job's counts with it (``state.tokens``/``flops``)."""
        reduction.read()
        if reduction.counts:
            half = len(reduction.counts) // 2
            job, window = reduction.counts[:half], reduction.counts[half:]
            self.job_work, self.job_window_work = Work(*map(round, job)), Work(*map(round, window))
            self.state.tokens = self._base[0] + self.job_work.computed
            self.state.flops = self._base[1] + float(self.job_work.flops)

    def _settle(self, reduction: StepReduction) -> bool:
        """The current step's collective read (waiting for it); whether the run stops at this step."""
        self._read(reduction)
        return reduction.stop

    def evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        try:
            result = evaluate(self.engine, self.eval_set, self.device, self.family.evaluation)
        except torch.OutOfMemoryError:
            raise out_of_memory(self.cfg.micro_batch, "evaluation") from None
        self.clock.eval_s += time.perf_counter() - t0
        return result

    # ------------------------------------------------------------------ reporting
    def performance(self) -> dict[str, Any]:
        """Throughput over the measured window (training steps only), with its MFU and data-wait fraction."""
        seconds = self.clock.seconds()
        if self.clock.measured_steps <= 0 or seconds <= 0:
            return {}
        window = self.job_window_work
        tp = throughput(self.clock.measured_steps * self.cfg.global_batch, window.computed, seconds, self.world)
        achieved = flops_per_sec_per_device(window.flops, seconds, self.world)
        return {
            "sequences_per_sec": tp.sequences_per_sec,
            "tokens_per_sec": tp.tokens_per_sec,
            "sequences_per_sec_per_device": tp.sequences_per_sec_per_device,
            "tokens_per_sec_per_device": tp.tokens_per_sec_per_device,
            "tflops_per_device": achieved / 1e12,
            "mfu": mfu(achieved, self.peak_flops),
            "flops_per_token": window.flops / window.computed if window.computed else None,
            "data_wait_fraction": self.clock.data_wait_s / seconds,
        }

    def _log_step(self, step: int, reduction: StepReduction, lr: float, with_eval: bool) -> None:
        t0 = time.perf_counter()
        record = {
            "step": step,
            **reduction.values,
            "lr": lr,
            "grad_norm": self._grad_norm(),
            "samples": self.state.samples,
            "tokens": self.state.tokens,
            **(self.last_eval if with_eval else {}),
            **self.performance(),
            "peak_memory_bytes": peak_memory_bytes(),
            **self._kernel_record(),
            **(compile_stats() or {}),
        }
        self.logbook.write(record)
        self.logbook.console(record)
        self.clock.log_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        """Run to ``train.steps``; returns the performance figures and whether the run stopped early."""
        cfg, ckpt = self.cfg, self.checkpointer
        start_step = self.state.step
        warm_until = start_step + self.clock.warmup_steps
        reduction = StepReduction(
            collectives.comm_device(), n_carried=len(ckpt.flags()), loss_parts=self.family.loss_parts
        )
        self._base = (self.state.tokens, self.state.flops)
        stopped = ""
        t_loop = self.clock.start_loop()
        while self.state.step < cfg.steps:
            if not self.clock.running and self.state.step >= warm_until:
                self.clock.open()
                self.clock.warmup_s = self.clock.steps_outside(t_loop)
            t_step = time.perf_counter()
            lr = self.train_step(reduction)
            if self.first_step_s is None:  # compilation (model.compile) and first-touch allocations included
                synchronize()
                self.first_step_s = time.perf_counter() - t_step
                self._announce_kernel()
            step = self.state.step
            # the checkpointer's part of the step: a due save comes before this step's evaluation and log
            settle = functools.partial(self._settle, reduction)  # read only if the checkpointer saves
            if not ckpt.after_step(step, reduction.step, reduction.carried, settle):
                stopped = "save_failed"  # every rank at this step; the checkpointer's close raises the line
                break
            if self.clock.running:
                self.clock.measured_steps += 1
            do_eval = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.steps
            do_log = step % self.log_every == 0 or step == cfg.steps or do_eval
            stop_here = step == cfg.stop_at_step
            if do_log or do_eval or stop_here:
                with self.clock.paused():  # the window holds training steps only
                    self._read(reduction)
                    if do_eval:
                        self.last_eval = self.evaluate()
                    if do_log:
                        self._log_step(step, reduction, lr, do_eval)
            if stop_here:
                log.info(f"train.stop_at_step={step}: saving and exiting with code {EXIT_PREEMPTED}")
                stopped = "stop_at_step"
                break
            if reduction.stop:
                self._read(reduction)  # the counts the stop's event records are this step's
                self._stopping(step)
                stopped = "sigterm"
                break
        if self.clock.measured_steps == 0:  # every step was a warm-up step
            self.clock.warmup_s = self.clock.steps_outside(t_loop)
        self.clock.close()
        self._read(reduction)
        if reduction.values and reduction.step == self.state.step:
            self.last_loss = reduction.values["loss"]
        perf = self.performance()
        step = self.state.step
        ckpt.close(step, self.stop if stopped == "sigterm" else None)
        if not stopped and self.eval_set is not None:
            self.last_eval = self.evaluate()
            if self.last_eval:
                log.info("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items()))
                self.logbook.write({"step": step, **self.last_eval, **self._kernel_record()})
        ran = self.attention_kernel
        return {
            **perf,
            "attention_kernel": None if ran is None else ran.name,
            "attention_kernel_reason": None if ran is None else ran.reason,
            **self.clock.breakdown(),
            "measured_steps": self.clock.measured_steps,
            "padding_fraction": self.job_work.padding_fraction,
            "first_step_s": self.first_step_s,
            "stopped": stopped,
        }

    def _stopping(self, step: int) -> None:
        why = self.stop.reason or "another rank's SIGTERM or launcher loss"
        if self.stop.reason:  # this rank's own signal or launcher: recorded by the rank that saw it
            kind = "sigterm" if self.stop.reason == "SIGTERM" else "launcher_lost"
            events.record(
                self.events_to.run_dir,
                kind,
                attempt=self.events_to.attempt,
                rank=collectives.rank(),
                step=step,
                tokens=self.state.tokens,
                flops=self.state.flops,
                why=self.stop.reason,
            )
        log.warning(f"SIGTERM: stopping after step {step} ({why}); saving, exit code {EXIT_PREEMPTED}")

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
        for obj in (self.loader, self.eval_set, self.data_watchdog):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self.logbook.close()


def exit_code(perf: dict[str, Any]) -> int:
    return EXIT_PREEMPTED if perf.get("stopped") else 0
