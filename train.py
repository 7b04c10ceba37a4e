"""Pre-train BERT or GPT-NeoX with DeepSpeed: the program the ``deepspeed`` launcher runs on every rank.

deepspeed --num_gpus N train.py --config configs/smoke.yaml [section.key=value ...]
python train.py --config smoke            # one process
python train.py --config X --print-config # resolved config and the generated DeepSpeed JSON, then exit
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from common.errors import EXIT_PEER_LOST, EXIT_USER_ERROR, SUPERVISED_ENV, USER_ERROR_WAIT_S, RankError, UserError
from common.log import get_logger
from data.reads import ShardDamaged, ShardUnavailable
from training import ownership
from training.config import Config, gradient_accumulation, load_config, read_retry_s

log = get_logger("train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a YAML file or a recipe name in configs/ (e.g. smoke)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-3 train.steps=100")
    return p.parse_args(argv)


def run(cfg: Config) -> int:
    # on call (start-up time): torch loads once the arguments and the config are read, so --help and a bad config
    # answer at once (the imports at the top load no torch)
    from training import collectives
    from training.trainer import exit_code

    start = prepare(cfg)
    if start is None:
        return 0
    trainer = start.trainer
    try:
        trainer.logbook.open()  # wandb, after the resume: part of the start-up time
        startup_s = announce(cfg, start.facts, start.ds_config, trainer, start.point)
        perf = trainer.train()
        report(start.facts, trainer, perf, startup_s)
    finally:
        trainer.close()
    collectives.barrier()
    return exit_code(perf)


@dataclass
class Start:
    """A run's start, up to its first step: the trainer (restored or initialised), what the run is, the
    DeepSpeed configuration and the checkpoint it resumed from."""

    trainer: Any
    facts: Any
    ds_config: dict
    point: Any


def prepare(cfg: Config) -> Start | None:
    """Everything before the first step, on every rank: the process group, the data, the model and its engine,
    the trainer with its checkpointer, and the resume (or ``train.init_from``). None: the checkpoint is
    already at ``train.steps``. The caller runs the trainer and closes it (and ends the process group)."""
    # on call (start-up time), as in run
    from model.registry import family_of, get_spec
    from training import collectives
    from training import engine as ds_engine
    from training.build import build_engine, check_run_dir, model_spec, open_data
    from training.checkpoint.resume import check_shared, find_resume
    from training.checkpoint.safeload import restrict

    restrict()  # every checkpoint load of this rank (DeepSpeed's too) reads weights only: a file runs no code
    ds_engine.start(cfg)  # precision and backend checks, the device, threads, determinism, the process group
    rank, world = collectives.rank(), collectives.world_size()
    grad_accum = gradient_accumulation(cfg.train, world)
    run_dir = Path(cfg.run.dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    # one live owner: refused here, on every rank, before anything is written in either directory
    ownership.take([run_dir, ckpt_dir], cfg.run.owner_stale_s, cfg.run.takeover)
    family = family_of(get_spec(cfg.model.name))  # validates the name before any data is read
    check_run_dir(run_dir)
    data = open_data(cfg.data, cfg.train, cfg.model, family, grad_accum, rank, world, read_retry_s(cfg))
    spec = model_spec(cfg.model, cfg.data, data.attrs)
    check_shared(ckpt_dir)
    point = find_resume(
        cfg.checkpoint,
        ckpt_dir,
        world=world,
        global_batch=cfg.train.global_batch,
        steps=cfg.train.steps,
        optimizer=cfg.optimizer.name,
    )
    if point is not None and point.saved["step"] == cfg.train.steps:
        log.info(f"{point.ckpt_dir / point.tag} is already at train.steps={cfg.train.steps}: nothing to train")
        return None
    ds_config = ds_engine.deepspeed_config(cfg, grad_accum, str(run_dir))
    ds_config["checkpoint"]["load_universal"] = bool(point and point.universal)
    engine = build_engine(cfg.model, cfg.optimizer, cfg.schedule, cfg.train, spec, ds_config, rank)
    trainer, facts = assemble(cfg, engine, data, spec, family, grad_accum, ckpt_dir)
    try:
        if point is not None:
            trainer.checkpointer.restore(point)
            trainer.load_client_state(point.saved)
        elif cfg.train.init_from:
            trainer.checkpointer.initialise_from(Path(cfg.train.init_from))
    except BaseException:
        trainer.close()
        raise
    return Start(trainer, facts, ds_config, point)


def assemble(cfg: Config, engine, data, spec, family, grad_accum: int, ckpt_dir: Path):
    """The trainer of this start, with its checkpointer, logbook and data watchdog, and the run's facts."""
    # on call (start-up time), as in run
    from common.cluster import node_count
    from model.flops import WorkCounter
    from training import collectives
    from training.build import run_identity, seed_everything
    from training.checkpoint.checkpointer import Checkpointer
    from training.clock import Clock
    from training.events import EventLog
    from training.logbook import Logbook
    from training.optim.factory import attach_zero
    from training.trainer import Trainer, next_attempt
    from training.watch import DataWatchdog

    rank, world, run_dir = collectives.rank(), collectives.world_size(), Path(cfg.run.dir)
    resolved = cfg.to_dict()
    events_to = EventLog(run_dir, next_attempt(run_dir, rank), node_count())
    clock = Clock(cfg.logging.warmup_steps)  # the run's time: the trainer's steps, the checkpointer's saves
    checkpointer = Checkpointer(
        cfg.checkpoint,
        ckpt_dir,
        engine,
        run_identity(spec, data, world, cfg.train, cfg.optimizer, resolved),
        lambda step: seed_everything(cfg.train.seed + 1000 * rank + step),
        clock=clock,
        steps=cfg.train.steps,
        events_to=events_to,
        after_load=[attach_zero],
    )
    facts = run_facts(cfg, spec, family, world, grad_accum, engine, events_to)
    max_pred = cfg.data.max_pred if family.format.uses_max_pred else None
    trainer = Trainer(
        engine,
        data.loader,
        eval_set=data.eval_set,
        train=cfg.train,
        checkpointer=checkpointer,
        logbook=Logbook(
            run_dir,
            rank,
            events_to.attempt,
            cfg.train.steps,
            engine.monitor,
            wandb=functools.partial(start_wandb, cfg, run_dir, resolved) if cfg.logging.wandb.project else None,
            family=family,
        ),
        events_to=events_to,
        grad_accum=grad_accum,
        count=WorkCounter(spec, cfg.data.seq_len, max_pred, unpadded=family.unpadded(cfg.model.unpad)),
        peak_flops=facts.peak_flops_per_device,
        clock=clock,
        log_every=cfg.logging.every,
        family=family,
        data_watchdog=DataWatchdog(cfg.deepspeed.timeout_s, cfg.data.num_workers, run_dir),
    )
    return trainer, facts


