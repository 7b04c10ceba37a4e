"""Stand-in for train.py in the launch tests, honouring the same contract until train.py exists.

``deepspeed --num_gpus W launch_standin_train.py --config X.yaml run.dir=D train.steps=N
run.threads_per_rank=T`` trains a small MLP with real DeepSpeed (data parallel over W CPU ranks, gloo
all-reduce of the gradients), times the steps after a warm-up, and writes ``D/summary.json`` with the keys
``launch.report`` reads (and nothing about other runs: the report compares them). Only the model is a
stand-in; launcher, ranks and collectives are real. Its MFU is ``null``, as for a device without a known peak.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    for ov in args.overrides:  # dotted key=value, YAML-typed
        key, val = ov.split("=", 1)
        node = cfg
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(val)

    import deepspeed
    import deepspeed.comm as dist
    import torch

    from common.atomic import atomic_write_json
    from common.cluster import node_count
    from common.process import end_process_group
    from training.engine import no_shm_all_reduce
    from training.metrics import RunSummary, config_fingerprint, throughput

    threads = int(cfg["run"].get("threads_per_rank", 1))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    no_shm_all_reduce()  # nothing left in /dev/shm
    deepspeed.init_distributed(verbose=False)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        t = cfg["train"]
        micro, gbatch, seq, hidden = t["micro_batch"], t["global_batch"], t["seq_len"], cfg["model"]["hidden"]
        if gbatch % (micro * world):
            raise SystemExit(f"train.global_batch {gbatch} is not a multiple of micro_batch {micro} x world {world}")
        accum = gbatch // (micro * world)
        model = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
        )
        ds_cfg = {
            "train_batch_size": gbatch,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
            "zero_optimization": {"stage": 0},
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=ds_cfg
        )
        x = torch.randn(micro, seq, hidden)
        warmup, steps = t.get("warmup_steps", 2), t["steps"]
        t0 = 0.0
        for step in range(steps):
            if step == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            for _ in range(accum):
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        tp = throughput((steps - warmup) * gbatch, (steps - warmup) * gbatch * seq, seconds, world)
        if rank == 0:
            run_dir = Path(cfg["run"]["dir"])
            resolved = dict(cfg, world_size=world)
            summary = RunSummary(
                model="standin-mlp",
                family="standin",
                world_size=world,
                nodes=node_count(),
                device_kind="cpu",
                device_count=world,
                threads_per_rank=threads,
                precision="fp32",
                zero_stage=0,
                zero_stage_requested=0,
                optimizer="adamw",
                micro_batch=micro,
                global_batch=gbatch,
                grad_accum=accum,
                seq_len=seq,
                steps=steps,
                measured_steps=steps - warmup,
                samples=steps * gbatch,
                tokens=steps * gbatch * seq,
                # 6 x matmul weights per token (forward + backward multiply-adds), model.flops's convention
                flops_per_token=6.0 * sum(m.weight.numel() for m in model if isinstance(m, torch.nn.Linear)),
                peak_flops_per_device=None,
                attempt=1,
                stopped="",
                peak_memory_bytes=0,
                startup_s=0.0,
                warmup_s=0.0,
                train_window_s=seconds,
                eval_s=0.0,
                save_s=0.0,
                log_s=0.0,
                wall_time_s=seconds,
                final_loss=None,
                fingerprint=config_fingerprint(resolved),
                config=resolved,
                sequences_per_sec=tp.sequences_per_sec,
                tokens_per_sec=tp.tokens_per_sec,
                sequences_per_sec_per_device=tp.sequences_per_sec_per_device,
                tokens_per_sec_per_device=tp.tokens_per_sec_per_device,
                mfu=None,
            ).to_dict()
            summary["host"] = socket.gethostname()
            atomic_write_json(run_dir / "summary.json", summary)
        dist.barrier()
        return 0
    finally:
        end_process_group()


if __name__ == "__main__":
    from common.process import exit_fast

    exit_fast(main())
