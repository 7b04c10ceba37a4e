"""The training log: every ``logging.every`` steps a record to RUN_DIR/metrics.jsonl, the console, wandb and
TensorBoard, written by rank 0 alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.log import get_logger
from model.family import Family
from training import ownership

log = get_logger("train")


class Logbook:
    """Rank 0's record of a run. Every row carries ``attempt``: the steps a restart re-does stay visible."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        attempt: int,
        total_steps: int,
        monitor: Any = None,
        wandb: Callable[[], Any] | None = None,
        *,
        family: Family,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.rank, self.attempt, self.total_steps = rank, attempt, total_steps
        # the console's loss parts and evaluation metrics: the model family's (its record)
        self.loss_parts = family.loss_parts
        self.eval_labels = (("eval_loss", "eval loss"), *family.evaluation.labels)
        self.monitor = monitor  # DeepSpeed's (TensorBoard), when enabled
        self.start_wandb = wandb  # rank 0's, when logging.wandb.project is set: started by open()
        self.wandb_run: Any = None

    def open(self) -> None:
        """Start wandb (rank 0's, when set), once the run has started (``training.start.run``: after the resume, before
        the start-up time is taken), so that a refused start creates no wandb run."""
        if self.rank == 0 and self.start_wandb is not None and self.wandb_run is None:
            self.wandb_run = self.start_wandb()

    def write(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        ownership.fence()  # a run taken over by another job: this rank ends here, the row unwritten
        record = {"attempt": self.attempt, **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self.wandb_run.log(numbers, step=record["step"])
        if self.monitor is not None and self.monitor.enabled:
            points = [(f"train/{k}", v, record["step"]) for k, v in record.items() if isinstance(v, float)]
            self.monitor.write_events(points)

    def console(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        parts = [f"step {record['step']}/{self.total_steps}"]
        if "loss" in record:
            parts.append(f"loss {record['loss']:.4f}")
            parts += [f"{k.replace('_loss', '').upper()} {record[k]:.4f}" for k in self.loss_parts if k in record]
            parts.append(f"lr {record['lr']:.3e}")
        if "sequences_per_sec" in record:
            parts += [
                f"{record['sequences_per_sec']:.1f} seq/s",
                f"{record['tokens_per_sec']:.0f} tok/s",
                f"{record['tflops_per_device']:.3f} TFLOP/s/dev",
            ]
            if record.get("mfu") is not None:
                parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts += [f"{label} {record[k]:.4f}" for k, label in self.eval_labels if k in record]
        log.info(" | ".join(parts))

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
