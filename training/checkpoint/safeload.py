"""Checkpoint files are read without running code: every ``torch.load`` in a process that calls ``restrict``,
DeepSpeed's own loads included, unpickles with torch's weights-only unpickler.

A checkpoint is a pickle, and a pickle can name any function to call while it is read. Users pass checkpoints
around (phase 1 -> ``train.init_from``, ``python -m training export``), so a file from elsewhere must not run
its author's code. ``restrict`` sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``, which makes every ``torch.load`` of
the process (and of the processes it starts) restricted even where the caller passes ``weights_only=False``
(DeepSpeed does, everywhere), and registers ``ALLOWED``: the few non-tensor types that today's checkpoints hold.
Nothing is checked before a load and loaded after: the load itself refuses, so a file cannot change in between.

A file that needs anything else is refused as one line naming the file and the first global it asks for
(``refusal``). ``python -m training.checkpoint.safeload MODULE ARGS...`` runs another module's ``main`` restricted (the
universal-checkpoint conversion runs so).
"""

from __future__ import annotations

import os
import pickle
import re
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from common.errors import EXIT_USER_ERROR, RankError, UserError

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@dataclass(frozen=True)
class Allowed:
    """One global a checkpoint may name: where it lives, the name it is pickled under, and why it is safe."""

    module: str
    attr: str
    pickled_as: str
    reason: str


# Each global, once, with the reason it is here. Everything else (tensors, torch.Size, dicts, lists, tuples,
# OrderedDict, numbers, strings) torch's weights-only unpickler reads without help.
ALLOWED = (
    Allowed(
        "deepspeed.runtime.zero.config",
        "ZeroStageEnum",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "an IntEnum: the ZeRO stage DeepSpeed records in its optimizer states (stage 1-3 and BF16)",
    ),
    Allowed(
        "deepspeed.runtime.fp16.loss_scaler",
        "LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "the static loss scaler of DeepSpeed's ZeRO optimizers: numbers only (scale, dtype flags)",
    ),
    Allowed(
        "deepspeed.runtime.fp16.loss_scaler",
        "DynamicLossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "the dynamic loss scaler the same optimizers hold under FP16: numbers only",
    ),
    Allowed(
        "deepspeed.utils.tensor_fragment",
        "fragment_address",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "a dataclass of two ints (start, numel): where each parameter sits in the BF16 optimizer's partition",
    ),
    # numpy's RNG state (rng_rank*.pt): one uint32 array, rebuilt by numpy's own array reconstruction. numpy 2
    # pickles it under numpy._core, numpy 1.x under numpy.core: both names map to this numpy's function, so a
    # file written under either version reads under the other.
    Allowed(
        "numpy",
        "_reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy 2's ndarray reconstruction (the numpy RNG state's key array)",
    ),
    Allowed(
        "numpy",
        "_reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy 1.x's name for the same reconstruction",
    ),
    Allowed("numpy", "ndarray", "numpy.ndarray", "the array type the reconstruction builds"),
    Allowed("numpy", "dtype", "numpy.dtype", "the array's dtype (uint32)"),
    Allowed("numpy", "UInt32DType", "numpy.dtypes.UInt32DType", "that dtype's class, which its state is set on"),
)


def _resolve(entry: Allowed) -> Any:
    if entry.module == "numpy" and entry.attr == "_reconstruct":
        core = getattr(np, "_core", None) or np.core
        return core.multiarray._reconstruct
    if entry.module == "numpy" and entry.attr == "UInt32DType":
        return type(np.dtype(np.uint32))
    module = __import__(entry.module, fromlist=[entry.attr])
    return getattr(module, entry.attr)


def allowed_names() -> set[str]:
    return {entry.pickled_as for entry in ALLOWED}


def register() -> None:
    """Register ``ALLOWED`` with torch's weights-only unpickler in this process."""
    torch.serialization.add_safe_globals([(_resolve(e), e.pickled_as) for e in ALLOWED])


def restrict() -> None:
    """From now on, every ``torch.load`` in this process and its children reads weights only (see the module)."""
    os.environ[FORCE_ENV] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # with both set, torch refuses every load
    register()


@contextmanager
def restricted() -> Iterator[None]:
    """Every ``torch.load`` inside the block reads weights only, DeepSpeed's too (for callers in a process that
    did not ``restrict`` itself, e.g. ``export_checkpoint`` as a library); the environment is restored after."""
    register()
    before = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = before


_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


def _loaded_file(tb: TracebackType | None) -> str | None:
    """The file of the innermost ``torch.load`` in the traceback (its ``f`` argument), if a path."""
    found, serialization = None, os.path.join("torch", "serialization.py")
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "load" and frame.f_code.co_filename.endswith(serialization):
            f = frame.f_locals.get("f")
            if isinstance(f, (str, os.PathLike)):
                found = os.fspath(f)
        tb = tb.tb_next
    return found


def refusal(e: BaseException, where: Path | str) -> UserError | None:
    """The one-line error for a load the weights-only unpickler refused (``None`` for any other error).

    Names the file (from the refused ``torch.load`` itself, else ``where``) and the first global it asked
    for. A file of one rank (``rng_rank*``, ``*zero_pp_rank_*``) is a ``RankError``: every rank that reads
    such a file prints its own line.
    """
    if not isinstance(e, pickle.UnpicklingError):
        return None
    text = str(e)
    if "Weights only load failed" not in text and "WeightsUnpickler" not in text:
        return None
    path = _loaded_file(e.__traceback__) or str(where)
    m = _GLOBAL.search(text)
    if m:
        what = f"it names {m.group(1)}, which a checkpoint may not hold"
    else:
        detail = [ln.strip() for ln in text.splitlines() if ln.strip() and "Weights only load failed" not in ln]
        what = f"its pickle does more than rebuild tensors ({(detail or ['refused'])[0][:160]})"
    line = f"{path}: refusing to load this checkpoint file: {what} (allowed: training/checkpoint/safeload.py ALLOWED)"
    name = Path(path).name
    per_rank = name.startswith("rng_rank") or "zero_pp_rank_" in name
    return RankError(line) if per_rank else UserError(line)


@contextmanager
def refusing(where: Path | str) -> Iterator[None]:
    """Turn a refused load inside the block into its one-line ``UserError``."""
    try:
        yield
    except pickle.UnpicklingError as e:
        err = refusal(e, where)
        if err is None:
            raise
        raise err from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m training.checkpoint.safeload MODULE ARGS...``: run MODULE as ``__main__``, every load
    restricted."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m training.checkpoint.safeload MODULE [ARGS...]", file=sys.stderr)
        return EXIT_USER_ERROR
    restrict()
    module, sys.argv = args[0], args
    try:
        with refusing(module):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
