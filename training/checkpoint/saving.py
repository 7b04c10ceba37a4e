"""Writing a checkpoint tag and committing it: the synchronous save, the background save and the vote.

A tag is committed (``COMPLETE``, then ``latest``: ``training.checkpoint.storage``'s layout) only once every rank's
files of it are written and fsynced, and every rank learns the outcome at the same point:

* **synchronous** (``save``): each rank writes and fsyncs its part, the ranks vote in one all-gather
  (``collectives.first_failure``, also the commit barrier), rank 0 commits, and they vote on the commit: a
  failure anywhere is the same one line on every rank, and the partial tag is removed;
* **background** (``save_in_background``, ``checkpoint.async_save``): DeepSpeed's save runs with its file
  writes replaced by copies to host memory, and a thread per rank writes them while training goes on. Each
  rank reports its part durable or failed in the step's collective (``StepReduction``'s ``save_written`` and
  ``save_failed`` flags); rank 0 commits once every rank has, and the next step's collective says whether the
  commit stood. ``BackgroundSave.finish`` is the synchronous ending (before the next save and at the end).

DeepSpeed's own file writes record their error instead of raising past its barriers (``_EngineWrites``), so
the failing rank still reaches the vote instead of leaving its peers to time out.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_path, atomic_write_json, atomic_write_text
from common.errors import UserError
from training import collectives, ownership
from training.checkpoint.storage import (
    COMPLETE,
    FORMAT,
    LATEST,
    UNIVERSAL_PREFIX,
    complete_tags,
    describe_write_error,
    fsync_dir,
    fsync_tree,
    incomplete_tags,
    read_latest,
    tag_files,
    tag_for,
)

OnCommit = Callable[[str], None] | None
"""Called once on rank 0 with the tag as soon as ``latest`` names it (the next start resumes from it): before old
tags are removed and before the ranks vote on the commit. The run's ``checkpoint`` event is written there, so
that neither a peer lost in that vote nor a failure after the rename leaves a resumable tag without its event."""


def save(
    engine,
    ckpt_dir: Path,
    step: int,
    client_state: dict[str, Any],
    rng: dict[str, Any],
    keep: int,
    on_commit: OnCommit = None,
) -> str:
    """Save on every rank; commit (COMPLETE, then ``latest``) only when every rank has written its part.
    ``client_state`` is every rank's (rank 0 writes it), ``rng`` this rank's RNG states (``rng_rank{R}.pt``)."""
    tag = tag_for(step)
    rank = collectives.rank()
    extra = _start_save(engine, ckpt_dir, tag, rank)
    guard = _EngineWrites(engine, engine.checkpoint_engine.save, (OSError, RuntimeError))
    error = None
    try:
        with guard:  # a failed write does not skip DeepSpeed's own barriers: every rank reaches the vote below
            engine.save_checkpoint(
                str(ckpt_dir), tag=tag, client_state={"client": client_state, **extra}, save_latest=False
            )
        if guard.error is not None:
            raise guard.error
        with atomic_path(ckpt_dir / tag / f"rng_rank{rank}.pt") as tmp:
            torch.save(rng, tmp)
        if rank == 0:
            atomic_write_json(ckpt_dir / tag / "client_state.json", {"format": FORMAT, **client_state})
        fsync_tree(ckpt_dir / tag, rank)  # this rank's files are on disk before it votes to commit
    except (OSError, RuntimeError) as e:
        error = describe_write_error(e, ckpt_dir)
    failed = collectives.first_failure(error)  # the commit vote, also the commit barrier
    if failed:
        _give_up(ckpt_dir, tag, rank)
        raise UserError(_failed_save(ckpt_dir, tag, failed))
    _voted_commit(ckpt_dir, tag, keep, rank, on_commit)
    return tag


def _start_save(engine, ckpt_dir: Path, tag: str, rank: int) -> dict[str, Any]:
    """What both kinds of save do first: rank 0 removes tags that never completed (a crash, a full disk,
    a background save that failed: their space first); returns the universal-checkpoint info."""
    if rank == 0:
        ownership.fence()  # another job's run now: its save in flight is not ours to remove
        for partial in incomplete_tags(ckpt_dir):
            if partial != tag:
                shutil.rmtree(ckpt_dir / partial, ignore_errors=True)
    from deepspeed.checkpoint.constants import (  # deferred: importing DeepSpeed takes seconds
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    # The (empty) universal-checkpoint info lets DeepSpeed's ds_to_universal convert this checkpoint for a
    # resume on another world size: no tensor- or pipeline-parallel slicing to describe.
    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def _give_up(ckpt_dir: Path, tag: str, rank: int) -> None:
    """Rank 0 removes a tag that failed (its space is what a full disk lacks), unless ``latest`` already names
    it (a commit that failed after its last rename: the tag is whole)."""
    if rank == 0 and read_latest(ckpt_dir) != tag:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def _try_commit(ckpt_dir: Path, tag: str, keep: int, rank: int, on_commit: OnCommit) -> str | None:
    """Rank 0 commits; the error (one line) if it could not, None otherwise and on other ranks."""
    if rank != 0:
        return None
    ownership.fence()  # a run taken over by another job: rank 0 ends here, before COMPLETE and latest
    try:
        _commit(ckpt_dir, tag)
    except OSError as e:
        if on_commit is not None and read_latest(ckpt_dir) == tag:  # renamed before the failure: whole (_give_up)
            on_commit(tag)
        return describe_write_error(e, ckpt_dir)
    if on_commit is not None:
        on_commit(tag)
    try:
        _remove_old(ckpt_dir, keep)
    except OSError as e:
        return describe_write_error(e, ckpt_dir)
    return None


def _voted_commit(ckpt_dir: Path, tag: str, keep: int, rank: int, on_commit: OnCommit) -> None:
    """Rank 0 commits and every rank learns whether it could (a full disk can refuse even COMPLETE): the same
    one line on every rank, instead of rank 0 failing alone while the others wait for it."""
    failed = collectives.first_failure(_try_commit(ckpt_dir, tag, keep, rank, on_commit))
    if failed:
        _give_up(ckpt_dir, tag, rank)
        raise UserError(_failed_save(ckpt_dir, tag, failed))


def _commit(ckpt_dir: Path, tag: str) -> None:
    """Rank 0, once every rank's files of ``tag`` are durable: COMPLETE (listing them), then ``latest``."""
    atomic_write_json(ckpt_dir / tag / COMPLETE, {"files": tag_files(ckpt_dir / tag)})
    fsync_dir(ckpt_dir / tag)
    atomic_write_text(ckpt_dir / LATEST, tag + "\n")
    fsync_dir(ckpt_dir)


