"""Training throughput (CPU; the GPU rows with ``--rows``): our ``train.py`` (DeepSpeed, BF16, sparse MLM
head) beside Hugging Face ``Trainer``.

Same machine, same run, same HDF5 shards (built from the enwiki sample with our CLIs), same model shapes
(``model.bert.hf_config`` / ``model.neox.hf_config`` of the registry size), same micro and global batch,
sequence length, BF16, AdamW (the Trainer's default optimizer, ``adamw_torch_fused``; ours is torch AdamW
(foreach) under DeepSpeed's BF16 optimizer), lr 5e-4, 10% linear warm-up then cosine to 0, weight decay
0.01, gradient clipping 1.0, one DataLoader worker, one process with the same torch thread count.

* ours: ``train.py`` on one process (DeepSpeed ZeRO stage 0, which runs as stage 1 under BF16), started
  through ``benchmarks/bench_train_ours.py`` (train.py's start, ``training.start.run``, unchanged, plus the CPU
  time of its throughput window); the figure is ``sequences_per_sec`` of RUN_DIR/summary.json (steps after
  ``--warmup`` excluded); MFU against the CPU matmul peak ``train.py`` uses (``peak_flops_per_device``: the
  fastest of the run's compute dtypes, cached).
* peer: ``benchmarks/bench_train_hf.py``: ``Trainer`` with ``BertForPreTraining`` (MLM head over every
  position) or ``GPTNeoXForCausalLM`` (``labels=input_ids``), timed by a callback from the end of step
  ``--warmup`` to the end of the last step.

Both sides also report sequences per CPU-second of the training process over the same window: with other jobs
on the same cores, wall-clock figures swing by 2x between runs, CPU-time figures much less. One thread per
process by default: on 2 shared cores, 2 torch threads ran ~10x slower than 1 (OpenMP barriers waiting for a
descheduled thread).

Each (model, side) is measured ``--repeats`` times, the two sides interleaved with alternating order (other
processes share the CPU); the table shows the medians. Targets (from the issue): BERT >= 1.5x, GPT-NeoX >= 1x.

    python benchmarks/bench_train.py                               # 3 models x 2 sides x 2 repeats, ~6 min
    idle
    python benchmarks/bench_train.py --models bert-debug --repeats 3 --two-ranks
    python benchmarks/bench_train.py --peer-site /tmp/peers/hf_trainer/site   # accelerate installed there

Toy size (CI, seconds, not a measurement): ``--models bert-debug --steps 2 --warmup 1 --repeats 1
--micro-batch 2 --global-batch 4``.

GPU rows (``--rows``, on one GPU; ``--tiny``: the same rows at debug sizes on CPU, a smoke test, not a
measurement). Each row is a shipped recipe (configs/) run by ours with each of its optimizers and by the
Trainer (BF16 autocast, SDPA, fused AdamW; ``--peer-compile``: its ``torch_compile``) on the same shards,
sequence length, micro-batch and global batch; ``--largest`` then doubles each side's micro-batch until it runs
out of device memory (``--largest-cap``):

* ``bert-large-p1``: configs/bert-large-phase1.yaml (seq 128, max_pred 20), LAMB (the recipe's) and LANS,
  ZeRO-1, micro-batch 64, global 1024;
* ``bert-large-p2``: configs/bert-large-phase2.yaml (seq 512, max_pred 80, from scratch, not from phase 1),
  LAMB and LANS, ZeRO-1, micro-batch 16, global 256;
* ``neox-1.3b``: configs/neox-1.3b.yaml (seq 2048), AdamW, ZeRO-1, micro-batch 8, global 32.

Per run, a record (``--records``: one JSON line appended the moment the run ends, whatever its status: ``ok``,
``oom``, ``timeout`` past ``--timeout``, ``failed``): row, side, optimizer, micro-batch, global batch, measured
steps, sequences/s, tokens/s and MFU (ours: its summary.json, real tokens only; the Trainer: every position it
computes, dense MLM head, under the same FLOP convention, ``model.flops``), peak device memory, the attention
kernel that ran, host syncs per measured step (CUDA's sync debug mode; none on CPU), the mean optimizer-step
time, the wall seconds and the command. Timed runs make no checkpoint saves (``checkpoint.final_save=false``;
``benchmarks/bench_checkpoint_stall.py`` measures the stall). ``--only`` picks runs (``ours:lans``, ``peer``,
``profile``: ours under ``torch.profiler``, the top kernels and the share neither matmul nor attention, in
``--profile-out``); ``--data-only`` builds the shards. ``scripts/gpu.sh`` runs them one at a time against its
calls' deadlines with the bundle's real vocabulary and tokenizer; $WIKIPRETRAIN_DEVICE_MEMORY_GIB caps both
sides.

    python benchmarks/bench_train.py --rows bert-large-p1 --only ours:lans,peer --vocab V --records rows.jsonl
    python benchmarks/bench_train.py --tiny                                                         # CPU, ~1 min

``Trainer`` needs ``accelerate`` (>= 1.1), which the project itself does not use (the ``bench`` and ``dev``
extras install it): ``pip install accelerate``, or ``pip install --no-deps --target DIR accelerate`` and
``--peer-site DIR`` (only the peer's process sees it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from common.errors import UserError, run_cli
from common.log import get_logger
from common.packages import python_path

REPO = Path(__file__).resolve().parents[1]

log = get_logger("bench_train")

TARGET_RATIO = {"bert": 1.5, "neox": 1.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/bench_train", help="text, vocabularies, shards, runs, logs (reused)")
    p.add_argument("--models", default="bert-debug,bert-10m,neox-debug", help="comma-separated registry names")
    p.add_argument("--steps", type=int, default=None, help="measured optimizer steps (after --warmup; 30, rows 10)")
    p.add_argument("--warmup", type=int, default=None, help="optimizer steps excluded from the timing (5, rows 3)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per (model, side); the median is shown")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (and OMP_NUM_THREADS), both")
    p.add_argument("--micro-batch", type=int, default=None, help="8; rows: the row's")
    p.add_argument("--global-batch", type=int, default=None, help="32; rows: the row's")
    p.add_argument("--bert-seq", type=int, default=128, help="BERT sequence length (shards built for it)")
    p.add_argument("--max-pred", type=int, default=20, help="BERT masked positions per sequence")
    p.add_argument("--gpt-seq", type=int, default=128, help="GPT-NeoX sequence length (shards built for it)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--two-ranks", action="store_true", help="also run ours on 2 DeepSpeed ranks x 1 thread")
    p.add_argument("--port", type=int, default=29850, help="first MASTER_PORT; each of our runs takes the next")
    p.add_argument("--peer-site", default=None, help="extra PYTHONPATH entry for the peer (where accelerate is)")
    p.add_argument("--rebuild", action="store_true", help="rebuild text, vocabularies and shards")
    p.add_argument("--json", default=None, help="also write every measurement and the medians to this file")
    rows = p.add_argument_group("GPU rows (--rows / --tiny; see the module docstring)")
    rows.add_argument("--rows", default=None, help=f"'all' or comma-separated: {', '.join(ROWS)}")
    rows.add_argument("--tiny", action="store_true", help="the rows at debug sizes on CPU (CI; not a measurement)")
    rows.add_argument("--largest", action="store_true", help="also each side's largest micro-batch that fits")
    rows.add_argument("--largest-cap", type=int, default=1024, help="stop the largest-micro search here")
    rows.add_argument("--peer-compile", action="store_true", help="the Trainer with torch_compile=True")
    rows.add_argument("--vocab", default=None, help="BERT vocab.txt (default: built from the sample)")
    rows.add_argument("--tokenizer", default=None, help="GPT-NeoX tokenizer.json (default: built from the sample)")
    rows.add_argument(
        "--jobs", type=int, default=None, help="runs at once (1; --tiny: 2, not a measurement; never on a GPU)"
    )
    rows.add_argument(
        "--only",
        default=None,
        help="these runs of each row only, comma-separated: ours:OPTIMIZER (ours: the row's last), peer, profile "
        "(train.py under torch.profiler: the top kernels and the time outside matmuls and attention)",
    )
    rows.add_argument("--records", default=None, help="append one JSON line per run to this file as each run ends")
    rows.add_argument("--timeout", type=float, default=None, help="cut each run after this many seconds")
    rows.add_argument("--profile-out", default=None, help="--only profile: write the profile's tables here")
    rows.add_argument("--data-only", action="store_true", help="build (or reuse) the rows' shards, run nothing")
    args = p.parse_args(argv)
    rows_mode = bool(args.rows or args.tiny)
    for key, plain, in_rows in (
        ("steps", 30, 10),
        ("warmup", 5, 3),
        ("micro_batch", 8, None),
        ("global_batch", 32, None),
    ):
        if getattr(args, key) is None:
            setattr(args, key, in_rows if rows_mode else plain)
    if rows_mode:
        return args
    for key in (
        "steps",
        "warmup",
        "repeats",
        "threads",
        "micro_batch",
        "global_batch",
        "bert_seq",
        "gpt_seq",
    ):
        if getattr(args, key) <= 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.global_batch % args.micro_batch:
        raise UserError(f"--global-batch={args.global_batch} is not a multiple of --micro-batch={args.micro_batch}")
    if args.two_ranks and args.global_batch % (2 * args.micro_batch):
        raise UserError(f"--two-ranks: --global-batch={args.global_batch} is not a multiple of 2 x --micro-batch")
    return args


def subprocess_env(threads: int, extra_path: str | None = None) -> dict[str, str]:
    """The project importable, thread counts pinned, no hub access."""
    env = dict(os.environ)
    env["PYTHONPATH"] = python_path(str(REPO), extra_path or "")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


class RunFailed(UserError):
    """A measured command that failed (``status`` ``failed``) or was cut at its time limit (``timeout``)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str], what: str, timeout: float | None = None) -> float:
    """Run a command with its output in ``log_path``, in a session of its own so that ``timeout`` (seconds)
    ends it with everything it started (a launcher's ranks: SIGTERM, SIGKILL 10 s later); a failure or a cut
    names the log (:class:`RunFailed`). Returns the wall time."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            raise RunFailed(f"{what} cut at its time limit of {timeout:.0f}s; see {log_path}", "timeout") from None
    if rc != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise RunFailed(
            f"{what} failed with exit code {rc} ({tail[0] if tail else 'no output'}); see {log_path}", "failed"
        )
    return time.perf_counter() - t0


def _end_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s process group at once: a measured run is disposable, and a SIGTERM would have
    train.py save its state first (seconds to minutes on a GPU, gigabytes written) past the run's limit."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ----------------------------------------------------------------------------------------------- data


def build_data(
    work: Path,
    args: argparse.Namespace,
    kinds: tuple[str, ...] = ("bert", "gpt"),
    vocab: str | None = None,
    tokenizer: str | None = None,
) -> dict[str, Path]:
    """Text, then for BERT (``kinds``) a WordPiece vocab (or ``vocab``) and shards, for GPT a BPE tokenizer
    (or ``tokenizer``) and shards, from the enwiki sample (reused when present)."""
    from data.sample import sample_dump_path

    py = sys.executable
    env = subprocess_env(1)
    paths = {
        "text": work / "text",
        "vocab": Path(vocab).resolve() if vocab else work / "vocab.txt",
        "tokenizer": Path(tokenizer).resolve() if tokenizer else work / "tokenizer.json",
        "bert": work / f"bert{args.bert_seq}-p{args.max_pred}{'-' + Path(vocab).stem if vocab else ''}",
        "gpt": work / f"gpt{args.gpt_seq}{'-' + Path(tokenizer).stem if tokenizer else ''}",
    }
    for given in (vocab, tokenizer):
        if given and not Path(given).is_file():
            raise UserError(f"{given}: no such vocabulary/tokenizer file")
    steps = [
        (
            "text",
            [
                py,
                "-m",
                "data",
                "wiki",
                str(sample_dump_path()),
                "--out",
                str(paths["text"]),
                "--workers",
                "2",
            ],
        ),
        (
            "vocab",
            [py, "-m", "data", "vocab", str(paths["text"]), "--out", str(paths["vocab"]), "--size", "8000"],
        ),
        (
            "tokenizer",
            [py, "-m", "data", "vocab", str(paths["text"]), "--out", str(paths["tokenizer"])]
            + ["--size", "8000", "--kind", "bpe"],
        ),
        (
            "bert",
            [py, "-m", "data", "bert", "--text", str(paths["text"]), "--vocab", str(paths["vocab"])]
            + ["--out", str(paths["bert"]), "--seq-len", str(args.bert_seq), "--max-pred", str(args.max_pred)]
            + ["--workers", "2", "--no-progress"],
        ),
        (
            "gpt",
            [py, "-m", "data", "gpt", "--text", str(paths["text"]), "--tokenizer", str(paths["tokenizer"])]
            + ["--out", str(paths["gpt"]), "--seq-len", str(args.gpt_seq), "--workers", "2", "--no-progress"],
        ),
    ]
    wanted = set()
    if "bert" in kinds:
        wanted |= {"bert"} | (set() if vocab else {"vocab"})
    if "gpt" in kinds:
        wanted |= {"gpt"} | (set() if tokenizer else {"tokenizer"})

    def done(name: str) -> bool:
        out = paths[name]
        return not args.rebuild and ((out / "manifest.json").exists() if out.suffix == "" else out.exists())

    if not all(done(name) for name in wanted):  # the text only where something is built from it
        wanted.add("text")
    for name, cmd in steps:
        if name not in wanted or done(name):
            continue
        out = paths[name]
        cmd = cmd + ["--overwrite"] if name in ("text", "bert", "gpt") else cmd
        dt = run_logged(cmd, work / "logs" / f"data-{name}.log", env, f"python -m data {cmd[3]} ({name})")
        log.info(f"built {name}: {out} ({dt:.1f}s)")
    return paths


# ----------------------------------------------------------------------------------------------- runs


class Ports:
    """Distinct MASTER_PORTs for our runs, so that no two of them (nor a stale one) collide."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def our_overrides(model: str, family: str, paths: dict[str, Path], run_dir: Path, args, steps: int) -> list[str]:
    """train.py overrides that match the peer's settings (no --config: every setting given here)."""
    bert = family == "bert"
    return [
        f"run.dir={run_dir}",
        f"run.threads_per_rank={args.threads}",
        f"model.name={model}",
        f"data.train={paths['bert' if bert else 'gpt']}",
        f"data.vocab={paths['vocab' if bert else 'tokenizer']}",
        f"data.seq_len={args.bert_seq if bert else args.gpt_seq}",
        f"data.max_pred={args.max_pred}",
        "data.num_workers=1",
        "optimizer.name=adamw",
        f"optimizer.lr={args.lr}",
        "optimizer.eps=1e-6",
        "optimizer.weight_decay=0.01",
        "schedule.kind=cosine_warmup",
        "schedule.warmup=0.1",
        "schedule.min_ratio=0.0",
        f"train.steps={steps}",
        f"train.micro_batch={args.micro_batch}",
        f"train.global_batch={args.global_batch}",
        "train.eval_every=0",
        "deepspeed.zero_stage=0",
        "deepspeed.precision=bf16",
        "deepspeed.grad_clip=1.0",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        f"logging.warmup_steps={args.warmup}",
        f"logging.every={steps}",
    ]


