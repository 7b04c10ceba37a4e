"""Checkpoints: DeepSpeed's sharded save plus our client state, committed atomically.

Layout of ``CKPT_DIR``::

    step00000020/            one DeepSpeed tag: model/optimizer shards, written by every rank
        client_state.json    step, samples, tokens, loader state, resolved config (rank 0)
        rng_rank{R}.pt       python/numpy/torch RNG states of rank R
        COMPLETE             written last, after every rank fsynced its files and a barrier: the size of
                             every file of the tag (JSON), so a damaged tag is recognised without loading it
    latest                   the newest complete tag, replaced atomically (rename) after COMPLETE

Durability: each rank fsyncs the files of the tag before the commit barrier; rank 0 fsyncs the tag directory
and ``CKPT_DIR`` after the renames of ``COMPLETE`` and ``latest``. A crash mid-save leaves a tag without
``COMPLETE`` and ``latest`` still naming the previous one; resume ignores incomplete tags and a save removes
them before it writes (freeing their space).

Shared storage: checkpoints are committed by rank 0 and read by every rank, so ``CKPT_DIR`` must be one
directory that every node mounts. ``check_shared`` refuses, at start-up, a directory some rank cannot see or
write; node-local checkpoint directories are not supported. Before anything is loaded, every rank checks
that it sees every file of the chosen tag with its recorded size.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import random
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.atomic import atomic_path, atomic_write_json, atomic_write_text
from common.errors import UserError
from common.log import get_logger
from training import collectives
from training.config import CheckpointSection

log = get_logger("train")

COMPLETE = "COMPLETE"
LATEST = "latest"
# The layout of a tag as this code writes and reads it (client_state.json's keys, our files beside
# DeepSpeed's).
# Raise it when a change makes older code misread new checkpoints; older formats stay readable.
FORMAT = 1
TAG_RE = re.compile(r"^step\d{8}$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and (p / COMPLETE).exists())


def incomplete_tags(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in ckpt_dir.iterdir()
        if p.is_dir() and p.name.startswith("step") and not (p / COMPLETE).exists()
    )


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names, or None (absent). Anything but a tag name of this directory (binary
    garbage, a path such as ``../../other-run/step...``) is ignored with a warning naming the file."""
    pointer = ckpt_dir / LATEST
    try:
        raw = pointer.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning(f"{pointer}: unreadable ({e.strerror}); using the newest complete checkpoint instead")
        return None
    try:
        tag = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        tag = ""
    if not TAG_RE.match(tag):
        log.warning(f"{pointer} holds {raw[:40]!r}, not a checkpoint tag of this directory (stepNNNNNNNN); "
                    "ignoring it and using the newest complete checkpoint")  # fmt: skip
        return None
    return tag


