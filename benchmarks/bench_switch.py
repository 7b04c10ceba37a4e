"""A BERT speed switch on and off: our ``train.py`` both ways, side by side in one run.

``--switch model.unpad`` (the default): the encoder computes the real tokens only, or ``transformers``' padded
forward. ``--switch model.compile``: compiled transformer blocks, or eager. Same shards (built from the enwiki
sample by ``bench_train.build_data``, one set per sequence length), same model, batches and settings as
``bench_train.py``'s "ours" column (BF16, AdamW, ZeRO-0, one process); the only difference is the switch.
Each (sequence length, side) runs ``--repeats`` times, the sides interleaved with alternating order; the
table shows the medians of sequences/s and of sequences per CPU-second of the training process (less
sensitive to other load), the padding fraction of what the runs read (their summaries' ``padding_fraction``)
and the first step's time (``first_step_s``: compilation included, outside the throughput window). For
``model.unpad``, ``1/(1-p)`` is the gain if every cost scaled with the tokens computed: the linears do,
attention falls faster (``n**2``), and what does not shrink (the optimizer step, the MLM head at ``max_pred``
positions, the NSP head, the loader, the unpadding's gathers) pulls the gain below it.

    python benchmarks/bench_switch.py                                    # model.unpad, bert-10m, seq 128 and 512
    python benchmarks/bench_switch.py --switch model.compile --seqs 128:20
    python benchmarks/bench_switch.py --model bert-base --steps 6 --warmup 2 --micro-batch 4 --global-batch 8

Toy size (CI, seconds, not a measurement): ``--model bert-debug --seqs 128:20 --steps 2 --warmup 1 --repeats
1 --micro-batch 2 --global-batch 4``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_train import Ports, build_data, run_ours  # a sibling: a script's directory is on sys.path

from common.errors import UserError, run_cli
from common.log import get_logger

REPO = Path(__file__).resolve().parents[1]

log = get_logger("bench_switch")
SWITCHES = ("model.unpad", "model.compile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/bench_train", help="text, vocabulary, shards, runs (bench_train's)")
    p.add_argument("--switch", default="model.unpad", choices=SWITCHES, help="the setting run true and false")
    p.add_argument("--model", default="bert-10m", help="a BERT registry name")
    p.add_argument("--seqs", default="128:20,512:80", help="comma list of seq_len:max_pred")
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--port", type=int, default=29950)
    p.add_argument("--rebuild", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from model.registry import get_spec

    if get_spec(args.model).family != "bert":
        raise UserError(f"--model {args.model}: give a BERT size (the switches are measured on BERT)")
    try:
        seqs = [tuple(int(x) for x in item.split(":")) for item in args.seqs.split(",") if item.strip()]
        assert seqs and all(len(s) == 2 for s in seqs)
    except (ValueError, AssertionError):
        raise UserError(f"--seqs {args.seqs!r}: expected seq_len:max_pred pairs, e.g. 128:20,512:80") from None
    work = Path(args.work).resolve()
    if work == REPO or REPO in work.parents:
        raise UserError(f"--work {work} is inside the repository; use a directory outside it")
    work.mkdir(parents=True, exist_ok=True)
    args.work = str(work)
    ports, t_start, rows = Ports(args.port), time.perf_counter(), []
    for seq, max_pred in seqs:
        run_args = argparse.Namespace(**{**vars(args), "bert_seq": seq, "max_pred": max_pred, "gpt_seq": 128})
        paths = build_data(work, run_args, kinds=("bert",))
        runs: dict[str, list[dict]] = {"true": [], "false": []}
        for rep in range(args.repeats):
            for side in ("true", "false") if rep % 2 == 0 else ("false", "true"):
                tag = f"{args.switch}-{args.model}-{seq}-{side}-r{rep}"
                rec = run_ours(args.model, "bert", paths, run_args, tag, ports, extra=(f"{args.switch}={side}",))
                runs[side].append(rec)
                log.info(f"{tag}: {rec['sequences_per_sec']:.2f} seq/s, {rec['sequences_per_cpu_sec']:.2f} seq/CPU-s")
        med = {
            (side, key): statistics.median(r[key] for r in runs[side])
            for side in runs
            for key in ("sequences_per_sec", "sequences_per_cpu_sec", "padding_fraction", "first_step_s")
        }
        rows.append((seq, max_pred, med, runs))
    print(
        f"\nBERT {args.model}, {args.switch} on and off, CPU, BF16, 1 process x {args.threads} thread(s), micro "
        f"batch {args.micro_batch}, global batch {args.global_batch}; {args.steps} measured steps after "
        f"{args.warmup} warm-up; median of {args.repeats} interleaved runs. "
        f"Wall {time.perf_counter() - t_start:.0f}s.\n"
    )
    head = ["seq", "max_pred", "padding", "on seq/s", "off seq/s", "ratio"]
    head += ["on seq/CPU-s", "off seq/CPU-s", "CPU ratio", "on first step s", "off first step s"]
    head += ["1/(1-p)"] if args.switch == "model.unpad" else []
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for seq, max_pred, med, _ in rows:
        pad = med[("true", "padding_fraction")]
        cells = [str(seq), str(max_pred), f"{100 * pad:.1f}%"]
        for key in ("sequences_per_sec", "sequences_per_cpu_sec"):
            on, off = med[("true", key)], med[("false", key)]
            cells += [f"{on:.2f}", f"{off:.2f}", f"{on / off:.2f}x"]
        cells += [f"{med[(side, 'first_step_s')]:.2f}" for side in ("true", "false")]
        if args.switch == "model.unpad":
            cells.append(f"{1 / (1 - pad):.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
