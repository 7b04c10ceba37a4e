"""A run's start, decided once: the ``RunPlan``, then everything it builds up to the first step, then the run.

``train.py`` parses the arguments and maps what a start raises to an exit code; everything between is here.

The plan comes first. Its static part (``StaticPlan``) is what a config alone decides: the family and its named
size, whether the run unpads, the attention kernel it asks for, ``max_pred`` and the shard format; any tool
builds it (``launch report`` too). Its run part (``RunPart``) is decided on every rank once the process group
exists: the gradient accumulation, the checkpoint folder and the resume decision. Every builder is given the
plan, or the part of it it needs, and decides none of it again.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.atomic import atomic_write_json
from common.cluster import node_count
from common.log import get_logger
from data.formats import ShardFormat
from model.family import Family
from model.flops import WorkCounter, training_flops_per_token
from model.registry import ModelSpec, family_of, get_spec, spec_to_dict
from training import collectives, devices, events, ownership
from training import engine as ds_engine
from training.build import RunData, build_engine, check_run_dir, model_spec, open_data
from training.checkpoint.checkpointer import Checkpointer
from training.checkpoint.replicas import write_replica_digest
from training.checkpoint.resume import ResumePoint, RunIdentity
from training.checkpoint.safeload import restrict
from training.clock import Clock, peak_memory_bytes, process_age_s
from training.config import (
    Config,
    DataSection,
    ModelSection,
    OptimizerSection,
    TrainSection,
    gradient_accumulation,
    read_retry_s,
)
from training.logbook import Logbook
from training.metrics import RunFacts, summarize
from training.optim.factory import attach_zero
from training.state import TrainState
from training.trainer import Trainer, exit_code
from training.watch import DataWatchdog

log = get_logger("train")


@dataclass(frozen=True)
class StaticPlan:
    """What a run's config alone decides, before anything is built."""

    family: Family
    """The model family's record (``model.family``)."""
    spec: ModelSpec
    """The named size (``model.name``), with ``model.vocab_size`` where set (the run's own takes the shards')."""
    unpadded: bool
    """Whether the model computes only the real tokens (``Family.unpadded``, asked here once per plan)."""
    unpad_kernel: str | None
    """The attention kernel the run asks for over the packed tokens (None: the device's default, or no unpad)."""
    max_pred: int | None
    """``data.max_pred`` where the shard format has it, else None."""
    shard_format: ShardFormat
    """The family's shard format (``Family.format``)."""


def static_plan(model: ModelSection, data: DataSection) -> StaticPlan:
    """The static part of a run's plan, from its model and data sections (one line for an unknown model name or
    an unregistered shard format)."""
    spec = get_spec(model.name, vocab_size=model.vocab_size)
    family = family_of(spec)
    fmt = family.format
    unpadded = family.unpadded(model.unpad)
    kernel = None  # auto: the device's default; the kernel that runs is resolved in the model's forward
    if unpadded and model.unpad_attention != "auto":
        kernel = {"loop": "varlen"}.get(model.unpad_attention, model.unpad_attention)
    return StaticPlan(family, spec, unpadded, kernel, data.max_pred if fmt.uses_max_pred else None, fmt)


@dataclass(frozen=True)
class RunPart:
    """What a run decides on every rank once its process group exists."""

    rank: int
    world: int
    grad_accum: int
    run_dir: Path
    ckpt_dir: Path
    resume: ResumePoint | None
    """The checkpoint it continues from (its tag, and whether it loads as a universal one), or None."""
    init_from: Path | None
    """``train.init_from`` where the run does not resume: the weights it starts from."""


@dataclass(frozen=True)
class RunPlan:
    static: StaticPlan
    run: RunPart


@dataclass
class Start:
    """A run's start, up to its first step: the trainer (restored or initialised), the run's plan and facts
    (``training.metrics.RunFacts``), and the DeepSpeed configuration."""

    trainer: Trainer
    facts: RunFacts
    ds_config: dict
    plan: RunPlan

    @property
    def point(self) -> ResumePoint | None:
        return self.plan.run.resume


def run(cfg: Config) -> int:
    """A run on this rank, from its start to its summary; the exit code (``training.trainer.exit_code``)."""
    start = prepare(cfg)
    if start is None:
        return 0
    trainer = start.trainer
    try:
        trainer.logbook.open()  # wandb, after the resume: part of the start-up time
        startup_s = announce(start)
        perf = trainer.train()
        report(start.facts, trainer, perf, startup_s)
    finally:
        trainer.close()
    collectives.barrier()
    return exit_code(perf)


