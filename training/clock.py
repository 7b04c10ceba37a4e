"""Where a run's wall time goes: the throughput window and the phases paused out of it."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

from training import collectives


def synchronize() -> None:
    collectives.accelerator().synchronize()


def peak_memory_bytes() -> int:
    """Peak accelerator memory, or on CPU the peak resident set size of this process."""
    acc = collectives.accelerator()
    if acc.device_name() != "cpu":
        return int(acc.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    return time.time() - psutil.Process().create_time()


@dataclass
class Clock:
    """Where a run's wall time goes. The throughput window is the measured training steps only."""

    warmup_steps: int
    window_s: float = 0.0
    measured_steps: int = 0
    data_wait_s: float = 0.0
    warmup_s: float = 0.0
    eval_s: float = 0.0
    save_s: float = 0.0
    log_s: float = 0.0
    loop_start: float | None = None  # perf_counter when the training loop began
    _open: float | None = None

    def start_loop(self) -> float:
        self.loop_start = time.perf_counter()
        return self.loop_start

    @property
    def running(self) -> bool:
        return self._open is not None

    def open(self) -> None:
        synchronize()
        self._open = time.perf_counter()

    def close(self) -> None:
        if self._open is not None:
            synchronize()
            self.window_s += time.perf_counter() - self._open
            self._open = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The block is outside the throughput window (evaluation, saving, logging, reading the step's
        collective); the window reopens after it if it was open (not after an error: the run is ending)."""
        was_running = self.running
        self.close()
        yield
        if was_running:
            self.open()

    def seconds(self) -> float:
        """The window so far (device work included: synchronises when open)."""
        if self._open is None:
            return self.window_s
        synchronize()
        return self.window_s + time.perf_counter() - self._open

    def steps_outside(self, t_loop: float) -> float:
        """Training time since the loop began that no other phase (evaluation, saving, logging) holds."""
        return time.perf_counter() - t_loop - self.eval_s - self.save_s - self.log_s

    def breakdown(self) -> dict[str, float]:
        return {
            "warmup_s": self.warmup_s,
            "train_window_s": self.seconds(),
            "eval_s": self.eval_s,
            "save_s": self.save_s,
            "log_s": self.log_s,
        }
