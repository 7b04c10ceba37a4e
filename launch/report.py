"""Scaling report: the table published BERT results use, from the ``summary.json`` of each run.

A run writes only its own summary; everything that compares runs is computed here, when the report reads
them. Runs are grouped by ``fingerprint`` (``training.metrics.config_fingerprint``: the resolved configuration
minus the keys that change with scale; threads per rank stays in, so CPU runs with different thread counts
never compare). In each group the *baseline* is the run with the fewest accelerators (ties: the first by
path); every other run's scaling efficiency is ``training.metrics.scaling_efficiency`` of its per-accelerator
sequences/s against the baseline's. A group with one size has no baseline and says so; no 100% is invented.
A run's MFU is the one its summary recorded; a device without a known peak recorded ``mfu: null``, shown n/a.

Projections (``--recipe``, a comma list of recipe names or YAMLs, one per phase): each phase is read with the
loader train.py uses (``training.config.load_config``, so ``base:`` and the defaults apply) and costs
``train.steps x train.global_batch`` samples times the training FLOPs of the positions its model computes
(``training.metrics``' convention): ``data.seq_len`` per sample at ``model.flops.training_flops_per_token``, or,
for an unpadding BERT (``model.unpad``), the mean real length of ``data.train``'s rows and its attention over
their real lengths, both from the shards' manifest (the data's padding fraction); a phase whose manifest is not
at hand counts every position and says so. A measured run projects the recipe at its own achieved model FLOP/s
per accelerator (its tokens/s per accelerator x its FLOPs per token, ``training.metrics``): wall
time = recipe FLOPs / (that x its accelerators); times its accelerators the accelerator-hours; times its nodes
and the profile's ``price_per_instance_hour`` the cost. Where the recipe's model or sequence length differs
from the run's, the projection assumes the run's MFU carries over, and says so (``*``). ``--device NAME
--mfu X`` projects the recipe at an assumed MFU of that device's peak (``training.devices.peak_flops``).

Each run's owner (``training.ownership.describe_owner``) closes the report and is the ``owner`` column: the job
that holds its directory now, ``none``, or ``stale since T`` (a holder that is gone or stopped renewing).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

from common.atomic import atomic_path, atomic_write_json, atomic_write_text
from common.errors import UserError
from common.log import get_logger
from launch.profiles import load_profile
from training.metrics import RunSummary, scaling_efficiency
from training.ownership import describe_owner

log = get_logger("launch.report")


@dataclass
class Run:
    path: Path  # the summary.json
    summary: RunSummary

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def devices(self) -> int:
        return int(self.summary.device_count)

    @property
    def nodes(self) -> int:
        return int(self.summary.nodes or 1)

    @property
    def per_device(self) -> float:
        return float(self.summary.sequences_per_sec_per_device or 0.0)

    @property
    def achieved_flops_per_device(self) -> float | None:
        """Model FLOP/s per accelerator the run reached, or None when its summary lacks the figures."""
        tokens, per_token = self.summary.tokens_per_sec_per_device, self.summary.flops_per_token
        if not (_positive_number(tokens) and _positive_number(per_token)):
            return None
        return float(tokens) * float(per_token)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive_number(v: Any) -> TypeGuard[float]:
    return _finite(v) and v > 0


def load_summary(path: Path) -> RunSummary | None:
    """The run's typed summary, checked; None (with a warning) for a run too short to measure throughput."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read summary ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: summary is not a JSON object")
    try:
        summary = RunSummary.from_dict(data)
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: summary {e}") from None
    if summary.sequences_per_sec is None:
        log.warning(f"{path}: no measured throughput (too few steps after warm-up): left out")
        return None
    for key in ("device_count", "sequences_per_sec", "sequences_per_sec_per_device"):
        if not _positive_number(getattr(summary, key)):
            raise UserError(f"{path}: {key} must be a positive number (got {getattr(summary, key)!r})")
    return summary


def find_runs(roots: list[Path]) -> list[Run]:
    """Every measured ``summary.json`` under the given directories (or the files themselves), by path."""
    paths: set[Path] = set()
    for root in roots:
        if root.is_file() and root.name == "summary.json":
            paths.add(root.resolve())
        elif root.is_dir():
            paths.update(p.resolve() for p in root.rglob("summary.json"))
        else:
            raise UserError(f"{root}: no such run directory")
    runs = []
    for p in sorted(paths):
        summary = load_summary(p)
        if summary is not None:
            runs.append(Run(p, summary))
    return runs


