"""The pieces of a run, each built from its own section of the config: data, model and engine.

``training.start`` reads as a list of these calls; each takes the sections it needs, not the whole config, and
the part of the run's plan it needs (``training.start.StaticPlan``) instead of deciding it again.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.errors import UserError
from common.log import get_logger
from data.formats import get_format
from data.loader import EvalSet, PretrainingLoader
from data.reads import ReadRetry
from data.tokenizer import vocab_sha256
from model.build import build_model
from model.compile import compiled_modules
from model.compile import wanted as compile_wanted
from model.registry import with_fields
from model.unpad import resolve_kernel
from training import collectives
from training.config import DataSection, ModelSection, OptimizerSection, ScheduleSection, TrainSection
from training.optim.factory import attach_zero, build_optimizer, param_groups
from training.optim.schedules import SCHEDULES, build_scheduler
from training.state import seed_everything

if TYPE_CHECKING:
    from training.start import StaticPlan  # the plan's module builds these pieces: a cycle at run time

log = get_logger("train")


def check_run_dir(run_dir: Path) -> None:
    """At start-up, on every rank: ``run_dir`` can be created and written (rank 0 writes the config, metrics
    and summary there, every rank its replica digest). Otherwise every rank raises the same one-line error
    naming the first node that failed, before anything is built."""
    problem = None
    probe = run_dir / f".probe-rank{collectives.rank()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe")
        probe.unlink()
    except OSError as e:
        problem = e.strerror or type(e).__name__
    failure = collectives.first_failure(problem)
    if failure:
        why, host, rank = failure
        raise UserError(
            f"run.dir {run_dir} is not writable on node {host} (rank {rank}): {why}; give a writable run.dir"
        )


@dataclass
class RunData:
    """The training loader, the fixed evaluation set and what the shards say about themselves."""

    loader: Any
    eval_set: Any
    kind: str
    attrs: dict[str, Any]
    vocab_sha256: str | None


def open_data(
    data: DataSection,
    train: TrainSection,
    plan: StaticPlan,
    grad_accum: int,
    rank: int,
    world: int,
    read_retry_s: float,
) -> RunData:
    """Open the shards the model family reads, checking them against ``data.*`` (sequence length,
    vocabulary). When the run unpads (the plan's ``unpadded``: BERT with ``model.unpad``) the micro-batches carry
    where their real tokens are, found on the host (``data.loader.unpadding_index``)."""
    fmt, family = plan.shard_format, plan.family
    if data.kind != "auto" and get_format(data.kind) is not fmt:  # one line if data.kind is unknown
        raise UserError(f"data.kind={data.kind} does not fit model {plan.spec.name} ({family.name}, {fmt.name} shards)")
    kind = fmt.name
    expect: dict[str, Any] = {"seq_len": data.seq_len}
    if plan.max_pred is not None:
        expect["max_pred"] = plan.max_pred
    vocab_sha = None
    if data.vocab:
        if not Path(data.vocab).exists():
            raise UserError(f"data.vocab={data.vocab}: file does not exist")
        vocab_sha = vocab_sha256(data.vocab)  # the identity the shard writers store
        expect[fmt.hash_key] = vocab_sha
    unpad = plan.unpadded
    read_retry = ReadRetry(data.read_retries, read_retry_s)  # training and evaluation reads alike
    if not data.train:
        raise UserError("data.train is not set: give a directory of HDF5 shards (python -m data bert|gpt)")
    if not Path(data.train).exists():
        raise UserError(f"data.train={data.train}: directory does not exist")
    loader = PretrainingLoader(
        data.train,
        kind,
        micro_batch=train.micro_batch,
        grad_accum=grad_accum,
        dp_rank=rank,
        dp_world=world,
        seed=train.seed,
        num_workers=data.num_workers,
        prefetch_factor=data.prefetch,
        expect=expect,
        require_manifest=data.require_manifest,
        unpad=unpad,
        pin_memory=collectives.accelerator().device_name() == "cuda",  # pinned by the DataLoader's thread
        read_retry=read_retry,
    )
    eval_set = None
    if data.eval:
        if not Path(data.eval).exists():
            raise UserError(f"data.eval={data.eval}: directory does not exist")
        eval_set = EvalSet(
            data.eval,
            kind,
            train.eval_samples,
            micro_batch=train.micro_batch,
            dp_rank=rank,
            dp_world=world,
            expect=expect,
            require_manifest=data.require_manifest,
            unpad=unpad,
            read_retry=read_retry,
        )
    attrs = loader.attrs
    return RunData(loader, eval_set, kind, attrs, vocab_sha or attrs.get(fmt.hash_key))


def model_spec(plan: StaticPlan, model: ModelSection, data: DataSection, shard_attrs: dict[str, Any]):
    """The plan's named size with this run's vocabulary (``model.vocab_size``, else the shards') and dropout, as
    ``model.registry.get_spec`` replaces fields; refuses a sequence length beyond its positions."""
    vocab = model.vocab_size or shard_attrs.get("vocab_size")
    spec = with_fields(plan.spec, model.name, vocab_size=vocab, dropout=model.dropout)
    if spec.max_positions < data.seq_len:
        raise UserError(f"data.seq_len={data.seq_len} exceeds {spec.name}'s max_positions={spec.max_positions}")
    return spec


def schedule_kwargs(schedule: ScheduleSection, total_steps: int) -> dict:
    """The schedule section's fields that the chosen schedule function takes, plus the total steps."""
    fields = {**dataclasses.asdict(schedule), "total_steps": total_steps}
    accepted = inspect.signature(SCHEDULES[schedule.kind]).parameters
    return {k: v for k, v in fields.items() if k in accepted and k != "step"}


def check_unpad_kernel(kernel: str | None, device: str, dtype: torch.dtype, spec) -> None:
    """``model.unpad_attention=varlen`` asked for where it cannot run (CUDA in FP32, an older card, an odd head
    size) for a model computing in ``dtype``: refused at the start in one line, not at the first forward."""
    if kernel != "varlen":
        return
    try:
        resolve_kernel(kernel, device, dtype, spec.hidden // spec.heads)
    except ValueError as e:
        raise UserError(f"model.unpad_attention=varlen: {e}") from None


def build_engine(
    model_cfg: ModelSection,
    opt: OptimizerSection,
    schedule: ScheduleSection,
    train: TrainSection,
    spec,
    plan: StaticPlan,
    ds_config: dict[str, Any],
    dtype: torch.dtype,
    rank: int,
):
    """Model (same initial weights on every rank), optimizer, schedule and the DeepSpeed engine; whether it
    unpads, and over which kernel, is the plan's."""
    import deepspeed  # deferred: seconds to import, and after training.engine.start's quiet()

    from training.zero_init import build_partitioned, local_numel  # deferred: it imports DeepSpeed too

    schedule_args = schedule_kwargs(schedule, train.steps)
    log.info(f"building {spec.name} and its optimizer")
    torch.manual_seed(train.seed)  # same initial weights on every rank (they draw from torch's RNG alone)
    device = collectives.accelerator().device_name()
    check_unpad_kernel(plan.unpad_kernel, device, dtype, spec)
    # the kernel that runs is resolved in the model's forward, from its runtime device and dtype; the trainer logs
    # it after the first step and records it (attention_kernel)
    build: dict[str, Any] = {
        "attention": model_cfg.attention,
        "activation_checkpointing": model_cfg.activation_checkpointing,
        "unpad": plan.unpadded,
        "unpad_kernel": plan.unpad_kernel,
        "compile": compile_wanted(model_cfg.compile, device),
        "family": plan.family,
    }
    if ds_config["zero_optimization"]["stage"] == 3:  # each rank holds only its partition
        model = build_partitioned(spec, ds_config, **build)
        held, whole = local_numel(model)
        log.info(f"built under zero.Init: this rank holds {held:,} of {whole:,} parameters")
    else:
        model = build_model(spec, **build)
    if build["compile"]:
        log.info(f"model.compile: {len(compiled_modules(model))} transformer-block modules compiled (dynamic shapes)")
    seed_everything(train.seed + 1000 * rank)  # rank-specific dropout streams
    optimizer = build_optimizer(
        opt.name,
        param_groups(model, opt.weight_decay),
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        trust_no_decay=opt.trust_no_decay,
    )
    scheduler = build_scheduler(optimizer, schedule.kind, **schedule_args)
    log.info("initialising the DeepSpeed engine")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    attach_zero(engine)
    return engine