def run_ours(
    model: str,
    family: str,
    paths: dict[str, Path],
    args,
    tag: str,
    ports: Ports,
    ranks: int = 1,
    extra: tuple[str, ...] = (),
) -> dict:
    """One train.py run (1 process, or ``ranks`` under the deepspeed launcher) with ``extra`` overrides; its
    summary.json."""
    work = Path(args.work)
    run_dir = work / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)  # never resume an earlier measurement
    steps = args.warmup + args.steps
    overrides = our_overrides(model, family, paths, run_dir, args if ranks == 1 else _one_thread(args), steps)
    overrides += extra
    port = ports.take()
    env = subprocess_env(args.threads if ranks == 1 else 1)
    env["MASTER_PORT"] = str(port)
    script = str(REPO / "benchmarks" / "bench_train_ours.py")  # train.py + the window's CPU time
    if ranks == 1:
        cmd = [sys.executable, script, *overrides]
    else:
        launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
        cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(port), script, *overrides]
    wall = run_logged(cmd, work / "logs" / f"{tag}.log", env, f"train.py ({tag})")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    keep = (
        "sequences_per_sec",
        "tokens_per_sec",
        "mfu",
        "peak_flops_per_device",
        "flops_per_token",
        "threads_per_rank",
        "world_size",
        "measured_steps",
        "data_wait_fraction",
        "padding_fraction",
        "first_step_s",
        "final_loss",
    )
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    rec = {**{k: summary.get(k) for k in keep}, "wall_s": wall}
    cpu_file = run_dir / "bench_cpu.json"
    if cpu_file.exists():
        cpu_s = json.loads(cpu_file.read_text(encoding="utf-8"))["cpu_s"]
        rec["cpu_seconds"] = cpu_s
        rec["sequences_per_cpu_sec"] = summary["measured_steps"] * args.global_batch / ranks / cpu_s
    return rec


