"""LANS step time beside torch AdamW (foreach) and a straightforward per-tensor LANS, measured in one run;
and the cost of LANS's per-tensor norm all-reduces inside a ZeRO-2 training step on 2 CPU ranks.

Part 1: the ~200 parameter tensors of BERT-base (``transformers.BertForPreTraining(BertConfig())``, random
init, fp32, CPU). Every optimizer updates the same parameters with the same gradients; one round runs one step
of each, in turn, so that load from other processes hits all of them alike; the figure is the median over the
measured rounds after warm-up rounds (which include torch.compile of the fused kernels).

Part 2: ``deepspeed --num_gpus 2 tests/scripts/lans_zero_run.py --model bert`` (a 4-layer, 256-wide BERT MLM,
ZeRO-2, gloo); per step, the wall time of the norm all-reduces (measured inside the optimizer, so it includes
waiting for the slower rank) against the whole training step; median over steps after the first two.

    python benchmarks/bench_lans.py --threads 2 --steps 15 --warmup 2       # both parts
    python benchmarks/bench_lans.py --skip-zero                              # part 1 only

Toy size (CI, seconds): ``--params tiny --steps 2 --warmup 1 --zero-model mixed --zero-steps 1``: part 1 on a
2-layer, 64-wide BERT's tensors, part 2 on ``lans_zero_run.py``'s small mixed-shape network.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from training.optim.lans import LANS

REPO = Path(__file__).resolve().parents[1]


class NaiveLANS(torch.optim.Optimizer):
    """The straightforward implementation: a Python loop over tensors, a dozen small kernels per tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                g = p.grad
                gn = g.norm()
                if gn > 0:
                    g = g / (gn + eps)
                st["m"].mul_(b1).add_(g, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                d = (st["v"] / (1 - b2 ** st["step"])).sqrt_().add_(eps)
                r = st["m"] / (1 - b1 ** st["step"]) / d + wd * p
                c = g / d + wd * p
                wn, rn, cn = p.norm(), r.norm(), c.norm()
                tr = wn / rn if wn > 0 and rn > 0 else 1.0
                tc = wn / cn if wn > 0 and cn > 0 else 1.0
                p.add_(r, alpha=-lr * b1 * float(tr)).add_(c, alpha=-lr * (1 - b1) * float(tc))


def bert_params(size: str) -> list[torch.nn.Parameter]:
    """The parameters of BERT-base, or of a tiny BERT (``tiny``), with random gradients."""
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig()
    if size == "tiny":
        config = BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
        )
    model = BertForPreTraining(config)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def part1(threads: int, steps: int, warmup: int, size: str) -> None:
    torch.set_num_threads(threads)
    params = bert_params(size)
    n = sum(p.numel() for p in params)
    opts = {
        "torch AdamW (foreach=True)": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True),
        "LANS cpu (ours, default on CPU)": LANS(params, lr=1e-4, impl="cpu"),
        "LANS fused (ours, torch.compile)": LANS(params, lr=1e-4, impl="fused"),
        "LANS foreach (ours, eager)": LANS(params, lr=1e-4, impl="foreach"),
        "naive per-tensor LANS": NaiveLANS(params, lr=1e-4),
    }
    times: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(warmup + steps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    base, base_best = med["torch AdamW (foreach=True)"], best["torch AdamW (foreach=True)"]
    print(f"Part 1: one optimizer step, BERT-{size} parameters ({len(params)} tensors, {n / 1e6:.1f}M fp32), CPU,")
    print(f"torch.set_num_threads({threads}), {steps} interleaved rounds after {warmup} warm-up rounds")
    print(f"{'optimizer':<36}{'median s':>10}{'x AdamW':>9}{'best s':>9}{'x AdamW':>9}")
    for k in med:
        print(f"{k:<36}{med[k]:>10.3f}{med[k] / base:>9.2f}{best[k]:>9.3f}{best[k] / base_best:>9.2f}")
    naive = "naive per-tensor LANS"
    for ours in ("LANS cpu (ours, default on CPU)", "LANS fused (ours, torch.compile)"):
        print(
            f"naive / {ours.split(' (')[0]}: {med[naive] / med[ours]:.1f}x (median), "
            f"{best[naive] / best[ours]:.1f}x (best)"
        )


def part2(steps: int, model: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.pt"
        with socket.socket() as sock:  # a free port: the launcher's default may be taken by another job
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--master_port",
            str(port),
        ]
        cmd += [str(REPO / "tests" / "scripts" / "lans_zero_run.py")]
        cmd += ["--model", model, "--runs", "lans:2:fp32", "--steps", str(steps + 2), "--global-batch", "16"]
        cmd += ["--micro-batch", "8", "--lr", "1e-3", "--out", str(out)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        res = torch.load(out)["lans:2:fp32"]
    step_t, comm_t = res["step_times"][2:], res["comm_times"][2:]
    frac = [c / s for c, s in zip(comm_t, step_t)]
    what = "small BERT MLM (4x256, seq 128" if model == "bert" else "small mixed-shape network (seq 6"
    print(
        f"\nPart 2: ZeRO-2, 2 CPU ranks (gloo, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}), {what}, "
        f"micro-batch 8), median of {len(step_t)} steps"
    )
    print(f"{'training step s':>16}{'norm all-reduces s':>20}{'share':>8}")
    print(f"{statistics.median(step_t):>16.5f}{statistics.median(comm_t):>20.5f}{100 * statistics.median(frac):>7.2f}%")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--zero-steps", type=int, default=8)
    p.add_argument("--skip-zero", action="store_true")
    p.add_argument("--params", choices=("base", "tiny"), default="base", help="part 1: BERT-base or tiny")
    p.add_argument("--zero-model", choices=("bert", "mixed"), default="bert", help="part 2: lans_zero_run.py --model")
    args = p.parse_args()
    part1(args.threads, args.steps, args.warmup, args.params)
    if not args.skip_zero:
        part2(args.zero_steps, args.zero_model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
