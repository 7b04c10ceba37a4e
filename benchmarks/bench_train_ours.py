"""Our run as ``train.py`` starts it, plus the process CPU time of its throughput window (for ``bench_train.py``).

On a CPU shared with other jobs, wall-clock throughput moves with their load; the CPU time this process
spent in the measured steps moves much less. This wrapper runs the start ``train.py`` runs
(``training.start.run``, with ``train.py``'s arguments and one-line errors) in-process and adds up
``time.process_time()`` over every interval the Trainer's ``Clock`` holds its throughput window open (from
``Clock.open()`` to ``Clock.close()``: the measured training steps, with evaluation, saving and logging paused
out of it; the same window as ``sequences_per_sec`` in summary.json), then writes RUN_DIR/bench_cpu.json on
rank 0, with the host syncs per measured step (CUDA) and the mean optimizer-step time of the same window
(:class:`StepProbe`). Arguments are ``train.py``'s; it also works under the ``deepspeed`` launcher.

    python benchmarks/bench_train_ours.py model.name=bert-debug data.train=DIR ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


class StepProbe:
    """Host syncs and optimizer-step time over a measured window (steady-state steps only), on either side.

    ``open()``/``close()`` bracket the window. Optimizer steps are timed by torch's global optimizer-step hooks
    (the innermost ``torch.optim.Optimizer`` step: LANS/LAMB/AdamW itself, not DeepSpeed's wrapper around it),
    with device events on CUDA (no host sync added), wall time on CPU. Host syncs are counted on CUDA only,
    with ``torch.cuda.set_sync_debug_mode("warn")`` while the window is open (``common.syncs``); on CPU there
    is no device queue to wait for and the count is None.
    """

    def __init__(self, cuda: bool) -> None:
        import warnings

        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from common.syncs import SYNC_WARNING, is_sync_warning

        self.torch = torch
        self.cuda = cuda  # the device the run trains on, not merely one torch can see
        self.is_open = False
        self.syncs = 0
        self._start: object | None = None
        self._spans: list[tuple[object, object]] = []
        register_optimizer_step_pre_hook(self._pre)
        register_optimizer_step_post_hook(self._post)
        if self.cuda:
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
                if is_sync_warning(message):
                    self.syncs += self.is_open
                    return
                shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            warnings.filterwarnings("always", message=SYNC_WARNING)

    def _mark(self) -> object:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, *_: object) -> None:
        self._start = self._mark() if self.is_open else None

    def _post(self, *_: object) -> None:
        if self.is_open and self._start is not None:
            self._spans.append((self._start, self._mark()))
        self._start = None

    def open(self) -> None:
        self.is_open = True
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode("warn")

    def close(self) -> None:
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode(0)
        self.is_open = False

    def result(self, steps: int) -> dict[str, float | None]:
        """``host_syncs_per_step`` over ``steps`` measured steps, ``optimizer_step_s`` (mean of the steps timed)."""
        if self.cuda:
            self.torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in self._spans]  # type: ignore[attr-defined]
        else:
            times = [float(b) - float(a) for a, b in self._spans]  # type: ignore[arg-type]
        return {
            "host_syncs_per_step": self.syncs / steps if self.cuda and steps else None,
            "optimizer_step_s": sum(times) / len(times) if times else None,
            "optimizer_steps_timed": len(times),
        }


def time_clock_window(probe: StepProbe) -> dict[str, float]:
    """Wrap ``Clock.open`` / ``Clock.close`` (the trainer's public clock) so that each open interval adds
    its process CPU time and wall time to the returned dict, with ``probe`` open over the same intervals."""
    from training.trainer import Clock

    window = {"cpu_s": 0.0, "wall_s": 0.0}
    started: dict[int, tuple[float, float]] = {}
    open_, close_ = Clock.open, Clock.close

    def open_timed(self: Clock) -> None:
        open_(self)
        probe.open()
        started[id(self)] = (time.process_time(), time.perf_counter())

    def close_timed(self: Clock) -> None:
        probe.close()
        close_(self)
        mark = started.pop(id(self), None)
        if mark is not None:
            window["cpu_s"] += time.process_time() - mark[0]
            window["wall_s"] += time.perf_counter() - mark[1]

    Clock.open, Clock.close = open_timed, close_timed  # type: ignore[method-assign]
    return window


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``train.py``'s arguments."""
    p = argparse.ArgumentParser(description="train.py's run, with its throughput window's CPU time")
    p.add_argument("--config", default=None, help="as train.py's")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, as train.py's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # on call, as train.py: --help answers without torch

    from common.atomic import atomic_write_json
    from common.errors import EXIT_USER_ERROR, RankError, UserError
    from common.process import end_process_group
    from training import ownership, start
    from training.config import load_config

    probe = StepProbe(cuda=torch.cuda.is_available())  # train.py's accelerator is CUDA wherever torch sees one
    window = time_clock_window(probe)
    run_dir: Path | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.dir)
        rc = start.run(cfg)
    except UserError as e:  # a config, a run refused, or out of memory: train.py's one line and exit code
        if os.environ.get("LOCAL_RANK", "0") == "0" or isinstance(e, RankError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        rc = EXIT_USER_ERROR
    finally:
        ownership.release(run_dir)  # as train.py's main: the owner's mark, after rank 0's last write
        end_process_group()
    if rc == 0 and run_dir is not None and int(os.environ.get("RANK", "0")) == 0 and window["wall_s"] > 0:
        import json

        steps = int(json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["measured_steps"])
        atomic_write_json(run_dir / "bench_cpu.json", {**window, **probe.result(steps)})
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