def run_facts(cfg: Config, spec, family, world: int, grad_accum: int, engine, events_to):
    """What this start of the run is (``training.metrics.RunFacts``); ranks of one job report one peak."""
    # on call (start-up time), as in run
    from model.flops import training_flops_per_token
    from training import collectives, devices
    from training import engine as ds_engine
    from training.metrics import RunFacts

    flops = training_flops_per_token(spec, cfg.data.seq_len, cfg.data.max_pred if family.format.uses_max_pred else None)
    device = devices.device_name()
    peak = devices.peak_flops(device, ds_engine.compute_dtypes(cfg.deepspeed))
    if peak is not None:  # ranks of one job report one MFU: the best peak any of them measured
        peak = collectives.all_reduce_values([peak], "max")[0]
    return RunFacts(
        model=spec.name,
        family=spec.family,
        world_size=world,
        nodes=events_to.nodes,
        device_kind=device,
        threads_per_rank=_threads(),
        precision=cfg.deepspeed.precision,
        zero_stage=engine.zero_optimization_stage(),
        zero_stage_requested=cfg.deepspeed.zero_stage,
        optimizer=cfg.optimizer.name,
        micro_batch=cfg.train.micro_batch,
        global_batch=cfg.train.global_batch,
        grad_accum=grad_accum,
        seq_len=cfg.data.seq_len,
        flops_per_token=flops,
        peak_flops_per_device=peak,
        attempt=events_to.attempt,
        config=cfg.to_dict(),
    )


def announce(cfg: Config, facts, ds_config: dict, trainer, point) -> float:
    """Before the first step: rank 0 writes the resolved configs, the run's line and the start events. Returns
    the start-up time (process start to here)."""
    # on call (start-up time), as in run
    from common.atomic import atomic_write_json
    from training import collectives, events
    from training.clock import process_age_s

    startup_s = process_age_s()
    if collectives.rank() != 0:
        return startup_s
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", facts.config)
    atomic_write_json(run_dir / "deepspeed_config.json", ds_config)
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
        step=trainer.state.step,
        tokens=trainer.state.tokens,
        flops=trainer.state.flops,
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


