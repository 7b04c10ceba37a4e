"""Pre-train BERT or GPT-NeoX with DeepSpeed: the program the ``deepspeed`` launcher runs on every rank.

deepspeed --num_gpus N train.py --config configs/smoke.yaml [section.key=value ...]
python train.py --config smoke            # one process
python train.py --config X --print-config # resolved config and the generated DeepSpeed JSON, then exit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from common.errors import EXIT_PEER_LOST, EXIT_USER_ERROR, UserError
from common.log import get_logger
from training.config import Config, gradient_accumulation, load_config

log = get_logger("train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a YAML file or a recipe name in configs/ (e.g. smoke)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-3 train.steps=100")
    return p.parse_args(argv)


def run(cfg: Config) -> int:
    from common.atomic import atomic_write_json
    from common.cluster import node_count
    from model.flops import training_flops_per_token
    from model.registry import family_of, get_spec, spec_to_dict
    from training import checkpoint, collectives, devices, events
    from training import engine as ds_engine
    from training.build import build_engine, check_run_dir, open_data, scalar_attrs, seed_everything
    from training.metrics import RunSummary, config_fingerprint
    from training.trainer import (
        DataWatchdog,
        Trainer,
        exit_code,
        next_attempt,
        peak_memory_bytes,
        process_age_s,
        write_replica_digest,
    )

    ds_engine.start(cfg)  # precision and backend checks, threads, determinism, the process group
    rank, world = collectives.rank(), collectives.world_size()
    grad_accum = gradient_accumulation(cfg.train, world)
    run_dir = Path(cfg.run.dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    family = family_of(get_spec(cfg.model.name))  # validates the name before any data is read
    check_run_dir(run_dir)
    data = open_data(cfg, family, grad_accum, rank, world)
    spec = get_spec(cfg.model.name, vocab_size=cfg.model.vocab_size or data.attrs.get("vocab_size"),
                    dropout=cfg.model.dropout)  # fmt: skip
    if spec.max_positions < cfg.data.seq_len:
        raise UserError(
            f"data.seq_len={cfg.data.seq_len} exceeds {spec.name}'s max_positions={spec.max_positions}"
        )
    checkpoint.check_shared(ckpt_dir)
    point = checkpoint.find_resume(cfg.checkpoint, ckpt_dir, world=world, global_batch=cfg.train.global_batch,
                                   steps=cfg.train.steps, optimizer=cfg.optimizer.name)  # fmt: skip
    if point is not None and point.saved["step"] == cfg.train.steps:
        log.info(
            f"{point.ckpt_dir / point.tag} is already at train.steps={cfg.train.steps}: nothing to train"
        )
        return 0
    ds_config = ds_engine.deepspeed_config(cfg, grad_accum, str(run_dir))
    ds_config["checkpoint"]["load_universal"] = bool(point and point.universal)
    engine = build_engine(cfg, spec, ds_config, rank)
    resolved = cfg.to_dict()
    client_static = {
        "model_spec": {**spec_to_dict(spec), "padded_vocab": spec.padded_vocab},
        "vocab_sha256": data.vocab_sha256,
        "world_size": world,
        "global_batch": cfg.train.global_batch,
        "optimizer": cfg.optimizer.name,
        "data_attrs": scalar_attrs(data.attrs),
        "config": resolved,
    }
    flops = training_flops_per_token(
        spec, cfg.data.seq_len, cfg.data.max_pred if family.uses_max_pred else None
    )
    device = devices.device_name()
    peak = devices.peak_flops(device, ds_engine.compute_dtypes(cfg.deepspeed))
    if peak is not None:  # ranks of one job report one MFU: the best peak any of them measured
        peak = collectives.all_reduce_values([peak], "max")[0]
    trainer = Trainer(
        engine, data.loader, eval_set=data.eval_set, train=cfg.train, logging=cfg.logging,
        ckpt=cfg.checkpoint,
        grad_accum=grad_accum, seq_len=cfg.data.seq_len, flops_per_token=flops,
        peak_flops=peak, run_dir=run_dir,
        ckpt_dir=ckpt_dir, client_static=client_static, attempt=next_attempt(run_dir, rank),
        nodes=node_count(),
        data_watchdog=DataWatchdog(cfg.deepspeed.timeout_s, cfg.data.num_workers, run_dir),
    )  # fmt: skip
    try:
        if point is not None:
            checkpoint.restore(engine, point, client_static, lambda step: seed_everything(
                cfg.train.seed + 1000 * rank + step), wait_s=cfg.checkpoint.convert_timeout_s)  # fmt: skip
            trainer.load_client_state(point.saved)
        elif cfg.train.init_from:
            checkpoint.initialise_from(engine, Path(cfg.train.init_from), client_static)
        zero_stage = engine.zero_optimization_stage()
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / "config.json", resolved)
            atomic_write_json(run_dir / "deepspeed_config.json", ds_config)
            log.info(
                f"{spec.name} | world {world} | micro {cfg.train.micro_batch} x accum {grad_accum} = global "
                f"{cfg.train.global_batch} | seq {cfg.data.seq_len} | ZeRO {zero_stage} | "
                f"{cfg.deepspeed.precision} | {cfg.optimizer.name} | {device} | attempt {trainer.attempt}"
            )
            trainer.wandb_run = start_wandb(cfg, run_dir, resolved)
        startup_s = process_age_s()
        if rank == 0:
            events.record(run_dir, "start", attempt=trainer.attempt, rank=0, world_size=world,
                          nodes=node_count(), step=trainer.state.step,
                          resumed_from=point.tag if point else None,
                          restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                          startup_s=round(startup_s, 3))  # fmt: skip
            if point is not None and point.saved["world_size"] != world:
                events.record(run_dir, "world_size_change", attempt=trainer.attempt, rank=0,
                              previous=point.saved["world_size"], world_size=world)  # fmt: skip
        perf = trainer.train()
        if rank == 0 and not perf["stopped"]:
            events.record(run_dir, "finish", attempt=trainer.attempt, rank=0, step=trainer.state.step,
                          samples=trainer.state.samples)  # fmt: skip
        if zero_stage < 3:  # replicas hold full parameters: they must agree bit for bit
            write_replica_digest(run_dir, engine.module, rank, world)
        peak_mem = collectives.all_reduce_values([float(peak_memory_bytes())], "max")[0]
        if rank == 0 and (not perf["stopped"] or "sequences_per_sec" in perf):
            st = trainer.state
            evs = events.read(run_dir)
            summary = RunSummary(
                model=spec.name, family=spec.family, world_size=world, nodes=node_count(), device_kind=device,
                device_count=world, threads_per_rank=_threads(), precision=cfg.deepspeed.precision,
                zero_stage=zero_stage, zero_stage_requested=cfg.deepspeed.zero_stage,
                optimizer=cfg.optimizer.name,
                micro_batch=cfg.train.micro_batch, global_batch=cfg.train.global_batch, grad_accum=grad_accum,
                seq_len=cfg.data.seq_len, steps=st.step, samples=st.samples, tokens=st.tokens,
                flops_per_token=flops, peak_flops_per_device=trainer.peak_flops, attempt=trainer.attempt,
                peak_memory_bytes=int(peak_mem), startup_s=startup_s, final_loss=trainer.last_loss,
                fingerprint=config_fingerprint({**resolved, "threads_per_rank": _threads()}), config=resolved,
                evaluation=trainer.last_eval, wall_time_s=process_age_s(),
                goodput=events.goodput(evs),
                segments=events.segments(evs, cfg.train.global_batch, cfg.data.seq_len, flops,
                                         trainer.peak_flops),
                **perf,
            )  # fmt: skip
            atomic_write_json(run_dir / "summary.json", summary.to_dict())
            keys = ("model", "world_size", "steps", "sequences_per_sec", "tokens_per_sec", "mfu")
            shown = {k: summary.to_dict().get(k) for k in keys}
            log.info("summary: " + json.dumps(shown))
    finally:
        trainer.close()
    collectives.barrier()
    return exit_code(perf)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def start_wandb(cfg: Config, run_dir: Path, resolved: dict):
    """A wandb run on rank 0 when ``logging.wandb.project`` is set (wandb is an optional extra)."""
    w = cfg.logging.wandb
    if not w.project:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError(
            "logging.wandb.project is set but wandb is not installed: pip install wandb"
        ) from None
    return wandb.init(project=w.project, entity=w.entity, name=w.name or cfg.run.name, mode=w.mode,
                      config=resolved, dir=str(run_dir))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg: Config | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            from training.engine import check_setup, deepspeed_config

            check_setup(cfg)
            accum = gradient_accumulation(cfg.train, int(os.environ.get("WORLD_SIZE", "1")))
            ds = deepspeed_config(cfg, accum, cfg.run.dir)
            print(json.dumps({"config": cfg.to_dict(), "deepspeed": ds}, indent=2))
            return 0
        return run(cfg)
    except UserError as e:
        if local_rank == 0:  # every rank raises the same error: one line per node, in each node's log
            print(f"error: {e}", file=sys.stderr, flush=True)
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ  # launch elastic must not retry it: it reads this
        if cfg is not None and under_agent and os.environ.get("RANK", "0") == "0":
            from training import events

            events.record(Path(cfg.run.dir), "user_error", rank=0, message=str(e))
        return EXIT_USER_ERROR
    except RuntimeError as e:  # torch.distributed's DistBackendError included
        from training.collectives import peer_lost

        why = peer_lost(e)
        if why is None:
            raise
        first = str(e).strip().splitlines()[0][-160:]
        rank = os.environ.get("RANK", "0")
        if cfg is not None:
            from training import events

            events.record(Path(cfg.run.dir), "failure", rank=int(rank), why=why)
        print(
            f"error: rank {rank}: {why}; the job ends here and resumes from its last checkpoint ({first})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_LOST)  # no teardown: it would wait on the peer that is not answering
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
