"""Host memory and time of one GPT-NeoX forward + backward: our chunked LM loss against ``transformers``' logits.

Ours: ``NeoxPretraining`` (loss from the final hidden states in chunks of tokens, ``model.losses``). Peer:
``GPTNeoXForCausalLM(input_ids, labels=...)`` on the same weights (same seed, same construction order), which
holds the [tokens, vocabulary] logits, their FP32 log-softmax and their gradients. Both score every one of the
``batch x seq`` positions (the peer through ``shift_labels``, our packed-window convention), FP32 on the CPU.

Each side runs in a fresh process, sides alternating, ``--repeats`` processes each. Memory: the median over all
measured steps of a side. Time: each side's best step (load from other work only adds time), with the medians
printed beside it. In a process: build the
model, one warm-up step (the "cold" figures), then ``--steps`` measured steps; before each, gradients are
dropped and freed memory returned to the system (``malloc_trim``), and the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``), so "added" is the peak resident memory during the step less the resident memory
before it: activations, logits or chunks, and the gradients (the same 4 bytes a parameter on both sides).
Without ``clear_refs`` (not Linux) the figure is ``ru_maxrss`` growth, a lower bound.

    python benchmarks/bench_neox_loss.py           # neox-125m widths and vocabulary, 2 layers, seq 2048, batch 2
    python benchmarks/bench_neox_loss.py --tiny    # seconds: neox-debug widths, small vocabulary, one thread
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOALS = {"memory": 0.5, "time": 1.25}  # ours / peer, at most


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRss:
    """Resident memory now and its peak since the last ``reset`` (MiB)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        self._trim = getattr(libc, "malloc_trim", None)
        try:
            self.reset()
            self.exact = True
        except OSError:
            self.exact = False

    def trim(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)

    def now(self) -> float:
        return _status_kb("VmRSS") / 1024 if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak(self) -> float:
        return _status_kb("VmHWM") / 1024 if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import GPTNeoXForCausalLM

    from model.losses import CHUNK_TOKENS
    from model.neox import NeoxPretraining, hf_config
    from model.registry import get_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = get_spec(args.model, layers=args.layers, vocab_size=args.vocab)
    rss = PeakRss()
    base = rss.now()
    torch.manual_seed(0)
    if args.side == "ours":
        model: torch.nn.Module = NeoxPretraining(spec, "sdpa", loss_chunk_tokens=args.chunk or CHUNK_TOKENS)
    else:
        model = GPTNeoXForCausalLM(hf_config(spec, "sdpa"))
    model.train()
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        if args.side == "ours":
            loss = model(input_ids=ids)["loss"]
        else:  # every position scored, as ours: the targets given already shifted
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1], shift_labels=ids[:, 1:].contiguous()).loss
        loss.backward()
        return float(loss)

    def measured() -> tuple[float, float, float]:
        for p in model.parameters():
            p.grad = None
        rss.trim()
        if rss.exact:
            rss.reset()
        before = rss.now()
        t0 = time.perf_counter()
        loss = step()
        seconds = time.perf_counter() - t0
        return loss, seconds, rss.peak() - before

    built = rss.now()
    loss, cold_s, cold_mib = measured()
    runs = [measured() for _ in range(args.steps)]
    return {
        "side": args.side,
        "loss": loss,
        "model_mib": built - base,
        "cold_s": cold_s,
        "cold_added_mib": cold_mib,
        "step_s": [r[1] for r in runs],
        "added_mib": [r[2] for r in runs],
        "exact_peak": rss.exact,
        "threads": torch.get_num_threads(),
    }


def sizes(args: argparse.Namespace) -> list[str]:
    if args.tiny:
        return [
            "--model",
            "neox-debug",
            "--layers",
            "2",
            "--vocab",
            "8192",
            "--seq",
            "256",
            "--batch",
            "2",
            "--chunk",
            "128",
        ]
    return ["--model", "neox-125m", "--layers", "2", "--vocab", "0", "--seq", "2048", "--batch", "2"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny sizes: seconds, same figures")
    p.add_argument("--repeats", type=int, help="processes per side, alternating (default 2; --tiny 1)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per process, after the warm-up step")
    p.add_argument("--threads", type=int, help="torch threads per process (default: torch's own; --tiny 1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--side", choices=["ours", "peer"], help=argparse.SUPPRESS)  # a child process
    p.add_argument("--model", default="neox-125m", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)  # 0: the model's own
    p.add_argument("--seq", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)  # ours: tokens per chunk (0: default)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.tiny else 2
    if args.threads is None:  # tiny steps are milliseconds of work: on a busy machine, OpenMP start-up would rule
        args.threads = 1 if args.tiny else 0
    if args.vocab == 0:
        args.vocab = None
    if args.side:
        print(json.dumps(child(args)))
        return 0

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    for _ in range(args.repeats):
        for side in ("ours", "peer"):
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                *sizes(args),
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
            if out.returncode != 0:
                sys.stderr.write(out.stderr)
                return out.returncode
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))

    summary = {}
    for side, runs in results.items():
        summary[side] = {
            "added_mib": statistics.median(m for r in runs for m in r["added_mib"]),
            "step_s": statistics.median(s for r in runs for s in r["step_s"]),
            "best_s": min(s for r in runs for s in r["step_s"]),
            "cold_added_mib": statistics.median(r["cold_added_mib"] for r in runs),
            "cold_s": statistics.median(r["cold_s"] for r in runs),
            "model_mib": statistics.median(r["model_mib"] for r in runs),
            "loss": runs[0]["loss"],
            "threads": runs[0]["threads"],
        }
    # Time: each side's best step. Other work on the machine only ever adds time, and its load changes over
    # minutes, so the best step of each side is the least disturbed; medians and per-pair ratios are printed too.
    # Memory does not depend on the load.
    pairs = [
        statistics.median(o["step_s"]) / statistics.median(p["step_s"])
        for o, p in zip(results["ours"], results["peer"])
    ]
    ratio = {
        "memory": summary["ours"]["added_mib"] / summary["peer"]["added_mib"],
        "time": summary["ours"]["best_s"] / summary["peer"]["best_s"],
        "time_of_medians": summary["ours"]["step_s"] / summary["peer"]["step_s"],
    }
    if args.json:
        print(json.dumps({"sizes": sizes(args), "summary": summary, "ratio": ratio, "runs": results}, indent=1))
        return 0
    print(
        f"sizes: {' '.join(sizes(args))}; FP32, CPU, {summary['ours']['threads']} threads; "
        f"{args.repeats} processes x {args.steps} measured steps per side"
    )
    print(
        f"{'':6} {'model MiB':>10} {'added MiB':>10} {'best s':>8} {'median s':>9} {'cold added':>11} "
        f"{'cold s':>8} {'loss':>10}"
    )
    for side, s in summary.items():
        print(
            f"{side:6} {s['model_mib']:10.0f} {s['added_mib']:10.0f} {s['best_s']:8.2f} {s['step_s']:9.2f} "
            f"{s['cold_added_mib']:11.0f} {s['cold_s']:8.2f} {s['loss']:10.5f}"
        )
    for key, goal in GOALS.items():
        verdict = "meets" if ratio[key] <= goal else "misses"
        print(f"ours/peer {key}: {ratio[key]:.3f} ({verdict} the goal <= {goal})")
    print(
        f"ours/peer time of the medians: {ratio['time_of_medians']:.3f}; per process pair (medians): "
        f"{', '.join(f'{r:.3f}' for r in pairs)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
