"""Typed run configuration: dataclasses, YAML recipes, dotted command-line overrides.

One precedence rule: command line > YAML file (> the files it ``base:``-includes) > the defaults declared
here. Every mistake (unknown key, wrong type, inconsistent batch arithmetic, missing file) raises
``UserError`` with one line that names the key and the values.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, cast, get_args, get_origin

import yaml

from common.errors import UserError
from data.formats import get_format, load_formats

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class RunSection:
    name: str = "run"
    """Run name, used in logs and wandb."""
    dir: str = "runs/default"
    """Run directory: metrics.jsonl, summary.json, resolved config, checkpoints (unless checkpoint.dir)."""
    threads_per_rank: int = 0
    """torch intra-op threads per rank; 0 = leave torch's default. Recorded: part of the fingerprint."""
    owner_stale_s: float = 60.0
    """A run has one live owner (``training.ownership``): a job whose owner's mark in ``run.dir`` or
    ``checkpoint.dir`` is not renewed for this long (its holder renews it every ``min(2, this / 6)`` s) is
    taken to be gone, and the next start takes it over after watching that long. A holder on this host and
    boot that has ended is known at once."""
    takeover: bool = False
    """Take the run over from a live-looking owner at once (for an operator who knows that job is dead): the
    line names whose mark was broken, and ``events.jsonl`` records it (``owner_takeover``, reason
    ``forced``). That job stops before its next write, with exit 4."""


@dataclass
class ModelSection:
    name: str = "bert-debug"
    """A registry name (``python -m model list``)."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel: PyTorch scaled-dot-product attention (flash/efficient kernels on GPU) or eager."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass (memory for compute)."""
    unpad: bool = True
    """BERT: compute only the real tokens of each padded micro-batch (embeddings, linears, LayerNorms on the packed
    tokens, variable-length attention); tokens/s, TFLOP/s and MFU then count only those tokens
    (``training.metrics``). false runs ``transformers``' padded forward, which computes and counts every
    position. GPT-NeoX ignores it: its packed windows have no padding."""
    unpad_attention: Literal["auto", "varlen", "padded", "jagged", "loop"] = "auto"
    """BERT with ``model.unpad``: the attention kernel over the packed tokens (``model.unpad``'s module
    docstring). auto: ``varlen`` (one registered operator: torch's flash variable-length kernel with dropout on
    CUDA in BF16/FP16 on compute capability >= 8.0, one sequence at a time on CPU) where it runs, else
    ``padded`` (one dense SDPA call over ``[B, max_seqlen]`` with a key mask; the linears still see only the
    real tokens). ``jagged``: SDPA on jagged nested tensors, 3.5x slower than the padded forward on an H200
    (docs/gpu-notes.md). ``loop``: the former name of ``varlen``'s CPU branch, read as ``varlen``."""
    compile: bool | None = None
    """``torch.compile`` the transformer blocks (``model.compile``: dynamic shapes; a failed compile warns once
    and runs eager; the first step, compile included, is reported as ``first_step_s``). null: on for
    accelerators, off on CPU, where compiling would slow every start by tens of seconds."""
    dropout: float | None = None
    """Override the size's dropout (BERT 0.1, GPT-NeoX 0.0)."""
    vocab_size: int | None = None
    """Override the vocabulary size; by default it is read from the data's vocabulary/tokenizer."""
    families: list[str] = field(default_factory=list)
    """Python modules (dotted names, importable from the working directory or PYTHONPATH) that each define a
    model family as one ``FAMILY`` record (``model.family.Family``) with its sizes; loading the config registers
    them (``model.registry.load_families``), so ``model.name`` may name one of their sizes. The built-in BERT and
    GPT-NeoX need none."""


