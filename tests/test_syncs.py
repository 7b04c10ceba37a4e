"""common.syncs: counting CUDA's sync-debug warnings, fed here with warnings of the kind CUDA raises."""

from __future__ import annotations

import warnings

import pytest

from common.syncs import (
    SYNC_WARNING,
    HostSyncs,
    collect_warnings,
    count_host_syncs,
    count_sync_warnings,
    count_warned_syncs,
    is_sync_warning,
)

# What torch raises in sync debug mode "warn" (TORCH_WARN in c10/cuda/CUDAFunctions.cpp), as Python sees it.
CUDA_TEXT = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:151.)"


def _sync() -> None:
    warnings.warn(CUDA_TEXT, UserWarning, stacklevel=1)  # one source line: repeats must all count


def test_classifies_sync_warnings_by_their_message():
    assert CUDA_TEXT.startswith(SYNC_WARNING)
    assert is_sync_warning(CUDA_TEXT) and is_sync_warning(UserWarning(CUDA_TEXT))
    assert not is_sync_warning("called a synchronizing MPS operation")
    assert not is_sync_warning(UserWarning("TypedStorage is deprecated"))
    assert count_sync_warnings([CUDA_TEXT, "other", UserWarning(CUDA_TEXT)]) == 2


def test_counts_every_sync_of_every_step_and_divides_by_the_steps():
    calls = []

    def step():
        calls.append(1)
        _sync()
        _sync()  # repeats from the same line count: the default filter would show them once

    counted = count_warned_syncs(step, steps=3)
    assert counted == HostSyncs(total=6, steps=3)
    assert counted.per_step == 2.0 and len(calls) == 3
    assert count_warned_syncs(lambda: None, steps=2).per_step == 0.0


def test_other_warnings_are_shown_not_swallowed_and_filters_restored():
    def step():
        _sync()
        warnings.warn("a real problem", RuntimeWarning, stacklevel=1)

    with pytest.warns(RuntimeWarning, match="a real problem") as shown:
        assert count_warned_syncs(step, steps=2).total == 2
    assert not any(is_sync_warning(w) for w in shown)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with collect_warnings() as caught:
            _sync()
        assert len(caught) == 1
        with pytest.raises(UserWarning):  # the outer "error" filter is back
            _sync()


def test_on_cpu_no_count_and_the_reason():
    calls = []
    counted = count_host_syncs(lambda: calls.append(1), steps=4, device="cpu")
    assert counted.total is None and counted.per_step is None and counted.steps == 4
    assert "cpu" in counted.reason and "CUDA" in counted.reason
    assert calls == []  # nothing run that could not be counted
    with pytest.raises(ValueError, match="steps must be positive"):
        count_warned_syncs(lambda: None, steps=0)
