"""Scaling report: the table published BERT results use, from the ``summary.json`` of each run.

Runs are grouped by ``fingerprint`` (``training.metrics.config_fingerprint``: the resolved configuration minus the
keys that change with scale; threads per rank stays in, so CPU runs with different thread counts never compare).
In each group the *baseline* is the run with the fewest accelerators (ties: the first by path); every other run's
scaling efficiency is ``training.metrics.scaling_efficiency`` of its per-accelerator sequences/s against the
baseline's. A group with one size has no baseline and says so; no 100% is invented.

Projections (``--recipe``): the samples a recipe trains (sum over its phase YAMLs of ``train.steps`` x
``train.global_batch``) divided by a run's measured sequences/s give the projected wall time, times its
accelerators the accelerator-hours, times its nodes and the profile's ``price_per_instance_hour`` the cost.
The projection applies the run's measured sequences/s to every recipe sample: a phase with another sequence
length than the run (BERT phase 2 at 512 vs a 128-token run) is flagged, because its real cost per sample is higher.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.atomic import atomic_path, atomic_write_json, atomic_write_text
from common.errors import UserError
from training.metrics import scaling_efficiency

REQUIRED_KEYS = ("fingerprint", "device_count", "sequences_per_sec", "sequences_per_sec_per_device")


@dataclass
class Run:
    path: Path  # the summary.json
    summary: dict[str, Any]

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def devices(self) -> int:
        return int(self.summary["device_count"])

    @property
    def nodes(self) -> int:
        return int(self.summary.get("nodes", 1) or 1)

    @property
    def per_device(self) -> float:
        return float(self.summary["sequences_per_sec_per_device"])


def load_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read summary ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: summary is not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise UserError(f"{path}: summary lacks {', '.join(missing)}")
    for key in REQUIRED_KEYS[1:]:
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UserError(f"{path}: {key} must be a positive number (got {v!r})")
    return data


def find_runs(roots: list[Path]) -> list[Run]:
    """Every ``summary.json`` under the given directories (or the files themselves), sorted by path."""
    paths: set[Path] = set()
    for root in roots:
        if root.is_file() and root.name == "summary.json":
            paths.add(root.resolve())
        elif root.is_dir():
            paths.update(p.resolve() for p in root.rglob("summary.json"))
        else:
            raise UserError(f"{root}: no such run directory")
    return [Run(p, load_summary(p)) for p in sorted(paths)]


def group_runs(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(str(r.summary["fingerprint"]), []).append(r)
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


@dataclass(frozen=True)
class Recipe:
    """Samples to train, by phase, read from the recipe YAMLs (``train.steps``, ``train.global_batch``)."""

    phases: tuple[tuple[str, int, int, int | None], ...]  # (file, steps, global_batch, seq_len or None)

    @property
    def samples(self) -> int:
        return sum(steps * gb for _, steps, gb, _ in self.phases)


def _get(d: dict[str, Any], dotted: str) -> Any:
    cur: Any = d
    for k in dotted.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def load_recipe(paths: list[str]) -> Recipe:
    phases = []
    for p in paths:
        path = Path(p)
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"recipe {path}: cannot read ({str(e).splitlines()[0]})") from None
        if not isinstance(cfg, dict):
            raise UserError(f"recipe {path}: expected a mapping")
        vals = {}
        for key in ("train.steps", "train.global_batch"):
            v = _get(cfg, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"recipe {path}: {key} must be a positive integer (got {v!r})")
            vals[key] = v
        seq = next(
            (_get(cfg, k) for k in ("data.seq_len", "train.seq_len", "model.seq_len") if _get(cfg, k)), None
        )
        phases.append((str(path), vals["train.steps"], vals["train.global_batch"], seq))
    return Recipe(tuple(phases))


def _fmt_hours(h: float) -> str:
    if h >= 48:
        return f"{h / 24:,.1f} d"
    if h >= 1:
        return f"{h:,.1f} h"
    return f"{h * 60:,.1f} min"


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
            wall = s.get("wall_time_s")
            row: dict[str, Any] = {
                "fingerprint": fp,
                "run": str(r.dir),
                "model": s.get("model"),
                "device_kind": s.get("device_kind"),
                "nodes": r.nodes,
                "accelerators": r.devices,
                "threads_per_rank": s.get("threads_per_rank"),
                "global_batch": s.get("global_batch"),
                "seq_len": s.get("seq_len"),
                "sequences_per_sec": float(s["sequences_per_sec"]),
                "sequences_per_sec_per_accelerator": r.per_device,
                "tokens_per_sec_per_accelerator": s.get("tokens_per_sec_per_device"),
                "scaling_efficiency": eff,
                "baseline_run": str(base.dir) if base is not None else None,
                "is_baseline": base is not None and r is base,
                "wall_time_s": wall,
                "accelerator_hours": r.devices * float(wall) / 3600 if wall is not None else None,
            }
            if recipe is not None:
                hours = recipe.samples / row["sequences_per_sec"] / 3600
                row["projected_hours"] = hours
                row["projected_accelerator_hours"] = hours * r.devices
                row["projection_seq_len_mismatch"] = any(
                    seq is not None and s.get("seq_len") is not None and seq != s.get("seq_len")
                    for _, _, _, seq in recipe.phases
                )
                row["projected_cost"] = (
                    hours * r.nodes * price_per_instance_hour if price_per_instance_hour else None
                )
            rows.append(row)
    return rows


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
        cols = ["nodes", "accelerators", "sequences/s", "sequences/s per accelerator", "scaling efficiency"]
        cols += ["accelerator-hours (run)"]
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
                eff_s,
                "n/a" if ah is None else f"{ah:.4f}",
            ]
            if recipe is not None:
                flag = " *" if row["projection_seq_len_mismatch"] else ""
                cells += [
                    _fmt_hours(row["projected_hours"]) + flag,
                    f"{row['projected_accelerator_hours']:,.0f}",
                ]
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
    if recipe is not None:
        phases = "; ".join(f"{Path(f).name}: {st:,} steps x {gb:,}" for f, st, gb, _ in recipe.phases)
        out.write(f"Recipe: {recipe.samples:,} samples ({phases}).")
        if price:
            out.write(f" Cost at ${price:,.2f} per instance-hour.")
        if any(r.get("projection_seq_len_mismatch") for r in rows):
            out.write(
                " `*`: the recipe has phases at another sequence length than the measured run; the projection "
                "applies the run's sequences/s to them and underestimates longer sequences."
            )
        out.write("\n")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eff, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["fingerprint"], []).append(row)
    for fp, grp in groups.items():
        label = f"{grp[0]['model'] or 'run'} [{fp[:8]}]"
        x = [r["accelerators"] for r in grp]
        ax_tp.plot(x, [r["sequences_per_sec"] for r in grp], "o-", label=label)
        pts = [
            (r["accelerators"], r["scaling_efficiency"] * 100)
            for r in grp
            if r["scaling_efficiency"] is not None
        ]
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


def annotate_efficiency(run_dir: Path, runs_root: Path) -> float | None:
    """Write ``scaling_efficiency`` and ``baseline_run`` into ``run_dir/summary.json`` when a baseline exists.

    train.py calls this at the end of a run: the baseline is the run of the same fingerprint under
    ``runs_root`` with the fewest accelerators, and it must have fewer than this run (a run is not its own
    baseline). Returns the efficiency, or None (summary left untouched) when there is no baseline.
    """
    own = Path(run_dir) / "summary.json"
    summary = load_summary(own)
    runs = [r for r in find_runs([Path(runs_root)]) if r.summary["fingerprint"] == summary["fingerprint"]]
    me = Run(own.resolve(), summary)
    smaller = [r for r in runs if r.devices < me.devices and r.path != me.path]
    if not smaller:
        return None
    base = min(smaller, key=lambda r: (r.devices, str(r.path)))
    eff = scaling_efficiency(me.per_device, base.per_device)
    summary["scaling_efficiency"] = eff
    summary["baseline_run"] = str(base.dir)
    atomic_write_json(own, summary)
    return eff


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (searched recursively for summary.json)")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    parser.add_argument("--csv", default=None, help="also write one CSV row per run here")
    parser.add_argument("--plot", default=None, help="PNG of efficiency and throughput against accelerators")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--recipe", default=None, help="comma list of recipe YAMLs (phases) to project time and cost for"
    )
    parser.add_argument(
        "--profile", default=None, help="cluster profile (name or YAML) with price_per_instance_hour"
    )


def run(args: argparse.Namespace) -> int:
    runs = find_runs([Path(p) for p in args.runs])
    if not runs:
        raise UserError(f"no summary.json under {', '.join(args.runs)}")
    recipe = load_recipe([p for p in args.recipe.split(",") if p.strip()]) if args.recipe else None
    price = None
    if args.profile:
        from launch.profiles import load_profile

        prof = load_profile(args.profile)
        price = prof.price_per_instance_hour
        if price is None:
            raise UserError(f"{prof.path}: no price_per_instance_hour, so no cost projection")
    rows = build_rows(runs, recipe, price)
    text = markdown(rows, recipe, price)
    print(text, end="")
    if args.markdown:
        atomic_write_text(args.markdown, text)
    if args.csv:
        atomic_write_text(args.csv, csv_text(rows))
    if args.json:
        atomic_write_json(args.json, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0
