"""Pre-train BERT or GPT-NeoX with DeepSpeed: the program the ``deepspeed`` launcher runs on every rank.

deepspeed --num_gpus N train.py --config configs/smoke.yaml [section.key=value ...]
python train.py --config smoke            # one process
python train.py --config X --print-config # resolved config and the generated DeepSpeed JSON, then exit
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from common.atomic import atomic_write_json
from common.errors import EXIT_USER_ERROR, UserError
from common.log import get_logger
from data.h5format import sha256_file
from training.config import Config, gradient_accumulation, load_config

log = get_logger("train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a YAML file or a recipe name in configs/ (e.g. smoke)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-3 train.steps=100")
    return p.parse_args(argv)


def scalar_attrs(attrs: dict) -> dict:
    """The shards' scalar attributes as plain JSON values (HDF5 gives numpy scalars)."""
    out = {}
    for k, v in attrs.items():
        v = v.item() if isinstance(v, np.generic) else v
        if isinstance(v, str | int | float | bool):
            out[k] = v
    return out


def schedule_kwargs(cfg: Config) -> dict:
    """The schedule section's fields that the chosen schedule function takes, plus the total steps."""
    import inspect

    from training.schedules import SCHEDULES

    fields = {**dataclasses.asdict(cfg.schedule), "total_steps": cfg.train.steps}
    accepted = inspect.signature(SCHEDULES[cfg.schedule.kind]).parameters
    return {k: v for k, v in fields.items() if k in accepted and k != "step"}


def write_replica_digest(run_dir: Path, module: torch.nn.Module, rank: int, world: int) -> None:
    """Each rank records a hash of its parameters and where it ran: a cheap cross-node consistency check."""
    import socket

    from common.net import own_address

    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    info = {
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "params_sha256": h.hexdigest(),
        "address": own_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
    }
    atomic_write_json(run_dir / "replicas" / f"rank{rank}.json", info)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_run_paths(cfg: Config) -> tuple[Path, Path]:
    run_dir = Path(cfg.run.dir)
    return run_dir, Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def find_resume_point(cfg: Config, ckpt_dir: Path) -> tuple[Path, str | None]:
    """Where to resume from: (checkpoint dir, tag or None for a fresh start). Never silently starts over."""
    from training import checkpoint

    resume = cfg.checkpoint.resume
    if resume == "auto":
        tag = checkpoint.latest_complete(ckpt_dir)
        if tag is None and checkpoint.incomplete_tags(ckpt_dir):
            log.warning(
                f"{ckpt_dir}: only incomplete checkpoints ({', '.join(checkpoint.incomplete_tags(ckpt_dir))}); starting fresh"
            )
        return ckpt_dir, tag
    if resume == "never":
        if checkpoint.complete_tags(ckpt_dir):
            raise UserError(
                f"{ckpt_dir} already holds checkpoints and checkpoint.resume=never; use another run.dir"
            )
        return ckpt_dir, None
    return checkpoint.resolve(Path(resume), "checkpoint.resume")


def build_loader(cfg: Config, path: str, kind: str, grad_accum: int, rank: int, world: int, expect: dict):
    from data.loader import PretrainingLoader

    if not path:
        raise UserError("data.train is not set: give a directory of HDF5 shards (python -m data bert|gpt)")
    if not Path(path).exists():
        raise UserError(f"data directory {path} does not exist")
    return PretrainingLoader(
        path,
        kind,
        micro_batch=cfg.train.micro_batch,
        grad_accum=grad_accum,
        dp_rank=rank,
        dp_world=world,
        seed=cfg.train.seed,
        num_workers=cfg.data.num_workers,
        expect=expect,
    )


