"""The training loop: a thin, stateful trainer around a DeepSpeed engine.

``Trainer.train()`` runs optimizer steps until ``train.steps`` or a stop request (SIGTERM), logging on rank 0,
evaluating and checkpointing every K steps. Everything needed to continue exactly (step, samples, tokens,
loader position, RNG states) goes into the checkpoint.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.log import get_logger
from training import checkpoint
from training.metrics import mfu, tflops_per_device, throughput

log = get_logger("train")

EXIT_PREEMPTED = 3  # SIGTERM received: the current step finished, a checkpoint was saved


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_bytes() -> int:
    """Peak accelerator memory, or on CPU the peak resident set size of this process."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples, "tokens": self.tokens}


@dataclass
class ThroughputWindow:
    """Times optimizer steps after the warm-up ones, with device synchronisation at both ends."""

    warmup_steps: int
    start: float | None = None
    steps: int = 0
    data_wait: float = 0.0
    losses: list[float] = field(default_factory=list)

    def begin_if_due(self, step: int) -> None:
        if self.start is None and step >= self.warmup_steps:
            synchronize()
            self.start = time.perf_counter()

    def elapsed(self) -> float:
        synchronize()
        return time.perf_counter() - self.start if self.start is not None else 0.0


class StopRequest:
    """SIGTERM (spot reclaim, batch-job preemption) asks every rank to stop after the current step."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (one tiny all-reduce per step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Trainer:
    def __init__(
        self,
        engine,
        loader,
        *,
        eval_loader=None,
        steps: int,
        seq_len: int,
        global_batch: int,
        grad_accum: int,
        flops_per_token: float,
        peak_flops: float,
        run_dir: Path,
        ckpt_dir: Path,
        ckpt_every: int,
        ckpt_keep: int,
        stop_at_step: int = 0,
        log_every: int,
        warmup_steps: int,
        eval_every: int,
        eval_batches: int,
        client_static: dict[str, Any],
        wandb_run=None,
    ) -> None:
        self.engine = engine
        self.loader = loader
        self.eval_loader = eval_loader
        self.steps = steps
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.grad_accum = grad_accum
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.run_dir = run_dir
        self.ckpt_dir = ckpt_dir
        self.ckpt_every = ckpt_every
        self.ckpt_keep = ckpt_keep
        self.stop_at_step = stop_at_step
        self.log_every = log_every
        self.eval_every = eval_every
        self.eval_batches = eval_batches
        self.client_static = client_static
        self.wandb_run = wandb_run
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.state = TrainState()
        self.window = ThroughputWindow(warmup_steps)
        self.stop = StopRequest()
        self.device = engine.device
        self._iter = None
        self.last_eval: dict[str, float] = {}
        self.last_loss: float | None = None
        self.metrics_file = run_dir / "metrics.jsonl"

    # ------------------------------------------------------------------ state
    def client_state(self) -> dict[str, Any]:
        return {**self.client_static, **self.state.to_dict(), "loader": self.loader.state_dict()}

    def load_client_state(self, client: dict[str, Any]) -> None:
        self.state = TrainState(client["step"], client["samples"], client["tokens"])
        self.loader.load_state_dict(client["loader"])
        self._iter = None

    # ------------------------------------------------------------------ steps
    def _next_batch(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        # Loading must not touch the global RNG that dropout draws from: starting the loader's workers
        # draws a base seed, and a resumed run starts them at a different step than an uninterrupted one.
        with torch.random.fork_rng(devices=[]):
            if self._iter is None:
                self._iter = iter(self.loader)
            batch = next(self._iter)
        self.window.data_wait += time.perf_counter() - t0
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self) -> dict[str, float]:
        """One optimizer step: grad_accum micro-batches, then DeepSpeed's step (clip, optimizer, schedule)."""
        self.engine.train()
        lr = float(self.engine.get_lr()[0])  # the rate this step's update uses
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _ in range(self.grad_accum):
            out = self.engine(**self._next_batch())
            self.engine.backward(out["loss"])
            self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            loss_sum += out["loss"].detach().double().cpu()
        # The step's loss: mean over the global batch (every micro-batch of every rank weighs the same).
        loss = loss_sum / self.grad_accum
        dist.all_reduce(loss)
        loss = float(loss) / self.world
        self.state.step += 1
        self.state.samples += self.global_batch
        self.state.tokens += self.global_batch * self.seq_len
        grad_norm = self.engine.get_global_grad_norm()
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """BERT: MLM and NSP accuracy; GPT-NeoX: validation loss and perplexity (summed over all ranks)."""
        if self.eval_loader is None:
            return {}
        self.engine.eval()
        it = iter(self.eval_loader)
        sums: dict[str, float] = {}
        for _ in range(self.eval_batches):
            batch = {k: v.to(self.device) for k, v in next(it).items()}
            out = self.engine(**batch)
            n = float(batch["input_ids"].size(0))
            pieces = {"loss_x_n": float(out["loss"]) * n, "n": n}
            for key in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens"):
                if key in out:
                    pieces[key] = float(out[key])
            if "tokens" in out:
                pieces["lm_loss_x_tokens"] = float(out["lm_loss"]) * float(out["tokens"])
            for k, v in pieces.items():
                sums[k] = sums.get(k, 0.0) + v
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        total = dict(zip(keys, t.tolist()))
        result = {"eval_loss": total["loss_x_n"] / total["n"]}
        if "mlm_count" in total:
            result["eval_mlm_accuracy"] = total["mlm_correct"] / max(total["mlm_count"], 1.0)
            result["eval_nsp_accuracy"] = total["nsp_correct"] / max(total["nsp_count"], 1.0)
        if "tokens" in total:
            lm = total["lm_loss_x_tokens"] / total["tokens"]
            result["eval_loss"] = lm
            result["eval_perplexity"] = math.exp(min(lm, 50.0))
        self.engine.train()
        return result

    # ------------------------------------------------------------------ loop
    def _performance(self) -> dict[str, float]:
        measured_steps = self.state.step - max(self.window.warmup_steps, self._start_step)
        seconds = self.window.elapsed()
        if measured_steps <= 0 or seconds <= 0:
            return {}
        tp = throughput(measured_steps * self.global_batch, seconds, self.seq_len, self.world)
        return {
            "sequences_per_sec": tp.sequences_per_sec,
            "tokens_per_sec": tp.tokens_per_sec,
            "sequences_per_sec_per_device": tp.sequences_per_sec_per_device,
            "tokens_per_sec_per_device": tp.tokens_per_sec_per_device,
            "tflops_per_device": tflops_per_device(tp.tokens_per_sec_per_device, self.flops_per_token),
            "mfu": mfu(tp.tokens_per_sec_per_device, self.flops_per_token, self.peak_flops),
            "data_wait_fraction": self.window.data_wait / seconds,
        }

    def _log(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(
                {k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"]
            )
        if self.engine.monitor is not None and self.engine.monitor.enabled:
            events = [(f"train/{k}", v, record["step"]) for k, v in record.items() if isinstance(v, float)]
            self.engine.monitor.write_events(events)
        parts = [
            f"step {record['step']}/{self.steps}",
            f"loss {record['loss']:.4f}",
            f"lr {record['lr']:.3e}",
        ]
        if "sequences_per_sec" in record:
            parts += [
                f"{record['sequences_per_sec']:.1f} seq/s",
                f"{record['tokens_per_sec']:.0f} tok/s",
                f"{record['tflops_per_device']:.3f} TFLOP/s/dev",
                f"MFU {100 * record['mfu']:.1f}%",
            ]
        for k, label in (("eval_loss", "eval loss"), ("eval_mlm_accuracy", "MLM acc"),
                         ("eval_nsp_accuracy", "NSP acc"), ("eval_perplexity", "ppl")):  # fmt: skip
            if k in record:
                parts.append(f"{label} {record[k]:.4f}")
        log.info(" | ".join(parts))

    def save(self) -> str:
        tag = checkpoint.save(
            self.engine, self.ckpt_dir, self.state.step, self.client_state(), self.ckpt_keep
        )
        log.info(f"saved checkpoint {self.ckpt_dir / tag}")
        return tag

    def train(self) -> dict[str, Any]:
        """Run to ``steps``; returns the final performance figures. Exits with EXIT_PREEMPTED on SIGTERM."""
        self._start_step = self.state.step
        self.window.warmup_steps = self.state.step + self.window.warmup_steps
        wall0 = time.perf_counter()
        preempted = stopped_early = False
        last_saved = self.state.step
        while self.state.step < self.steps:
            self.window.begin_if_due(self.state.step)
            record = {"step": self.state.step + 1, **self.train_step()}
            self.last_loss = record["loss"]
            record["samples"], record["tokens"] = self.state.samples, self.state.tokens
            step = self.state.step
            if self.eval_every and step % self.eval_every == 0 and step < self.steps:
                self.last_eval = self.evaluate()
                record.update(self.last_eval)
            if step % self.log_every == 0 or step == self.steps or "eval_loss" in record:
                record.update(self._performance())
                record["peak_memory_bytes"] = peak_memory_bytes()
                self._log(record)
            if self.ckpt_every and step % self.ckpt_every == 0 and step < self.steps:
                self.save()
                last_saved = step
            if step == self.stop_at_step:
                log.info(f"train.stop_at_step={step}: saving and exiting")
                stopped_early = True
                break
            if self.stop.agreed():
                preempted = True
                log.warning(f"SIGTERM: stopping after step {step}")
                break
        perf = self._performance()
        if not (preempted or stopped_early) and self.eval_loader is not None:
            self.last_eval = self.evaluate()
            if self.last_eval:
                log.info("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items()))
                if self.rank == 0:
                    with open(self.metrics_file, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"step": self.state.step, **self.last_eval}) + "\n")
        if self.state.step != last_saved:
            self.save()
        perf["wall_time_s"] = time.perf_counter() - wall0
        perf["preempted"] = preempted
        return perf


def exit_code(perf: dict[str, Any]) -> int:
    return EXIT_PREEMPTED if perf.get("preempted") else 0