def group_runs(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(str(r.summary.fingerprint), []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: (r.devices, str(r.path)))
    return groups


def baseline_of(group: list[Run]) -> Run | None:
    """The smallest run, if the group has a larger one to compare with it; else None (no baseline)."""
    if not group or max(r.devices for r in group) == min(r.devices for r in group):
        return None
    return min(group, key=lambda r: (r.devices, str(r.path)))


def efficiency(run: Run, baseline: Run | None) -> float | None:
    if baseline is None:
        return None
    return scaling_efficiency(run.per_device, baseline.per_device)


# ------------------------------------------------------------------------------------------ recipes


@dataclass(frozen=True)
class Phase:
    """One recipe YAML, resolved as train.py resolves it."""

    config: str  # the YAML's path
    model: str
    steps: int
    global_batch: int
    seq_len: int
    tokens_per_sample: float
    """Positions the model computes per sample: ``seq_len``, or the data's mean real length when it unpads."""
    flops_per_sample: float
    """Their training FLOPs (``model.flops``: attention over the real lengths when it unpads)."""
    padding_fraction: float | None = None
    """The data's padded share (its manifest's ``real_tokens``); None when the phase counts every position."""
    note: str = ""
    """Why a phase that would unpad counts every position (its data's padding is unknown here)."""

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch

    @property
    def tokens(self) -> int:
        return round(self.samples * self.tokens_per_sample)

    @property
    def flops_per_token(self) -> float:
        return self.flops_per_sample / self.tokens_per_sample

    @property
    def flops(self) -> float:
        return self.samples * self.flops_per_sample


@dataclass(frozen=True)
class Recipe:
    phases: tuple[Phase, ...]

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.phases)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.phases)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.phases)


def load_phase(name_or_path: str) -> Phase:
    """A recipe name (``neox-20b``) or YAML, through ``training.config.load_config`` (``base:``, defaults)."""
    # on call (start-up time): model.flops loads torch, and the registry each family's module; a report of
    # measured runs reads neither
    from model.flops import training_flops_of_sums, training_flops_per_token
    from training.config import load_config, resolve_config_path
    from training.start import static_plan

    path = resolve_config_path(name_or_path)
    cfg = load_config(str(path))
    # The vocabulary size is the registry's unless model.vocab_size sets it (a run reads it from the data).
    plan = static_plan(cfg.model, cfg.data)
    spec, seq_len, max_pred = plan.spec, cfg.data.seq_len, plan.max_pred
    phase = Phase(
        str(path),
        cfg.model.name,
        cfg.train.steps,
        cfg.train.global_batch,
        seq_len,
        tokens_per_sample=seq_len,
        flops_per_sample=training_flops_per_token(spec, seq_len, max_pred) * seq_len,
    )
    if not plan.unpadded:
        return phase
    lengths = data_lengths(cfg.data.train)
    if lengths is None:
        why = f"{cfg.data.train or 'data.train'} has no manifest.json with real_tokens here"
        return replace(phase, note=f"{Path(path).name}: padding unknown ({why}): every position counted")
    real, squares = lengths
    return replace(
        phase,
        tokens_per_sample=real,
        flops_per_sample=training_flops_of_sums(spec, real, squares, 1, max_pred),
        padding_fraction=1 - real / seq_len,
    )


def data_lengths(shards: str) -> tuple[float, float] | None:
    """Mean real length of a BERT shard directory's rows and mean of its squares, from its manifest's totals
    (``python -m data bert`` records them); None when the directory, its manifest or those totals are absent."""
    try:
        totals = json.loads((Path(shards) / "manifest.json").read_text(encoding="utf-8"))["totals"]
        rows, real, squares = totals["instances"], totals["real_tokens"], totals["real_tokens_squared"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(rows, int) and rows > 0 and _positive_number(real) and _positive_number(squares)):
        return None
    return real / rows, squares / rows