def _remove_old(ckpt_dir: Path, keep: int) -> None:
    """After a commit: complete tags beyond the newest ``keep`` and universal conversions of removed tags go."""
    for old in complete_tags(ckpt_dir)[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    kept = set(complete_tags(ckpt_dir))
    for converted in ckpt_dir.glob(UNIVERSAL_PREFIX + "*"):
        if converted.name.removeprefix(UNIVERSAL_PREFIX) not in kept:
            shutil.rmtree(converted, ignore_errors=True)


class HostBuffers:
    """Host memory for the copies of background saves, reused from one save to the next.

    The pool is sized at the first save: the i-th tensor a save copies takes the i-th buffer (a save copies
    the same tensors in the same order every time), and a buffer whose shape, strides or dtype no longer match
    is replaced. Copies of accelerator tensors go to pinned buffers with ``non_blocking=True``, and an event
    recorded after the last one is what the writer thread waits on before it reads (``ready``); copies of CPU
    tensors are plain synchronous copies into ordinary buffers. One save holds the pool from ``start`` until its
    writer is done (``release``); a save that starts while another holds it gets buffers of its own.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._pinned: list[bool] = []
        self._lock = threading.Lock()
        self._held = False

    def start(self) -> _HostCopies:
        """The copies of one save: this pool's buffers, or fresh ones while another save holds them."""
        with self._lock:
            mine = not self._held
            self._held = self._held or mine
        return _HostCopies(self if mine else None)

    def release(self) -> None:
        with self._lock:
            self._held = False

    def buffer(self, i: int, t: torch.Tensor, pinned: bool) -> torch.Tensor:
        if i < len(self._bufs):
            buf = self._bufs[i]
            if (
                buf.shape == t.shape
                and buf.stride() == t.stride()
                and buf.dtype == t.dtype
                and self._pinned[i] == pinned
            ):
                return buf
        buf = _empty_host(t, pinned)
        if i < len(self._bufs):
            self._bufs[i], self._pinned[i] = buf, pinned
        else:
            self._bufs.append(buf)
            self._pinned.append(pinned)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._bufs)


def _empty_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """Host memory shaped like ``t`` (its strides where dense, as ``t.to("cpu", copy=True)`` would give), of
    ``t``'s size only: a view of a larger storage is saved without the rest of it."""
    return torch.empty_like(t, device="cpu", pin_memory=pinned)


