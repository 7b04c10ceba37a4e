"""Checkpoints: DeepSpeed's sharded save plus our client state, committed atomically.

Layout of ``CKPT_DIR``::

    step00000020/            one DeepSpeed tag: model/optimizer shards, written by every rank
        client_state.json    step, samples, tokens, loader state, resolved config (rank 0)
        rng_rank{R}.pt       python/numpy/torch RNG states of rank R
        COMPLETE             written last, after a barrier: the tag is whole
    latest                   the newest complete tag, replaced atomically (rename) after COMPLETE

A crash mid-save leaves a tag without ``COMPLETE`` and ``latest`` still naming the previous one; resume ignores
incomplete tags and they are removed by the next successful save.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from common.atomic import atomic_path, atomic_write_json, atomic_write_text
from common.errors import UserError

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
    """A checkpoint given as a tag directory or as a checkpoint directory -> (checkpoint dir, complete tag)."""
    if (path / COMPLETE).exists():
        return path.parent, path.name
    tag = latest_complete(path) if path.is_dir() else None
    if tag is None:
        raise UserError(f"{what}={path}: no complete checkpoint there")
    return path, tag


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep: int) -> str:
    """Save on every rank; commit (COMPLETE, then ``latest``) only when every rank has written its part."""
    tag = tag_for(step)
    rank = dist.get_rank()
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
    dist.barrier()
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
    dist.barrier()
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
    if dist.get_rank() == 0 and not (out / UNIVERSAL_DONE).exists():
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt_dir / tag),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # we keep our own pointers
        if res.returncode != 0:
            shutil.rmtree(out, ignore_errors=True)
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"{ckpt_dir / tag}: conversion to a universal checkpoint failed ({tail[0]})")
        shutil.copy2(ckpt_dir / tag / "client_state.json", out / "client_state.json")
        atomic_write_text(out / UNIVERSAL_DONE, "ok\n")
    dist.barrier()
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
        rng_file = ckpt_dir / tag / f"rng_rank{dist.get_rank()}.pt"
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
            f"{where}: checkpoint was trained on vocab {a[:12]}... but the data has vocab {b[:12]}...; refusing to resume"
        )