def load_recipe(names: list[str]) -> Recipe:
    """The phases of a recipe, in order (``bert-large-phase1,bert-large-phase2``)."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UserError("--recipe names no recipe")
    return Recipe(tuple(load_phase(n) for n in names))


def device_peak(name: str) -> float:
    """Peak FLOP/s of one ``name`` device (``training.devices.peak_flops``); a UserError when unknown."""
    from training.devices import PEAK_FLOPS, normalise_name, peak_flops  # on call (start-up time): torch

    known = [*PEAK_FLOPS, "cpu"]
    if normalise_name(name) not in {normalise_name(k) for k in known}:  # checked first: one line, no warning
        raise UserError(f"--device {name!r}: no peak FLOP/s known for it; known devices: {', '.join(known)}")
    peak = peak_flops(name)
    if peak is None:
        raise UserError(f"--device {name!r}: no peak FLOP/s known for it")
    return peak


def recipe_projection(recipe: Recipe, peak: float, mfu: float, accelerators: int) -> dict[str, float]:
    """Time on ``accelerators`` devices of peak ``peak`` FLOP/s each, at model FLOPs utilisation ``mfu``."""
    accel_hours = recipe.flops / (peak * mfu) / 3600
    return {"accelerator_hours": accel_hours, "hours": accel_hours / accelerators}


def _fmt_hours(h: float) -> str:
    if h >= 48:
        return f"{h / 24:,.1f} d"
    if h >= 1:
        return f"{h:,.1f} h"
    return f"{h * 60:,.1f} min"


def _fmt_pct(v: Any) -> str:
    return f"{v * 100:.1f}%" if _finite(v) else "n/a"


# ------------------------------------------------------------------------------------------ tables


def build_rows(
    runs: list[Run], recipe: Recipe | None = None, price_per_instance_hour: float | None = None
) -> list[dict[str, Any]]:
    """One row per run, grouped by fingerprint, smallest first; the numbers every output format shares."""
    rows = []
    for fp, group in group_runs(runs).items():
        base = baseline_of(group)
        for r in group:
            s = r.summary
            eff = efficiency(r, base)
            wall = s.wall_time_s
            row: dict[str, Any] = {
                "fingerprint": fp,
                "run": str(r.dir),
                "model": s.model,
                "device_kind": s.device_kind,
                "nodes": r.nodes,
                "accelerators": r.devices,
                "threads_per_rank": s.threads_per_rank,
                "global_batch": s.global_batch,
                "seq_len": s.seq_len,
                "sequences_per_sec": float(s.sequences_per_sec or 0.0),
                "sequences_per_sec_per_accelerator": r.per_device,
                "tokens_per_sec_per_accelerator": s.tokens_per_sec_per_device,
                "mfu": s.mfu,
                "scaling_efficiency": eff,
                "baseline_run": str(base.dir) if base is not None else None,
                "is_baseline": base is not None and r is base,
                "wall_time_s": wall,
                "accelerator_hours": r.devices * float(wall) / 3600 if _positive_number(wall) else None,
                **_goodput_cells(s.goodput),
                "owner": describe_owner(r.dir),
            }
            if recipe is not None:
                achieved = r.achieved_flops_per_device
                hours = recipe.flops / (achieved * r.devices) / 3600 if achieved else None
                row["projected_hours"] = hours
                row["projected_accelerator_hours"] = hours * r.devices if hours is not None else None
                row["projection_extrapolated"] = any(
                    p.model != s.model or p.seq_len != s.seq_len for p in recipe.phases
                )
                row["projected_cost"] = (
                    hours * r.nodes * price_per_instance_hour if hours is not None and price_per_instance_hour else None
                )
            rows.append(row)
    return rows


def _goodput_cells(g: dict[str, Any] | None) -> dict[str, Any]:
    """The goodput figures of a summary (training.metrics.goodput), flat for the table and the CSV."""
    g = g or {}
    failures = g.get("failures") or []
    return {
        "goodput": g.get("goodput"),
        "starts": g.get("attempts"),
        "world_sizes": " ".join(str(w) for w in g.get("world_sizes") or []) or None,
        "restart_s": round(sum(float(f.get("restart_s", 0)) for f in failures), 3) if g else None,
        "redone_s": round(sum(float(f.get("redone_s", 0)) for f in failures), 3) if g else None,
        "checkpoint_stall_s": g.get("checkpoint_stall_s"),
    }


def owner_markdown(rows: list[dict[str, Any]]) -> str:
    """Who owns each run now (``training.ownership``): a live holder, ``none``, or ``stale since T``."""
    lines = [f"- `{row['run']}`: {row['owner']}\n" for row in rows if row.get("owner")]
    return "Owner (the job that holds each run directory now):\n\n" + "".join(lines) + "\n" if lines else ""


def goodput_markdown(rows: list[dict[str, Any]]) -> str:
    """One line per run that has goodput figures: what its failures and checkpoints cost."""
    lines = []
    for row in rows:
        if row.get("goodput") is None:
            continue
        lines.append(
            f"- `{row['run']}`: goodput {row['goodput'] * 100:.1f}% over {row['starts']} start(s) at world "
            f"size(s) {row['world_sizes']}; restarts {row['restart_s']:.1f} s, re-done steps "
            f"{row['redone_s']:.1f} s, checkpoint stalls {row['checkpoint_stall_s']:.1f} s\n"
        )
    if not lines:
        return ""
    head = (
        "Goodput: time on steps that survive to the end over wall time from the first launch (README, "
        '"When nodes fail").\n\n'
    )
    return head + "".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]], recipe: Recipe | None = None, price: float | None = None) -> str:
    out = io.StringIO()
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["fingerprint"], []).append(row)
    for fp, grp in groups.items():
        first = grp[0]
        out.write(
            f"### {first['model'] or 'run'} (fingerprint {fp}; {first['device_kind']}, "
            f"threads/rank {first['threads_per_rank']}, seq {first['seq_len']})\n\n"
        )
        cols = ["nodes", "accelerators", "sequences/s", "sequences/s per accelerator", "MFU"]
        cols += ["scaling efficiency", "accelerator-hours (run)"]
        if recipe is not None:
            cols += ["projected time", "projected accelerator-hours"]
            if price:
                cols += ["projected cost"]
        cols += ["run"]
        out.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for row in grp:
            eff = row["scaling_efficiency"]
            eff_s = (
                "n/a (no baseline)"
                if eff is None
                else f"{eff * 100:.1f}%" + (" (baseline)" if row["is_baseline"] else "")
            )
            ah = row["accelerator_hours"]
            cells = [
                str(row["nodes"]),
                str(row["accelerators"]),
                f"{row['sequences_per_sec']:,.2f}",
                f"{row['sequences_per_sec_per_accelerator']:,.2f}",
                _fmt_pct(row["mfu"]),
                eff_s,
                "n/a" if ah is None else f"{ah:.4f}",
            ]
            if recipe is not None:
                hours = row["projected_hours"]
                if hours is None:  # the summary has no FLOPs per token to project with
                    cells += ["n/a", "n/a"] + (["n/a"] if price else [])
                else:
                    flag = " *" if row["projection_extrapolated"] else ""
                    cells += [_fmt_hours(hours) + flag, f"{row['projected_accelerator_hours']:,.0f}"]
                    if price:
                        cells += [f"${row['projected_cost']:,.0f}"]
            cells += [f"`{row['run']}`"]
            out.write("| " + " | ".join(cells) + " |\n")
        if all(r["scaling_efficiency"] is None for r in grp):
            out.write(
                "\nNo baseline: every run of this configuration has the same number of accelerators, "
                "so there is no scaling efficiency to report.\n"
            )
        out.write("\n")
    if recipe is not None and rows:
        out.write(f"Projected: the recipe's {recipe.flops:.3e} training FLOPs at each run's achieved FLOP/s.")
        if price:
            out.write(f" Cost at ${price:,.2f} per instance-hour.")
        if any(r.get("projection_extrapolated") for r in rows):
            out.write(
                " `*`: the recipe's model or sequence length differs from the measured run's; the projection "
                "assumes the run's MFU carries over."
            )
        if any(r.get("projected_hours") is None for r in rows):
            out.write(" n/a: the run's summary has no flops_per_token.")
        out.write("\n")
    good = goodput_markdown(rows)
    if good:
        out.write(("\n" if out.tell() else "") + good)
    owners = owner_markdown(rows)
    if owners:
        out.write(("\n" if out.tell() else "") + owners)
    return out.getvalue()


def recipe_markdown(recipe: Recipe, device: str | None = None, mfu: float | None = None, accelerators: int = 1) -> str:
    """The recipe's phases and their FLOPs; with ``device`` and ``mfu``, its projected time there."""
    out = io.StringIO()
    out.write("### Recipe\n\n")
    cols = ["phase", "model", "steps", "global batch", "seq len", "samples", "tokens", "FLOPs/token", "FLOPs"]
    out.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    for p in recipe.phases:
        cells = [Path(p.config).name, p.model, f"{p.steps:,}", f"{p.global_batch:,}", f"{p.seq_len:,}"]
        cells += [f"{p.samples:,}", f"{p.tokens:,}", f"{p.flops_per_token:.3e}", f"{p.flops:.3e}"]
        out.write("| " + " | ".join(cells) + " |\n")
    out.write(
        f"| total | | | | | {recipe.samples:,} | {recipe.tokens:,} | | {recipe.flops:.3e} |\n\n"
        "FLOPs: model.flops (6 N + 12 L d n per token, forward and backward; tokens are the positions the model "
        "computes: an unpadding BERT's real tokens, n their sequence's length, from its data's manifest).\n"
    )
    for p in recipe.phases:
        if p.padding_fraction is not None:
            out.write(
                f"{Path(p.config).name}: {p.padding_fraction * 100:.1f}% of the data's positions are padding, "
                "not computed.\n"
            )
        if p.note:
            out.write(p.note + ".\n")
    if device is not None and mfu is not None:
        peak = device_peak(device)
        proj = recipe_projection(recipe, peak, mfu, accelerators)
        out.write(
            f"On {device} ({peak / 1e12:,.1f} TFLOP/s peak) at {mfu * 100:.1f}% MFU: "
            f"{proj['accelerator_hours']:,.0f} accelerator-hours, {_fmt_hours(proj['hours'])} "
            f"on {accelerators:,} accelerator(s).\n"
        )
    return out.getvalue()


