"""``python -m launch curve RUN_DIR``: a run's learning curve as a PNG, and the baseline it must beat.

The curve reads RUN_DIR/metrics.jsonl. A step re-done after a restart appears once per attempt; the latest
attempt's row counts. BERT runs show the MLM and NSP losses apart (their sum is the total), and the held-out
MLM accuracy beside the accuracy of always predicting the most frequent masked token of the same held-out
samples.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from common.atomic import atomic_write_json
from common.errors import UserError
from data.formats import BERT
from training.ownership import describe_owner


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(training rows, evaluation rows) by step, the latest attempt's row for each step."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path} does not exist: not a run directory, or the run logged nothing yet")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not a JSON line") from None
        if "loss" in rec:
            train[rec["step"]] = rec
        if "eval_loss" in rec:
            evals[rec["step"]] = rec
    return train, evals


def mlm_majority_baseline(eval_dir: Path, n: int) -> tuple[int, float]:
    """(token id, accuracy) of always predicting the most frequent masked token of the first ``n`` held-out
    samples: the samples the run evaluates on (``train.eval_samples``)."""
    from data.loader import EvalSet  # on call (start-up time): the loader loads torch; drawing a curve does not

    labels: Counter[int] = Counter()
    for batch in EvalSet(eval_dir, BERT.name, n, micro_batch=64, dp_rank=0, dp_world=1):
        ids, weights = batch["masked_lm_ids"], batch["masked_lm_weights"]
        labels.update(ids[weights > 0].tolist())
    if not labels:
        raise UserError(f"{eval_dir}: no masked tokens in the first {n} samples")
    token, count = labels.most_common(1)[0]
    return token, count / sum(labels.values())


def plot(run_dir: Path, out: Path, baseline: float | None = None) -> Path:
    try:
        import matplotlib  # on call: an optional extra (plot), needed only to draw
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'wikipretrain[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use: pyplot takes its backend when imported

    train, evals = read_metrics(run_dir)
    if not train:
        raise UserError(f"{run_dir / 'metrics.jsonl'} has no training rows")
    steps = sorted(train)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [train[s]["loss"] for s in steps], label="loss (total)")
    for key, label in (("mlm_loss", "MLM loss"), ("nsp_loss", "NSP loss")):
        if all(key in train[s] for s in steps):
            ax_loss.plot(steps, [train[s][key] for s in steps], label=label)
    ev_steps = sorted(evals)
    ax_loss.plot(ev_steps, [evals[s]["eval_loss"] for s in ev_steps], "o--", label="held-out loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    acc = [s for s in ev_steps if "eval_mlm_accuracy" in evals[s]]
    if acc:
        ax_acc.plot(acc, [evals[s]["eval_mlm_accuracy"] for s in acc], "o-", label="held-out MLM accuracy")
        ax_acc.plot(acc, [evals[s]["eval_nsp_accuracy"] for s in acc], "s-", label="held-out NSP accuracy")
        if baseline is not None:
            ax_acc.axhline(baseline, color="grey", linestyle=":", label="MLM: most frequent token")
        ax_acc.set_ylim(bottom=0)
    elif ev_steps:
        ax_acc.plot(
            ev_steps,
            [evals[s].get("eval_perplexity", float("nan")) for s in ev_steps],
            "o-",
            label="held-out perplexity",
        )
    ax_acc.set_xlabel("optimizer step")
    ax_acc.legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run directory (RUN_DIR/metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/loss_curve.png)")
    p.add_argument(
        "--eval-data",
        type=Path,
        default=None,
        help="BERT: the held-out shards, to draw the most-frequent-token MLM baseline",
    )


def run(args: argparse.Namespace) -> int:
    out = args.out or args.run_dir / "loss_curve.png"
    baseline = None
    if args.eval_data is not None:
        config = json.loads((args.run_dir / "config.json").read_text())
        token, baseline = mlm_majority_baseline(args.eval_data, config["train"]["eval_samples"])
        print(f"MLM baseline: always predicting token {token} scores {baseline:.4f} on the held-out samples")
        atomic_write_json(out.with_suffix(".json"), {"mlm_majority_token": token, "mlm_majority_accuracy": baseline})
    print(f"wrote {plot(args.run_dir, out, baseline)}")
    print(f"owner: {describe_owner(args.run_dir)}")  # a live holder is still writing the curve's rows
    return 0