def latest_complete(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag, else None."""
    tag = read_latest(ckpt_dir)
    if tag is not None and (ckpt_dir / tag / COMPLETE).exists():
        return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def candidates(ckpt_dir: Path) -> list[str]:
    """Complete tags to resume from, best first: ``latest`` if it names one, then the rest newest first."""
    tags = complete_tags(ckpt_dir)[::-1]
    first = latest_complete(ckpt_dir)
    return ([first] if first else []) + [t for t in tags if t != first]


def tag_problem(ckpt_dir: Path, tag: str) -> str | None:
    """Why a complete tag cannot be loaded as committed (a file missing or of another size than COMPLETE
    records, an unreadable client state), or None. Stats only: nothing is loaded."""
    where = ckpt_dir / tag
    try:
        record = json.loads((where / COMPLETE).read_text())
        files = dict(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        files = {}  # a COMPLETE marker from before the file list: check what can be checked
    for rel, size in files.items():
        try:
            have = (where / rel).stat().st_size
        except FileNotFoundError:
            return f"{where / rel} is missing"
        if have != size:
            return f"{where / rel} has {have} bytes, {size} when committed"
    try:
        json.loads((where / "client_state.json").read_text())
    except FileNotFoundError:
        return f"{where / 'client_state.json'} is missing"
    except (OSError, ValueError) as e:
        return f"{where / 'client_state.json'} is unreadable ({e})"
    return None


def tag_files(where: Path) -> dict[str, int]:
    """Every file of a tag directory (relative path -> size), COMPLETE aside."""
    out = {}
    for root, _, names in os.walk(where):
        for name in names:
            p = Path(root) / name
            rel = str(p.relative_to(where))
            if rel != COMPLETE and not name.endswith(".tmp"):
                out[rel] = p.stat().st_size
    return dict(sorted(out.items()))


_OWNER = re.compile(r"(?:pp_rank_|rng_rank)(\d+)")


def owner(name: str) -> int:
    """The rank that writes a checkpoint file: DeepSpeed's ``*zero_pp_rank_R_*`` shards and our
    ``rng_rankR.pt`` name it; the rest (model states, client state) is rank 0's."""
    m = _OWNER.search(name)
    return int(m.group(1)) if m else 0


def fsync_tree(where: Path, rank: int) -> None:
    """fsync the files of a tag that ``rank`` wrote, and (rank 0) every directory of it: their data and
    names reach the disk before the commit marker names them."""
    for root, _, names in os.walk(where):
        for name in names:
            if owner(name) != rank or name.endswith(".tmp"):
                continue
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if rank == 0:
            fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: Path, what: str) -> tuple[Path, str]:
    """A checkpoint given as a tag directory or as a checkpoint directory -> (checkpoint dir, complete
    tag)."""
    if (path / COMPLETE).exists():
        return path.parent, path.name
    tag = latest_complete(path) if path.is_dir() else None
    if tag is None:
        raise UserError(f"{what}={path}: no complete checkpoint there")
    return path, tag


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    acc = collectives.accelerator()
    if acc.device_name() != "cpu":  # CUDA, HPU, ...: through DeepSpeed's accelerator abstraction
        state["accelerator"] = acc.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    acc = collectives.accelerator()
    device_state = state.get("accelerator", state.get("cuda"))  # "cuda": checkpoints before the abstraction
    if device_state is not None and acc.device_name() != "cpu":
        acc.set_rng_state(device_state)


def young_interval(save_s: float, step_s: float, job_mtbf_s: float) -> dict[str, float]:
    """Checkpoint interval from the failure rate: Young's first-order optimum sqrt(2 x C x MTBF).

    ``save_s``: the training stall of one save (C); ``step_s``: one optimizer step; ``job_mtbf_s``: the job's
    mean time between failures. Returns the interval in seconds and whole steps (at least 1) and the expected
    loss per failure: half an interval of re-done work on average (restart and load come on top).
    """
    interval_s = math.sqrt(2.0 * max(save_s, 1e-6) * job_mtbf_s)
    steps = max(1, int(round(interval_s / max(step_s, 1e-9))))
    return {"interval_s": interval_s, "steps": steps, "expected_loss_s": steps * step_s / 2.0}


def save(engine, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep: int) -> str:
    """Save on every rank; commit (COMPLETE, then ``latest``) only when every rank has written its part."""
    tag = tag_for(step)
    rank = collectives.rank()
    extra = _start_save(engine, ckpt_dir, tag, rank)
    guard = _EngineWrites(engine, engine.checkpoint_engine.save, (OSError, RuntimeError))
    error = None
    try:
        with (
            guard
        ):  # a failed write does not skip DeepSpeed's own barriers: every rank reaches the vote below
            engine.save_checkpoint(
                str(ckpt_dir), tag=tag, client_state={"client": client_state, **extra}, save_latest=False
            )
        if guard.error is not None:
            raise guard.error
        with atomic_path(ckpt_dir / tag / f"rng_rank{rank}.pt") as tmp:
            torch.save(rng_state(), tmp)
        if rank == 0:
            atomic_write_json(ckpt_dir / tag / "client_state.json", {"format": FORMAT, **client_state})
        fsync_tree(ckpt_dir / tag, rank)  # this rank's files are on disk before it votes to commit
    except (OSError, RuntimeError) as e:
        error = _describe_write_error(e, ckpt_dir)
    failed = collectives.first_failure(error)  # the commit vote, also the commit barrier
    if failed:
        _give_up(ckpt_dir, tag, rank)
        raise UserError(_failed_save(ckpt_dir, tag, failed))
    _voted_commit(ckpt_dir, tag, keep, rank)
    return tag