def csv_text(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        fields = list(rows[0].keys())
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def plot(rows: list[dict[str, Any]], path: str | Path) -> None:
    """PNG: scaling efficiency and sequences/s against accelerators, one line per configuration."""
    try:
        import matplotlib  # on call: an optional extra (plot), needed only to draw
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'wikipretrain[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use: pyplot takes its backend when imported

    fig, (ax_eff, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["fingerprint"], []).append(row)
    for fp, grp in groups.items():
        label = f"{grp[0]['model'] or 'run'} [{fp[:8]}]"
        x = [r["accelerators"] for r in grp]
        ax_tp.plot(x, [r["sequences_per_sec"] for r in grp], "o-", label=label)
        pts = [(r["accelerators"], r["scaling_efficiency"] * 100) for r in grp if r["scaling_efficiency"] is not None]
        if pts:
            ax_eff.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax_eff.axhline(100, color="grey", lw=0.8, ls="--")
    ax_eff.set(xlabel="accelerators", ylabel="scaling efficiency (%)", title="Scaling efficiency")
    ax_tp.set(xlabel="accelerators", ylabel="sequences/s", title="Throughput")
    for ax in (ax_eff, ax_tp):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="*", help="run directories (searched recursively for summary.json)")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    parser.add_argument("--csv", default=None, help="also write one CSV row per run here")
    parser.add_argument("--plot", default=None, help="PNG of efficiency and throughput against accelerators")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--recipe",
        default=None,
        help="comma list of recipe names or YAMLs (its phases, in order) to project time and cost for",
    )
    parser.add_argument("--profile", default=None, help="cluster profile (name or YAML) with price_per_instance_hour")
    parser.add_argument("--device", default=None, help="with --recipe: project on this device (exact name, or cpu)")
    parser.add_argument("--mfu", type=float, default=None, help="with --device: the MFU to assume (0-1)")
    parser.add_argument("--accelerators", type=int, default=1, help="with --device: how many devices (default 1)")