def _one_thread(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "threads": 1})


def run_peer(model: str, family: str, paths: dict[str, Path], args, tag: str) -> dict:
    """One Hugging Face Trainer run (benchmarks/bench_train_hf.py); its JSON record."""
    from model.registry import FAMILIES

    work = Path(args.work)
    out = work / "runs" / f"{tag}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_train_hf.py"),
        "--model",
        model,
        "--data",
        str(paths[FAMILIES[family].format.name]),
        "--steps",
        str(args.warmup + args.steps),
        "--warmup",
        str(args.warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
        "--lr",
        str(args.lr),
        "--threads",
        str(args.threads),
        "--workers",
        "1",
        "--out",
        str(out),
    ]
    env = subprocess_env(args.threads, args.peer_site)
    wall = run_logged(cmd, work / "logs" / f"{tag}.log", env, f"Hugging Face Trainer ({tag})")
    return {**json.loads(out.read_text(encoding="utf-8")), "wall_s": wall}


def check_peer_available(peer_site: str | None) -> None:
    """Fail before any measurement when the peer cannot run (Trainer needs accelerate)."""
    if peer_site:
        if not (Path(peer_site) / "accelerate").is_dir():
            raise UserError(f"--peer-site {peer_site} holds no accelerate package (pip install --target it)")
        return
    if importlib.util.find_spec("accelerate") is None:
        raise UserError(
            "the peer (transformers.Trainer) needs accelerate>=1.1.0: pip install accelerate, or "
            "pip install --no-deps --target DIR accelerate and pass --peer-site DIR"
        )


