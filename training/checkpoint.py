"""Checkpoints: DeepSpeed's sharded save plus our client state, committed atomically.

Layout of ``CKPT_DIR``::

    step00000020/            one DeepSpeed tag: model/optimizer shards, written by every rank
        client_state.json    step, samples, tokens, loader state, resolved config (rank 0)
        rng_rank{R}.pt       python/numpy/torch RNG states of rank R
        COMPLETE             written last, after a barrier: the tag is whole
    latest                   the newest complete tag, replaced atomically (rename) after COMPLETE

A crash mid-save leaves a tag without ``COMPLETE`` and ``latest`` still naming the previous one; resume
ignores incomplete tags and they are removed by the next successful save.
"""

from __future__ import annotations

import json
import random
import shutil
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


def latest_complete(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag, else None."""
    pointer = ckpt_dir / LATEST
    if pointer.exists():
        tag = pointer.read_text().strip()
        if (ckpt_dir / tag / COMPLETE).exists():
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


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


def save(engine, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep: int) -> str:
    """Save on every rank; commit (COMPLETE, then ``latest``) only when every rank has written its part."""
    tag = tag_for(step)
    rank = collectives.rank()
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    # The (empty) universal-checkpoint info lets DeepSpeed's ds_to_universal convert this checkpoint for a
    # resume on another world size: no tensor- or pipeline-parallel slicing to describe.
    extra = {
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    }
    engine.save_checkpoint(
        str(ckpt_dir), tag=tag, client_state={"client": client_state, **extra}, save_latest=False
    )
    with atomic_path(ckpt_dir / tag / f"rng_rank{rank}.pt") as tmp:
        torch.save(rng_state(), tmp)
    if rank == 0:
        atomic_write_json(ckpt_dir / tag / "client_state.json", client_state)
    collectives.barrier()
    if rank == 0:
        atomic_write_text(ckpt_dir / tag / COMPLETE, "ok\n")
        atomic_write_text(ckpt_dir / LATEST, tag + "\n")
        for old in complete_tags(ckpt_dir)[:-keep]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
        for partial in incomplete_tags(ckpt_dir):
            if partial != tag:
                shutil.rmtree(ckpt_dir / partial, ignore_errors=True)
        kept = set(complete_tags(ckpt_dir))
        for converted in ckpt_dir.glob(UNIVERSAL_PREFIX + "*"):
            if converted.name.removeprefix(UNIVERSAL_PREFIX) not in kept:
                shutil.rmtree(converted, ignore_errors=True)
    collectives.barrier()
    return tag


def read_client_state(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    path = ckpt_dir / tag / "client_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable checkpoint client state ({e})") from None


UNIVERSAL_PREFIX = "universal-"
UNIVERSAL_DONE = "UNIVERSAL_COMPLETE"


def to_universal(ckpt_dir: Path, tag: str) -> str:
    """Convert a complete tag to DeepSpeed's universal format (rank 0; every rank waits); returns its tag.

    A universal checkpoint stores each parameter's FP32 weights and optimizer moments whole, so a run with a
    different data-parallel world size can load it (``checkpoint.load_universal``). DeepSpeed's own
    ``ds_to_universal`` does the conversion; the result is committed by a marker, so a crash mid-conversion
    is redone on the next start.
    """
    import subprocess
    import sys

    out_tag = UNIVERSAL_PREFIX + tag
    out = ckpt_dir / out_tag
    if collectives.rank() == 0 and not (out / UNIVERSAL_DONE).exists():
        log.info(f"converting {ckpt_dir / tag} to a universal checkpoint for a new world size")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(ckpt_dir / tag), "--output_folder", str(out), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # we keep our own pointers
        if res.returncode != 0:
            shutil.rmtree(out, ignore_errors=True)
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"{ckpt_dir / tag}: conversion to a universal checkpoint failed ({tail[0]})")
        shutil.copy2(ckpt_dir / tag / "client_state.json", out / "client_state.json")
        atomic_write_text(out / UNIVERSAL_DONE, "ok\n")
    collectives.barrier()
    return out_tag


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


def _find(section: CheckpointSection, ckpt_dir: Path) -> tuple[Path, str | None]:
    resume = section.resume
    if resume == "auto":
        tag = latest_complete(ckpt_dir)
        if tag is None and incomplete_tags(ckpt_dir):
            log.warning(f"{ckpt_dir}: only incomplete checkpoints ({', '.join(incomplete_tags(ckpt_dir))}); "
                        "starting fresh")  # fmt: skip
        return ckpt_dir, tag
    if resume == "never":
        if complete_tags(ckpt_dir):
            raise UserError(
                f"{ckpt_dir} already holds checkpoints and checkpoint.resume=never; use another run.dir"
            )
        return ckpt_dir, None
    return resolve(Path(resume), "checkpoint.resume")


def find_resume(
    section: CheckpointSection, ckpt_dir: Path, *, world: int, global_batch: int, steps: int
) -> ResumePoint | None:
    """Rank 0 finds the checkpoint to continue from and checks it fits this run; every rank gets its answer.

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
                _check_resumable(point, world=world, global_batch=global_batch, steps=steps)
            answer = ("ok", point)
        except UserError as e:
            answer = ("error", str(e))
    status, value = collectives.broadcast_object(answer)
    if status == "error":
        raise UserError(value)
    return value


def _check_resumable(point: ResumePoint, *, world: int, global_batch: int, steps: int) -> None:
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


def restore(engine, point: ResumePoint, client_static: dict[str, Any], reseed: Callable[[int], None]) -> None:
    """check -> convert -> load -> re-seed: continue a run from ``point`` on every rank.

    The learning rate of the first resumed step comes from this run's schedule (which may be longer than the
    saved run's), not from the rate stored in the optimizer state.
    """
    from training.lans import attach_zero

    check_compatible(point.saved, client_static, point.ckpt_dir / point.tag)
    tag = to_universal(point.ckpt_dir, point.tag) if point.universal else point.tag
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
