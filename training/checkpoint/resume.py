"""Where a run continues from: the run's identity, the shared-directory check and the resume decision.

Rank 0 decides (``find_resume``) and broadcasts the decision, so every rank continues from the same tag, and
every rank checks that it sees every file of it before anything is loaded. A checkpoint is never passed over
silently for a fresh start: one that cannot be resumed is a one-line error on every rank.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.atomic import atomic_write_text
from common.errors import UserError
from common.log import get_logger
from model.registry import spec_from_dict, spec_to_dict
from training import collectives
from training.checkpoint.storage import (
    candidates,
    complete_tags,
    incomplete_tags,
    read_client_state,
    resolve,
    tag_problem,
)
from training.config import CheckpointSection

log = get_logger("train")


@dataclass(frozen=True)
class RunIdentity:
    """What every checkpoint of a run records about it (its static client state, beside the step, the data
    position and the RNG states), and what a resume is checked against.

    A resume refuses another architecture (``model_spec``: its ``architecture``) or another vocabulary
    (``vocab_sha256``), naming the field (``check_compatible``); another ``optimizer`` (its state does not
    carry over); and, at another ``world_size``, another ``global_batch`` (``find_resume``).
    """

    model_spec: dict[str, Any]
    """The model's named size as built (``model.registry.spec_to_dict``) plus its padded vocabulary."""
    vocab_sha256: str | None
    """The sha256 of the vocabulary or tokenizer file the shards were made with."""
    world_size: int
    """Data-parallel ranks: another one resumes through a universal checkpoint."""
    global_batch: int
    optimizer: str
    data_attrs: dict[str, Any]
    """The training shards' scalar attributes (format, sequence length, ...)."""
    config: dict[str, Any]
    """The resolved configuration."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NOT_ARCHITECTURE = frozenset({"name", "dropout"})
"""The model spec's fields a resume may change: the size's label and the dropout rate (no parameter depends on
them). Every other field of the family's spec, and the padded vocabulary, is architecture (``architecture``)."""


def architecture(model_spec: dict[str, Any]) -> dict[str, Any]:
    """The architecture a stored model spec describes: every field of its family's spec (one an older
    checkpoint did not record at its default) and ``padded_vocab``, less ``NOT_ARCHITECTURE``."""
    full = spec_to_dict(spec_from_dict(model_spec))
    full["padded_vocab"] = model_spec.get("padded_vocab")
    return {k: v for k, v in full.items() if k not in NOT_ARCHITECTURE}


def check_compatible(saved: dict[str, Any], current: RunIdentity, where: Path) -> None:
    """Refuse to resume onto a different architecture or data vocabulary, naming the field."""
    ours, theirs = architecture(current.model_spec), architecture(saved["model_spec"])
    keys = ["family", *ours, *theirs]  # the family first, then the fields in the spec's order
    for key in dict.fromkeys(keys):
        a, b = theirs.get(key), ours.get(key)
        if a != b:
            raise UserError(
                f"{where}: checkpoint has model {key}={a!r} but this run has {key}={b!r}; refusing to resume"
            )
    a, b = saved.get("vocab_sha256"), current.vocab_sha256
    if a and b and a != b:
        raise UserError(
            f"{where}: checkpoint was trained on vocab {a[:12]}... but the data has vocab {b[:12]}...; "
            "refusing to resume"
        )


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
            status = (
                "error",
                f"{ckpt_dir}: cannot write checkpoints there ({e.strerror}); give a writable run.dir or checkpoint.dir",
            )
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
        log.warning(f"{ckpt_dir}: only incomplete checkpoints ({', '.join(incomplete_tags(ckpt_dir))}); starting fresh")
    return None


def _find(section: CheckpointSection, ckpt_dir: Path) -> tuple[Path, str | None]:
    resume = section.resume
    if resume == "auto":
        return ckpt_dir, _find_auto(ckpt_dir)
    if resume == "never":
        if complete_tags(ckpt_dir):
            raise UserError(f"{ckpt_dir} already holds checkpoints and checkpoint.resume=never; use another run.dir")
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
                _check_resumable(point, world=world, global_batch=global_batch, steps=steps, optimizer=optimizer)
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


def _check_resumable(point: ResumePoint, *, world: int, global_batch: int, steps: int, optimizer: str) -> None:
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
