"""``train.py`` unchanged, plus the process CPU time of its throughput window (for ``bench_train.py``).

On a CPU shared with other jobs, wall-clock throughput moves with their load; the CPU time this process
spent in the measured steps moves much less. This wrapper runs ``train.main`` in-process and adds up
``time.process_time()`` over every interval the Trainer's ``Clock`` holds its throughput window open (from
``Clock.open()`` to ``Clock.close()``: the measured training steps, with evaluation, saving and logging paused
out of it; the same window as ``sequences_per_sec`` in summary.json), then writes RUN_DIR/bench_cpu.json on
rank 0. Arguments are ``train.py``'s; it also works under the ``deepspeed`` launcher.

    python benchmarks/bench_train_ours.py model.name=bert-debug data.train=DIR ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def time_clock_window() -> dict[str, float]:
    """Wrap ``Clock.open`` / ``Clock.close`` (the trainer's public clock) so that each open interval adds
    its process CPU time and wall time to the returned dict."""
    from training.trainer import Clock

    window = {"cpu_s": 0.0, "wall_s": 0.0}
    started: dict[int, tuple[float, float]] = {}
    open_, close_ = Clock.open, Clock.close

    def open_timed(self: Clock) -> None:
        open_(self)
        started[id(self)] = (time.process_time(), time.perf_counter())

    def close_timed(self: Clock) -> None:
        close_(self)
        mark = started.pop(id(self), None)
        if mark is not None:
            window["cpu_s"] += time.process_time() - mark[0]
            window["wall_s"] += time.perf_counter() - mark[1]

    Clock.open, Clock.close = open_timed, close_timed  # type: ignore[method-assign]
    return window


def main(argv: list[str] | None = None) -> int:
    import train
    from common.atomic import atomic_write_json

    window = time_clock_window()
    args = train.parse_args(argv)
    rc = train.main(argv)
    if rc == 0 and int(os.environ.get("RANK", "0")) == 0 and window["wall_s"] > 0:
        from training.config import load_config

        run_dir = Path(load_config(args.config, args.overrides).run.dir)
        atomic_write_json(run_dir / "bench_cpu.json", window)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
