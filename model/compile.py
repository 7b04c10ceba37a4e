"""Compiled transformer blocks (``model.compile``): ``torch.compile`` with dynamic shapes, eager on failure.

What is compiled, per family, is its record's ``Family.compile_scope``. The modules keep their names, parameters
and hooks: each one's ``forward`` (or the call of its own the model makes) is replaced by a guarded compiled call,
so checkpoints, the Hugging Face export, ZeRO-3's gathering hooks and activation checkpointing see the same
modules:

* BERT on its real tokens (``model.unpad``): each whole layer, attention included (``model.unpad.packed_layer``:
  the attention is one opaque operator, ``model.attention``, and the layer's inputs are tensors and ints, so one
  graph serves every token count, set of lengths and number of sequences), with the ``varlen`` and ``padded``
  kernels (the ``jagged`` kernel, kept for comparison, then runs eager). Under ZeRO-3 (partitioned weights,
  gathered by each module's own hooks) and for the padded forward (``model.unpad=false``): each layer's dense
  part, the modules both encoders call (the attention's output projection with its residual and LayerNorm, the
  FFN's two halves, and the pre-LN sizes' LayerNorms), attention eager.
* GPT-NeoX: each whole ``GPTNeoXLayer`` (fixed-length windows, causal SDPA).

Dynamic shapes (``dynamic=True``): under unpadding the token count changes every micro-batch; each module is
compiled once for any length, which ``compile_count`` lets a test check.

A failed compilation (a backend error, an unsupported operation) warns once for the whole model
(``Compiled.failed``), and the model runs eager from then on, with one choice per module and micro-batch: a
module chooses at its first call in a micro-batch (a forward of the model, which a forward pre-hook counts:
``Compiled.micro_batch``) and makes its later calls in it, activation checkpointing's recompute, the same way,
so each dropout mask is drawn by one implementation (inductor's draws are not eager's: a recompute the other way
would mix two masks in one micro-batch's gradients). In the micro-batch in flight, the modules that ran compiled
before the failure recompute compiled; the one that failed (nothing of it ran compiled, as it is one graph) and
every module after it run eager, forward and recompute; later micro-batches and evaluation batches run eager.
This takes a micro-batch's backward to run before the model's next forward, as the trainer runs them. The cost
is a comparison per call, outside the graphs.

Not caught: errors of the computation itself; a compilation error in the recompute of a compiled call (it reuses
the graph its forward compiled, so none is expected, and eager there would mix masks); a failure compiling the
backward graph when the first backward runs (inductor may defer it there on an accelerator). Each ends the run
with its own error; the last two are not seen on CPU, where both graphs compile in the forward call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from common.log import get_logger
from model.family import CompileTarget
from model.registry import family_of

log = get_logger("model.compile")


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "compilation failed" (not "the computation failed")."""
    import torch._dynamo.exc as dynamo_exc  # on call (start-up time): torch._dynamo takes about 2 s to load

    errors: list[type[BaseException]] = [dynamo_exc.TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError  # on call (start-up time, as above); older torch lacks it

        errors.append(InductorError)
    except ImportError:  # older torch: inductor errors arrive as BackendCompilerFailed
        pass
    return tuple(errors)


def compile_scope(model: nn.Module) -> list[CompileTarget]:
    """What :func:`compile_blocks` compiles in ``model``, as its family's record says (``Family.compile_scope``)."""
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ValueError(f"{type(model).__name__}: not a pre-training model of this project")
    return family_of(spec).compile_scope(model)


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`compile_blocks` compiles in ``model``."""
    return [module for module, _, _ in compile_scope(model)]


def whole_layers(model: nn.Module) -> bool:
    """Whether ``model``'s layers compile whole through a call of their own that the model makes, attention
    included (BERT on its real tokens outside ZeRO-3: each layer's ``packed_call``)."""
    return any(attribute != "forward" for _, attribute, _ in compile_scope(model))


class Compiled:
    """What :func:`compile_blocks` did to one model: ``modules`` compiled, ``failed`` (None, or the first
    compilation failure, after which each module's next choice is eager: they share this record), and
    ``micro_batch``, the model's forwards so far (its forward pre-hook counts them), by which each module keeps
    one choice per micro-batch (the module docstring)."""

    def __init__(self, modules: int) -> None:
        self.modules = modules
        self.failed: str | None = None
        self.micro_batch = 0

    def advance(self, *_: Any) -> None:
        """The model's forward pre-hook: a new micro-batch (or evaluation batch), in which each module chooses
        again."""
        self.micro_batch += 1

    def fail(self, error: BaseException) -> None:
        if self.failed is None:
            cause = getattr(error, "inner_exception", None) or error.__cause__ or error  # the backend's own error
            text = str(cause).strip()
            self.failed = f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}"
            log.warning(f"model.compile: compiling a transformer block failed, running eager instead ({self.failed})")


def _guarded(eager: Callable[..., Any], backend: Any, record: Compiled) -> Callable[..., Any]:
    """``eager`` compiled, one choice per micro-batch (the module docstring): the module's first call in a
    micro-batch runs compiled unless a compilation failed before it, eager if its own fails; its later calls in
    the micro-batch (activation checkpointing's recompute) run as the first one did."""
    compiled = torch.compile(eager, dynamic=True, backend=backend)
    errors = compile_errors()
    chosen_in = -1  # the micro-batch of the module's first call ...
    use_compiled = False  # ... and its choice

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal chosen_in, use_compiled
        if chosen_in != record.micro_batch:
            chosen_in, use_compiled = record.micro_batch, record.failed is None
            if use_compiled:
                try:
                    return compiled(*args, **kwargs)
                except errors as e:
                    use_compiled = False
                    record.fail(e)
        elif use_compiled:  # the recompute of a compiled call: its graph again, errors not caught
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    return forward


def compile_blocks(model: nn.Module, backend: Any = "inductor") -> Compiled:
    """Compile ``model``'s transformer blocks in place (see the module docstring), as part of building it
    (``model.build.build_model``'s ``compile``): its blocks' calls are replaced, as ``transformers``' own
    ``gradient_checkpointing_enable`` replaces its layers' calls; on ``model`` itself, only a forward pre-hook
    that counts its forwards (``Compiled.micro_batch``)."""
    targets = compile_scope(model)
    compiled = Compiled(len(targets))
    for module, attribute, eager in targets:  # e.g. forward, or the packed_call model.unpad.encode makes
        object.__setattr__(module, attribute, _guarded(eager, backend, compiled))
    model.register_forward_pre_hook(compiled.advance)
    _COMPILED_HERE.append(len(targets))
    return compiled


_COMPILED_HERE: list[int] = []  # modules per compile_blocks call in this process


def compile_stats() -> dict[str, int] | None:
    """The training log's compile figures, once ``compile_blocks`` has run in this process (None before):
    ``compiled_graphs`` (``compile_count``: it stops growing when every micro-batch shape reuses a graph) and
    ``graph_breaks`` (TorchDynamo's count; 0 when each block is one graph)."""
    if not _COMPILED_HERE:
        return None
    from torch._dynamo.utils import counters  # on call (start-up time, as in compile_errors)

    return {"compiled_graphs": compile_count(), "graph_breaks": int(sum(counters["graph_break"].values()))}


def compile_count() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (TorchDynamo's own counter): constant
    once every compiled module has run, when nothing recompiles."""
    from torch._dynamo.utils import counters  # on call (start-up time, as in compile_errors)

    return int(counters["stats"]["unique_graphs"])


def wanted(setting: bool | None, device_type: str) -> bool:
    """``model.compile``: as set, or by default on accelerators and off on CPU (compiling there would slow every
    start, and CI's, by tens of seconds)."""
    return setting if setting is not None else device_type != "cpu"