def prepare(cfg: Config) -> Start | None:
    """Everything before the first step, on every rank: the plan, the process group, the data, the model and its
    engine, the trainer with its checkpointer, and the resume (or ``train.init_from``). None: the checkpoint is
    already at ``train.steps``. The caller runs the trainer and closes it (and ends the process group)."""
    static = static_plan(cfg.model, cfg.data)  # from the config alone: a wrong model name is refused first
    restrict()  # every checkpoint load of this rank (DeepSpeed's too) reads weights only: a file runs no code
    ds_engine.start(cfg)  # precision and backend checks, the device, threads, determinism, the process group
    rank, world = collectives.rank(), collectives.world_size()
    grad_accum, retry_s = gradient_accumulation(cfg.train, world), read_retry_s(cfg)
    run_dir = Path(cfg.run.dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    # one live owner: refused here, on every rank, before anything is written in either directory
    ownership.take([run_dir, ckpt_dir], cfg.run.owner_stale_s, cfg.run.takeover)
    check_run_dir(run_dir)
    state = TrainState(seed=cfg.train.seed, rank=rank)  # the trainer's and the checkpointer's
    clock = Clock(cfg.logging.warmup_steps)  # the run's time: the trainer's steps, the checkpointer's saves
    checkpointer = Checkpointer(
        cfg.checkpoint, ckpt_dir, state, clock=clock, steps=cfg.train.steps, after_load=[attach_zero]
    )
    point = checkpointer.plan(world=world, global_batch=cfg.train.global_batch, optimizer=cfg.optimizer.name)
    init_from = Path(cfg.train.init_from) if cfg.train.init_from and point is None else None
    plan = RunPlan(static, RunPart(rank, world, grad_accum, run_dir, ckpt_dir, point, init_from))
    if point is not None and point.saved["step"] == cfg.train.steps:
        log.info(f"{point.ckpt_dir / point.tag} is already at train.steps={cfg.train.steps}: nothing to train")
        return None
    data = open_data(cfg.data, cfg.train, static, grad_accum, rank, world, retry_s)
    spec = model_spec(static, cfg.model, cfg.data, data.attrs)
    state.attach(data.loader)
    ds_config = ds_engine.deepspeed_config(cfg, grad_accum, str(run_dir))
    ds_config["checkpoint"]["load_universal"] = bool(point and point.universal)
    dtype = getattr(torch, ds_engine.compute_dtypes(cfg.deepspeed)[0])  # the model's
    engine = build_engine(cfg.model, cfg.optimizer, cfg.schedule, cfg.train, spec, static, ds_config, dtype, rank)
    identity = run_identity(spec, data, world, cfg.train, cfg.optimizer, cfg.to_dict())
    trainer, facts = assemble(cfg, plan, engine, data, spec, checkpointer)
    try:
        checkpointer.load(engine, identity, trainer.events_to, init_from)  # the resume, or init_from's weights
    except BaseException:
        trainer.close()
        raise
    return Start(trainer, facts, ds_config, plan)


def run_identity(
    spec: ModelSpec, data: RunData, world: int, train: TrainSection, optimizer: OptimizerSection, resolved: dict
) -> RunIdentity:
    """The run's identity (``training.checkpoint.resume.RunIdentity``), built once per start: every checkpoint
    records it and a resume is checked against it."""
    return RunIdentity(
        model_spec={**spec_to_dict(spec), "padded_vocab": spec.padded_vocab},
        vocab_sha256=data.vocab_sha256,
        world_size=world,
        global_batch=train.global_batch,
        optimizer=optimizer.name,
        data_attrs=scalar_attrs(data.attrs),
        config=resolved,
    )


def scalar_attrs(attrs: dict) -> dict:
    """The shards' scalar attributes as plain JSON values (HDF5 gives numpy scalars)."""
    out = {}
    for k, v in attrs.items():
        v = v.item() if isinstance(v, np.generic) else v
        if isinstance(v, str | int | float | bool):
            out[k] = v
    return out


def assemble(
    cfg: Config, plan: RunPlan, engine, data: RunData, spec: ModelSpec, checkpointer: Checkpointer
) -> tuple[Trainer, RunFacts]:
    """The trainer of this start, with its logbook and data watchdog, and the run's facts."""
    static, part = plan.static, plan.run
    rank, run_dir = part.rank, part.run_dir
    events_to = events.EventLog(run_dir, next_attempt(run_dir, rank), node_count())
    facts = run_facts(cfg, plan, spec, engine, events_to)
    trainer = Trainer(
        engine,
        data.loader,
        state=checkpointer.state,
        eval_set=data.eval_set,
        train=cfg.train,
        checkpointer=checkpointer,
        logbook=Logbook(
            run_dir,
            rank,
            events_to.attempt,
            cfg.train.steps,
            engine.monitor,
            wandb=functools.partial(start_wandb, cfg, run_dir, facts.config) if cfg.logging.wandb.project else None,
            family=static.family,
        ),
        events_to=events_to,
        grad_accum=part.grad_accum,
        count=WorkCounter(spec, cfg.data.seq_len, static.max_pred, unpadded=static.unpadded),
        peak_flops=facts.peak_flops_per_device,
        clock=checkpointer.clock,
        log_every=cfg.logging.every,
        family=static.family,
        data_watchdog=DataWatchdog(cfg.deepspeed.timeout_s, cfg.data.num_workers, run_dir),
    )
    return trainer, facts


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


def run_facts(cfg: Config, plan: RunPlan, spec: ModelSpec, engine, events_to: events.EventLog) -> RunFacts:
    """What this start of the run is (``training.metrics.RunFacts``); ranks of one job report one peak."""
    flops = training_flops_per_token(spec, cfg.data.seq_len, plan.static.max_pred)
    device = devices.device_name()
    peak = devices.peak_flops(device, ds_engine.compute_dtypes(cfg.deepspeed))
    if peak is not None:  # ranks of one job report one MFU: the best peak any of them measured
        peak = collectives.all_reduce_values([peak], "max")[0]
    return RunFacts(
        model=spec.name,
        family=spec.family,
        world_size=plan.run.world,
        nodes=events_to.nodes,
        device_kind=device,
        threads_per_rank=torch.get_num_threads(),
        precision=cfg.deepspeed.precision,
        zero_stage=engine.zero_optimization_stage(),
        zero_stage_requested=cfg.deepspeed.zero_stage,
        optimizer=cfg.optimizer.name,
        micro_batch=cfg.train.micro_batch,
        global_batch=cfg.train.global_batch,
        grad_accum=plan.run.grad_accum,
        seq_len=cfg.data.seq_len,
        flops_per_token=flops,
        peak_flops_per_device=peak,
        attempt=events_to.attempt,
        config=cfg.to_dict(),
    )


def announce(start: Start) -> float:
    """Before the first step: rank 0 writes the resolved configs, the run's line and the start events. Returns
    the start-up time (process start to here)."""
    startup_s = process_age_s()
    if collectives.rank() != 0:
        return startup_s
    facts, state, point = start.facts, start.trainer.state, start.point
    run_dir = start.plan.run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", facts.config)
    atomic_write_json(run_dir / "deepspeed_config.json", start.ds_config)
    log.info(
        f"{facts.model} | world {facts.world_size} | micro {facts.micro_batch} x accum {facts.grad_accum} = "
        f"global {facts.global_batch} | seq {facts.seq_len} | ZeRO {facts.zero_stage} | {facts.precision} | "
        f"{facts.optimizer} | {facts.device_kind} | attempt {facts.attempt}"
    )
    events.record(
        run_dir,
        "start",
        attempt=facts.attempt,
        rank=0,
        world_size=facts.world_size,
        nodes=facts.nodes,
        step=state.step,
        tokens=state.tokens,
        flops=state.flops,
        resumed_from=point.tag if point else None,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        startup_s=round(startup_s, 3),
    )
    if point is not None and point.saved["world_size"] != facts.world_size:
        events.record(
            run_dir,
            "world_size_change",
            attempt=facts.attempt,
            rank=0,
            previous=point.saved["world_size"],
            world_size=facts.world_size,
        )
    return startup_s


def report(facts: RunFacts, trainer: Trainer, perf: dict, startup_s: float) -> None:
    """After the last step: the finish event, the replica digests, and rank 0's summary.json."""
    rank, run_dir = collectives.rank(), trainer.events_to.run_dir
    if rank == 0 and not perf["stopped"]:
        state = trainer.state
        events.record(
            run_dir,
            "finish",
            attempt=facts.attempt,
            rank=0,
            step=state.step,
            samples=state.samples,
            tokens=state.tokens,
            flops=state.flops,
        )
    if facts.zero_stage < 3:  # replicas hold full parameters: they must agree bit for bit
        write_replica_digest(run_dir, trainer.engine.module, rank, facts.world_size)
    peak_mem = collectives.all_reduce_values([float(peak_memory_bytes())], "max")[0]
    if rank == 0 and (not perf["stopped"] or "sequences_per_sec" in perf):
        summary = summarize(
            facts,
            trainer.state.to_dict(),
            perf,
            events.read(run_dir),
            peak_memory_bytes=int(peak_mem),
            startup_s=startup_s,
            wall_time_s=process_age_s(),
            final_loss=trainer.last_loss,
            evaluation=trainer.last_eval,
        ).to_dict()
        atomic_write_json(run_dir / "summary.json", summary)
        keys = ("model", "world_size", "steps", "sequences_per_sec", "tokens_per_sec", "mfu")
        log.info("summary: " + json.dumps({k: summary.get(k) for k in keys}))


def start_wandb(cfg: Config, run_dir: Path, resolved: dict):
    """A wandb run (``logging.wandb``; rank 0's ``Logbook`` starts it as the loop starts)."""
    w = cfg.logging.wandb
    import wandb  # on call: an optional extra (training.engine.check_setup refuses a run without it)

    return wandb.init(
        project=w.project, entity=w.entity, name=w.name or cfg.run.name, mode=w.mode, config=resolved, dir=str(run_dir)
    )
