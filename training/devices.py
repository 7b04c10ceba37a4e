"""What this process runs on, and the peak FLOP/s that MFU divides by.

Convention: the peak of an accelerator is its dense (no 2:4 sparsity) BF16 tensor-core FLOP/s from the
vendor's datasheet, looked up by the exact product name the accelerator reports (``PEAK_FLOPS``). A device
that is not in the table has no peak (``None``): MFU is then not reported, never guessed.

A CPU has no datasheet figure that fits, so its peak is *measured*: the fastest square matmul this process
reaches (best of several trials, at its current torch thread count) in any dtype the run computes in. The
result is cached per CPU model, thread count, ATen CPU capability and torch version in
``$XDG_CACHE_HOME/wikipretrain/cpu_matmul_peak.json`` and only ever grows (the maximum of all measurements),
so a measurement taken on a busy machine cannot later push MFU above 1.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from common.atomic import atomic_write_json
from common.errors import RankError
from common.log import get_logger
from model.unpad import HOST_KEYS
from training import collectives

log = get_logger(__name__)

# Dense BF16 tensor FLOP/s per device, keyed by the name the accelerator reports
# (torch.cuda.get_device_name() on NVIDIA, habana_frameworks.torch.hpu.get_device_name() on Gaudi).
# NVIDIA datasheets print BF16 "with sparsity"; the dense figure is half of it. Every entry has its source.
PEAK_FLOPS: dict[str, float] = {
    # NVIDIA H100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core, H100 SXM 1,979 TFLOPS with sparsity
    "NVIDIA H100 80GB HBM3": 989.5e12,
    # NVIDIA H100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core, H100 PCIe 1,513 TFLOPS with sparsity
    "NVIDIA H100 PCIe": 756.5e12,
    # NVIDIA H100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core, H100 NVL 1,671 TFLOPS with sparsity
    "NVIDIA H100 NVL": 835.5e12,
    # NVIDIA H200 Tensor Core GPU datasheet: BFLOAT16 Tensor Core, H200 SXM 1,979 TFLOPS with sparsity
    "NVIDIA H200": 989.5e12,
    # NVIDIA H200 Tensor Core GPU datasheet: BFLOAT16 Tensor Core, H200 NVL 1,671 TFLOPS with sparsity
    "NVIDIA H200 NVL": 835.5e12,
    # NVIDIA GH200 Grace Hopper Superchip datasheet: BFLOAT16 Tensor Core 990 TFLOPS (dense)
    "NVIDIA GH200 480GB": 990e12,
    # NVIDIA A100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity), SXM
    "NVIDIA A100-SXM4-80GB": 312e12,
    # NVIDIA A100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity), SXM
    "NVIDIA A100-SXM4-40GB": 312e12,
    # NVIDIA A100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity), PCIe
    "NVIDIA A100 80GB PCIe": 312e12,
    # NVIDIA A100 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity), PCIe
    "NVIDIA A100-PCIE-40GB": 312e12,
    # NVIDIA A10 Tensor Core GPU datasheet: BF16 Tensor Core 125 TF (250 TF with sparsity)
    "NVIDIA A10": 125e12,
    # NVIDIA L4 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 242 TFLOPS with sparsity
    "NVIDIA L4": 121e12,
    # NVIDIA L40 GPU Accelerator datasheet: BFLOAT16 Tensor Core 181.05 TFLOPS (362.1 with sparsity)
    "NVIDIA L40": 181.05e12,
    # NVIDIA L40S datasheet: BFLOAT16 Tensor Core 362.05 TFLOPS (733 with sparsity)
    "NVIDIA L40S": 362.05e12,
    # Intel, "Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference" (Hot Chips 2024),
    # product table, Peak Compute (BF16): Gaudi 60 TFLOPs
    "GAUDI": 60e12,
    # same table: Gaudi 2 432 TFLOPs
    "GAUDI2": 432e12,
    # same table: Gaudi 3 1835 TFLOPs (BF16 Matrix TFLOPs 1835)
    "GAUDI3": 1835e12,
}
# Left out for want of a vendor figure: NVIDIA A10G (AWS's part; NVIDIA publishes no datasheet for it).


def normalise_name(name: str) -> str:
    """Case, surrounding and repeated whitespace, and a leading "NVIDIA " do not distinguish devices."""
    s = " ".join(name.split()).casefold()
    return s.removeprefix("nvidia ")


_BY_NORMALISED = {normalise_name(k): v for k, v in PEAK_FLOPS.items()}
if len(_BY_NORMALISED) != len(PEAK_FLOPS):  # pragma: no cover - guards edits of the table
    raise RuntimeError("two PEAK_FLOPS names normalise to the same key")

_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """Once per process, and in a job only on rank 0: every rank of a job would say the same."""
    if key not in _WARNED:
        _WARNED.add(key)
        if int(os.environ.get("RANK", "0")) == 0:
            log.warning(message)


def device_name() -> str:
    """The product name of this process's accelerator (as it reports it), or ``"cpu"``.

    The accelerator is DeepSpeed's (``deepspeed.accelerator.get_accelerator()``), the one the engine uses.
    """
    acc = collectives.accelerator()
    kind = acc.device_name()
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        return torch.cuda.get_device_name(acc.current_device())
    if kind == "hpu":
        import habana_frameworks.torch.hpu as hthpu  # optional: present whenever DeepSpeed picked the HPU

        return hthpu.get_device_name()
    return kind


# --------------------------------------------------------------------------------------------- CPU


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_BUDGET_PER_DTYPE_S = 0.6  # two dtypes stay under 1.5 s of start-up when nothing is cached
_GROW_BELOW_S = 0.02  # a matmul size is doubled while one product takes less than this
_MAX_SIZE = 4096
_TRIALS_PER_SIZE = 3
_EMULATED_BELOW = 0.25  # BF16 matmul rate / FP32 matmul rate under which BF16 counts as emulated


def _dtype_name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"compute dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return name


def cache_path() -> Path:
    """The JSON file that keeps measured CPU matmul peaks (``$XDG_CACHE_HOME``, default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "wikipretrain" / "cpu_matmul_peak.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_cache_key() -> str:
    """What a measured peak depends on: CPU model, torch threads, ATen's kernel ISA and the torch version."""
    return (
        f"{_cpu_model()} | threads={torch.get_num_threads()} | "
        f"isa={torch.backends.cpu.get_cpu_capability()} | torch={torch.__version__}"
    )


def measure_matmul_rate(dtype: str | torch.dtype, budget_s: float = _BUDGET_PER_DTYPE_S) -> float:
    """Best FLOP/s of square ``dtype`` matmuls on the CPU at the current torch thread count.

    Sizes double from 128 while a product is quick (so the rate is taken where the kernel is at its
    best, whatever that size is on this CPU); then every size is timed again, a few products back to back,
    until ``budget_s`` is spent. The best single product wins: interference only ever slows a trial down.
    """
    dt = _DTYPES[_dtype_name(dtype)]
    start = time.perf_counter()
    pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    best = last = 0.0

    def trial(a: torch.Tensor, b: torch.Tensor) -> float:
        t0 = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - t0

    size = 128
    while True:
        gen = torch.Generator().manual_seed(size)
        a = torch.randn(size, size, generator=gen).to(dt)
        b = torch.randn(size, size, generator=gen).to(dt)
        pairs.append((size, a, b))
        # the first product of a size also pays for packing and allocation; on a busy machine any product
        # may wait for a core, so the size is judged by its fastest of three
        last = min(trial(a, b) for _ in range(_TRIALS_PER_SIZE))
        best = max(best, 2.0 * size**3 / last)
        # doubling the size costs 8x per product
        grow_s = 8 * last * _TRIALS_PER_SIZE
        if size >= _MAX_SIZE or last >= _GROW_BELOW_S or time.perf_counter() - start + grow_s > budget_s:
            break
        size *= 2
    while True:
        for n, a, b in pairs:
            for _ in range(_TRIALS_PER_SIZE):  # back to back, so that the operands are warm in cache
                if time.perf_counter() - start + (last if n == size else 0.0) > budget_s:
                    return best
                t = trial(a, b)
                best = max(best, 2.0 * n**3 / t)
                if n == size:
                    last = t


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cpu_matmul_rates(dtypes: Iterable[str | torch.dtype], remeasure: bool = False) -> dict[str, float]:
    """Peak matmul FLOP/s per dtype on this CPU, from the cache or measured now (and then cached).

    With ``remeasure`` the dtypes are measured again. The cache keeps, per dtype, the largest rate ever
    measured under the same key (``cpu_cache_key``), and that is what is returned.
    """
    names = list(dict.fromkeys(_dtype_name(d) for d in dtypes))
    path, key = cache_path(), cpu_cache_key()
    cached = _read_cache(path).get(key, {})
    todo = names if remeasure else [n for n in names if not cached.get(n)]
    if not todo:
        return {n: float(cached[n]) for n in names}
    log.info(f"measuring CPU matmul peak ({', '.join(todo)}; cached in {path}) ...")
    fresh = {n: measure_matmul_rate(n) for n in todo}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:  # ranks on one host share the file
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read_cache(path)
        entry = data.setdefault(key, {})
        for n, rate in fresh.items():
            entry[n] = max(float(entry.get(n) or 0.0), rate)
        atomic_write_json(path, data)
    return {n: float(entry.get(n) or cached[n]) for n in names}


_NATIVE: dict[str, bool] = {}


def _judge_bf16(rates: dict[str, float]) -> bool:
    """Record (and say once) whether BF16 matmuls run at hardware speed, from BF16 and FP32 rates."""
    key = cpu_cache_key()
    native = rates["bfloat16"] >= _EMULATED_BELOW * rates["float32"]
    _NATIVE[key] = native
    if not native:
        _warn_once(
            "bf16-emulated:" + key,
            f"BF16 matmuls are emulated on this CPU: {rates['bfloat16'] / 1e9:.3g} GFLOP/s against "
            f"{rates['float32'] / 1e9:.3g} GFLOP/s in FP32; FP32 trains faster here",
        )
    return native


def cpu_peak_flops(dtypes: Iterable[str | torch.dtype] = ("bfloat16",), remeasure: bool = False) -> float:
    """The CPU's peak for MFU: the fastest matmul rate among the dtypes the run computes in.

    When BF16 is among them, FP32 is measured too, to tell (once) whether BF16 is emulated here.
    """
    names = list(dict.fromkeys(_dtype_name(d) for d in dtypes))
    if not names:
        raise ValueError("cpu_peak_flops needs at least one compute dtype")
    wanted = names + (["float32"] if "bfloat16" in names and "float32" not in names else [])
    rates = cpu_matmul_rates(wanted, remeasure=remeasure)
    if "bfloat16" in names:
        _judge_bf16(rates)
    return max(rates[n] for n in names)


def bf16_is_native() -> bool:
    """Whether BF16 matmuls run at hardware speed here (not emulated far below FP32's rate).

    On CPU this compares the measured (and cached) BF16 and FP32 matmul rates, once per process; on an
    accelerator it asks DeepSpeed's accelerator.
    """
    if device_name() != "cpu":
        return bool(collectives.accelerator().is_bf16_supported())
    key = cpu_cache_key()
    if key not in _NATIVE:
        _judge_bf16(cpu_matmul_rates(("bfloat16", "float32")))
    return _NATIVE[key]


# ------------------------------------------------------------------------------------------ lookup


def peak_flops(name: str | None = None, dtypes: Iterable[str | torch.dtype] = ("bfloat16",)) -> float | None:
    """Peak FLOP/s of one device called ``name`` (default: this process's device); None if unknown.

    Names match whole after ``normalise_name``, never by substring: "NVIDIA L4" is not "NVIDIA L40S".
    ``dtypes`` are the dtypes the run's matmuls compute in (e.g. ``("bfloat16", "float32")`` for BF16
    training with FP32 master weights); they matter only on CPU, where the peak is measured. An accelerator's
    peak is its dense BF16 tensor figure from ``PEAK_FLOPS``.
    """
    name = device_name() if name is None else name
    key = normalise_name(name)
    if key == "cpu":
        return cpu_peak_flops(dtypes)
    peak = _BY_NORMALISED.get(key)
    if peak is None:
        _warn_once(
            "unknown:" + key,
            f"no peak FLOP/s known for device {name!r}: MFU is not reported "
            "(add its datasheet's dense BF16 figure to training.devices.PEAK_FLOPS)",
        )
    return peak


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A host micro-batch on ``device``, without making the host wait when the loader pinned it (the
    training loader does on CUDA: ``PretrainingLoader(pin_memory=True)``); the unpadding's host keys
    (``model.unpad.HOST_KEYS``: exact kernel sizes) stay on the host."""
    return {k: v if k in HOST_KEYS else v.to(device, non_blocking=True) for k, v in batch.items()}


MEMORY_CAP_ENV = "WIKIPRETRAIN_DEVICE_MEMORY_GIB"
"""GiB of device memory a process may use (``training.engine.cap_device_memory``): a bigger card measured as a
smaller one."""


def out_of_memory(micro_batch: int, during: str = "") -> RankError:
    """The one line of a micro-batch that ran out of device memory (``during``: where, when not in a training
    step): this rank's peak, of how much, and half the micro-batch to try (``train.global_batch`` stays: the
    accumulation steps follow; evaluation runs at the same micro-batch)."""
    acc, gib = collectives.accelerator(), 1 << 30
    peak, total = acc.max_memory_allocated() / gib, acc.total_memory() / gib
    cap = os.environ.get(MEMORY_CAP_ENV)  # checked by training.engine.cap_device_memory at bind time
    total = min(total, float(cap)) if cap else total
    rank, where = os.environ.get("RANK", "0"), f" in {during}" if during else ""
    return RankError(
        f"train.micro_batch={micro_batch} runs out of device memory{where} on rank {rank} ({device_name()}): "
        f"peak {peak:.1f} GiB of {total:.1f} GiB; try train.micro_batch={max(1, micro_batch // 2)}"
    )
