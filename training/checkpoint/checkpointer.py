"""The trainer's checkpointing: where a run resumes from, when to save, how (synchronously or in the
background), and the restore.

``Checkpointer`` owns every decision about checkpoints: the resume (``plan``: the checkpoint to continue from,
found before the engine is built; ``load``: check, convert, load, the hooks that run after a load, the
trainer's state, re-seed, the schedule's rate; or ``train.init_from``'s weights), the interval
(``checkpoint.every``, or ``auto``: Young's interval from the save cost measured in the run and the failure
rate), the background save in flight and what the step's collective says of it, and the last save (at the end,
at ``train.stop_at_step``, and after SIGTERM only when it fits in ``checkpoint.preempt_grace_s``). It gets at
construction the checkpoint section and folder, the trainer's state (``training.state.TrainState``: what a
checkpoint holds beside the run's identity), the run's clock and length and the hooks; ``load`` gives it the
engine, the run's identity and where its events go.

A start calls ``plan()`` then ``load(...)``; the training loop calls three members, in this order:

* ``flags()`` in every step: this rank's numbers for the step's collective (``training.trainer.StepReduction``
  sums them over the ranks without reading them);
* ``after_step(...)`` after every step, with the newest sums on the host: it follows the background save and
  saves when one is due, and says whether the run must stop (a background save failed);
* ``close(...)`` after the loop: the save in flight finished, then the last save.

Storage, the write-and-vote protocol and the resume decision are in ``training.checkpoint.storage``,
``training.checkpoint.saving`` and ``training.checkpoint.resume``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.log import get_logger
from training import collectives, events
from training.checkpoint import saving
from training.checkpoint.resume import ResumePoint, RunIdentity, check_compatible, check_shared, find_resume
from training.checkpoint.storage import latest_complete, load, read_client_state, resolve, to_universal
from training.clock import Clock
from training.config import CheckpointSection
from training.events import EventLog
from training.optim.schedules import rates_at_current_step
from training.state import TrainState
from training.watch import StopRequest

log = get_logger("train")


def young_interval(save_s: float, step_s: float, job_mtbf_s: float) -> dict[str, float]:
    """Checkpoint interval from the failure rate: Young's first-order optimum sqrt(2 x C x MTBF).

    ``save_s``: the training stall of one save (C); ``step_s``: one optimizer step; ``job_mtbf_s``: the job's
    mean time between failures. Returns the interval in seconds and whole steps (at least 1) and the expected
    loss per failure: half an interval of re-done work on average (restart and load come on top).
    """
    interval_s = math.sqrt(2.0 * max(save_s, 1e-6) * job_mtbf_s)
    steps = max(1, int(round(interval_s / max(step_s, 1e-9))))
    return {"interval_s": interval_s, "steps": steps, "expected_loss_s": steps * step_s / 2.0}


class Checkpointer:
    def __init__(
        self,
        section: CheckpointSection,
        ckpt_dir: Path,
        state: TrainState,
        *,
        clock: Clock,
        steps: int,
        after_load: Sequence[Callable[[Any], None]] = (),
    ) -> None:
        self.cfg, self.dir, self.state, self.after_load = section, ckpt_dir, state, after_load
        # given by load(): the engine it restores and saves, the run's identity, where its events go
        self.engine: Any = None
        self.identity: RunIdentity | None = None
        self.log = EventLog(Path(), 0)
        self.point: ResumePoint | None = None  # plan()'s answer
        self.rank, self.world = collectives.rank(), collectives.world_size()
        self.clock = clock  # the run's: saving stalls training and is paused out of its window
        self.steps = steps  # train.steps: the run's last step is saved by close(), once
        self.last_save_s: float | None = None  # the training stall of the newest save
        self.full_save_s: float | None = None  # a whole save's duration (the grace check after SIGTERM)
        self.pending: saving.BackgroundSave | None = None
        self.host_buffers = saving.HostBuffers()  # background saves' host copies (pinned on accelerators)
        self.last_saved = -1
        self._begun = False
        self._auto_next: int | None = None  # checkpoint.every=auto: the step of the next save
        self._auto_mark = (0.0, 0)  # (perf_counter, step) at the end of the newest save

    # ------------------------------------------------------------------ the start's two calls
    def plan(self, *, world: int, global_batch: int, optimizer: str) -> ResumePoint | None:
        """Before the engine is built, on every rank: the checkpoint folder is shared by every rank, and the
        checkpoint the run continues from (``training.checkpoint.resume.find_resume``: rank 0 decides), or
        None. One line on every rank where one cannot be resumed."""
        check_shared(self.dir)
        self.point = find_resume(
            self.cfg, self.dir, world=world, global_batch=global_batch, steps=self.steps, optimizer=optimizer
        )
        return self.point

    def load(self, engine: Any, identity: RunIdentity, events_to: EventLog, init_from: Path | None = None) -> None:
        """The engine this run trains, restored from ``plan()``'s checkpoint with the trainer's state, or given
        ``init_from``'s weights (phase 2), or left as built; then saved by this checkpointer."""
        self.engine, self.identity, self.log = engine, identity, events_to
        point = self.point
        if point is not None:
            rng = self._restore(point)  # None at another world size: per-rank streams re-seed from the step
            self.state.load_state_dict({**point.saved, "rng": rng})  # after the engine
        elif init_from is not None:
            self._initialise_from(init_from)

    # ------------------------------------------------------------------ the training loop's three calls
    def flags(self) -> list[float]:
        """This rank's part of the step's collective: whether its files of the background save in flight are
        durable, and whether its write failed (``after_step`` gets the sums over the ranks)."""
        pending = self.pending
        return [float(pending is not None and pending.written), float(pending is not None and pending.failed)]

    def after_step(
        self,
        step: int,
        as_of: int,
        flags: Sequence[float],
        settle: Callable[[], bool],
    ) -> bool:
        """Once per step on every rank, after ``step``'s collective was launched. ``flags``: the sums over the
        ranks of ``flags()`` in the newest collective on the host, that of step ``as_of``; ``settle``: reads
        ``step``'s collective (waiting for it) and says whether the run stops at this step.

        It follows the background save in flight (rank 0 commits it once every rank's files are durable), and
        saves when a save is due, unless the run stops at this step or ends at it (``close`` saves then, within
        the preemption grace). False: a background save failed, and every rank stops at this step (``close``
        raises the line)."""
        if not self._begun:
            self._begin(step - 1)
        if not self._follow(step, as_of, round(flags[0]), flags[1] > 0):
            return False
        if self._due(step) and step < self.steps:
            with self.clock.paused():  # a due save waits for this step's stop flag (the one seen so far is older)
                if not settle():
                    self._save_scheduled(step)
        return True

    def close(self, step: int, stop: StopRequest | None = None) -> None:
        """After the loop, on every rank: the background save in flight committed (or its failure raised, the
        same line on every rank), then a save of ``step`` unless it is saved already or ``final_save`` is off,
        or, when the run stops for SIGTERM or a lost launcher (``stop``), unless the save does not fit in the
        grace left."""
        self._finish_pending()
        if stop is None and not self.cfg.final_save:
            return
        if step != self.last_saved and (stop is None or self._fits_after_sigterm(step, stop.at)):
            self._save(step)  # before the final evaluation, which can fail (out of memory)

    # ------------------------------------------------------------------ when
    def _begin(self, start: int) -> None:
        """The loop started after ``start`` (at the clock's ``loop_start``); ``auto`` saves first right after the
        warm-up, to measure the cost."""
        self._begun = True
        if self.cfg.every == "auto":
            self._auto_next = start + self.clock.warmup_steps + 1
            self._auto_mark = (self.clock.loop_start or time.perf_counter(), start)

    def _due(self, step: int) -> bool:
        every = self.cfg.every
        if every == "auto":
            return self._auto_next is not None and step >= self._auto_next
        return bool(every) and step % every == 0

    def _plan_next(self, step: int, save_started: float) -> None:
        """checkpoint.every=auto: Young's interval from this run's save cost and step time (every rank agrees
        on the worst of them: a save is collective)."""
        t_mark, s_mark = self._auto_mark
        if step > s_mark and self.last_save_s is not None and self.cfg.mtbf_hours:
            local_step_s = (save_started - t_mark) / (step - s_mark)
            save_s, step_s = collectives.all_reduce_values([self.last_save_s, local_step_s], "max")
            job_mtbf_s = self.cfg.mtbf_hours * 3600.0 / max(1, self.log.nodes)
            plan = young_interval(save_s, step_s, job_mtbf_s)
            self._auto_next = step + int(plan["steps"])
            if self.rank == 0:
                log.info(
                    f"checkpoint.every=auto: save {save_s:.2f} s, step {step_s:.3f} s, job MTBF "
                    f"{job_mtbf_s / 3600:.1f} h ({self.cfg.mtbf_hours:g} h per node / {self.log.nodes} nodes): "
                    f"every {int(plan['steps'])} steps ({plan['interval_s'] / 60:.1f} min); expected loss "
                    f"per failure {plan['expected_loss_s'] / 60:.1f} min of re-done steps plus the restart"
                )
                events.record(
                    self.log.run_dir,
                    "checkpoint_interval",
                    attempt=self.log.attempt,
                    rank=0,
                    step=step,
                    every_steps=int(plan["steps"]),
                    # microseconds: a save of a few ms recorded to 0.1 ms was 0.2% off (the plan is checked from these)
                    interval_s=round(plan["interval_s"], 6),
                    save_s=round(save_s, 6),
                    step_s=round(step_s, 6),
                    job_mtbf_s=round(job_mtbf_s, 1),
                    expected_loss_s=round(plan["expected_loss_s"], 3),
                )
        self._auto_mark = (time.perf_counter(), step)

    def _fits_after_sigterm(self, step: int, requested_at: float | None) -> bool:
        """After SIGTERM: whether a save can finish in what remains of ``checkpoint.preempt_grace_s``, judged by
        the previous save's duration (unknown: try). Rank 0 decides for every rank (a save is collective)."""
        now = time.monotonic()
        remaining = self.cfg.preempt_grace_s - (now - (requested_at or now))
        fits = self.full_save_s is None or self.full_save_s <= remaining
        if not collectives.broadcast_object(fits):
            log.warning(
                f"SIGTERM: no checkpoint at step {step}: the last save took {self.full_save_s or 0:.1f} s and "
                f"{max(0.0, remaining):.1f} s of checkpoint.preempt_grace_s={self.cfg.preempt_grace_s:g} "
                f"remain; the next start resumes from {latest_complete(self.dir) or 'the beginning'}"
            )
            return False
        return True

    # ------------------------------------------------------------------ saving
    def _save(self, step: int, background: bool = False) -> str:
        """Save at ``step`` (the trainer's state: step, samples, tokens, loader position): synchronously, or
        (``background``, ``checkpoint.async_save``) with the files written while training goes on and
        committed once every rank reports them durable. A save first finishes the background one in flight."""
        t0 = time.perf_counter()
        self._finish_pending()  # its wait is part of this save's stall (and of checkpoint.every=auto's C)
        t1 = time.perf_counter()
        assert self.identity is not None  # given by load()
        progress = self.state.state_dict()
        rng = progress.pop("rng")  # this rank's: a file of its own, beside the client state every rank shares
        client = {**self.identity.to_dict(), **progress}
        counted: dict[str, float] = {k: progress[k] for k in ("tokens", "flops") if k in progress}  # for segments
        if background:
            pending = saving.save_in_background(self.engine, self.dir, step, client, rng, self.host_buffers)
            pending.counted = counted
            tag = pending.tag
        else:
            tag = saving.save(
                self.engine,
                self.dir,
                step,
                client,
                rng,
                self.cfg.keep,
                on_commit=lambda tag: self._record(step, tag, time.perf_counter() - t0, **counted),
            )
        self.last_save_s = time.perf_counter() - t0
        self._stalled(time.perf_counter() - t1)  # the wait above is counted where it happened
        self.last_saved = step
        if background:
            pending.stall_s, pending.done_at = self.last_save_s, time.time()
            self.pending = pending
        else:
            self.full_save_s = self.last_save_s
            log.info(f"saved checkpoint {self.dir / tag}")
        return tag

    def _save_scheduled(self, step: int) -> None:
        """A due save: in the background when ``checkpoint.async_save``; with ``checkpoint.every=auto``, the
        next save is planned from this one's cost."""
        started = time.perf_counter()
        self._save(step, background=self.cfg.async_save)
        if self.cfg.every == "auto":
            self._plan_next(step, started)

    def _stalled(self, seconds: float) -> None:
        self.clock.save_s += seconds

    def _record(self, step: int, tag: str, save_s: float, **more: Any) -> None:
        if self.rank == 0:
            events.record(
                self.log.run_dir,
                "checkpoint",
                attempt=self.log.attempt,
                rank=0,
                step=step,
                tag=tag,
                save_s=round(save_s, 4),
                **more,
            )

    def _committed(self, pending: saving.BackgroundSave) -> None:
        """Every rank, once the background save's commit stood (its event is already written)."""
        self.full_save_s = pending.stall_s + pending.write_s
        log.info(f"saved checkpoint {self.dir / pending.tag} (written in the background in {pending.write_s:.2f} s)")

    def _record_background(self, pending: saving.BackgroundSave) -> saving.OnCommit:
        """The event of a background save, for rank 0 to write the moment its commit is on disk."""
        return lambda tag: self._record(
            pending.step,
            tag,
            pending.stall_s,
            write_s=round(pending.write_s, 4),
            done_at=pending.done_at,
            **pending.counted,
        )

    def _follow(self, step: int, as_of: int, written: int, failed: bool) -> bool:
        """What the step's collective says of the background save in flight, as of step ``as_of``
        (``written``: ranks whose files are durable; ``failed``: a rank's write or rank 0's commit failed):
        every rank's files are durable (rank 0 commits now), the commit stood (the save is done), or a
        failure: False, and every rank stops at ``step`` (``close`` raises the line)."""
        pending = self.pending
        if pending is None or as_of <= pending.reported_step:
            return True
        if failed:
            log.warning(f"stopping after step {step}: a background checkpoint save failed")
            return False
        if pending.committed:  # and no rank reported the commit failed
            self.pending = None
        elif written == self.world:
            with self.clock.paused():  # rank 0's commit (COMPLETE, latest, old tags removed) is not training time
                t0 = time.perf_counter()
                if pending.commit(self.cfg.keep, self._record_background(pending)):
                    self._committed(pending)
                self._stalled(time.perf_counter() - t0)
            pending.reported_step = step  # the next collective says whether the commit stood
        return True

    def _finish_pending(self) -> None:
        """Every rank at the same point: wait for the background save in flight (if any) and commit it, or
        raise its failure (the same line on every rank)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        already = pending.committed
        pending.finish(self.cfg.keep, self._record_background(pending))
        self._stalled(time.perf_counter() - t0)  # waiting for it stalls training too
        if not already:
            self._committed(pending)

    # ------------------------------------------------------------------ loading
    def _restore(self, point: ResumePoint) -> dict[str, Any] | None:
        """check -> convert -> load -> hooks: continue a run's engine from ``point`` on every rank; returns this
        rank's saved RNG states (None from a universal checkpoint), which ``load`` gives the trainer's state.

        The learning rate of the first resumed step comes from this run's schedule (which may be longer than
        the saved run's), not from the rate stored in the optimizer state.
        """
        assert self.identity is not None
        check_compatible(point.saved, self.identity, point.ckpt_dir / point.tag)
        wait_s = self.cfg.convert_timeout_s
        tag = to_universal(point.ckpt_dir, point.tag, wait_s) if point.universal else point.tag
        rng = load(self.engine, point.ckpt_dir, tag)
        for hook in self.after_load:  # the optimizer was loaded: e.g. LANS's per-tensor layout, from its links
            hook(self.engine)
        if self.engine.lr_scheduler is not None:
            rates_at_current_step(self.engine.lr_scheduler)
        self.last_saved = point.saved["step"]
        log.info(f"resumed from {point.ckpt_dir / tag} at step {point.saved['step']}")
        return rng

    def _initialise_from(self, path: Path) -> None:
        """Phase 2: this checkpoint's weights, with a fresh optimizer, step count and schedule."""
        assert self.identity is not None
        init_dir, init_tag = resolve(path, "train.init_from")
        check_compatible(read_client_state(init_dir, init_tag), self.identity, init_dir / init_tag)
        load(self.engine, init_dir, init_tag, module_only=True)  # no optimizer state: no hooks
        log.info(f"initialised weights from {init_dir / init_tag} (fresh optimizer, step count and schedule)")
