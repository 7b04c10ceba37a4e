"""Collective benchmark: all-reduce, all-gather, reduce-scatter bandwidth through ``deepspeed.comm``.

Run it under the DeepSpeed launcher, which supports Python modules (``--module``)::

    deepspeed --num_gpus 8 --module launch commbench --sizes 1K..256M           # one node
    deepspeed --hostfile hostfile --module launch commbench --out comm.json     # the cluster
    python -m launch commbench --launch-local 2 --sizes 1K..1M                  # starts the launcher for you

Conventions are nccl-tests' (so figures compare with ``all_reduce_perf`` and with published tables):

* *size* is the bytes of the full buffer: the all-reduce tensor, the all-gather *output*, the reduce-scatter
  *input* (each rank holds size/n of the gathered or scattered data); float32 elements.
* time = mean over ``iters`` calls after ``warmup`` calls, taken as the slowest rank's (max over ranks);
* algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce and x (n-1)/n for all-gather and
  reduce-scatter. Bandwidths are printed in MB/s (10^6 bytes/s) and stored in the JSON in bytes/s.

Why not DeepSpeed's own suite: ``ds_bench`` in the deepspeed 0.19.8 wheel imports
``benchmarks.communication``, which the wheel does not ship (the suite lives in DeepSpeedExamples); that
suite times with device events and on CPU prints "No Event support on CPU" and measures nothing, offers no
gloo backend and no reduce-scatter, and reports all-reduce "throughput" as 2 x size / time rather than
nccl-tests' algbw.

gloo: torch 2.13's gloo implements ``reduce_scatter_tensor`` and ``all_gather_into_tensor``. Where a backend
lacks them we fall back to the list forms (``reduce_scatter``/``all_gather``), and finally to all-reduce plus
a local slice for reduce-scatter; the ``impl`` column says which call was timed, so a fallback is never
reported as the real collective.

CPU default sizes stop at 32 MB (two ranks on a shared two-core machine move 32 MB in about 0.1 s, so the
full default sweep finishes in under a minute); the GPU default runs to 256 MB. Sizes: ``1K..256M`` (powers of
``--factor``), or a list ``1K,32M``; 32 MB, the published table's row, is always included.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from common.atomic import atomic_write_json
from common.errors import UserError
from common.net import free_port, own_address
from common.process import end_process_group

OPS = ("all_reduce", "all_gather", "reduce_scatter")
PUBLISHED_ROW_BYTES = 32 * 1024 * 1024
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """``1K`` -> 1024, ``32M`` -> 33554432, ``4096`` -> 4096 (binary units, as nccl-tests prints them)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise UserError(f"bad message size {text!r} (examples: 4096, 1K, 32M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_sizes(spec: str, factor: int = 4) -> list[int]:
    """``1K..256M`` -> powers of ``factor`` from 1K up to 256M, plus 32 MB; ``1K,32M`` -> exactly those."""
    if factor < 2:
        raise UserError(f"--factor must be >= 2 (got {factor})")
    if ".." in spec:
        lo_s, hi_s = spec.split("..", 1)
        lo, hi = parse_size(lo_s), parse_size(hi_s)
        if lo <= 0 or hi < lo:
            raise UserError(f"bad size range {spec!r}: need 0 < low <= high")
        sizes = []
        s = lo
        while s <= hi:
            sizes.append(s)
            s *= factor
        if lo <= PUBLISHED_ROW_BYTES <= hi:
            sizes.append(PUBLISHED_ROW_BYTES)
    else:
        sizes = [parse_size(s) for s in spec.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise UserError(f"no valid message sizes in {spec!r}")
    return sorted(set(sizes))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link must carry relative to algbw."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(op)


def fmt_bytes(n: int) -> str:
    for unit, div in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


class _Collectives:
    """The three collectives with their fallbacks; ``impl`` names the call that is actually timed."""

    def __init__(self, dist: Any, world: int) -> None:
        self.dist, self.n = dist, world

    def make(self, op: str, numel: int, device: Any, torch: Any) -> tuple[Callable[[], None], str]:
        d, n = self.dist, self.n
        if op == "all_reduce":
            buf = torch.ones(numel, dtype=torch.float32, device=device)
            return (lambda: d.all_reduce(buf)), "all_reduce"
        shard = numel // n
        if op == "all_gather":
            inp = torch.ones(shard, dtype=torch.float32, device=device)
            out = torch.empty(shard * n, dtype=torch.float32, device=device)
            chunks = list(out.chunk(n))
            candidates = [
                ("all_gather_into_tensor", lambda: d.all_gather_into_tensor(out, inp)),
                ("all_gather(list)", lambda: d.all_gather(chunks, inp)),
            ]
        else:
            inp = torch.ones(shard * n, dtype=torch.float32, device=device)
            out = torch.empty(shard, dtype=torch.float32, device=device)
            rank = d.get_rank()

            def emulated() -> None:
                d.all_reduce(inp)
                out.copy_(inp[rank * shard : (rank + 1) * shard])

            candidates = [
                ("reduce_scatter_tensor", lambda: d.reduce_scatter_tensor(out, inp)),
                ("reduce_scatter(list)", lambda: d.reduce_scatter(out, list(inp.chunk(n)))),
                ("EMULATED all_reduce+slice", emulated),
            ]
        for name, fn in candidates:
            ok = torch.ones(1, device=device)
            try:
                fn()
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                ok.zero_()
            d.all_reduce(ok, op=d.ReduceOp.MIN)  # every rank must agree on the implementation
            if ok.item() == 1:
                return fn, name
        raise RuntimeError(f"no implementation of {op} works on this backend")


def _bench_one(fn: Callable[[], None], iters: int, warmup: int, budget_s: float, sync: Callable) -> tuple[float, int]:
    """Mean seconds per call (slowest rank) and the iteration count used."""
    from training import collectives  # on call (start-up time): torch, which the launching side never loads

    for _ in range(warmup):
        fn()
    sync()
    collectives.barrier()
    if budget_s > 0:  # cap iterations so big messages on CPU fit the budget; every rank must agree
        t0 = time.perf_counter()
        fn()
        sync()
        probe = collectives.all_reduce_values([time.perf_counter() - t0], "max")[0]
        iters = max(3, min(iters, int(budget_s / max(probe, 1e-9))))
        collectives.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    elapsed = collectives.all_reduce_values([time.perf_counter() - t0], "max")[0]
    return elapsed / iters, iters


def format_table(results: list[dict[str, Any]], world: int) -> str:
    lines = [
        f"{'op':<15}{'size':>8}{'count':>12}{'iters':>7}{'time_us':>12}{'algbw_MB/s':>13}{'busbw_MB/s':>13}  impl",
    ]
    for r in results:
        lines.append(
            f"{r['op']:<15}{fmt_bytes(r['bytes']):>8}{r['count']:>12}{r['iters']:>7}"
            f"{r['time_s'] * 1e6:>12.1f}"
            f"{r['algbw_Bps'] / 1e6:>13.1f}{r['busbw_Bps'] / 1e6:>13.1f}  {r['impl']}"
        )
    row = [r for r in results if r["bytes"] == PUBLISHED_ROW_BYTES]
    if row:
        lines.append("")
        lines.append(f"32 MB row (the published table's size), {world} ranks:")
        for r in row:
            lines.append(
                f"  {r['op']:<15} algbw {r['algbw_Bps'] / 1e6:10.1f} MB/s   busbw "
                f"{r['busbw_Bps'] / 1e6:10.1f} MB/s   ({r['impl']})"
            )
    return "\n".join(lines)


def run_rank(args: argparse.Namespace) -> int:
    """The benchmark, in every rank started by the DeepSpeed launcher: its process group, ended here."""
    # on call (start-up time): torch and DeepSpeed load in the ranks only; `launch commbench` itself needs neither
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    on_cpu = accel.device_name() == "cpu"
    if on_cpu:
        from training.engine import no_shm_all_reduce  # on call (start-up time): torch and DeepSpeed

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        no_shm_all_reduce()  # nothing left in /dev/shm
    deepspeed.init_distributed(timeout=timedelta(seconds=args.timeout_s), verbose=False)
    try:
        return _bench(args, on_cpu)
    finally:
        end_process_group()


def _bench(args: argparse.Namespace, on_cpu: bool) -> int:
    """The measurements, in a rank whose process group is up."""
    # on call (start-up time): torch and DeepSpeed load in the ranks only, as in run_rank
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not on_cpu:
        accel.set_device(local_rank)
    device = torch.device(accel.device_name(local_rank) if not on_cpu else "cpu")
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    info = {
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "hostname": socket.gethostname(),
        "address": own_address(master),
        "node_rank": int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "0"))),
        "pid": os.getpid(),
        "backend": dist.get_backend() if hasattr(dist, "get_backend") else accel.communication_backend_name(),
    }
    if args.rank_info:
        atomic_write_json(Path(args.rank_info) / f"rank{rank}.json", info)
    from training import collectives  # on call (start-up time): torch

    everyone = collectives.all_gather_object(info)

    sizes = parse_sizes(args.sizes or ("1K..32M" if on_cpu else "1K..256M"), args.factor)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UserError(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    budget = args.time_budget_s if args.time_budget_s is not None else (2.0 if on_cpu else 0.0)
    if args.api == "torch":  # the peer: the same calls straight to torch.distributed, bypassing deepspeed.comm
        import torch.distributed as tdist  # on call (start-up time): torch, as above

        colls = _Collectives(tdist, world)
    else:
        colls = _Collectives(dist, world)
    results = []
    for _ in range(max(1, args.repeat)):
        for op in ops:
            for size in sizes:
                numel = max(world, size // 4 // world * world)
                fn, impl = colls.make(op, numel, device, torch)
                t, iters = _bench_one(fn, args.iters, args.warmup, budget, accel.synchronize)
                nbytes = numel * 4
                algbw = nbytes / t
                results.append(
                    {
                        "op": op,
                        "bytes": nbytes,
                        "count": numel,
                        "iters": iters,
                        "time_s": t,
                        "algbw_Bps": algbw,
                        "busbw_Bps": algbw * bus_factor(op, world),
                        "impl": impl,
                    }
                )
    if rank == 0:
        hosts = sorted({(p["node_rank"], p["address"]) for p in everyone})
        print(
            f"commbench: {world} ranks on {len(hosts)} node(s) {[a for _, a in hosts]}, backend "
            f"{info['backend']}, api {args.api}, device {device.type}, float32",
            flush=True,
        )
        print(format_table(results, world), flush=True)
        if args.out:
            atomic_write_json(
                args.out,
                {
                    "world_size": world,
                    "backend": info["backend"],
                    "device": device.type,
                    "ranks": everyone,
                    "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__,
                    "api": args.api,
                    "conventions": ("nccl-tests: algbw=bytes/time, busbw=algbw*2(n-1)/n (all_reduce), *(n-1)/n"),
                    "results": results,
                },
            )
    collectives.barrier()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None, help="1K..256M (range) or 1K,32M (list); default 1K..32M on CPU")
    parser.add_argument("--factor", type=int, default=4, help="step between sizes of a range (default 4)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size (upper bound on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="cap timed seconds per size (default 2 on CPU, off on GPU)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="repeat the whole sweep (soak and failure tests)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout: a silent peer fails")
    parser.add_argument(
        "--api",
        choices=["deepspeed", "torch"],
        default="deepspeed",
        help="call deepspeed.comm (default) or torch.distributed",
    )
    parser.add_argument("--out", default=None, help="write results JSON here (rank 0)")
    parser.add_argument("--rank-info", default=None, help="directory: each rank writes rank<R>.json (host, address)")
    parser.add_argument(
        "--launch-local",
        type=int,
        default=None,
        metavar="N",
        help="start `deepspeed --num_gpus N` for this command",
    )
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The options of this command, for the ranks that the launcher starts."""
    argv = ["--factor", str(args.factor), "--ops", args.ops, "--iters", str(args.iters), "--api", args.api]
    argv += ["--warmup", str(args.warmup), "--repeat", str(args.repeat), "--timeout-s", str(args.timeout_s)]
    for flag, value in (
        ("--sizes", args.sizes),
        ("--time-budget-s", args.time_budget_s),
        ("--out", args.out),
        ("--rank-info", args.rank_info),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def launch_local(args: argparse.Namespace) -> int:
    """Start ``deepspeed --num_gpus N --module launch commbench ...`` on this machine and wait for it."""
    if args.launch_local < 1:
        raise UserError(f"--launch-local must be >= 1 (got {args.launch_local})")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.launch_local)]
    cmd += ["--master_port", str(free_port()), "--module", "launch", "commbench", *rank_argv(args)]
    return subprocess.call(cmd)


def run(args: argparse.Namespace) -> int:
    if args.iters < 1 or args.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    parse_sizes(args.sizes or "1K", args.factor)  # fail early, before ranks start
    if args.launch_local is not None:
        return launch_local(args)
    if "WORLD_SIZE" not in os.environ:
        raise UserError(
            "commbench runs under the DeepSpeed launcher: `deepspeed --num_gpus N --module launch commbench "
            "...` (or add --launch-local N)"
        )
    return run_rank(args)
