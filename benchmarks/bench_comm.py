"""Collective bandwidth through ``deepspeed.comm`` (ours) beside the same calls on ``torch.distributed``
(peer).

Both are measured in this run, on the same ranks, sizes and iteration counts, by ``python -m launch
commbench`` (``--api deepspeed`` then ``--api torch``); the table prints bus bandwidth side by side. On a GPU
cluster the reference peer is nccl-tests (``all_reduce_perf -b 1K -e 256M -f 4 -g 1`` under mpirun, one
process per GPU), which uses the same algbw/busbw conventions.

    python benchmarks/bench_comm.py --ranks 2 --sizes 1K..256M        # this machine, CPU ranks (gloo)
    python benchmarks/bench_comm.py --ranks 2 --sizes 1K..4K --iters 3      # toy size (CI), seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(api: str, ranks: int, sizes: str, iters: int, out: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "launch", "commbench", "--launch-local", str(ranks), "--sizes", sizes]
    cmd += ["--iters", str(iters), "--api", api, "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="1K..256M")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours = measure("deepspeed", args.ranks, args.sizes, args.iters, Path(tmp) / "ds.json")
        peer = measure("torch", args.ranks, args.sizes, args.iters, Path(tmp) / "torch.json")
    print(f"{args.ranks} ranks, backend {ours['backend']}, device {ours['device']}, float32, nccl-tests conventions")
    print(f"{'op':<15}{'size':>8}{'busbw MB/s deepspeed.comm':>28}{'busbw MB/s torch.distributed':>31}{'ratio':>8}")
    from launch.commbench import fmt_bytes

    peer_by_key = {(r["op"], r["bytes"]): r for r in peer["results"]}
    for r in ours["results"]:
        q = peer_by_key[(r["op"], r["bytes"])]
        ratio = r["busbw_Bps"] / q["busbw_Bps"]
        print(
            f"{r['op']:<15}{fmt_bytes(r['bytes']):>8}{r['busbw_Bps'] / 1e6:>28.3f}"
            f"{q['busbw_Bps'] / 1e6:>31.3f}{ratio:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
