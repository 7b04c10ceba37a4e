"""ZeRO-3 model construction: each rank holds only its partition of the weights from the start.

Without this every rank builds the whole model in FP32 on its host before DeepSpeed partitions it: neox-20b
needs about 80 GB per rank, 650 GB per 8-GPU node. Under ``deepspeed.zero.Init`` a module's parameters are
partitioned as soon as the module's constructor returns, in the training dtype, so a rank's host memory is
bounded by its partition plus the largest single module.

Weight initialisation follows ``transformers``: construction skips the throw-away ``torch.nn`` init, then
each module's parameters are gathered, rank 0 applies the model's own ``_init_weights`` in the order
``PreTrainedModel.initialize_weights`` uses, and the result is scattered back; buffers (which
``_init_weights`` may recompute) are then broadcast from rank 0. Every rank thus holds rank 0's weights. On
the CPU they are exactly those of a model built whole the same way (no ``torch.nn`` init, then
``initialize_weights``) from the same generator state; on an accelerator the parameters are initialised where
they live, with its generator, so they follow the same distributions but are other draws.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.zero import partition_parameters as pp
from torch import nn
from transformers import PreTrainedModel
from transformers.initialization import guard_torch_init_functions, no_init_weights

from common.errors import UserError
from model.build import build_model
from model.family import Family
from model.registry import family_of, get_spec
from training import collectives


def build_partitioned(
    spec: Any, ds_config: dict[str, Any], *, family: Family | None = None, **build_kwargs: Any
) -> nn.Module:
    """Build ``spec`` under ``deepspeed.zero.Init`` (with this run's DeepSpeed config) and initialise it with
    its ``transformers`` model's own initialisation (``Family.transformers_model``); ``family``: the spec's
    record where the caller holds it (a run's plan), else looked up."""
    if isinstance(spec, str):
        spec = get_spec(spec)
    if family is None:
        family = family_of(spec)
    if family.transformers_model is None:
        raise UserError(f"deepspeed.zero_stage=3: {family.title} models have no transformers model to initialise")
    with large_blocks_returned():
        with no_init_weights(), _arange_keeps_its_dtype(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(spec, family=family, **build_kwargs)
        hf: Any = family.transformers_model(model)
        initialise_gathered(hf)
        hf.tie_weights()
    return model


@contextlib.contextmanager
def _arange_keeps_its_dtype() -> Iterator[None]:
    """Under ``zero.Init`` (entered inside this), ``torch.arange`` keeps the dtype it is asked for.

    ``zero.Init`` makes the floating-point tensor constructors produce the training dtype, ``torch.arange``
    included, so rotary frequencies (``base ** (arange(0, d, 2, dtype=int64).float() / d)``) came out
    computed in BF16: 0.0564 instead of 0.0562 for the sixth. Only the device is still chosen for it.
    """
    wrap = pp.zero_wrapper_for_fp_tensor_constructor

    def wrapper(fn: Any, target_fp_dtype: Any, target_device: Any) -> Any:
        return wrap(fn, None if fn is pp._orig_torch_arange else target_fp_dtype, target_device)

    pp.zero_wrapper_for_fp_tensor_constructor = wrapper
    try:
        yield
    finally:
        pp.zero_wrapper_for_fp_tensor_constructor = wrap


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@contextlib.contextmanager
def large_blocks_returned(threshold: int = 1 << 20) -> Iterator[None]:
    """Serve host blocks of ``threshold`` bytes or more with their own mappings while the model is built.

    Building under ``zero.Init`` allocates each module's whole tensors, then keeps only the partition. With
    glibc's default (dynamic) threshold, blocks of up to 32 MiB come from the heap, and the freed space is
    kept by the process: measured with neox-760m on 2 ranks, peak RSS 3.5 GB per rank (as much as building
    the whole model in FP32) against 1.5 GB with this. Afterwards the threshold is left at the ceiling the
    dynamic rule would reach (32 MiB), and the freed heap is returned to the system. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        trim(0)


def initialise_gathered(hf: nn.Module) -> None:
    """Apply ``hf``'s weight initialisation to partitioned parameters, one module at a time.

    The walk is ``PreTrainedModel.initialize_weights``'s: children first, each sub-model with its own
    ``_initialize_weights``. Only one module's parameters (and its direct children's, which some
    ``_init_weights`` touch) are whole at any moment.
    """
    rank = collectives.rank()

    def walk(module: nn.Module, init) -> None:
        for child in module.children():
            walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
            if rank == 0:
                init(module, False)

    with torch.no_grad(), guard_torch_init_functions():
        walk(hf, hf._initialize_weights)
        collectives.broadcast_(list(hf.buffers()))  # not partitioned, so not scattered by the gather


def local_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) over unique parameters."""
    held = whole = 0
    for p in {id(p): p for p in model.parameters()}.values():
        whole += getattr(p, "ds_numel", p.numel())
        held += p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
    return held, whole
