"""Checkpoint storage: the layout of a checkpoint directory, what a committed tag is, and loading one.

Layout of ``CKPT_DIR``::

    step00000020/            one DeepSpeed tag: model/optimizer shards, written by every rank
        client_state.json    step, samples, tokens, loader state, resolved config (rank 0)
        rng_rank{R}.pt       python/numpy/torch RNG states of rank R
        COMPLETE             written last, after every rank fsynced its files and a barrier: the size of
                             every file of the tag (JSON), so a damaged tag is recognised without loading it
    latest                   the newest complete tag, replaced atomically (rename) after COMPLETE

Durability: each rank fsyncs the files of the tag before the commit vote; rank 0 fsyncs the tag directory
and ``CKPT_DIR`` after the renames of ``COMPLETE`` and ``latest``. A crash mid-save leaves a tag without
``COMPLETE`` and ``latest`` still naming the previous one; resume ignores incomplete tags and a save removes
them before it writes (freeing their space).

The rest of checkpointing lives beside this module: ``training.checkpoint.saving`` writes and commits a tag (the vote,
the background save), ``training.checkpoint.resume`` decides where a run continues from, and
``training.checkpoint.checkpointer.Checkpointer`` is what the trainer holds: when to save, and restore.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_write_text
from common.errors import UserError
from common.log import get_logger
from training import collectives
from training.checkpoint.safeload import refusing

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
        p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step") and not (p / COMPLETE).exists()
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
        log.warning(
            f"{pointer} holds {raw[:40]!r}, not a checkpoint tag of this directory (stepNNNNNNNN); "
            "ignoring it and using the newest complete checkpoint"
        )
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


def describe_write_error(e: BaseException, ckpt_dir: Path) -> str:
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
    log.info(f"converting {ckpt_dir / tag} to a universal checkpoint for a new world size")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "training.checkpoint.safeload",  # DeepSpeed's conversion, with every load restricted as in the ranks
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt_dir / tag),
        "--output_folder",
        str(out),
        # 1 and 1: in this process, where training.checkpoint.safeload registered the allowlist (worker processes would
        # need it too, and a refusal there would not name its file)
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
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


def load(engine, ckpt_dir: Path, tag: str, *, module_only: bool = False) -> dict[str, Any] | None:
    """Load a complete tag into the engine (all ranks); returns this rank's RNG states (its ``rng_rank{R}.pt``)
    for the trainer's state to continue, unless module_only.

    A universal tag (another world size) has no per-rank RNG states: None, and the trainer's state re-seeds.
    """
    with refusing(ckpt_dir / tag):  # every load restricted (training.checkpoint.safeload): a refusal is one line
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
        with refusing(rng_file):
            return torch.load(rng_file, weights_only=True)
    return None
