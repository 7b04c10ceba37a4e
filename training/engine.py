"""DeepSpeed set-up: the DeepSpeed JSON config is generated here from the typed config, never kept by hand."""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from common.errors import UserError
from common.log import get_logger
from common.net import free_port
from training import collectives
from training.config import Config, DeepSpeedSection, LoggingSection
from training.devices import MEMORY_CAP_ENV

log = get_logger("train")


def on_accelerator() -> bool:
    """True on CUDA, Gaudi and other DeepSpeed accelerators; False on the CPU."""
    return collectives.accelerator().device_name() != "cpu"


def backend_for(section: DeepSpeedSection) -> str:
    """auto: the accelerator's own backend (nccl on CUDA, hccl on Gaudi), gloo on the CPU."""
    if section.backend != "auto":
        return section.backend
    return collectives.accelerator().communication_backend_name() if on_accelerator() else "gloo"


def check_setup(cfg: Config) -> None:
    """Refuse, in one line, what cannot run on this machine, before any process group exists (the model name is
    the run's plan's to check: ``training.start.static_plan``)."""
    if cfg.logging.wandb.project and importlib.util.find_spec("wandb") is None:
        raise UserError("logging.wandb.project is set but wandb is not installed: pip install wandb")
    ds = cfg.deepspeed
    if ds.precision == "fp16" and not on_accelerator():
        raise UserError("deepspeed.precision=fp16 needs a GPU; on CPU use deepspeed.precision=bf16 or fp32")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ds.backend == "nccl" and not torch.cuda.is_available():
        why = (
            "CUDA_VISIBLE_DEVICES is empty"
            if visible == ""
            else "this torch has no CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise UserError(f"deepspeed.backend=nccl needs a CUDA device, but {why}; use deepspeed.backend=gloo on CPU")
    if ds.backend == "auto" and torch.version.cuda is not None and visible == "":
        raise UserError(
            "CUDA_VISIBLE_DEVICES is set but empty: this CUDA build of torch sees no GPU; unset it, or set "
            "deepspeed.backend=gloo to train on the CPU on purpose"
        )


def compute_dtypes(section: DeepSpeedSection) -> tuple[str, ...]:
    """The dtypes a run's arithmetic uses: the model's, plus fp32 for master weights and the optimizer."""
    return {"bf16": ("bfloat16", "float32"), "fp16": ("float16", "float32")}.get(section.precision, ("float32",))


class _DropNoise(logging.Filter):
    """DeepSpeed messages a user can do nothing about, repeated by every rank at every start."""

    NOISE = ("Setting accelerator to CPU", "untested optimizer")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.NOISE)


def quiet() -> None:
    """Silence DeepSpeed's and torch's warnings that say nothing actionable (call before importing
    deepspeed)."""
    logging.getLogger("DeepSpeed").addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated", category=FutureWarning)


def no_shm_all_reduce() -> None:
    """Keep DeepSpeed from building its CPU shared-memory all-reduce (before ``init_distributed``).

    DeepSpeed builds and maps it at every CPU start: seconds of start-up, and two 69 MB
    ``deepspeed_allreduce_buffer_*`` files left in /dev/shm per job, which nothing removes (RAM-backed: about
    50 launches pinned 7 GB). Only its inference all-reduce uses it; training and our benchmarks never do.
    """
    import deepspeed.ops  # deferred: importing DeepSpeed takes seconds (a config error is refused before)

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def set_determinism() -> None:
    """Deterministic algorithms (``train.deterministic``), without filling new memory.

    torch fills every uninitialised tensor with NaN under ``use_deterministic_algorithms`` by default, to expose
    reads of uninitialised memory; it does not make a valid program more deterministic, and it made a CPU
    training step 3.2x slower (bert-debug, 2 ranks: 29 against 95 sequences/s). The exact-resume tests are
    what shows the runs repeat.
    """
    # cuBLAS needs a fixed workspace for deterministic matmuls; set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False


def start(cfg: Config) -> None:
    """Checks, threads, determinism and the process group (the launcher's env vars, or a single process)."""
    quiet()
    import deepspeed  # deferred: seconds to import, and after quiet()

    check_setup(cfg)
    if backend_for(cfg.deepspeed) == "gloo":
        no_shm_all_reduce()
    if cfg.run.threads_per_rank:
        torch.set_num_threads(cfg.run.threads_per_rank)
    if cfg.train.deterministic:
        set_determinism()
    section = cfg.deepspeed
    if "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        # a single process started without a launcher: any free port, not the launchers' default 29500,
        # which another job on this machine may hold

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    bind_device()  # before the process group: its first collectives run on this rank's own device
    if backend_for(section) == "nccl":
        value, note = nccl_error_handling(section.nccl_async_error_handling, os.environ.get(ASYNC_ERROR_ENV))
        os.environ[ASYNC_ERROR_ENV] = value
        if note and os.environ.get("RANK", "0") == "0":
            log.info(note)
        os.environ.update(flight_recorder_env(Path(cfg.run.dir), os.environ))  # check_run_dir makes the dir
    timeout = datetime.timedelta(seconds=section.timeout_s)
    bound_every_group(timeout)
    deepspeed.init_distributed(dist_backend=backend_for(section), timeout=timeout, verbose=False)