@dataclass
class DataSection:
    train: str = ""
    """Directory of training HDF5 shards (``python -m data bert|gpt``)."""
    eval: str | None = None
    """Directory of held-out shards for evaluation."""
    kind: str = "auto"
    """Shard format: a name in ``data.formats``' registry (``bert``, ``gpt``, or one ``data.formats`` below
    registers); auto: the model family's (``Family.shard_format``)."""
    formats: list[str] = field(default_factory=list)
    """Python modules (dotted names, as ``model.families``) that each define a shard format as one ``FORMAT``
    record (``data.formats.ShardFormat``); loading the config registers them (``data.formats.load_formats``),
    so ``data.kind`` and a family's ``shard_format`` may name one. The built-in ``bert`` and ``gpt`` need none."""
    seq_len: int = 128
    """Sequence length the shards must have."""
    max_pred: int = 20
    """BERT: MLM predictions per sequence the shards must have."""
    vocab: str | None = None
    """vocab.txt / tokenizer.json the shards were made with (checked against the shards' hash; exported)."""
    num_workers: int = 1
    """Loader worker processes per rank."""
    prefetch: int = 4
    """Transfers each loader worker keeps ready (torch DataLoader's ``prefetch_factor``; a transfer is about
    512 rows): host memory against a stall of the filesystem."""
    require_manifest: bool = True
    """Refuse shard directories without ``manifest.json`` (an interrupted ``python -m data bert|gpt`` leaves
    one); false reads shards made elsewhere (NVIDIA's) as they are, every rank opening every file."""
    read_retries: int = 4
    """A shard read that fails while training or evaluating (an I/O error, a stale handle, a timeout, a file
    briefly gone) is retried this many times, each wait twice the last, each retry logged with the shard and
    rows; then the rank ends with exit 4 and the job resumes from its last checkpoint. A shard of another size
    than its manifest records, or that does not decode, is not retried (exit 2). 0: no retries."""
    read_retry_s: float | None = None
    """The seconds from a read's first failure within which the retries happen (the reads of one outage share
    them); below the data watchdog's bound (``DATA_STALL_SHARE`` of ``deepspeed.timeout_s``), which a larger
    value is refused against. Default: 30 s, or half the bound when that is less."""


@dataclass
class OptimizerSection:
    name: Literal["lans", "lamb", "adamw"] = "lans"
    """lans (LANS, Zheng et al. 2020), lamb (LAMB, You et al. 2019) or adamw (torch's AdamW)."""
    lr: float = 1e-3
    """Peak learning rate (dimensionless): the schedule section multiplies it by a factor that warms up from 0
    to 1, then decays."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """[beta1, beta2]: decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-6
    """Added to the square root of the second moment in the update's denominator (numerical stability)."""
    weight_decay: float = 0.01
    """Weight decay coefficient, decoupled (added to the update, times lr, not to the gradient); biases, norm
    parameters and other 1-D tensors get none."""
    trust_no_decay: bool = True
    """LANS/LAMB: apply the trust ratio to the group without weight decay (biases, LayerNorm) too, as the
    papers do; false gives that group ratio 1, as NVIDIA's FusedLAMB does. No effect on adamw."""


@dataclass
class ScheduleSection:
    kind: Literal["poly_warmup", "warmup_constant_decay", "cosine_warmup"] = "poly_warmup"
    """poly_warmup: NVIDIA PolyWarmUp; warmup_constant_decay: the Gaudi recipes; cosine_warmup: GPT-NeoX."""
    warmup: float = 0.01
    """Warmup as a fraction of train.steps."""
    constant: float = 0.0
    """warmup_constant_decay: constant phase as a fraction of train.steps."""
    degree: float = 0.5
    """poly_warmup: decay exponent."""
    min_ratio: float = 0.0
    """Final lr as a fraction of optimizer.lr (cosine_warmup, warmup_constant_decay)."""


@dataclass
class TrainSection:
    steps: int = 20
    """Optimizer steps (this phase)."""
    global_batch: int = 32
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 8
    """Sequences per rank per forward/backward."""
    grad_accum: int | None = None
    """Derived: global_batch / (micro_batch x data-parallel world size). Give it only to assert it."""
    seed: int = 1234
    """Random seed of the initial weights (the same on every rank), of dropout (seed + 1000 x rank) and of
    the data order of every epoch."""
    eval_every: int = 0
    """Evaluate every K steps (0: only at the end when data.eval is set)."""
    eval_samples: int = 256
    """Held-out samples per evaluation: the first N of data.eval, the same every time and on any world
    size."""
    deterministic: bool = False
    """Deterministic algorithms (torch.use_deterministic_algorithms, new memory not filled): a resumed GPU run
    repeats an uninterrupted one's losses exactly, at some cost in speed."""
    stop_at_step: int = 0
    """Save a checkpoint and exit after this step (0: off), like Megatron's --exit-interval for time-boxed
    jobs; the next start resumes and finishes the same schedule."""
    init_from: str | None = None
    """Phase 2: start from this checkpoint's weights with a fresh optimizer, step count and schedule."""