class _HostCopies:
    """One save's copies to host memory (see ``HostBuffers``); ``pool`` None: fresh buffers."""

    def __init__(self, pool: HostBuffers | None) -> None:
        self.pool = pool
        self.count = 0
        self.event: Any = None  # recorded after the last asynchronous copy

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        pinned = t.device.type != "cpu"
        if self.pool is not None:
            buf = self.pool.buffer(self.count, t, pinned)
        else:
            buf = _empty_host(t, pinned)
        self.count += 1
        buf.copy_(t, non_blocking=pinned)
        if pinned:
            self.event = torch.Event(device=t.device)
            self.event.record()  # on the device's current stream: after every copy queued so far
        return buf

    def ready(self) -> None:
        """Wait until every copy has landed in host memory (the writer thread, before it reads)."""
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        if self.pool is not None:
            self.pool.release()


def _host_copy(obj: Any, copies: _HostCopies, memo: dict | None = None) -> Any:
    """A copy of a state dict that no longer changes with training: tensors copied to host memory
    (``copies``), other objects deep-copied. Tensors that are the same view of one storage (tied weights) stay
    one tensor, so the file does not grow."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key not in memo:
            memo[key] = copies.copy(t)
        return memo[key]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = _host_copy(v, copies, memo)
        return out
    if isinstance(obj, list):
        return [_host_copy(v, copies, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [_host_copy(v, copies, memo) for v in obj]
        if hasattr(obj, "_fields"):  # a named tuple takes its fields one by one
            return type(obj)(*items)
        return type(obj)(items)  # a tuple, or a subclass such as torch.Size
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return obj  # immutable
    return copy.deepcopy(obj)  # anything else can change with training (a live loss scaler): a snapshot


class BackgroundSave:
    """A checkpoint whose files a thread writes while training goes on (``checkpoint.async_save``).

    The commit protocol is the synchronous save's: the tag is committed (COMPLETE, then ``latest``) only
    once every rank's files are written and fsynced. Each rank learns that the others are done through the
    step's collective (``StepReduction``: ``written`` and ``failed`` are this rank's part of it); nothing
    waits on files another rank should have written. ``commit`` is rank 0's part once every rank reported
    its files written; a commit that fails sets ``error`` like a failed write, for the next step's collective.
    ``finish`` is the synchronous ending: wait, vote, commit (unless done), vote: every rank raises the same
    line on a failure.
    """

    def __init__(
        self,
        ckpt_dir: Path,
        step: int,
        rank: int,
        writes: list[tuple[Any, str]],
        client_state: dict[str, Any] | None,
        error: str | None = None,
        copies: _HostCopies | None = None,
    ) -> None:
        self.ckpt_dir, self.step, self.tag, self.rank = ckpt_dir, step, tag_for(step), rank
        self.error = error  # set before the thread starts: nothing is written
        self.write_s = 0.0
        self.stall_s = 0.0  # set by the caller: the training stall it caused,
        self.done_at = 0.0  # and when that stall ended (time.time())
        self.counted: dict[str, float] = {}  # the run's tokens and FLOPs at ``step``, for its event
        self.committed = False
        self.reported_step = step  # the step after which the ranks' next report is awaited
        self._ok = False
        self._writes, self._client = writes, client_state
        self._copies = copies or _HostCopies(None)
        self._thread = threading.Thread(target=self._run, name=f"save-{self.tag}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        where = self.ckpt_dir / self.tag
        try:
            if self.error is None:
                self._copies.ready()
                for state, target in self._writes:
                    with atomic_path(target) as tmp:
                        torch.save(state, tmp)
                if self._client is not None:
                    atomic_write_json(where / "client_state.json", self._client)
                fsync_tree(where, self.rank)
                self._ok = True
        except (OSError, RuntimeError) as e:
            self.error = describe_write_error(e, self.ckpt_dir)
        except BaseException as e:  # whatever stops the writer, its files are not whole: never committed
            self.error = f"the writer thread failed: {type(e).__name__}: {e}"
        finally:
            self._writes = []  # the host copies go now (their buffers back to the pool)
            self._copies.release()
            self.write_s = time.perf_counter() - t0

    @property
    def written(self) -> bool:
        """This rank's files are written and durable."""
        return not self._thread.is_alive() and self._ok and self.error is None

    @property
    def failed(self) -> bool:
        return not self._thread.is_alive() and self.error is not None

    def commit(self, keep: int, on_commit: OnCommit = None) -> bool:
        """Every rank reported its files written (through the step's collective): rank 0 commits. False
        when the commit failed (``error`` says why; the next step's collective tells every rank)."""
        self._thread.join()
        self.error = _try_commit(self.ckpt_dir, self.tag, keep, self.rank, on_commit)
        self.committed = self.error is None
        return self.committed

    def finish(self, keep: int, on_commit: OnCommit = None) -> None:
        """Every rank at the same point: wait for this rank's writes, vote, commit unless done already, vote
        on the commit. On a failure rank 0 removes the tag and every rank raises the same one line."""
        self._thread.join()
        failed = collectives.first_failure(self.error)
        if failed:
            _give_up(self.ckpt_dir, self.tag, self.rank)
            raise UserError(_failed_save(self.ckpt_dir, self.tag, failed, "(in the background) "))
        if not self.committed:
            _voted_commit(self.ckpt_dir, self.tag, keep, self.rank, on_commit)
            self.committed = True


