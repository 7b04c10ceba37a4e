"""One small DeepSpeed training run with LANS/LAMB; launched by tests/test_lans_zero.py via ``deepspeed``.

The same model, data and global batch for any world size: each step's global batch is a deterministic
function of the step, split evenly over the ranks and into micro-batches (gradient accumulation makes the
global batch match). Rank 0 writes the final parameters (fp32), the loss curve and facts about the ZeRO
layout to ``--out`` (torch.save, atomically).
"""

from __future__ import annotations

import argparse
import json
import time

import deepspeed
import torch
import torch.distributed as dist

from common.atomic import atomic_path
from common.process import end_process_group, exit_fast
from training.engine import bf16_section, no_shm_all_reduce
from training.optim.factory import attach_zero, param_groups
from training.optim.lans import LAMB, LANS
from training.optim.schedules import build_scheduler

VOCAB, DIM, HID, OUT, SEQ = 50, 16, 33, 20, 6


class MixedNet(torch.nn.Module):
    """Embedding, Linear layers with biases, a LayerNorm: mixed shapes, some split across ZeRO partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc1 = torch.nn.Linear(DIM, HID)
        self.LayerNorm = torch.nn.LayerNorm(HID)
        self.fc2 = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.LayerNorm(torch.tanh(self.fc1(self.emb(x).mean(1))))
        return torch.nn.functional.cross_entropy(self.fc2(h).float(), y)


class BertMLM(torch.nn.Module):
    """A small BERT (transformers, random init, no download) for the communication-cost benchmark."""

    SEQ = 128

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=8192,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
        )
        self.bert = BertForMaskedLM(cfg)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=x, labels=y).loss


def bert_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 8192, (size, BertMLM.SEQ), generator=g)
    return x, x.clone()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: every token of a sample hints at its class (two tokens per class plus noise)."""
    g = torch.Generator().manual_seed(1000 + step)
    y = torch.randint(0, OUT, (size,), generator=g)
    x = (2 * y[:, None] + torch.randint(0, 2, (size, SEQ), generator=g)) % VOCAB
    noise = torch.rand(size, SEQ, generator=g) < 0.3
    x = torch.where(noise, torch.randint(0, VOCAB, (size, SEQ), generator=g), x)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument(
        "--runs",
        required=True,
        help="comma-separated OPT:STAGE:DTYPE[:naive|:refuse|:late] (lans|lamb, 0-3, fp32|bf16; naive = no "
        "attach_zero; refuse = only record attach_zero's refusal; late = bf16 without immediate_grad_update), "
        "each trains its own model in turn",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--comm-fp32", action="store_true", help="reduce gradients in fp32 under bf16")
    ap.add_argument("--model", choices=["mixed", "bert"], default="mixed", help="bert: small BERT (benchmark)")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps (and go on)")
    ap.add_argument("--load-dir", default=None, help="resume from the checkpoint in this directory")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    no_shm_all_reduce()  # nothing left in /dev/shm
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        gas = args.global_batch // (args.micro_batch * world)
        assert gas * args.micro_batch * world == args.global_batch, "global batch must split evenly"
        results = {spec: train_one(args, spec, world, rank, gas) for spec in args.runs.split(",")}
        if rank == 0:
            with atomic_path(args.out) as tmp:
                torch.save(results, tmp)
            print(json.dumps({spec: r["info"] for spec, r in results.items()}))
        dist.barrier()
    finally:
        end_process_group()


def ds_config(args: argparse.Namespace, stage: int, dtype: str, gas: int, flags: list[str]) -> dict:
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":  # train.py's section; "late": DeepSpeed's default, every micro-batch's gradients at once
        config["bf16"] = bf16_section(immediate_grad_update="late" not in flags)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if args.comm_fp32:
            config["communication_data_type"] = "fp32"
    return config


def train_one(args: argparse.Namespace, spec: str, world: int, rank: int, gas: int) -> dict:
    """Train one model as ``spec`` says; return its final fp32 parameters, losses and layout facts."""
    name, stage, dtype, *flags = spec.split(":")
    naive = "naive" in flags
    impl = next((f for f in flags if f in ("cpu", "fused", "foreach", "multi")), "auto")
    config = ds_config(args, int(stage), dtype, gas, flags)
    ckpt_name = spec.replace(":", "_")
    torch.manual_seed(0)
    model = BertMLM() if args.model == "bert" else MixedNet()
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    cls = LANS if name == "lans" else LAMB
    opt = cls(param_groups(model, 0.01), lr=args.lr, betas=(0.9, 0.999), eps=1e-6, impl=impl)
    sched = build_scheduler(opt, "warmup_constant_decay", total_steps=args.steps, warmup=0.25, constant=0.25)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    if "refuse" in flags:  # a path attach_zero must refuse: record its message instead of training
        try:
            attach_zero(engine)
        except RuntimeError as e:
            return {"info": {"refused": str(e)}}
        return {"info": {"refused": None}}
    if not naive:
        attach_zero(engine)
    if args.load_dir:
        engine.load_checkpoint(f"{args.load_dir}/{ckpt_name}", tag="ck")
        if not naive:
            attach_zero(engine)  # rebuild the fragment map from the (re-linked) DeepSpeed partitions

    # Facts about the partitioning, for the test to assert on.
    by_id = {id(p): n for n, p in model.named_parameters()}
    straddling = []
    zopt = engine.optimizer
    lp_groups = getattr(zopt, "bit16_groups", None) or getattr(zopt, "bf16_groups", None) or []
    for lps in lp_groups:
        for lp in lps:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is not None and 0 < mapping.lp_fragment_address.numel < lp.numel():
                straddling.append(by_id[id(lp)])
    info = {
        "world": world,
        "stage": int(stage),
        "wrapper": type(zopt).__name__,
        "immediate_grad_update": getattr(zopt, "immediate_grad_update", None),
        "attached_groups": len(opt._layouts),
        "straddling_rank0": straddling,
    }

    losses, step_times, comm_times = [], [], []
    batch_fn = bert_batch if args.model == "bert" else global_batch
    per_rank = args.global_batch // world
    for step in range(engine.global_steps, args.steps):
        t0, c0 = time.perf_counter(), opt.comm_seconds
        x, y = batch_fn(step, args.global_batch)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        step_loss = torch.zeros(())
        for k in range(gas):
            sl = slice(k * args.micro_batch, (k + 1) * args.micro_batch)
            loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        step_times.append(time.perf_counter() - t0)
        comm_times.append(opt.comm_seconds - c0)
        dist.all_reduce(step_loss)
        losses.append(float(step_loss) / world)
        if args.save_at is not None and engine.global_steps == args.save_at:
            engine.save_checkpoint(f"{args.save_dir}/{ckpt_name}", tag="ck")
    info["flat_group_steps"] = opt.flat_group_steps
    return {
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "init_params": init,
        "losses": losses,
        "info": info,
        "step_times": step_times,
        "comm_times": comm_times,
    }


if __name__ == "__main__":
    exit_fast(main())