# ----------------------------------------------------------------------------------------------- report


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _runs(xs: list[float]) -> str:
    return f"{median(xs):.1f} ({', '.join(f'{x:.1f}' for x in xs)})"


def verdict(ratios: list[float], target: float) -> str:
    """ok when wall-clock and CPU-time ratios both meet the target, MISSED when both fall short."""
    met = [r >= target for r in ratios if r == r]  # NaN (no CPU figure) does not vote
    return f">= {target:.1f}x " + ("ok" if all(met) else "MISSED" if not any(met) else "mixed")


def table(rows: list[dict], args: argparse.Namespace) -> str:
    """Markdown table; medians with the individual runs in parentheses."""
    head = ["model", "seq", "micro x accum", "ours seq/s", "peer seq/s", "ratio"]
    head += ["ours seq/CPU-s", "peer seq/CPU-s", "CPU ratio", "target", "our MFU", "CPU matmul peak"]
    if args.two_ranks:
        head.append("ours 2 ranks x 1 thread seq/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r["model"],
            str(r["seq"]),
            f"{args.micro_batch} x {args.global_batch // args.micro_batch}",
            _runs(r["ours_runs"]),
            _runs(r["peer_runs"]),
            f"{r['ratio']:.2f}x",
            _runs(r["ours_cpu_runs"]),
            _runs(r["peer_cpu_runs"]),
            f"{r['cpu_ratio']:.2f}x",
            verdict([r["ratio"], r["cpu_ratio"]], r["target"]),
            f"{100 * r['mfu']:.2f}%",
            f"{r['peak'] / 1e12:.2f} TFLOP/s",
        ]
        if args.two_ranks:
            cells.append(_runs(r["ours2_runs"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ GPU rows


@dataclass(frozen=True)
class Row:
    """One workload of ``--rows``: the shipped recipe, ours with each of its optimizers beside the Trainer."""

    config: str
    """The shipped recipe (configs/), which sets ZeRO, precision, schedule and the optimizer's settings."""
    model: str
    tiny_model: str
    seq: int
    tiny_seq: int
    max_pred: int
    optimizers: tuple[str, ...]
    micro: int
    """The micro-batch both sides run at (the largest-micro search starts from it)."""
    global_batch: int


ROWS = {
    # bert-large phase 1 and 2: the recipe's LAMB and our LANS, ZeRO-1, BF16
    "bert-large-p1": Row("bert-large-phase1", "bert-large", "bert-debug", 128, 128, 20, ("lamb", "lans"), 64, 1024),
    "bert-large-p2": Row("bert-large-phase2", "bert-large", "bert-debug", 512, 512, 80, ("lamb", "lans"), 16, 256),
    # neox-1.3b: AdamW, ZeRO-1, BF16
    "neox-1.3b": Row("neox-1.3b", "neox-1.3b", "neox-debug", 2048, 128, 0, ("adamw",), 8, 32),
}
TINY = {"micro": 2, "global_batch": 4, "steps": 2, "warmup": 1}
"""``--tiny``: the rows at debug sizes on CPU, a smoke test of the whole path (CI), not a measurement."""


def on_gpu(args: argparse.Namespace) -> bool:
    """Whether the rows run on a GPU: ``--rows`` where torch sees one; ``--tiny`` always on CPU."""
    import torch

    return not args.tiny and torch.cuda.is_available()


def gpu_index() -> str:
    """The one GPU both sides run on: the first of ``CUDA_VISIBLE_DEVICES``, else 0."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[0] if visible else "0"


def row_env(args: argparse.Namespace, extra_path: str | None = None) -> dict[str, str]:
    """A run's environment: one GPU for either side (the Trainer would take every visible GPU), none for
    ``--tiny`` (CPU even on a GPU machine)."""
    env = subprocess_env(args.threads, extra_path)
    env["CUDA_VISIBLE_DEVICES"] = gpu_index() if on_gpu(args) else ""
    return env


def versions(args: argparse.Namespace) -> dict[str, str | None]:
    """Device, driver, torch, CUDA, DeepSpeed and transformers versions, and the memory cap, recorded beside
    every figure."""
    import torch

    from common.packages import installed_version
    from training.devices import MEMORY_CAP_ENV, device_name

    gpu = on_gpu(args)
    driver = None
    if gpu and shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return {
        "device": torch.cuda.get_device_name(0) if gpu else device_name(),  # 0: the first visible, gpu_index()
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{package: installed_version(package) for package in ("deepspeed", "transformers")},
        "memory_cap_gib": os.environ.get(MEMORY_CAP_ENV) if gpu else None,
    }


def row_data(work: Path, row: Row, args: argparse.Namespace) -> dict[str, Any]:
    """Shards at the row's sequence length (the enwiki sample; ``--vocab``/``--tokenizer`` when given, else
    built from the sample), reused across runs."""
    seq = row.tiny_seq if args.tiny else row.seq
    data_args = argparse.Namespace(bert_seq=seq, max_pred=row.max_pred or 20, gpt_seq=seq, rebuild=args.rebuild)
    kind = "gpt" if row.max_pred == 0 else "bert"
    paths = build_data(work, data_args, (kind,), vocab=args.vocab, tokenizer=args.tokenizer)
    return {"data": paths[kind], "vocab": paths["vocab" if kind == "bert" else "tokenizer"], "seq": seq}


OOM_SIGNS = ("out of device memory", "OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def row_shape(row: Row, args: argparse.Namespace, micro: int) -> tuple[str, int]:
    """The row's model at this size (``--tiny``: debug) and its global batch at ``micro``: a whole number of
    micro-batches (the largest-micro search doubles ``micro``)."""
    total = args.global_batch or row.global_batch
    return (row.tiny_model if args.tiny else row.model), -(-total // micro) * micro


def our_row_overrides(row: Row, data: dict[str, Any], args, optimizer: str, micro: int, run_dir: Path) -> list[str]:
    """train.py's settings for ours on the row's recipe (``--config row.config``): the row's shards, model, batch
    and optimizer; no evaluation and no checkpoint saves (``checkpoint.final_save=false``: a timed run must
    not wait on one; ``benchmarks/bench_checkpoint_stall.py`` measures the stall in a run of its own)."""
    model, global_batch = row_shape(row, args, micro)
    steps = args.warmup + args.steps
    overrides = [
        f"run.dir={run_dir}",
        f"model.name={model}",
        f"data.train={data['data']}",
        "data.eval=null",
        "train.init_from=null",  # phase 2 recipes start from phase 1: here from scratch
        f"data.vocab={data['vocab']}",
        f"data.seq_len={data['seq']}",
        f"optimizer.name={optimizer}",
        f"train.steps={steps}",
        f"train.micro_batch={micro}",
        f"train.global_batch={global_batch}",
        "train.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.final_save=false",
        "checkpoint.resume=never",
        f"logging.warmup_steps={args.warmup}",
        f"logging.every={steps}",
    ]
    if row.max_pred:
        overrides.append(f"data.max_pred={row.max_pred}")
    return overrides


def row_ours(row: Row, data: dict[str, Any], args, optimizer: str, micro: int, port: int) -> dict:
    """Ours on the row's recipe (``port``: its MASTER_PORT): its record (:func:`measured`)."""
    work = Path(args.work)
    model, global_batch = row_shape(row, args, micro)
    tag = f"{model}-seq{data['seq']}-{optimizer}-m{micro}"
    run_dir = work / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = our_row_overrides(row, data, args, optimizer, micro, run_dir)
    env = row_env(args)
    env["MASTER_PORT"] = str(port)
    script = str(REPO / "benchmarks" / "bench_train_ours.py")
    if on_gpu(args):  # name the peer's GPU to the launcher (it sets the rank's CUDA_VISIBLE_DEVICES itself)
        env.pop("CUDA_VISIBLE_DEVICES")
        launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--include", f"localhost:{gpu_index()}"]
        cmd = [*launcher, "--master_port", str(port), script, "--config", row.config, *overrides]
    else:
        cmd = [sys.executable, script, "--config", row.config, *overrides, f"run.threads_per_rank={args.threads}"]
    head = {"row": row_name(row), "side": "ours", "optimizer": optimizer}
    head.update(micro_batch=micro, global_batch=global_batch)

    def figures() -> dict:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        probe = json.loads((run_dir / "bench_cpu.json").read_text(encoding="utf-8"))
        keep = ("sequences_per_sec", "tokens_per_sec", "mfu", "peak_memory_bytes", "attention_kernel")
        return {
            **{k: summary.get(k) for k in keep},
            **{k: probe.get(k) for k in ("host_syncs_per_step", "optimizer_step_s")},
            "measured_steps": summary.get("measured_steps"),
            "padding_fraction": summary.get("padding_fraction"),
            "first_step_s": summary.get("first_step_s"),
        }

    return measured(head, cmd, work / "logs" / f"{tag}.log", env, f"train.py ({tag})", args, figures)


def row_peer(row: Row, data: dict[str, Any], args, micro: int) -> dict:
    """The Trainer on the same shards and shapes: its record (:func:`measured`)."""
    work = Path(args.work)
    model, global_batch = row_shape(row, args, micro)
    tag = f"{model}-seq{data['seq']}-peer-m{micro}"
    out = work / "runs" / f"{tag}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_train_hf.py"), "--model", model]
    cmd += ["--data", str(data["data"]), "--steps", str(args.warmup + args.steps), "--warmup", str(args.warmup)]
    cmd += ["--micro-batch", str(micro), "--global-batch", str(global_batch), "--threads", str(args.threads)]
    gpu = on_gpu(args)
    cmd += ["--workers", "2" if gpu else "1", "--out", str(out), "--device", "cuda" if gpu else "cpu"]
    cmd += ["--compile"] if args.peer_compile else []
    head = {"row": row_name(row), "side": "peer", "optimizer": "adamw_torch_fused"}
    head.update(micro_batch=micro, global_batch=global_batch)

    def figures() -> dict:
        rec = json.loads(out.read_text(encoding="utf-8"))
        keep = ("optimizer", "sequences_per_sec", "tokens_per_sec", "mfu", "peak_memory_bytes")
        keep += ("host_syncs_per_step", "optimizer_step_s", "attention_kernel", "compile")
        return {**{k: rec.get(k) for k in keep}, "measured_steps": args.steps}

    env = row_env(args, args.peer_site)
    return measured(head, cmd, work / "logs" / f"{tag}.log", env, f"Trainer ({tag})", args, figures)