ASYNC_ERROR_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_error_handling(configured: int, env_value: str | None) -> tuple[str, str | None]:
    """The ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` a NCCL rank runs with (``deepspeed.nccl_async_error_handling``),
    and the line to log when its environment held another value. A lost or hung peer under 2: the watchdog
    aborts the communicators and the blocked wait returns, so our handler ends the rank with one line. The
    rank cannot tell torchrun's 1 (what its agent gives workers) from a user's own: the config decides."""
    value = str(configured)
    if env_value is None or env_value.strip() == value:
        return value, None
    return value, (
        f"{ASYNC_ERROR_ENV}={env_value} in the environment (torchrun gives its workers 1); running with "
        f"deepspeed.nccl_async_error_handling={configured}"
    )


FLIGHT_RECORDER_ENTRIES = 20000
"""Collectives the NCCL flight recorder keeps per rank (a ring buffer of small records)."""


def flight_recorder_env(run_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """What a NCCL rank sets so that a collective timeout dumps torch's flight recorder (the last
    ``FLIGHT_RECORDER_ENTRIES`` collectives of every rank, what each was waiting on) into ``run_dir``: a file
    per rank, ``nccl_trace_rank_<rank>`` (``flight_recorder_file``). Values the environment already holds are
    kept. Both torch's names for each setting are set (the ``TORCH_FR_*`` ones are newer)."""
    size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or str(FLIGHT_RECORDER_ENTRIES)
    prefix = _dump_prefix(env) or str(run_dir / "nccl_trace_rank_")
    return {
        "TORCH_FR_BUFFER_SIZE": size,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def _dump_prefix(env: Mapping[str, str]) -> str | None:
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_file(rank: int, env: Mapping[str, str]) -> str | None:
    """Where this rank's flight-recorder dump lands on a NCCL timeout (``flight_recorder_env``), if enabled."""
    prefix = _dump_prefix(env)
    if not prefix or env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "0") in ("0", "false"):
        return None
    return f"{prefix}{rank}"


DUMP_WAIT_S = 15.0
"""How long a NCCL rank that ends on a lost peer waits for torch to write its flight-recorder dump (torch's
own wait for the dump, ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, is 15 s by default): the watchdog's monitor
writes it a moment after the communicators are aborted, while the rank's handler would end the process."""


def flight_recorder_note(rank: int, env: Mapping[str, str], wait_s: float = DUMP_WAIT_S) -> str:
    """The tail of a NCCL rank's one-line error: the dump file once it exists (waiting up to ``wait_s``), or
    that none appeared; empty where no dump is configured."""
    path = flight_recorder_file(rank, env)
    if path is None:
        return ""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return f"; no NCCL flight-recorder dump appeared at {path} within {wait_s:g} s"
        time.sleep(0.2)
    return f"; NCCL flight recorder: {path}"


def device_for(local_rank: int, device_count: int) -> int:
    """The accelerator a rank computes on: its local rank's. Two ranks share one device only when started so
    (both with ``LOCAL_RANK=0``, as the GPU tier does under gloo)."""
    if 0 <= local_rank < device_count:
        return local_rank
    envs = ", ".join(f"{e}={os.environ.get(e, '(unset)')}" for e in _visible_envs())
    raise UserError(
        f"LOCAL_RANK={local_rank} has no device of its own: this node shows {device_count} ({envs}); start "
        f"at most {device_count} ranks per node (--num_gpus / --nproc-per-node)"
    )


def _visible_envs() -> list[str]:
    return list(collectives.accelerator().visible_devices_envs())


def bind_device() -> None:
    """Make ``LOCAL_RANK``'s device this process's current one (the accelerator's ``set_device``), before any
    collective: DeepSpeed does so only inside ``deepspeed.initialize``, and until then every rank's
    ``cuda`` meant device 0, where the object collectives of the start-up checks ran. A no-op on the CPU."""
    if not on_accelerator():
        return
    acc = collectives.accelerator()
    acc.set_device(device_for(int(os.environ["LOCAL_RANK"]), acc.device_count()))
    cap_device_memory()


def cap_device_memory() -> float | None:
    """Cap this process's CUDA caching allocator at ``$WIKIPRETRAIN_DEVICE_MEMORY_GIB`` GiB of its current
    device (``torch.cuda.set_per_process_memory_fraction``), so that a run on a bigger card measures what fits
    a smaller one (an H200 capped at 80 GB stands in for an H100); returns the fraction, None when unset or not
    on CUDA. Past the cap an allocation raises ``torch.OutOfMemoryError`` as on the smaller card."""
    raw = os.environ.get(MEMORY_CAP_ENV)
    if not raw or not torch.cuda.is_available():
        return None
    try:
        gib = float(raw)
    except ValueError:
        raise UserError(f"{MEMORY_CAP_ENV}={raw!r} is not a number of GiB") from None
    if gib <= 0:
        raise UserError(f"{MEMORY_CAP_ENV}={raw!r} must be positive")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = min(1.0, gib * (1 << 30) / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def bound_every_group(timeout: datetime.timedelta) -> None:
    """Make ``timeout`` the default of every process group, not only the world group.

    DeepSpeed creates its data-parallel and ZeRO groups with ``dist.new_group(ranks)`` and no timeout, which
    torch then takes from a module default (30 minutes for gloo, 10 for NCCL), so a hung rank held its peers
    in a ZeRO collective far beyond ``deepspeed.timeout_s``. torch reads that default when a group is created.
    """
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def effective_zero_stage(section: DeepSpeedSection) -> int:
    """BF16 at stage 0 runs as stage 1.

    DeepSpeed's only BF16 path with FP32 master weights and FP32 gradient accumulation is its BF16 optimizer,
    which it selects for ZeRO stage 1; plain stage 0 with BF16 would train in pure BF16. On one rank the two
    stages are the same computation; on several, stage 1 also partitions the optimizer state.
    """
    if section.precision == "bf16" and section.zero_stage == 0:
        return 1
    return section.zero_stage


def deepspeed_config(cfg: Config, grad_accum: int, run_dir: str) -> dict[str, Any]:
    """The DeepSpeed JSON config for this run (written to RUN_DIR/deepspeed_config.json for reference)."""
    ds: DeepSpeedSection = cfg.deepspeed
    stage = effective_zero_stage(ds)
    accel = on_accelerator()
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero.update(
            overlap_comm=ds.overlap_comm and accel,
            contiguous_gradients=True,
            reduce_bucket_size=ds.bucket_size,
            allgather_bucket_size=ds.bucket_size,
            reduce_scatter=True,
        )
    if stage == 3:
        zero.update(
            overlap_comm=ds.overlap_comm and accel,
            contiguous_gradients=True,
            reduce_bucket_size=ds.bucket_size,
            stage3_prefetch_bucket_size=ds.bucket_size // 4,
            stage3_param_persistence_threshold=100_000,
            stage3_gather_16bit_weights_on_model_save=False,
        )
        if ds.mics_shard_size:
            zero["mics_shard_size"] = ds.mics_shard_size
        if ds.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": accel}
    if ds.offload_optimizer:
        if stage == 0:
            raise UserError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": accel}

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.train.global_batch,
        "gradient_clipping": ds.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
        # Our optimizers (LANS, LAMB, AdamW) are torch optimizers passed to deepspeed.initialize.
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"tag_validation": "FAIL"},
    }
    if ds.precision == "bf16":
        config["bf16"] = bf16_section()
        # Gradient accumulation in FP32: BF16 accumulation under ZeRO loses accuracy over many micro-batches.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = ds.communication_dtype
    elif ds.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    config.update(_monitor_config(cfg.logging, run_dir))
    return config


def bf16_section(immediate_grad_update: bool = True) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` section. ``immediate_grad_update``: at ZeRO-1 (where DeepSpeed wraps the optimizer
    in its ``BF16_Optimizer``) each parameter's BF16 gradient is added to its FP32 accumulator by a hook as
    backward produces it, instead of by a Python loop over every parameter after each micro-batch
    (``update_hp_grads``); the same additions, so the same losses (``tests/test_lans_zero.py``). Other stages
    do not read it."""
    return {"enabled": True, "immediate_grad_update": immediate_grad_update}


def _monitor_config(logging: LoggingSection, run_dir: str) -> dict[str, Any]:
    if not logging.tensorboard:
        return {}
    return {
        "tensorboard": {
            "enabled": True,
            "output_path": os.path.join(run_dir, "tensorboard"),
            "job_name": "train",
        }
    }