@dataclass
class DeepSpeedSection:
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 1 partitions the optimizer state over the data-parallel ranks, 2 also the gradients, 3
    also the parameters; 0 none. bf16 at 0 runs as 1 (``training.engine.effective_zero_stage``)."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """bf16: BF16 compute with FP32 master weights and FP32 gradient accumulation."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping (0: off)."""
    offload_optimizer: bool = False
    """ZeRO-Offload: optimizer state and step on the CPU."""
    offload_param: bool = False
    """ZeRO-3 only: parameters on the CPU."""
    mics_shard_size: int = 0
    """ZeRO-3 only: MiCS shard group size (0: off)."""
    communication_dtype: Literal["fp32", "bf16"] = "fp32"
    """Gradient reduction dtype with bf16: fp32 keeps results independent of the world size (bf16 halves
    the bytes but rounds every reduction)."""
    backend: Literal["auto", "nccl", "gloo", "hccl", "ccl"] = "auto"
    """Communication backend; auto = nccl on CUDA, gloo on CPU."""
    timeout_s: int = 600
    """Collective timeout of every process group of the job (DeepSpeed's own groups included): a dead or hung
    rank ends the job within this bound instead of hanging it."""
    nccl_async_error_handling: Literal[0, 1, 2, 3] = 2
    """On NCCL, torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for every rank: 2 aborts the communicators of a
    failed or timed-out collective and lets the rank end through our handler, in one line and with the
    flight recorder's dump in ``run.dir`` (3, torch's default, and 1, torchrun's for its workers, tear the
    process down with SIGABRT). The rank sets it whatever its environment says, and logs a different value."""
    overlap_comm: bool = True
    """ZeRO: overlap the gradient reduction with the backward pass (accelerators only; off on CPU)."""
    bucket_size: int = 200_000_000
    """ZeRO communication bucket size, in elements: reduce and all-gather buckets (ZeRO-3 prefetches a
    quarter of it); larger means fewer, bigger collectives and more memory."""


@dataclass
class CheckpointSection:
    dir: str | None = None
    """Checkpoint directory (default RUN_DIR/checkpoints)."""
    every: int | Literal["auto"] = 0
    """Save every K steps (0: only at the end), or ``auto``: Young's interval sqrt(2 x C x MTBF), C the save
    cost measured in the run (a first save after the warm-up steps measures it) and MTBF the job's: one node's
    ``mtbf_hours`` over the job's node count (independent failures). Recomputed after every save."""
    mtbf_hours: float | None = None
    """Mean time between failures of one node, in hours, for ``every: auto`` (the cluster's own records; a
    2,048-node job that sees a failure every 3 h has one node's MTBF near 6,000 h). Default: the cluster
    profile's ``WP_NODE_MTBF_HOURS``, which ``python -m launch env`` writes for every node."""
    keep: int = 3
    """Keep the newest K complete checkpoints."""
    async_save: bool = False
    """Write checkpoints while training goes on: the step's stall is DeepSpeed's save with its writes replaced
    by copies to host memory (the state is held twice until written); each rank's thread writes and fsyncs
    its files and says so in the step's collective, and rank 0 commits the tag once every rank's files are
    durable, as a synchronous save commits. A failed write stops every rank a step later with one line. The
    last save (and one after SIGTERM) is synchronous."""
    resume: str = "auto"
    """auto: the newest complete checkpoint if any; never: refuse to run over existing checkpoints; or a
    path."""
    final_save: bool = True
    """Save the last step when the run ends (a run stopped by SIGTERM saves whatever this says). false: for
    timed benchmark runs only (``benchmarks/bench_train.py``'s rows), whose figures must not wait on a save;
    the run then ends with nothing newer than its last ``every`` save."""
    preempt_grace_s: float = 25.0
    """After SIGTERM (or the loss of a launcher): the time the job has to finish its step, save and exit,
    below the DeepSpeed launcher's 30 s before it kills the ranks (and Slurm's KillWait). When the previous
    save's duration says a save cannot finish in what remains, it is skipped: the job exits 3 and resumes
    from the last complete checkpoint (logged)."""
    convert_timeout_s: int = 6 * 3600
    """How long the other ranks wait (on a file, outside any collective) while rank 0 converts a checkpoint
    to the universal format for a resume on another world size."""