def row_profile(row: Row, data: dict[str, Any], args, optimizer: str, micro: int, port: int) -> dict:
    """Ours as :func:`row_ours` runs it, in one process under ``torch.profiler``
    (``benchmarks/bench_train_profile.py``): its tables (the top kernels by device time, and the shares of
    matmuls, attention and the rest) in ``--profile-out``; its record has the shares."""
    work = Path(args.work)
    model, global_batch = row_shape(row, args, micro)
    tag = f"{model}-seq{data['seq']}-{optimizer}-m{micro}-profile"
    run_dir = work / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    shares = work / "runs" / f"{tag}.json"
    shares.unlink(missing_ok=True)
    script = str(REPO / "benchmarks" / "bench_train_profile.py")
    cmd = [sys.executable, script, "--threads", str(args.threads), "--top", "25", "--config", row.config]
    cmd += ["--shares", str(shares), "--", *our_row_overrides(row, data, args, optimizer, micro, run_dir)]
    env = row_env(args)
    env["MASTER_PORT"] = str(port)
    head = {"row": row_name(row), "side": "profile", "optimizer": optimizer}
    head.update(micro_batch=micro, global_batch=global_batch)
    log_path = work / "logs" / f"{tag}.log"

    def figures() -> dict:
        if args.profile_out:
            shutil.copyfile(log_path, args.profile_out)
        return json.loads(shares.read_text(encoding="utf-8"))

    return measured(head, cmd, log_path, env, f"profile ({tag})", args, figures)


