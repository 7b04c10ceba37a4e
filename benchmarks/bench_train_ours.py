"""``train.py`` unchanged, plus the process CPU time of its throughput window (for ``bench_train.py``).

On a CPU shared with other jobs, wall-clock throughput moves with their load; the CPU time this process
spent in the measured steps moves much less. This wrapper runs ``train.main`` in-process and records
``time.process_time()`` when the Trainer's throughput window starts and at its last reading (the same window
as ``sequences_per_sec`` in summary.json), then writes RUN_DIR/bench_cpu.json on rank 0. Arguments are
``train.py``'s; it also works under the ``deepspeed`` launcher.

    python benchmarks/bench_train_ours.py model.name=bert-debug data.train=DIR ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    import train
    from common.atomic import atomic_write_json
    from training import trainer as trainer_mod

    marks: dict[str, float] = {}
    W = trainer_mod.ThroughputWindow
    begin, elapsed = W.begin_if_due, W.elapsed

    def begin_if_due(self, step: int) -> None:
        started = self.start is not None
        begin(self, step)
        if not started and self.start is not None:
            marks["cpu0"], marks["wall0"] = time.process_time(), self.start

    def elapsed_(self) -> float:
        out = elapsed(self)
        marks["cpu1"], marks["wall1"] = time.process_time(), time.perf_counter()
        return out

    W.begin_if_due, W.elapsed = begin_if_due, elapsed_
    args = train.parse_args(argv)
    rc = train.main(argv)
    if rc == 0 and int(os.environ.get("RANK", "0")) == 0 and "cpu0" in marks:
        from training.config import load_config

        run_dir = Path(load_config(args.config, args.overrides).run.dir)
        atomic_write_json(
            run_dir / "bench_cpu.json",
            {"cpu_s": marks["cpu1"] - marks["cpu0"], "wall_s": marks["wall1"] - marks["wall0"]},
        )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