def report(facts, trainer, perf: dict, startup_s: float) -> None:
    """After the last step: the finish event, the replica digests, and rank 0's summary.json."""
    # on call (start-up time), as in run
    from common.atomic import atomic_write_json
    from training import collectives, events
    from training.checkpoint.replicas import write_replica_digest
    from training.clock import peak_memory_bytes, process_age_s
    from training.metrics import summarize

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


def _threads() -> int:
    import torch  # on call (start-up time), as in run

    return torch.get_num_threads()


def start_wandb(cfg: Config, run_dir: Path, resolved: dict):
    """A wandb run (``logging.wandb``; rank 0's ``Logbook`` starts it as the loop starts)."""
    w = cfg.logging.wandb
    import wandb  # on call: an optional extra (training.engine.check_setup refuses a run without it)

    return wandb.init(
        project=w.project, entity=w.entity, name=w.name or cfg.run.name, mode=w.mode, config=resolved, dir=str(run_dir)
    )


def end_rank(cfg: Config | None, why: str, line: str) -> NoReturn:
    """End this rank on a fault the job resumes from: a ``failure`` event, ``error: rank R: LINE``, exit 4,
    without a teardown (it would wait on ranks blocked in the step's collective)."""
    rank = os.environ.get("RANK", "0")
    if cfg is not None:
        from training import events  # on call: beside train.py's other imports on call (to the top in #52 item 1)

        events.record(Path(cfg.run.dir), "failure", rank=int(rank), why=why)
        ownership.release(Path(cfg.run.dir))  # the job ends in order: the next start proceeds at once
    print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg: Config | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            from training.engine import check_setup, deepspeed_config  # on call (start-up time), as in run

            check_setup(cfg)
            accum = gradient_accumulation(cfg.train, int(os.environ.get("WORLD_SIZE", "1")))
            ds = deepspeed_config(cfg, accum, cfg.run.dir)
            print(json.dumps({"config": cfg.to_dict(), "deepspeed": ds}, indent=2))
            return 0
        return run(cfg)
    except ShardUnavailable as e:  # the filesystem failed the read through every retry: resume when it serves
        end_rank(cfg, e.one_line(), e.one_line())
    except ownership.RunOwned as e:  # another job's run: nothing is written there, no event (that job would read it)
        if local_rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except UserError as e:
        # every rank raises the same error: one line per node, in each node's log; a RankError is this rank's own
        if local_rank == 0 or isinstance(e, RankError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ  # launch elastic must not retry it: it reads this
        own = int(os.environ.get("RANK", "0"))
        from training import events  # on call: as in end_rank

        if cfg is not None and isinstance(e, ShardDamaged):  # a run's failure, not a start refused: goodput's
            events.record(Path(cfg.run.dir), "failure", rank=own, why=str(e))
        if cfg is not None and under_agent and (own == 0 or isinstance(e, RankError)):
            events.record(Path(cfg.run.dir), "user_error", rank=own, message=str(e))
        if cfg is not None and under_agent and os.environ.get(SUPERVISED_ENV):
            import time  # on call: as in end_rank

            time.sleep(USER_ERROR_WAIT_S)  # launch elastic ends this process meanwhile (see SUPERVISED_ENV)
        return EXIT_USER_ERROR
    except RuntimeError as e:  # torch.distributed's DistBackendError included
        # on call (start-up time), as in run: loaded already by the time a collective fails
        from training import engine as ds_engine
        from training.collectives import peer_lost

        why = peer_lost(e)
        if why is None:
            raise
        first = str(e).strip().splitlines()[0][-160:]
        dump = ""
        if cfg is not None and ds_engine.backend_for(cfg.deepspeed) == "nccl":
            dump = ds_engine.flight_recorder_note(int(os.environ.get("RANK", "0")), os.environ)
        end_rank(cfg, why, f"{why}; the job ends here and resumes from its last checkpoint ({first}){dump}")
    finally:
        from common.process import end_process_group  # on call: as in end_rank

        ownership.release(Path(cfg.run.dir) if cfg is not None else None)  # rank 0's marks, after its last write
        end_process_group()


if __name__ == "__main__":
    from common.process import exit_fast

    exit_fast(main())