@dataclass
class WandbSection:
    project: str | None = None
    """Set to log to wandb (WANDB_MODE=offline works without network)."""
    entity: str | None = None
    """wandb user or team that owns the project (default: wandb's default entity of the logged-in user)."""
    name: str | None = None
    """wandb run name (default: run.name)."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """wandb mode (offline: synced later with ``wandb sync``); default: wandb's own (WANDB_MODE, else
    online)."""


@dataclass
class LoggingSection:
    every: int = 5
    """Console / metrics.jsonl line every K steps."""
    warmup_steps: int = 2
    """Steps excluded from throughput (compilation, allocator warm-up)."""
    wandb: WandbSection = field(default_factory=WandbSection)
    """Weights & Biases logging from rank 0 (the ``wandb`` extra)."""
    tensorboard: bool = False
    """Also log through DeepSpeed's TensorBoard monitor (RUN_DIR/tensorboard)."""


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- typed construction


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and where lossless, convert) ``value`` to the declared type ``tp``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except UserError as e:
                errors.append(e)
        raise UserError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        raise UserError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list | tuple):
            raise UserError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {value!r}")
        return _build(cast(type, tp), value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 6e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {tp} for {key}")
    raise UserError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(
            f"unknown key {prefix}{unknown[0]} (known in {prefix or 'top level'}: {', '.join(sorted(names))})"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


# --------------------------------------------------------------------------- YAML and overrides


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or a recipe name in ``configs/`` (``smoke`` -> configs/smoke.yaml)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():
            raise UserError(f"config file {p} does not exist")
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    raise UserError(f"config {name_or_path!r} is neither a YAML file nor a recipe in {CONFIG_DIR}")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe; a top-level ``base: other.yaml`` (relative to this file) is read first and overlaid."""
    path = path.resolve()
    if path in _seen:
        raise UserError(f"{path}: circular 'base:' include")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        data = _merge(load_yaml(path.parent / base, (*_seen, path)), data)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``optimizer.lr=3e-3`` -> (["optimizer", "lr"], 0.003); the value is parsed as YAML."""
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise UserError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file < command-line overrides; every key and type checked."""
    values: dict[str, Any] = load_yaml(resolve_config_path(path)) if path else {}
    for text in overrides:
        parts, value = parse_override(text)
        node = values
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise UserError(f"override {text!r}: {p} is not a section")
            node = child
        node[parts[-1]] = value
    cfg: Config = _build(Config, values)
    if cfg.checkpoint.mtbf_hours is None:
        cfg.checkpoint.mtbf_hours = node_mtbf_from_env()
    validate(cfg)
    load_formats(cfg.data.formats)  # before the families, whose records name their formats
    if cfg.data.kind != "auto":
        get_format(cfg.data.kind)  # one line naming the known formats otherwise
    if cfg.model.families:
        # on call (start-up time): the registry loads torch and transformers, which reading a config does not
        from model.registry import load_families

        load_families(cfg.model.families)
    return cfg


MTBF_ENV = "WP_NODE_MTBF_HOURS"


def node_mtbf_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The cluster profile's node MTBF (``launch env`` writes it on every node), the default of
    ``checkpoint.mtbf_hours``."""
    text = (os.environ if environ is None else environ).get(MTBF_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{MTBF_ENV}={text!r} (the cluster profile's env): not a positive number of hours")
    return value


DATA_STALL_SHARE = 0.8
"""The data watchdog ends a rank whose next batch has not come within this share of ``deepspeed.timeout_s``
(``training.watch.DataWatchdog``): below the collectives' own timeout, so the stalled rank names the cause."""


def read_retry_s(cfg: Config) -> float:
    """``data.read_retry_s``, its default resolved: 30 s, or half the data watchdog's bound when that is less."""
    if cfg.data.read_retry_s is not None:
        return cfg.data.read_retry_s
    return min(30.0, DATA_STALL_SHARE * cfg.deepspeed.timeout_s / 2)


def validate(cfg: Config) -> None:
    """Checks that need more than one field."""
    positive = {
        "train.steps": cfg.train.steps,
        "train.global_batch": cfg.train.global_batch,
        "train.micro_batch": cfg.train.micro_batch,
        "data.seq_len": cfg.data.seq_len,
        "logging.every": cfg.logging.every,
        "train.eval_samples": cfg.train.eval_samples,
        "data.prefetch": cfg.data.prefetch,
    }
    for key, v in positive.items():
        if v <= 0:
            raise UserError(f"{key} must be positive, got {v}")
    if cfg.run.owner_stale_s <= 0:
        raise UserError(f"run.owner_stale_s must be positive, got {cfg.run.owner_stale_s}")
    if cfg.optimizer.lr <= 0:
        raise UserError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if len(cfg.optimizer.betas) != 2 or not all(0 <= b < 1 for b in cfg.optimizer.betas):
        raise UserError(f"optimizer.betas must be two numbers in [0, 1), got {cfg.optimizer.betas}")
    if not 0 <= cfg.schedule.warmup + cfg.schedule.constant <= 1:
        raise UserError(
            f"schedule.warmup + schedule.constant must be within [0, 1], got {cfg.schedule.warmup} + "
            f"{cfg.schedule.constant}"
        )
    if cfg.deepspeed.offload_param and cfg.deepspeed.zero_stage != 3:
        raise UserError(f"deepspeed.offload_param needs deepspeed.zero_stage=3, got {cfg.deepspeed.zero_stage}")
    if cfg.deepspeed.mics_shard_size and cfg.deepspeed.zero_stage != 3:
        raise UserError(f"deepspeed.mics_shard_size needs deepspeed.zero_stage=3, got {cfg.deepspeed.zero_stage}")
    if cfg.optimizer.name in ("lans", "lamb") and (cfg.deepspeed.zero_stage == 3 or cfg.deepspeed.offload_optimizer):
        raise UserError(
            f"optimizer.name={cfg.optimizer.name} keeps per-tensor trust ratios under ZeRO stages 0-2 "
            f"without optimizer offload; got deepspeed.zero_stage={cfg.deepspeed.zero_stage}, "
            f"deepspeed.offload_optimizer={cfg.deepspeed.offload_optimizer}"
        )
    every, mtbf = cfg.checkpoint.every, cfg.checkpoint.mtbf_hours
    if every == "auto" and (mtbf is None or mtbf <= 0):
        raise UserError(
            "checkpoint.every=auto needs checkpoint.mtbf_hours > 0 (one node's mean time between failures, "
            f"in hours), got {mtbf}"
        )
    if every != "auto" and every < 0:
        raise UserError(f"checkpoint.every must be >= 0 or auto, got {every}")
    if cfg.checkpoint.keep < 1:
        raise UserError(f"checkpoint.keep must be at least 1, got {cfg.checkpoint.keep}")
    if cfg.train.global_batch % cfg.train.micro_batch:
        raise UserError(
            f"train.global_batch={cfg.train.global_batch} is not a multiple of "
            f"train.micro_batch={cfg.train.micro_batch}"
        )
    bound = DATA_STALL_SHARE * cfg.deepspeed.timeout_s
    if not 0 <= cfg.data.read_retries <= 16 or read_retry_s(cfg) < 0:
        raise UserError(
            f"data.read_retries must be within [0, 16] and data.read_retry_s >= 0, got {cfg.data.read_retries} "
            f"and {cfg.data.read_retry_s}"
        )
    if read_retry_s(cfg) >= bound:
        raise UserError(
            f"data.read_retry_s={read_retry_s(cfg):g} must be below the data watchdog's bound, "
            f"{DATA_STALL_SHARE:g} x deepspeed.timeout_s={cfg.deepspeed.timeout_s} = {bound:g} s (the watchdog "
            "would end the rank during the retries)"
        )


def gradient_accumulation(train: TrainSection, dp_world: int) -> int:
    """global_batch = micro_batch x grad_accum x data-parallel world size, reconciled once, here."""
    per_step = train.micro_batch * dp_world
    if train.global_batch % per_step:
        raise UserError(
            f"train.global_batch={train.global_batch} is not divisible by "
            f"train.micro_batch={train.micro_batch} "
            f"x data-parallel world size {dp_world} (= {per_step})"
        )
    accum = train.global_batch // per_step
    if train.grad_accum is not None and train.grad_accum != accum:
        raise UserError(
            f"train.grad_accum={train.grad_accum} contradicts train.global_batch={train.global_batch} / "
            f"(train.micro_batch={train.micro_batch} x world size {dp_world}) = {accum}"
        )
    return accum
