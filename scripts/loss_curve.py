"""Record or check the expected loss curves of the CPU debug runs (tests/expected/loss_*_debug.json).

    python scripts/loss_curve.py               # build the data, run bert and neox, compare (exit 1: a miss)
    python scripts/loss_curve.py --model neox  # one model
    python scripts/loss_curve.py --record      # run on this CPU's kernels and on an emulated older ISA, run
                                               # the negative controls, rewrite the expected files

Every run is one ``python train.py`` process in fp32 with dropout off, fixed seeds, one intra-op thread and
gradient accumulation 2, on shards built from the real enwiki sample dump (the gensim wheel's) exactly as the
test fixtures build them. ``--record`` measures the spread between two instruction sets (the default kernels
and ``ISA_ENV``: ATen's generic kernels, oneDNN SSE4.1, MKL SSE4.2) and sets the tolerance to
``min(10 x spread, CONTROL_FRACTION x the smallest negative-control deviation)``; see docs/loss-curve.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPECTED_DIR = REPO / "tests" / "expected"
MODELS = ("bert", "neox")

# The emulated second instruction set: ATen's generic (non-vectorised) kernels, oneDNN capped at SSE4.1, MKL
# at SSE4.2. Read by the libraries at load time, so they go into the environment of the train.py process.
ISA_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "MKL_CBWR": "SSE4_2",
}
# Every curve run pins its kernels to AVX2, which every CI machine has (Intel AVX-512 and AMD AVX2 alike):
# ATen's vectorised kernels, oneDNN and MKL's code path (MKL_CBWR), so AVX-512 computes what AVX2 does.
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
SPREAD_FACTOR = 10.0  # the tolerance is at most this many times the measured spread
CONTROL_FRACTION = 0.5  # ... and at most this fraction of the smallest negative control's deviation
SPREAD_FLOOR = 2.0**-23  # float32's relative resolution: the spread used when the runs are bit-identical
STEPS = 16

# Data: text extracted as tests/conftest.py's wiki_text_dir fixture does it. BERT reads the real
# bert-base-uncased vocabulary (../shared/data, the shared_bert_vocab fixture), not one trained on the sample:
# data.vocab's WordPiece training is not reproducible from one process to the next (which of tied candidates
# it keeps, and their order, changes), so a trained vocabulary gives other shards, and another curve.
WIKI_SHARDS, WIKI_WORKERS, BPE_SIZE = 4, 2, 4000
BERT_VOCAB = REPO.parent / "shared" / "data" / "bert-base-uncased-vocab.txt"
SEQ_LEN, MAX_PRED, DUPE_FACTOR, BERT_DATA_SEED = 128, 20, 2, 12345

# Every setting that shapes the curve is pinned here rather than taken from configs/smoke.yaml, so that a
# change of the smoke recipe does not move the expected curve. fp32: no dependence on how a CPU does BF16.
COMMON = {
    "run.threads_per_rank": 1,
    "model.dropout": 0.0,
    "model.attention": "sdpa",
    "model.activation_checkpointing": False,
    "data.seq_len": SEQ_LEN,
    "data.num_workers": 1,
    "train.steps": STEPS,
    "train.global_batch": 16,
    "train.micro_batch": 8,  # gradient accumulation 2 on one rank
    "train.seed": 1234,
    "train.eval_every": 0,
    "train.deterministic": False,
    "train.stop_at_step": 0,
    "deepspeed.precision": "fp32",
    "deepspeed.zero_stage": 1,
    "deepspeed.grad_clip": 1.0,
    "deepspeed.offload_optimizer": False,
    "checkpoint.every": 0,
    "checkpoint.resume": "never",
    "logging.every": 1,
}
SETTINGS = {
    "bert": {
        **COMMON,
        "model.name": "bert-debug",
        "data.max_pred": MAX_PRED,
        "optimizer.name": "lans",
        "optimizer.lr": 2e-3,
        "optimizer.weight_decay": 0.01,
        "schedule.kind": "warmup_constant_decay",
        "schedule.warmup": 0.125,
        "schedule.constant": 0.25,
        "schedule.min_ratio": 0.0,
    },
    "neox": {
        **COMMON,
        "model.name": "neox-debug",
        "optimizer.name": "adamw",
        "optimizer.lr": 1e-3,
        "optimizer.weight_decay": 0.01,
        "schedule.kind": "cosine_warmup",
        "schedule.warmup": 0.125,
        "schedule.min_ratio": 0.1,
    },
}
# The negative controls: runs the comparison must reject. A dropped gradient-accumulation step is stood in
# for by global_batch 8 at the same micro-batch: one of the two micro-batches of every optimizer step is gone.
CONTROLS = {
    "lr_x2": lambda s: {"optimizer.lr": 2 * s["optimizer.lr"]},
    "dropped_accum_step": lambda s: {"train.global_batch": s["train.global_batch"] // 2},
}


# --------------------------------------------------------------------------- data


def build_text(out: Path) -> Path:
    from data.sample import sample_dump_path
    from data.wiki import extract_dump

    extract_dump([sample_dump_path()], out, workers=WIKI_WORKERS, shards=WIKI_SHARDS)
    return out


def build_bert(text_dir: Path, vocab: Path, root: Path) -> dict[str, Path]:
    """BERT seq-128 shards of every text shard (no eval set: the curve is the training loss)."""
    from data.bert import build_bert_shards

    build_bert_shards(
        text_dir, vocab, root / "bert", seq_len=SEQ_LEN, max_pred=MAX_PRED, dupe_factor=DUPE_FACTOR, seed=BERT_DATA_SEED
    )
    return {"train": root / "bert", "vocab": Path(vocab)}


def build_neox(text_dir: Path, root: Path) -> dict[str, Path]:
    """A byte-level BPE tokenizer trained on the sample and packed seq-128 windows of every text shard."""
    from data.gpt import build_gpt_shards
    from data.vocab import train_bpe

    root.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(Path(text_dir), root / "tokenizer.json", BPE_SIZE)
    build_gpt_shards(tok, root / "gpt", text=text_dir, seq_len=SEQ_LEN)
    return {"train": root / "gpt", "vocab": tok}


def shard_digest(directory: Path) -> str:
    """sha256 over the shards' content: names, attributes and every dataset's dtype, shape and values, to see
    that two builds are identical. Not the files' bytes: lzf's compressor may encode the same chunk
    differently from one process state to the next, which moves HDF5's metadata, not the data."""
    import hashlib

    import h5py
    import numpy as np

    h = hashlib.sha256()
    for p in sorted(Path(directory).rglob("*")):
        if not p.is_file() or p.name == "manifest.json":  # the manifest records build times
            continue
        h.update(p.relative_to(directory).as_posix().encode() + b"\0")
        if p.suffix != ".h5":
            h.update(p.read_bytes())
            continue
        with h5py.File(p, "r") as f:
            for k in sorted(f.attrs):
                h.update(f"{k}={f.attrs[k]!r}".encode() + b"\0")
            for name in sorted(f):
                a = np.ascontiguousarray(f[name][:])
                h.update(f"{name}:{a.dtype.str}:{a.shape}".encode() + b"\0" + a.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(settings: dict, data: dict[str, Path], run_dir: Path) -> list[str]:
    paths = {"run.dir": run_dir, "data.train": data["train"], "data.eval": "", "data.vocab": data["vocab"]}
    return [f"{k}={v}" for k, v in {**settings, **paths}.items()]


def train(
    settings: dict,
    data: dict[str, Path],
    run_dir: Path,
    env: dict[str, str] | None = None,
    timeout: int = 600,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> dict[int, float]:
    """One ``python train.py --config smoke ...`` process; returns its per-step losses. ``run``: what starts
    it, called as ``subprocess.run`` (the tests fork it from an interpreter that has imported torch)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update({"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        e.pop(k, None)
    e.update(PINNED_ENV)
    e.update(env or {})
    cmd = [sys.executable, "train.py", "--config", "smoke", *overrides(settings, data, run_dir)]
    res = run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"train.py exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return read_losses(run_dir)


def read_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def cpu_capability(env: dict[str, str] | None = None) -> str:
    """What ATen dispatches to in a process with ``env``: proof that ISA_ENV changes the kernel path."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    res = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **(env or {})}, capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


# --------------------------------------------------------------------------- comparison


def rel_diffs(expected: dict[int, float], actual: dict[int, float]) -> dict[int, float]:
    """Per-step |actual - expected| / |expected| over the expected steps (inf where a step is missing or
    its loss is not finite: a NaN compares false with any tolerance and must not pass)."""
    out = {}
    for s, e in expected.items():
        d = abs(actual[s] - e) / abs(e) if s in actual else float("inf")
        out[s] = d if math.isfinite(d) else float("inf")
    return out


def max_rel_diff(expected: dict[int, float], actual: dict[int, float]) -> float:
    return max(rel_diffs(expected, actual).values())


def compare(expected: dict, actual: dict[int, float]) -> list[str]:
    """The failures of ``actual`` against an expected file's content: empty when the curve matches."""
    want = {int(s): v for s, v in expected["losses"].items()}
    tol = expected["tolerance"]["max_rel_diff"]
    problems = []
    if sorted(actual) != sorted(want):
        problems.append(f"steps {sorted(actual)} != expected {sorted(want)}")
    for step, d in rel_diffs(want, actual).items():
        if d > tol:
            got = actual.get(step)
            problems.append(f"step {step}: loss {got} vs expected {want[step]} (rel diff {d:.3g} > tol {tol:.3g})")
    return problems


def load_expected(model: str) -> dict:
    return json.loads((EXPECTED_DIR / f"loss_{model}_debug.json").read_text())


def config_drift(expected: dict, run_dir: Path) -> list[str]:
    """Keys of the resolved config that differ from the recorded one (paths aside): a hint for a miss."""
    now = json.loads((Path(run_dir) / "config.json").read_text())
    out = []
    for section, values in expected["resolved_config"].items():
        for key, v in values.items():
            if now.get(section, {}).get(key, v) != v:
                out.append(f"{section}.{key}: recorded {v!r}, now {now[section][key]!r}")
    return out


# --------------------------------------------------------------------------- record


def run_variants(model: str, data: dict[str, Path], work: Path) -> dict[str, dict[int, float]]:
    """The recording runs: default kernels, the emulated ISA, two threads, and the negative controls."""
    settings = SETTINGS[model]
    return {
        "default": train(settings, data, work / f"{model}-default"),
        "isa": train(settings, data, work / f"{model}-isa", env=ISA_ENV),
        "threads2": train(
            {**settings, "run.threads_per_rank": 2}, data, work / f"{model}-threads2", env={"OMP_NUM_THREADS": "2"}
        ),
        **{
            name: train({**settings, **change(settings)}, data, work / f"{model}-{name}")
            for name, change in CONTROLS.items()
        },
    }


def record(model: str, curves: dict[str, dict[int, float]], work: Path, digest: str) -> dict:
    """The expected file's content from ``run_variants``' curves (run directories under ``work``)."""
    from common.packages import installed_version

    settings, base = SETTINGS[model], curves["default"]
    isa_spread, thread_spread = max_rel_diff(base, curves["isa"]), max_rel_diff(base, curves["threads2"])
    controls = {name: max_rel_diff(base, curves[name]) for name in CONTROLS}
    # A spread of 0 (bit-identical runs) says only that no difference reached the float32 loss: the spread
    # used is then one float32 unit of relative resolution, the smallest difference a kernel change can make.
    spread_used = max(isa_spread, thread_spread) or SPREAD_FLOOR
    tol = min(SPREAD_FACTOR * spread_used, CONTROL_FRACTION * min(controls.values()))
    seconds = json.loads((work / f"{model}-default" / "summary.json").read_text())["wall_time_s"]
    resolved = json.loads((work / f"{model}-default" / "config.json").read_text())
    for section, key in (("run", "dir"), ("data", "train"), ("data", "eval"), ("data", "vocab")):
        resolved[section].pop(key, None)
    return {
        "model": model,
        "what": "per-step training loss of train.py: see scripts/loss_curve.py, docs/loss-curve.md",
        "overrides": settings,
        "data": {
            "wiki_shards": WIKI_SHARDS,
            "seq_len": SEQ_LEN,
            **(
                {
                    "vocab": BERT_VOCAB.name,
                    "max_pred": MAX_PRED,
                    "dupe_factor": DUPE_FACTOR,
                    "seed": BERT_DATA_SEED,
                }
                if model == "bert"
                else {"bpe_size": BPE_SIZE}
            ),
            "shards_sha256": digest,
        },
        "losses": {str(s): v for s, v in sorted(base.items())},
        "tolerance": {
            "max_rel_diff": round_down(tol),
            "metric": "max over steps of |loss - expected| / |expected|",
            "isa_spread": isa_spread,
            "isa_sides": {"a": cpu_capability(), "b": cpu_capability(ISA_ENV), "b_env": ISA_ENV},
            "thread_spread": thread_spread,
            "spread_floor": SPREAD_FLOOR,
            "spread_used": spread_used,
            "spread_factor": SPREAD_FACTOR,
            "control_fraction": CONTROL_FRACTION,
            "controls_max_rel_diff": controls,
            "rule": "min(factor x spread_used, fraction x min(controls)); used = max(spreads) or floor",
        },
        "recorded_on": {
            "torch": installed_version("torch"),
            "deepspeed": installed_version("deepspeed"),
            "seconds_per_run": round(seconds, 1),
        },
        "resolved_config": resolved,
    }


def round_down(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits, never above ``x`` (a tolerance must not grow by rounding)."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale) / scale


def build_all(work: Path, models: list[str]) -> tuple[dict[str, dict[str, Path]], dict[str, str]]:
    text = build_text(work / "text")
    data, digests = {}, {}
    if "bert" in models:
        if not BERT_VOCAB.is_file():
            raise SystemExit(f"the real BERT vocabulary is not at {BERT_VOCAB}")
        data["bert"] = build_bert(text, BERT_VOCAB, work)
        digests["bert"] = shard_digest(data["bert"]["train"])
    if "neox" in models:
        data["neox"] = build_neox(text, work / "neox")
        digests["neox"] = shard_digest(data["neox"]["train"])
    return data, digests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--record", action="store_true", help="measure the spread, run the controls, rewrite the files")
    p.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    models = list(MODELS) if args.model == "all" else [args.model]
    with tempfile.TemporaryDirectory(prefix="loss-curve-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, digests = build_all(work, models)
        failed = False
        for model in models:
            if args.record:
                rec = record(model, run_variants(model, data[model], work), work, digests[model])
                EXPECTED_DIR.mkdir(parents=True, exist_ok=True)
                dest = EXPECTED_DIR / f"loss_{model}_debug.json"
                dest.write_text(json.dumps(rec, indent=1) + "\n")
                t = rec["tolerance"]
                print(
                    f"{model}: wrote {dest.relative_to(REPO)}: isa spread {t['isa_spread']:.3g}, thread "
                    f"spread {t['thread_spread']:.3g}, controls {t['controls_max_rel_diff']}, "
                    f"tol {t['max_rel_diff']}"
                )
                continue
            expected = load_expected(model)
            if digests[model] != expected["data"]["shards_sha256"]:
                print(f"{model}: note: the shards differ from the recorded build's")
            run_dir = work / f"{model}-check"
            actual = train(SETTINGS[model], data[model], run_dir)
            problems = compare(expected, actual)
            worst = max_rel_diff({int(s): v for s, v in expected["losses"].items()}, actual)
            if problems:
                failed = True
                print(f"{model}: FAIL (max rel diff {worst:.3g})\n  " + "\n  ".join(problems))
                for d in config_drift(expected, run_dir):
                    print(f"  config drift: {d}")
            else:
                print(f"{model}: ok (max rel diff {worst:.3g} <= {expected['tolerance']['max_rel_diff']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