def _start_save(engine, ckpt_dir: Path, tag: str, rank: int) -> dict[str, Any]:
    """What both kinds of save do first: rank 0 removes tags that never completed (a crash, a full disk,
    a background save that failed: their space first); returns the universal-checkpoint info."""
    if rank == 0:
        for partial in incomplete_tags(ckpt_dir):
            if partial != tag:
                shutil.rmtree(ckpt_dir / partial, ignore_errors=True)
    from deepspeed.checkpoint.constants import (
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


def _try_commit(ckpt_dir: Path, tag: str, keep: int, rank: int) -> str | None:
    """Rank 0 commits; the error (one line) if it could not, None otherwise and on other ranks."""
    if rank != 0:
        return None
    try:
        _commit(ckpt_dir, tag, keep)
    except OSError as e:
        return _describe_write_error(e, ckpt_dir)
    return None


def _voted_commit(ckpt_dir: Path, tag: str, keep: int, rank: int) -> None:
    """Rank 0 commits and every rank learns whether it could (a full disk can refuse even COMPLETE): the same
    one line on every rank, instead of rank 0 failing alone while the others wait for it."""
    failed = collectives.first_failure(_try_commit(ckpt_dir, tag, keep, rank))
    if failed:
        _give_up(ckpt_dir, tag, rank)
        raise UserError(_failed_save(ckpt_dir, tag, failed))


def _commit(ckpt_dir: Path, tag: str, keep: int) -> None:
    """Rank 0, once every rank's files of ``tag`` are durable: COMPLETE (listing them), then ``latest``;
    older tags beyond ``keep`` and their universal conversions go."""
    atomic_write_json(ckpt_dir / tag / COMPLETE, {"files": tag_files(ckpt_dir / tag)})
    fsync_dir(ckpt_dir / tag)
    atomic_write_text(ckpt_dir / LATEST, tag + "\n")
    fsync_dir(ckpt_dir)
    for old in complete_tags(ckpt_dir)[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    kept = set(complete_tags(ckpt_dir))
    for converted in ckpt_dir.glob(UNIVERSAL_PREFIX + "*"):
        if converted.name.removeprefix(UNIVERSAL_PREFIX) not in kept:
            shutil.rmtree(converted, ignore_errors=True)


def _host_copy(obj: Any, memo: dict | None = None) -> Any:
    """A copy of a state dict that no longer changes with training: tensors copied to host memory, other
    objects deep-copied. Tensors that are the same view of one storage (tied weights) stay one tensor, so the
    file does not grow."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in memo:
            memo[key] = t.to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = _host_copy(v, memo)
        return out
    if isinstance(obj, list):
        return [_host_copy(v, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [_host_copy(v, memo) for v in obj]
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

    def __init__(self, ckpt_dir: Path, step: int, rank: int, writes: list[tuple[Any, str]],
                 client_state: dict[str, Any] | None, error: str | None = None) -> None:  # fmt: skip
        self.ckpt_dir, self.step, self.tag, self.rank = ckpt_dir, step, tag_for(step), rank
        self.error = error  # set before the thread starts: nothing is written
        self.write_s = 0.0
        self.stall_s = 0.0  # set by the caller: the training stall it caused,
        self.done_at = 0.0  # and when that stall ended (time.time())
        self.committed = False
        self.reported_step = step  # the step after which the ranks' next report is awaited
        self._ok = False
        self._writes, self._client = writes, client_state
        self._thread = threading.Thread(target=self._run, name=f"save-{self.tag}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        where = self.ckpt_dir / self.tag
        try:
            if self.error is None:
                for state, target in self._writes:
                    with atomic_path(target) as tmp:
                        torch.save(state, tmp)
                if self._client is not None:
                    atomic_write_json(where / "client_state.json", self._client)
                fsync_tree(where, self.rank)
                self._ok = True
        except (OSError, RuntimeError) as e:
            self.error = _describe_write_error(e, self.ckpt_dir)
        except BaseException as e:  # whatever stops the writer, its files are not whole: never committed
            self.error = f"the writer thread failed: {type(e).__name__}: {e}"
        finally:
            self._writes = []  # the host copies go now
            self.write_s = time.perf_counter() - t0

    @property
    def written(self) -> bool:
        """This rank's files are written and durable."""
        return not self._thread.is_alive() and self._ok and self.error is None

    @property
    def failed(self) -> bool:
        return not self._thread.is_alive() and self.error is not None

    def commit(self, keep: int) -> bool:
        """Every rank reported its files written (through the step's collective): rank 0 commits. False
        when the commit failed (``error`` says why; the next step's collective tells every rank)."""
        self._thread.join()
        self.error = _try_commit(self.ckpt_dir, self.tag, keep, self.rank)
        self.committed = self.error is None
        return self.committed

    def finish(self, keep: int) -> None:
        """Every rank at the same point: wait for this rank's writes, vote, commit unless done already, vote
        on the commit. On a failure rank 0 removes the tag and every rank raises the same one line."""
        self._thread.join()
        failed = collectives.first_failure(self.error)
        if failed:
            _give_up(self.ckpt_dir, self.tag, self.rank)
            raise UserError(_failed_save(self.ckpt_dir, self.tag, failed, "(in the background) "))
        if not self.committed:
            _voted_commit(self.ckpt_dir, self.tag, keep, self.rank)
            self.committed = True


def save_in_background(engine, ckpt_dir: Path, step: int, client_state: dict[str, Any]) -> BackgroundSave:
    """Start a save whose files are written while training goes on. The training stall is DeepSpeed's own
    save with its writes replaced by copies to host memory (the checkpoint state is held twice meanwhile)."""
    tag = tag_for(step)
    rank = collectives.rank()
    extra = _start_save(engine, ckpt_dir, tag, rank)
    writes: list[tuple[Any, str]] = []
    capture = _EngineWrites(
        engine,
        lambda state_dict, path, *args, **kwargs: writes.append((_host_copy(state_dict), str(path))),
        Exception,  # host memory, or a state object that cannot be copied
    )
    with capture:
        engine.save_checkpoint(
            str(ckpt_dir), tag=tag, client_state={"client": client_state, **extra}, save_latest=False
        )
    error = None
    if capture.error is not None:
        e = capture.error
        error = f"copying {Path(capture.failed_path).name} to host memory failed: {type(e).__name__}: {e}"
        writes = []
    writes.append((rng_state(), str(ckpt_dir / tag / f"rng_rank{rank}.pt")))
    client = {"format": FORMAT, **client_state} if rank == 0 else None
    return BackgroundSave(ckpt_dir, step, rank, writes, client, error=error)


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


def _describe_write_error(e: BaseException, ckpt_dir: Path) -> str:
    """One line for a failed checkpoint write; says "the disk is full" when it is (torch.save reports ENOSPC
    as an opaque zip-writer RuntimeError)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    try:
        free = shutil.disk_usage(ckpt_dir).free
    except OSError:
        free = -1
    if getattr(e, "errno", None) == errno.ENOSPC or 0 <= free < 16 << 20:
        return f"the disk is full ({free >> 20} MiB free on {ckpt_dir}; {type(e).__name__}: {first})"
    return f"{type(e).__name__}: {first}"


def read_client_state(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """A tag's client state; refuses one written in a newer checkpoint format than this code reads."""
    path = ckpt_dir / tag / "client_state.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable checkpoint client state ({e})") from None
    written = saved.get("format", 1)  # checkpoints from before the field are format 1
    if not isinstance(written, int) or written > FORMAT:
        raise UserError(
            f"{ckpt_dir / tag} was written in checkpoint format {written}; this version reads format "
            f"{FORMAT} and older: continue it with the version that wrote it"
        )
    return saved


UNIVERSAL_PREFIX = "universal-"
UNIVERSAL_DONE = "UNIVERSAL_COMPLETE"


def to_universal(ckpt_dir: Path, tag: str, wait_s: float = 6 * 3600) -> str:
    """Convert a complete tag to DeepSpeed's universal format (rank 0); returns its tag.

    A universal checkpoint stores each parameter's FP32 weights and optimizer moments whole, so a run with a
    different data-parallel world size can load it (``checkpoint.load_universal``). DeepSpeed's own
    ``ds_to_universal`` does the conversion; the result is committed by a marker, so a crash mid-conversion
    is redone on the next start. The conversion runs outside any collective: for a model of billions of
    parameters it takes longer than a collective timeout, so the other ranks wait for the marker (or a
    failure note) on the shared checkpoint directory, up to ``wait_s``, and then meet rank 0 in a barrier.
    Rank 0 logs progress every 30 s.
    """
    out_tag = UNIVERSAL_PREFIX + tag
    out = ckpt_dir / out_tag
    attempt = collectives.broadcast_object(secrets.token_hex(6))  # names this attempt's failure note
    failed = ckpt_dir / f".{out_tag}.{attempt}.failed"
    if collectives.rank() == 0:
        if not (out / UNIVERSAL_DONE).exists():
            try:
                _convert(ckpt_dir, tag, out)
            except UserError as e:
                atomic_write_text(failed, str(e))
                raise
    else:
        deadline = time.monotonic() + wait_s
        while not (out / UNIVERSAL_DONE).exists():
            if failed.exists():
                raise UserError(failed.read_text())
            if time.monotonic() > deadline:
                raise UserError(
                    f"{ckpt_dir / tag}: rank 0 did not finish the universal conversion within "
                    f"checkpoint.convert_timeout_s={wait_s:.0f}"
                )
            time.sleep(1.0)
    collectives.barrier()
    if collectives.rank() == 0:
        failed.unlink(missing_ok=True)
    return out_tag


def _convert(ckpt_dir: Path, tag: str, out: Path) -> None:
    import subprocess
    import sys

    log.info(f"converting {ckpt_dir / tag} to a universal checkpoint for a new world size")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(ckpt_dir / tag), "--output_folder", str(out), "--num_extract_workers", "1",
           "--num_merge_workers", "1"]  # fmt: skip
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
        reader.start()
        while proc.poll() is None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.info(f"converting {ckpt_dir / tag}: {time.monotonic() - t0:.0f} s")
        reader.join(timeout=10)
    (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # we keep our own pointers
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        tail = [ln.strip() for ln in lines if ln.strip()][-1:] or ["no output"]
        raise UserError(f"{ckpt_dir / tag}: conversion to a universal checkpoint failed ({tail[0]})")
    shutil.copy2(ckpt_dir / tag / "client_state.json", out / "client_state.json")
    fsync_tree(out, 0)
    atomic_write_text(out / UNIVERSAL_DONE, "ok\n")
    log.info(f"converted {ckpt_dir / tag} in {time.monotonic() - t0:.1f} s")


def load(engine, ckpt_dir: Path, tag: str, *, module_only: bool = False) -> None:
    """Load a complete tag into the engine (all ranks); restores this rank's RNG states unless module_only.

    A universal tag (another world size) has no per-rank RNG states to restore: the caller re-seeds.
    """
    load_path, _ = engine.load_checkpoint(
        str(ckpt_dir),
        tag=tag,
        load_module_only=module_only,
        load_optimizer_states=not module_only,
        load_lr_scheduler_states=not module_only,
    )
    if load_path is None:
        raise UserError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    if not module_only and not tag.startswith(UNIVERSAL_PREFIX):
        rng_file = ckpt_dir / tag / f"rng_rank{collectives.rank()}.pt"
        if not rng_file.exists():
            raise UserError(f"{rng_file} is missing: this checkpoint was written by a different world size")
        set_rng_state(torch.load(rng_file, weights_only=False))


ARCHITECTURE_KEYS = (
    "family",
    "layers",
    "hidden",
    "heads",
    "ffn",
    "padded_vocab",
    "pre_layernorm",
    "rotary_pct",
    "parallel_residual",
    "max_positions",
    "type_vocab",
)


def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """Refuse to resume onto a different architecture or data vocabulary, naming the field."""
    for key in ARCHITECTURE_KEYS:
        a, b = saved["model_spec"].get(key), current["model_spec"].get(key)
        if a != b:
            raise UserError(
                f"{where}: checkpoint has model {key}={a!r} but this run has {key}={b!r}; refusing to resume"
            )
    a, b = saved.get("vocab_sha256"), current.get("vocab_sha256")
    if a and b and a != b:
        raise UserError(
            f"{where}: checkpoint was trained on vocab {a[:12]}... but the data has vocab {b[:12]}...; "
            "refusing to resume"
        )


# --------------------------------------------------------------------------- resume


@dataclass
class ResumePoint:
    """Where a run continues from, decided once by rank 0 for every rank."""

    ckpt_dir: Path
    tag: str
    saved: dict[str, Any]
    universal: bool  # another data-parallel world size: load through a universal checkpoint


def check_shared(ckpt_dir: Path) -> None:
    """At start-up, on every rank: ``ckpt_dir`` is writable by every rank and is one directory for all of
    them. Rank 0 writes a probe with a fresh nonce; every rank must read it and write a file of its own.
    Otherwise every rank raises the same one-line error, naming the first node that failed."""
    nonce = secrets.token_hex(8)
    probe = ckpt_dir / f".probe-{nonce}"
    status: tuple[str, str] = ("ok", nonce)
    if collectives.rank() == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(probe, nonce)
        except OSError as e:
            status = ("error", f"{ckpt_dir}: cannot write checkpoints there ({e.strerror}); give a writable "
                               "run.dir or checkpoint.dir")  # fmt: skip
    kind, value = collectives.broadcast_object(status)
    if kind == "error":
        raise UserError(value)
    probe = ckpt_dir / f".probe-{value}"
    mine = ckpt_dir / f".probe-{value}-rank{collectives.rank()}"
    problem = None
    try:
        if probe.read_text() != value:
            problem = f"reads other content in {probe}"
    except OSError:
        problem = f"does not see {probe}, which rank 0 wrote"
    if problem is None:
        try:
            mine.write_text(value)
            mine.unlink()
        except OSError as e:
            problem = f"cannot write in {ckpt_dir} ({e.strerror})"
    failure = collectives.first_failure(problem)
    if collectives.rank() == 0:
        probe.unlink(missing_ok=True)
    if failure:
        p, host, r = failure
        raise UserError(
            f"checkpoint.dir {ckpt_dir} is not shared by every rank: node {host} (rank {r}) {p}. Checkpoints "
            "are committed by rank 0 and loaded by every rank, so every node must mount the same directory "
            "(a shared filesystem); node-local checkpoint directories are not supported"
        )


def _find_auto(ckpt_dir: Path) -> str | None:
    """The newest loadable complete tag: ``latest``'s, or an older one named in a warning when it is damaged.
    Refuses (never starts over) when complete tags exist but none is loadable."""
    damaged: list[str] = []
    for tag in candidates(ckpt_dir):
        problem = tag_problem(ckpt_dir, tag)
        if problem is None:
            if damaged:
                log.warning(f"{ckpt_dir}: resuming from {tag} instead of the damaged {', '.join(damaged)}")
            return tag
        log.warning(f"checkpoint {ckpt_dir / tag} is damaged: {problem}")
        damaged.append(tag)
    if damaged:
        raise UserError(
            f"{ckpt_dir}: every complete checkpoint is damaged (newest: {ckpt_dir / damaged[0]}); move the "
            "directory away to start over, or restore it"
        )
    if incomplete_tags(ckpt_dir):
        log.warning(f"{ckpt_dir}: only incomplete checkpoints ({', '.join(incomplete_tags(ckpt_dir))}); "
                    "starting fresh")  # fmt: skip
    return None


def _find(section: CheckpointSection, ckpt_dir: Path) -> tuple[Path, str | None]:
    resume = section.resume
    if resume == "auto":
        return ckpt_dir, _find_auto(ckpt_dir)
    if resume == "never":
        if complete_tags(ckpt_dir):
            raise UserError(
                f"{ckpt_dir} already holds checkpoints and checkpoint.resume=never; use another run.dir"
            )
        return ckpt_dir, None
    where, tag = resolve(Path(resume), "checkpoint.resume")
    problem = tag_problem(where, tag)
    if problem:
        raise UserError(f"checkpoint.resume={resume}: damaged checkpoint ({problem})")
    return where, tag


def find_resume(
    section: CheckpointSection, ckpt_dir: Path, *, world: int, global_batch: int, steps: int, optimizer: str
) -> ResumePoint | None:
    """Rank 0 finds the checkpoint to continue from and checks it fits this run; every rank gets its answer
    and checks that it sees every file of it, before anything is loaded.

    Never silently starts over: a checkpoint that cannot be resumed is a one-line error on every rank.
    """
    answer: tuple[str, Any] = ("none", None)
    if collectives.rank() == 0:
        try:
            where, tag = _find(section, ckpt_dir)
            point = None
            if tag is not None:
                saved = read_client_state(where, tag)
                point = ResumePoint(where, tag, saved, universal=saved["world_size"] != world)
                _check_resumable(
                    point, world=world, global_batch=global_batch, steps=steps, optimizer=optimizer
                )
            answer = ("ok", point)
        except UserError as e:
            answer = ("error", str(e))
    status, value = collectives.broadcast_object(answer)
    if status == "error":
        raise UserError(value)
    if value is not None:
        failure = collectives.first_failure(tag_problem(value.ckpt_dir, value.tag))
        if failure:
            p, host, r = failure
            raise UserError(
                f"node {host} (rank {r}) cannot load {value.ckpt_dir / value.tag}: {p}. Every rank loads the "
                "checkpoint rank 0 chose: put checkpoint.dir on storage every node mounts"
            )
    return value


def _check_resumable(
    point: ResumePoint, *, world: int, global_batch: int, steps: int, optimizer: str
) -> None:
    where, saved = point.ckpt_dir / point.tag, point.saved
    if point.universal and saved["global_batch"] != global_batch:
        raise UserError(
            f"{where} was trained with train.global_batch={saved['global_batch']}; resuming on {world} ranks "
            f"instead of {saved['world_size']} needs the same global batch, got {global_batch}"
        )
    if saved["step"] > steps:
        raise UserError(
            f"{where} is at step {saved['step']}, beyond train.steps={steps}; raise train.steps to continue "
            f"or use another run.dir"
        )
    if saved.get("optimizer", optimizer) != optimizer:
        raise UserError(
            f"{where} was trained with optimizer.name={saved['optimizer']}, this run has {optimizer}: its "
            f"optimizer state does not carry over; set optimizer.name={saved['optimizer']}, or start from "
            f"its weights with a fresh optimizer (train.init_from={where}, another run.dir)"
        )


def restore(engine, point: ResumePoint, client_static: dict[str, Any], reseed: Callable[[int], None],
            wait_s: float = 6 * 3600) -> None:  # fmt: skip
    """check -> convert -> load -> re-seed: continue a run from ``point`` on every rank.

    The learning rate of the first resumed step comes from this run's schedule (which may be longer than the
    saved run's), not from the rate stored in the optimizer state.
    """
    from training.lans import attach_zero

    check_compatible(point.saved, client_static, point.ckpt_dir / point.tag)
    tag = to_universal(point.ckpt_dir, point.tag, wait_s) if point.universal else point.tag
    load(engine, point.ckpt_dir, tag)
    attach_zero(engine)  # the per-tensor layout is rebuilt from DeepSpeed's links after a load
    if point.universal:  # per-rank RNG streams cannot carry over to another world size: re-seed from the step
        reseed(point.saved["step"])
    sched = engine.lr_scheduler
    if sched is not None:
        rates = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(sched.optimizer.param_groups, rates):
            group["lr"] = lr
        sched._last_lr = rates
    log.info(f"resumed from {point.ckpt_dir / tag} at step {point.saved['step']}")


def initialise_from(engine, path: Path, client_static: dict[str, Any]) -> None:
    """Phase 2: this checkpoint's weights, with a fresh optimizer, step count and schedule."""
    init_dir, init_tag = resolve(path, "train.init_from")
    saved = read_client_state(init_dir, init_tag)
    check_compatible(saved, client_static, init_dir / init_tag)
    load(engine, init_dir, init_tag, module_only=True)
    log.info(f"initialised weights from {init_dir / init_tag} (fresh optimizer, step count and schedule)")
