"""Count host synchronisations (the host waiting for the device) over training steps.

A sync stalls the host until the device drains its queue, so the next kernels are not queued in time:
``.item()``, ``bool(tensor)`` in an ``if``, a device-to-host copy into pageable memory, ``nonzero``. CUDA's
sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) makes each one raise a ``UserWarning`` whose
message starts with :data:`SYNC_WARNING`. Counting is split in two:

* :func:`count_warned_syncs`: run steps, collect the warnings raised meanwhile and count those that are sync
  warnings; whatever turned them on. Pure Python, so its logic is tested on CPU with synthetic warnings.
* :func:`count_host_syncs`: the same with CUDA's debug mode on (after warm-up steps that are not counted).
  On CPU it returns no count and says why: there is no device queue to wait for.

Other warnings raised during the counted steps are shown afterwards, as if not collected. ``torch`` is
imported only by :func:`count_host_syncs`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The start of the warning CUDA's sync debug mode raises (``c10::cuda::warn_or_error_on_sync``)."""


@dataclass(frozen=True)
class HostSyncs:
    """Host syncs counted over ``steps`` steps; ``total`` is None when they could not be counted (``reason``)."""

    total: int | None
    steps: int
    reason: str = ""

    @property
    def per_step(self) -> float | None:
        return None if self.total is None else self.total / self.steps


def is_sync_warning(warning: warnings.WarningMessage | Warning | str) -> bool:
    """Whether a (recorded) warning is CUDA's sync-debug warning."""
    message = getattr(warning, "message", warning)
    return str(message).startswith(SYNC_WARNING)


def count_sync_warnings(caught: Iterable[warnings.WarningMessage | Warning | str]) -> int:
    """How many of ``caught`` are sync warnings."""
    return sum(1 for w in caught if is_sync_warning(w))


@contextlib.contextmanager
def collect_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record every warning raised inside (none filtered out, repeats included); afterwards show again those that
    are not sync warnings, so counting hides no other warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    for w in caught:
        if not is_sync_warning(w):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def count_warned_syncs(step: Callable[[], Any], steps: int) -> HostSyncs:
    """Run ``step`` ``steps`` times and count the sync warnings raised meanwhile."""
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    with collect_warnings() as caught:
        for _ in range(steps):
            step()
    return HostSyncs(count_sync_warnings(caught), steps)


@contextlib.contextmanager
def cuda_sync_debug(mode: str = "warn") -> Iterator[None]:
    """CUDA's sync debug mode set to ``mode`` inside, the previous mode restored afterwards."""
    import torch  # on call: count_warned_syncs needs no torch (the docstring above)

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def count_host_syncs(step: Callable[[], Any], steps: int = 3, warmup: int = 1, device: Any = None) -> HostSyncs:
    """Host syncs of ``step`` (e.g. one training step), counted over ``steps`` calls after ``warmup`` calls.

    ``device``: where ``step`` runs (default: CUDA when available). The warm-up absorbs one-time syncs (lazy
    initialisation, allocator growth); the device is drained before and after the counted steps, outside them.
    """
    import torch  # on call: as in cuda_sync_debug

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return HostSyncs(None, steps, f"not counted on {dev.type}: only CUDA's sync debug mode reports host syncs")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(dev)
    with cuda_sync_debug("warn"):
        counted = count_warned_syncs(step, steps)
    torch.cuda.synchronize(dev)
    return counted