def run(cfg: Config) -> int:
    import deepspeed
    import torch.distributed as dist

    from model.build import build_model
    from model.flops import device_kind, peak_flops, training_flops_per_token
    from model.registry import get_spec, spec_to_dict
    from training import checkpoint
    from training.engine import check_precision, deepspeed_config, init_distributed
    from training.lans import attach_zero, build_optimizer, param_groups
    from training.metrics import config_fingerprint
    from training.schedules import build_scheduler
    from training.trainer import Trainer, exit_code, peak_memory_bytes

    t_start = time.perf_counter()
    check_precision(cfg.deepspeed)
    if cfg.run.threads_per_rank:
        torch.set_num_threads(cfg.run.threads_per_rank)
    init_distributed(cfg.deepspeed)
    rank, world = dist.get_rank(), dist.get_world_size()
    grad_accum = gradient_accumulation(cfg.train, world)
    run_dir, ckpt_dir = resolve_run_paths(cfg)
    spec = get_spec(cfg.model.name)  # validates the name before any data is read
    kind = spec.family if cfg.data.kind == "auto" else cfg.data.kind
    kind = "gpt" if kind == "neox" else kind
    if (kind == "bert") != (spec.family == "bert"):
        raise UserError(f"data.kind={cfg.data.kind} does not fit model {cfg.model.name} ({spec.family})")

    expect: dict = {"seq_len": cfg.data.seq_len}
    if kind == "bert":
        expect["max_pred"] = cfg.data.max_pred
    vocab_sha = None
    if cfg.data.vocab:
        if not Path(cfg.data.vocab).exists():
            raise UserError(f"data.vocab {cfg.data.vocab} does not exist")
        vocab_sha = sha256_file(cfg.data.vocab)  # the hash the shard writers store
        expect["vocab_sha256" if kind == "bert" else "tokenizer_sha256"] = vocab_sha
    loader = build_loader(cfg, cfg.data.train, kind, grad_accum, rank, world, expect)
    eval_loader = build_loader(cfg, cfg.data.eval, kind, 1, rank, world, expect) if cfg.data.eval else None
    attrs = loader.attrs
    vocab_sha = vocab_sha or attrs.get("vocab_sha256") or attrs.get("tokenizer_sha256")
    vocab_size = cfg.model.vocab_size or attrs.get("vocab_size")
    spec = get_spec(cfg.model.name, vocab_size=vocab_size, dropout=cfg.model.dropout)
    if spec.max_positions < cfg.data.seq_len:
        raise UserError(
            f"data.seq_len={cfg.data.seq_len} exceeds {spec.name}'s max_positions={spec.max_positions}"
        )

    seed_everything(cfg.train.seed)  # same initial weights on every rank
    model = build_model(
        spec, attention=cfg.model.attention, activation_checkpointing=cfg.model.activation_checkpointing
    )
    seed_everything(cfg.train.seed + 1000 * rank)  # rank-specific dropout streams
    opt = cfg.optimizer
    optimizer = build_optimizer(
        opt.name,
        param_groups(model, opt.weight_decay),
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    scheduler = build_scheduler(optimizer, cfg.schedule.kind, **schedule_kwargs(cfg))
    ds_config = deepspeed_config(cfg, grad_accum, str(run_dir))
    resume_dir, tag = find_resume_point(cfg, ckpt_dir)
    saved, universal = None, False
    if tag is not None:
        saved = checkpoint.read_client_state(resume_dir, tag)
        if saved["world_size"] != world:
            if saved["global_batch"] != cfg.train.global_batch:
                raise UserError(
                    f"{resume_dir / tag} was trained with train.global_batch={saved['global_batch']}; resuming on "
                    f"{world} ranks instead of {saved['world_size']} needs the same global batch, got {cfg.train.global_batch}"
                )
            tag, universal = checkpoint.to_universal(resume_dir, tag), True
            ds_config["checkpoint"]["load_universal"] = True
    resolved = cfg.to_dict()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    attach_zero(engine)

    model_spec = {**spec_to_dict(spec), "padded_vocab": spec.padded_vocab}
    client_static = {
        "model_spec": model_spec,
        "vocab_sha256": vocab_sha,
        "world_size": world,
        "global_batch": cfg.train.global_batch,
        "data_attrs": scalar_attrs(attrs),
        "config": resolved,
    }
    max_pred = cfg.data.max_pred if kind == "bert" else None
    flops = training_flops_per_token(spec, cfg.data.seq_len, max_pred)
    kind_name = device_kind()
    trainer = Trainer(
        engine,
        loader,
        eval_loader=eval_loader,
        steps=cfg.train.steps,
        seq_len=cfg.data.seq_len,
        global_batch=cfg.train.global_batch,
        grad_accum=grad_accum,
        flops_per_token=flops,
        peak_flops=peak_flops(kind_name),
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        ckpt_every=cfg.checkpoint.every,
        ckpt_keep=cfg.checkpoint.keep,
        stop_at_step=cfg.train.stop_at_step,
        log_every=cfg.logging.every,
        warmup_steps=cfg.logging.warmup_steps,
        eval_every=cfg.train.eval_every,
        eval_batches=cfg.train.eval_batches,
        client_static=client_static,
    )

    if tag is not None:
        checkpoint.check_compatible(saved, client_static, resume_dir / tag)
        checkpoint.load(engine, resume_dir, tag)
        attach_zero(engine)  # the per-tensor layout is rebuilt from DeepSpeed's links after a load
        if universal:
            # Per-rank RNG streams cannot carry over to another world size: re-seed them from the step.
            seed_everything(cfg.train.seed + 1000 * rank + saved["step"])
        trainer.load_client_state(saved)
        log.info(f"resumed from {resume_dir / tag} at step {trainer.state.step}")
    elif cfg.train.init_from:
        init_dir, init_tag = checkpoint.resolve(Path(cfg.train.init_from), "train.init_from")
        saved = checkpoint.read_client_state(init_dir, init_tag)
        checkpoint.check_compatible(saved, client_static, init_dir / init_tag)
        checkpoint.load(engine, init_dir, init_tag, module_only=True)
        log.info(f"initialised weights from {init_dir / init_tag} (fresh optimizer, step count and schedule)")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / "config.json", resolved)
        atomic_write_json(run_dir / "deepspeed_config.json", ds_config)
        log.info(
            f"{spec.name} | world {world} | micro {cfg.train.micro_batch} x accum {grad_accum} = global "
            f"{cfg.train.global_batch} | seq {cfg.data.seq_len} | ZeRO {cfg.deepspeed.zero_stage} | "
            f"{cfg.deepspeed.precision} | {cfg.optimizer.name} | {kind_name}"
        )

    wandb_run = None
    if rank == 0 and cfg.logging.wandb.project:
        import wandb

        w = cfg.logging.wandb
        wandb_run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or cfg.run.name,
            mode=w.mode,
            config=resolved,
            dir=str(run_dir),
        )
    trainer.wandb_run = wandb_run

    perf = trainer.train()
    if cfg.deepspeed.zero_stage < 3:  # replicas hold full parameters: they must agree bit for bit
        write_replica_digest(run_dir, engine.module, rank, world)
    peak = torch.tensor([float(peak_memory_bytes())])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        summary = {
            "model": spec.name,
            "family": spec.family,
            "world_size": world,
            "nodes": int(os.environ.get("WORLD_SIZE", world))
            // max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1),
            "device_kind": kind_name,
            "device_count": world,
            "threads_per_rank": torch.get_num_threads(),
            "precision": cfg.deepspeed.precision,
            "zero_stage": cfg.deepspeed.zero_stage,
            "optimizer": cfg.optimizer.name,
            "micro_batch": cfg.train.micro_batch,
            "global_batch": cfg.train.global_batch,
            "grad_accum": grad_accum,
            "seq_len": cfg.data.seq_len,
            "steps": trainer.state.step,
            "measured_steps": max(trainer.state.step - trainer.window.warmup_steps, 0),
            "samples": trainer.state.samples,
            "tokens": trainer.state.tokens,
            "flops_per_token": flops,
            "peak_flops_per_device": trainer.peak_flops,
            **{k: v for k, v in perf.items() if k != "preempted"},
            "preempted": perf["preempted"],
            "peak_memory_bytes": int(peak.item()),
            "total_wall_time_s": time.perf_counter() - t_start,
            "final_loss": trainer.last_loss,
            **trainer.last_eval,
            "fingerprint": config_fingerprint({**resolved, "threads_per_rank": torch.get_num_threads()}),
            "config": resolved,
        }
        atomic_write_json(run_dir / "summary.json", summary)
        if "sequences_per_sec" in summary:  # too few steps to measure: no efficiency either
            from launch.report import annotate_efficiency

            try:
                annotate_efficiency(run_dir, run_dir.parent)
            except UserError as e:  # a sibling run's unreadable summary must not fail this run
                log.warning(f"no scaling efficiency: {e}")
        shown = {
            k: summary[k]
            for k in ("model", "world_size", "steps", "sequences_per_sec", "tokens_per_sec", "mfu")
            if k in summary
        }
        log.info("summary: " + json.dumps(shown))
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float)})
            wandb_run.finish()
    dist.barrier()
    return exit_code(perf)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.config, args.overrides)
        from model.registry import get_spec
        from training.engine import check_precision

        get_spec(cfg.model.name)
        check_precision(cfg.deepspeed)
        if args.print_config:
            from training.engine import deepspeed_config

            world = int(os.environ.get("WORLD_SIZE", "1"))
            accum = gradient_accumulation(cfg.train, world)
            print(
                json.dumps(
                    {"config": cfg.to_dict(), "deepspeed": deepspeed_config(cfg, accum, cfg.run.dir)},
                    indent=2,
                )
            )
            return 0
        rc = run(cfg)
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