def save_in_background(
    engine,
    ckpt_dir: Path,
    step: int,
    client_state: dict[str, Any],
    rng: dict[str, Any],
    buffers: HostBuffers | None = None,
) -> BackgroundSave:
    """Start a save whose files are written while training goes on. The training stall is DeepSpeed's own
    save with its writes replaced by copies to host memory (``buffers``, reused from save to save; the
    checkpoint state is held twice meanwhile)."""
    tag = tag_for(step)
    rank = collectives.rank()
    extra = _start_save(engine, ckpt_dir, tag, rank)
    writes: list[tuple[Any, str]] = []
    copies = buffers.start() if buffers is not None else _HostCopies(None)
    capture = _EngineWrites(
        engine,
        lambda state_dict, path, *args, **kwargs: writes.append((_host_copy(state_dict, copies), str(path))),
        Exception,  # host memory, or a state object that cannot be copied
    )
    try:
        with capture:
            engine.save_checkpoint(
                str(ckpt_dir), tag=tag, client_state={"client": client_state, **extra}, save_latest=False
            )
    except BaseException:
        copies.release()  # no writer will: the next save gets the pool back
        raise
    error = None
    if capture.error is not None:
        e = capture.error
        error = f"copying {Path(capture.failed_path).name} to host memory failed: {type(e).__name__}: {e}"
        writes = []
    writes.append((rng, str(ckpt_dir / tag / f"rng_rank{rank}.pt")))
    client = {"format": FORMAT, **client_state} if rank == 0 else None
    return BackgroundSave(ckpt_dir, step, rank, writes, client, error=error, copies=copies)


def _failed_save(ckpt_dir: Path, tag: str, failed: tuple[str, str, int], how: str = "") -> str:
    """The one line every rank raises; the same on every rank whether or not rank 0 removed the tag yet."""
    why, host, r = failed
    named = read_latest(ckpt_dir)
    head = f"saving checkpoint {ckpt_dir / tag} {how}failed on node {host} (rank {r}): {why}"
    if named == tag:  # the commit failed after its last rename (an fsync): the checkpoint is whole and kept
        return f"{head}; {ckpt_dir / LATEST} names it already and the next start resumes from it"
    older = [t for t in complete_tags(ckpt_dir) if t != tag]
    previous = named if named in older else (older[-1] if older else None)
    still = previous or "no checkpoint"
    return f"{head}; nothing of it was committed and {ckpt_dir / LATEST} still names {still}"


class _EngineWrites:
    """While active, each file DeepSpeed's checkpoint engine would write goes to ``write(state_dict, path)``
    instead: the engine's own save (a synchronous save) or a copy to host memory (a background save). The
    first error of ``catch`` is recorded instead of raised (and the writes after it are skipped), so the
    failing rank still reaches DeepSpeed's barriers and the vote, and every rank learns of the failure at once
    instead of waiting out the collective timeout."""

    def __init__(self, engine, write: Callable[..., Any], catch: type[BaseException] | tuple) -> None:
        self.engine = engine.checkpoint_engine
        self.write, self.catch = write, catch
        self.error: BaseException | None = None
        self.failed_path = ""

    def __enter__(self) -> _EngineWrites:
        def save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if self.error is not None:
                return None
            try:
                return self.write(state_dict, path, *args, **kwargs)
            except self.catch as e:
                self.error, self.failed_path = e, str(path)
                return None

        self.engine.save = save  # an instance attribute: shadows the class's method until __exit__
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.engine.save