def _check_device_args(args: argparse.Namespace) -> None:
    if (args.device is None) != (args.mfu is None):
        raise UserError("--device and --mfu go together (the device's peak and the fraction of it to assume)")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1] (got {args.mfu})")
    if args.accelerators <= 0:
        raise UserError(f"--accelerators must be positive (got {args.accelerators})")
    if args.device is not None and not args.recipe:
        raise UserError("--device projects a recipe: give --recipe too")


def run(args: argparse.Namespace) -> int:
    _check_device_args(args)
    if not args.runs and not args.recipe:
        raise UserError("give run directories to report on, or --recipe to project")
    recipe = load_recipe(args.recipe.split(",")) if args.recipe else None
    runs = find_runs([Path(p) for p in args.runs])
    if args.runs and not runs:
        raise UserError(f"no measured summary.json under {', '.join(args.runs)}")
    price = None
    if args.profile:
        prof = load_profile(args.profile)
        price = prof.price_per_instance_hour
        if price is None:
            raise UserError(f"{prof.path}: no price_per_instance_hour, so no cost projection")
    rows = build_rows(runs, recipe, price)
    text = markdown(rows, recipe, price)
    if recipe is not None:
        text += ("\n" if text else "") + recipe_markdown(recipe, args.device, args.mfu, args.accelerators)
    print(text, end="")
    if args.markdown:
        atomic_write_text(args.markdown, text)
    if args.csv:
        atomic_write_text(args.csv, csv_text(rows))
    if args.json:
        atomic_write_json(args.json, rows)
    if args.plot:
        if not rows:
            raise UserError("--plot needs measured runs")
        plot(rows, args.plot)
    return 0