def measured(head: dict, cmd: list[str], log_path: Path, env: dict[str, str], what: str, args, figures) -> dict:
    """Run one side's command (cut at ``--timeout``) and return its record: ``head``, ``status`` (``ok``, or
    ``oom``: out of device memory, ``timeout``, ``failed``, with its ``error`` line), the figures
    (``figures()``) of a run that ended well, the wall seconds and the command; appended to ``--records`` the
    moment the run ends, whatever its status."""
    rec: dict[str, Any] = {**head, "status": "ok", "warmup": args.warmup}
    t0 = time.perf_counter()
    try:
        run_logged(cmd, log_path, env, what, timeout=args.timeout)
        rec.update(figures())
    except RunFailed as e:
        text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
        oom = e.status == "failed" and any(sign in text for sign in OOM_SIGNS)
        rec.update(status="oom" if oom else e.status, error=str(e))
    rec.update(wall_s=round(time.perf_counter() - t0, 2), log=str(log_path), command=shlex.join(cmd))
    append_record(args, rec)
    return rec


_RECORDS_LOCK = threading.Lock()


def append_record(args: argparse.Namespace, rec: dict) -> None:
    """Append ``rec`` (with the device) to ``--records`` as one JSON line, flushed to disk:
    a run cut later, or a call cut at its deadline, keeps every record written before."""
    if not args.records:
        return
    line = json.dumps({"device": args.device, **rec}) + "\n"
    with _RECORDS_LOCK, open(args.records, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def largest(run, start: int, cap: int) -> tuple[list[dict], int | None, bool]:
    """Double the micro-batch from ``start`` while it fits (up to ``cap``): the runs (every record, the one
    that ended the search included), the largest micro-batch that fitted (None if even ``start`` did not) and
    whether the search stopped at ``cap`` rather than at a run that did not end well (out of memory, or a
    kernel's limit at that size: logged; the shared-micro-batch figures already stand)."""
    runs: list[dict] = []
    fitted, micro = None, start
    while micro <= cap:
        rec = run(micro)
        runs.append(rec)
        if rec["status"] != "ok":
            if rec["status"] != "oom":
                log.warning(f"largest micro-batch search: micro-batch {micro} {rec['status']}, ending the search")
            return runs, fitted, False
        fitted, micro = micro, micro * 2
    return runs, fitted, True


def selected_runs(row: Row, only: str | None) -> list[tuple[str, str | None]]:
    """The (side, optimizer) runs of ``row`` that ``--only`` names (``ours:OPT``, or ``ours``: the row's last
    optimizer; ``peer``; ``profile``: ours with the row's last optimizer under the profiler), in that order;
    the row's shared runs (ours with each optimizer, the Trainer) when None."""
    runs: list[tuple[str, str | None]] = [("ours", opt) for opt in row.optimizers] + [("peer", None)]
    if only is None:
        return runs
    known = [*runs, ("profile", row.optimizers[-1])]
    chosen = []
    for item in (x.strip() for x in only.split(",") if x.strip()):
        side, _, opt = item.partition(":")
        run = (side, opt or (row.optimizers[-1] if side in ("ours", "profile") else None))
        if run not in known:
            raise UserError(
                f"--only {item}: not a run of this row (runs: ours:{'|'.join(row.optimizers)}, peer, profile)"
            )
        chosen.append(run)
    return chosen


def run_rows(args: argparse.Namespace) -> int:
    """``--rows``/``--tiny``: each row's shared-micro-batch runs (ours with each optimizer, the Trainer; or
    those ``--only`` names), then with ``--largest`` each side's largest micro-batch; a table, ``--json``,
    and a record per run in ``--records`` as each ends. ``--data-only``: the rows' shards, nothing run."""
    names = list(ROWS) if args.rows in ("all", None) else [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise UserError(f"--rows: unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    if args.tiny:
        args.micro_batch, args.global_batch = TINY["micro"], TINY["global_batch"]
        args.steps, args.warmup = TINY["steps"], TINY["warmup"]
    if args.steps < 1 or args.warmup < 1:
        raise UserError(f"--steps={args.steps} and --warmup={args.warmup} must be at least 1 in rows mode")
    if args.jobs is None:
        args.jobs = 2 if args.tiny and not args.only else 1
    if args.jobs < 1 or (args.jobs > 1 and on_gpu(args)):
        raise UserError(f"--jobs={args.jobs}: 1 on a GPU (its runs share one device), at least 1 elsewhere")
    plan = {name: selected_runs(ROWS[name], args.only) for name in names}
    for name in names:
        micro, total = args.micro_batch or ROWS[name].micro, args.global_batch or ROWS[name].global_batch
        if micro <= 0 or total % micro:
            raise UserError(f"row {name}: global batch {total} is not a multiple of micro-batch {micro}")
    if not args.data_only and any(side == "peer" for runs in plan.values() for side, _ in runs):
        check_peer_available(args.peer_site)
    work = Path(args.work).resolve()
    args.work = str(work)
    work.mkdir(parents=True, exist_ok=True)
    shards_of = {name: row_data(work, ROWS[name], args) for name in names}
    if args.data_only:
        for name, data in shards_of.items():
            print(f"{name}: {data['data']} (seq {data['seq']}; vocabulary {data['vocab']})")
        return 0
    ports = Ports(args.port)
    meta = versions(args)
    args.device = meta["device"]
    log.info("versions: " + ", ".join(f"{k} {v}" for k, v in meta.items()))
    results: dict[str, dict] = {}
    with RunQueue(args.jobs) as queue:
        queued = {}
        for name in names:  # each row's shared-micro-batch runs: with --jobs > 1, every row's queued at once
            row, data, micro = ROWS[name], shards_of[name], args.micro_batch or ROWS[name].micro
            queued[name] = queue.put(
                [
                    partial(row_peer, row, data, args, micro)
                    if side == "peer"
                    else partial(
                        row_profile if side == "profile" else row_ours, row, data, args, opt, micro, ports.take()
                    )
                    for side, opt in plan[name]
                ]
            )
        for name in names:
            t0 = time.perf_counter()
            row_results(name, shards_of[name], queue.results(queued[name]), results, args, ports)
            results[name]["wall_s"] = time.perf_counter() - t0
            log.info(f"row {name}: {len(results[name]['runs'])} runs in {results[name]['wall_s']:.0f}s")
            if args.json:  # after every row: a later failure keeps what was measured
                from common.atomic import atomic_write_json

                atomic_write_json(Path(args.json), {"versions": meta, "args": vars(args), "rows": results})
    print(rows_table(results, meta, args))
    runs = [r for res in results.values() for r in res["runs"]]
    bad = [f"{r['row']} {r['side']} {r['optimizer']}: {r['status']}" for r in runs if r["status"] != "ok"]
    if args.tiny:
        check_tiny(results)
    if bad and not args.largest:
        raise UserError(f"runs that did not end well: {'; '.join(bad)} (their logs are under {work / 'logs'})")
    return 0


def row_name(row: Row) -> str:
    return next(name for name, known in ROWS.items() if known is row)


def row_results(
    name: str, data: dict[str, Any], runs: list[dict], results: dict, args: argparse.Namespace, ports: Ports
) -> None:
    """A row's entry in ``results``: its shared-micro-batch runs, then with ``--largest`` each side's largest
    micro-batch (searched one run at a time), for the sides that fitted at the shared micro-batch."""
    row, micro = ROWS[name], args.micro_batch or ROWS[name].micro
    fits: dict[str, str] = {"ours": "-", "peer": "-"}  # "-": not searched (no --largest)
    if args.largest:

        def ours_at(micro: int) -> dict:
            return row_ours(row, data, args, row.optimizers[-1], micro, ports.take())

        peer_at = partial(row_peer, row, data, args)
        for side, run in (("ours", ours_at), ("peer", peer_at)):
            if not any(r["side"] == side and r["status"] == "ok" for r in runs):
                continue
            more, fitted, capped = largest(lambda m, run=run: run(micro=m), micro * 2, args.largest_cap)
            runs += more
            fits[side] = f">= {fitted or micro}" if capped else str(fitted or micro)
    results[name] = {"row": name, "seq": data["seq"], "runs": runs, "largest_micro_batch": fits}


class RunQueue:
    """Runs one after the other, each when its result is asked for (``jobs`` 1), or ``jobs`` at a time from
    when they are put (threads that wait on subprocesses). Leaving it cancels the runs not yet started: the
    first failure ends the rest."""

    def __init__(self, jobs: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None

    def put(self, runs: list[Callable[[], dict]]) -> list:
        return [self.pool.submit(run) for run in runs] if self.pool else runs

    def results(self, queued: list) -> list[dict]:
        return [q.result() for q in queued] if self.pool else [run() for run in queued]

    def __enter__(self) -> RunQueue:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)


def check_tiny(results: dict[str, dict]) -> None:
    """Every run ended well with every figure, MFU in (0, 1]."""
    for name, res in results.items():
        for r in res["runs"]:
            if r["status"] != "ok":
                raise UserError(f"row {name}, {r['side']} {r['optimizer']}: {r['status']} ({r.get('error')})")
            if r["side"] == "profile":
                continue
            if not (r["sequences_per_sec"] and r["tokens_per_sec"] and r["mfu"] and 0 < r["mfu"] <= 1):
                raise UserError(f"row {name}, {r['side']} {r['optimizer']}: incomplete or impossible figures {r}")


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def rows_table(results: dict[str, dict], meta: dict, args: argparse.Namespace) -> str:
    head = ["row", "seq", "side", "optimizer", "micro x accum", "status", "seq/s", "tokens/s", "MFU", "peak GiB"]
    head += ["attention", "host syncs/step", "optimizer step ms"]
    lines = [
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta.items()),
        f"{args.steps} measured steps after {args.warmup}; ours: train.py on the row's recipe; peer: Trainer.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for name, res in results.items():
        for r in res["runs"]:
            cells = [
                name,
                str(res["seq"]),
                r["side"],
                str(r["optimizer"]),
                f"{r['micro_batch']} x {r['global_batch'] // r['micro_batch']}",
                r["status"],
                _fmt(r.get("sequences_per_sec"), ".1f"),
                _fmt(r.get("tokens_per_sec"), ".0f"),
                _fmt(r.get("mfu"), ".1%"),
                _fmt(r.get("peak_memory_bytes"), ".1f", 1 / (1 << 30)),
                str(r.get("attention_kernel") or "-"),
                _fmt(r.get("host_syncs_per_step"), ".1f"),
                _fmt(r.get("optimizer_step_s"), ".2f", 1e3),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, res in results.items():
        shared = [r for r in res["runs"] if r["micro_batch"] == res["runs"][0]["micro_batch"] and r["status"] == "ok"]
        peer = next((r for r in shared if r["side"] == "peer"), None)
        ours = [r for r in shared if r["side"] == "ours"]
        if peer is None or not ours:
            continue
        ratios = ", ".join(f"{r['optimizer']} {r['sequences_per_sec'] / peer['sequences_per_sec']:.2f}x" for r in ours)
        lines.append(
            f"{name}: ours / Trainer at micro-batch {peer['micro_batch']}: {ratios}; largest micro-batch "
            f"that fits: ours {res['largest_micro_batch']['ours']}, Trainer {res['largest_micro_batch']['peer']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rows or args.tiny:
        return run_rows(args)
    from model.registry import FAMILIES, get_spec

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    families = {m: get_spec(m).family for m in models}  # unknown names fail here, before any work
    kinds = tuple(sorted({FAMILIES[f].format.name for f in families.values()}))
    check_peer_available(args.peer_site)
    work = Path(args.work).resolve()
    if work == REPO or REPO in work.parents:
        raise UserError(f"--work {work} is inside the repository; use a directory outside it (e.g. /tmp/bench_train)")
    args.work = str(work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    paths = build_data(work, args, kinds)
    ports = Ports(args.port)

    results: dict[str, dict[str, list[dict]]] = {m: {"ours": [], "peer": [], "ours2": []} for m in models}
    for rep in range(args.repeats):
        for i, m in enumerate(models):
            fam = families[m]
            order = ("ours", "peer") if (rep + i) % 2 == 0 else ("peer", "ours")
            for side in order:
                tag = f"{m}-{side}-r{rep}"
                rec = (
                    run_ours(m, fam, paths, args, tag, ports) if side == "ours" else run_peer(m, fam, paths, args, tag)
                )
                results[m][side].append(rec)
                log.info(
                    f"{tag}: {rec['sequences_per_sec']:.1f} seq/s, "
                    f"{rec.get('sequences_per_cpu_sec', 0):.1f} seq/CPU-s (run {rec['wall_s']:.0f}s)"
                )
            if args.two_ranks:
                rec = run_ours(m, fam, paths, args, f"{m}-ours2x1-r{rep}", ports, ranks=2)
                results[m]["ours2"].append(rec)
                log.info(f"{m}-ours2x1-r{rep}: {rec['sequences_per_sec']:.1f} seq/s (run {rec['wall_s']:.0f}s)")

    rows = []
    for m in models:
        fam = families[m]
        res = results[m]
        ours = [r["sequences_per_sec"] for r in res["ours"]]
        peer = [r["sequences_per_sec"] for r in res["peer"]]
        ours_cpu = [r.get("sequences_per_cpu_sec", float("nan")) for r in res["ours"]]
        peer_cpu = [r["sequences_per_cpu_sec"] for r in res["peer"]]
        rows.append(
            {
                "model": m,
                "seq": args.bert_seq if fam == "bert" else args.gpt_seq,
                "ours": median(ours),
                "peer": median(peer),
                "ours_runs": ours,
                "peer_runs": peer,
                "ratio": median(ours) / median(peer),
                "ours_cpu_runs": ours_cpu,
                "peer_cpu_runs": peer_cpu,
                "cpu_ratio": median(ours_cpu) / median(peer_cpu),
                "target": TARGET_RATIO[fam],
                "mfu": median([r["mfu"] for r in res["ours"]]),
                "peak": median([r["peak_flops_per_device"] for r in res["ours"]]),
                "ours2_runs": [r["sequences_per_sec"] for r in res["ours2"]],
            }
        )
    peer_opt = results[models[0]]["peer"][0].get("optimizer", "?")
    print(
        f"\nTraining throughput, CPU, BF16, 1 process x {args.threads} thread(s) each side, global batch "
        f"{args.global_batch}, AdamW; {args.steps} measured steps after {args.warmup} warm-up; median of "
        f"{args.repeats} interleaved runs (individual runs in parentheses). Peer: transformers.Trainer "
        f"(optim={peer_opt}); ours: train.py, DeepSpeed ZeRO-0 (BF16 optimizer). seq/CPU-s: sequences per "
        "CPU second of the training process in the same window (less sensitive to other load). Wall "
        f"{time.perf_counter() - t_start:.0f}s.\n"
    )
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "runs": results}, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
