"""``python -m launch elastic``: train.py under torch's elastic agent, a job that heals itself.

Run the same command on every node (Slurm: one task per node; AWS Batch: every node of a multi-node job)::

    python -m launch elastic --nodes 2:4 --procs-per-node 8 --max-restarts 3 \\
        --rendezvous node0:29400 -- --config configs/bert-large.yaml run.dir=/fsx/run

The agent (``torchrun``'s, ``torch.distributed.run``) starts the ranks after a c10d rendezvous. When a
rank or a node dies, the surviving ranks end (train.py: exit 4, a lost peer), the agents meet again, and
the job restarts from the last committed checkpoint on the nodes that answered: between ``MIN`` and ``MAX``
of them. A resume at another world size goes through a universal checkpoint, at the same global batch (more
or fewer accumulation steps). Nodes that come back join at the next restart. ``--max-restarts`` bounds the
restarts.

This command adds what the agent cannot know, read from RUN_DIR/events.jsonl (training.events):

- a preemption is not a failure: SIGTERM to this command stops the ranks (they save) and the job ends with
  code 3 for the scheduler to requeue (the agent alone would restart ranks that exit 3 in place);
- bad input is not a failure: the job ends with code 2 at once instead of failing ``--max-restarts`` times;
- a spent restart budget ends the job with one final line and exit 1;
- the global batch must divide at every world size the job may shrink or grow to: checked before the start.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from common.errors import EXIT_USER_ERROR, UserError
from training import events
from training.config import Config, gradient_accumulation, load_config

REPO = Path(__file__).resolve().parents[1]
EXIT_PREEMPTED = 3
POLL_S = 0.2


def parse_nodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nodes {text!r}: expected N or MIN:MAX, e.g. 2:4") from None
    if not 1 <= nmin <= nmax:
        raise UserError(f"--nodes {text!r}: need 1 <= MIN <= MAX")
    return nmin, nmax


def split_train_args(passthrough: list[str]) -> tuple[str | None, list[str]]:
    """train.py's ``--config`` value and its dotted overrides."""
    config, overrides, it = None, [], iter(passthrough)
    for a in it:
        if a == "--config":
            config = next(it, None)
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif not a.startswith("-"):
            overrides.append(a)
    return config, overrides


def check_world_sizes(cfg: Config, nmin: int, nmax: int, per_node: int) -> None:
    """Every node count the job may run on keeps ``train.global_batch``: refused before anything starts."""
    if cfg.train.grad_accum is not None:
        raise UserError(
            f"train.grad_accum={cfg.train.grad_accum} is fixed: an elastic job keeps train.global_batch and "
            "recomputes the accumulation at each world size; leave train.grad_accum unset"
        )
    bad = []
    for n in range(nmin, nmax + 1):
        try:
            gradient_accumulation(cfg.train, n * per_node)
        except UserError:
            bad.append(n)
    if bad:
        need = cfg.train.micro_batch * per_node
        raise UserError(
            f"train.global_batch={cfg.train.global_batch} cannot be kept on "
            f"{', '.join(map(str, bad))} node(s) "
            f"(train.micro_batch={cfg.train.micro_batch} x {per_node} ranks per node = {need} per node): "
            f"narrow --nodes or pick a global batch divisible by every node count's {need} x N"
        )


def hosts_rendezvous(endpoint: str) -> bool:
    """Is the rendezvous address one of this node's own? Then this node's agent hosts the store.

    torch's own guess compares the address with the host name's, which misses a node with several networks
    (the rendezvous on the fast fabric's address, the host name on the management network).
    """
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        raise UserError(f"--rendezvous {endpoint}: cannot resolve {host!r}") from None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def agent_command(args: argparse.Namespace, nmin: int, nmax: int, job_id: str) -> list[str]:
    conf = f"last_call_timeout={args.last_call_s},join_timeout={args.join_timeout_s}"
    conf += f",is_host={str(hosts_rendezvous(args.rendezvous)).lower()}"
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nmin}:{nmax}", f"--nproc-per-node={args.procs_per_node}",
        f"--max-restarts={args.max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rendezvous}",
        f"--rdzv-id={job_id}", f"--rdzv-conf={conf}", "--monitor-interval=1",
        *([f"--local-addr={args.local_addr}"] if args.local_addr else []),
        str(REPO / "train.py"), *args.passthrough,
    ]  # fmt: skip


def default_job_id() -> str:
    for name in ("SLURM_JOB_ID", "AWS_BATCH_JOB_ID"):
        v = os.environ.get(name, "").split("#")[0]  # AWS Batch node ids are "<job>#<node>"
        if v:
            return v
    return "wp-elastic"


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def supervise(cmd: list[str], run_dir: Path, max_restarts: int, endpoint: str, grace_s: float = 120.0) -> int:
    """Run the agent; end it at once on bad input; map its outcome to our exit codes.

    A signal to this process (the scheduler's preemption: Slurm signals every process of the step, AWS Batch
    the container's first one) is passed to the agent once, which stops its ranks (they save) without a
    restart, and the job ends with 3. A SIGTERM that reaches ranks alone comes from their agent (stopping them
    for a restart, when nodes join) or is a failure of that rank: the agent restarts the job.
    """
    path = run_dir / events.EVENTS
    offset = path.stat().st_size if path.exists() else 0
    signalled: list[int] = []
    # A node that joins a later rendezvous round (one coming back) waits forever for the workers' store
    # address if the agents share their rendezvous store with the workers: the others built it in their first
    # round and never publish it again (torch 2.13, dynamic_rendezvous.next_rendezvous). Opt out of sharing.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agent = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)  # signals come through us, once
    seen: dict[int, psutil.Process] = {}

    def forward(signum, frame) -> None:  # noqa: ARG001
        if not signalled:  # a second signal would cut short the agent's wait for its ranks' saves
            events.record(run_dir, "preempted", signal=signal.Signals(signum).name, host=socket.gethostname())
            if agent.poll() is None:
                agent.send_signal(signum)
        signalled.append(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    user_error = started = False
    last_scan = 0.0
    try:
        while agent.poll() is None:
            time.sleep(POLL_S)
            if time.monotonic() - last_scan > 1.0:  # the ranks, to wait for if the agent is cut short
                last_scan = time.monotonic()
                with contextlib.suppress(psutil.Error):
                    seen.update((c.pid, c) for c in psutil.Process(agent.pid).children(recursive=True))
            new, offset = events.read_from(run_dir, offset)
            for ev in new:
                started = started or ev.get("event") == "start"
                if ev.get("event") == "user_error" and not user_error:
                    # restarting cannot help, and there is nothing to save: train.py printed the one line
                    # already, so end the agent and whatever it has started again without another word
                    user_error = True
                    _kill_tree(agent.pid)
        rc = agent.wait()
        if not user_error:
            psutil.wait_procs([p for p in seen.values() if p.is_running()], timeout=grace_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if user_error:
        return EXIT_USER_ERROR
    if rc == 0:
        return 0
    if signalled:
        name = signal.Signals(signalled[0]).name
        print(f"launch elastic: {name}: the ranks stopped after saving; the job ends with code "
              f"{EXIT_PREEMPTED} for the scheduler to requeue", file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_PREEMPTED
    if not started:
        print(f"error: the elastic agent ended (exit code {rc}) before training started: see its lines above "
              f"(rendezvous {endpoint})", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    print(
        "error: the job failed and the elastic agent's restart budget is spent "
        f"(--max-restarts {max_restarts}); the failures are in {path}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", required=True, help="node count: N, or MIN:MAX (a job that shrinks and grows)")
    p.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (one per accelerator)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after failures before the job ends")
    p.add_argument("--rendezvous", required=True, help="HOST:PORT of the c10d rendezvous (the first node)")
    p.add_argument("--job-id", default=None, help="rendezvous id (default: the Slurm or AWS Batch job id)")
    p.add_argument("--last-call-s", type=int, default=30,
                   help="once MIN nodes are in, how long a rendezvous waits for more (seconds)")  # fmt: skip
    p.add_argument("--join-timeout-s", type=int, default=600,
                   help="how long a rendezvous waits for MIN nodes before failing (seconds)")  # fmt: skip
    p.add_argument("--local-addr", default=None,
                   help="this node's address for the others (default: its host name resolved)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the agent's command and exit")


def run(args: argparse.Namespace) -> int:
    nmin, nmax = parse_nodes(args.nodes)
    if args.procs_per_node < 1 or args.max_restarts < 0 or args.last_call_s < 0 or args.join_timeout_s < 1:
        raise UserError("need --procs-per-node >= 1, --max-restarts >= 0, --last-call-s >= 0 and "
                        "--join-timeout-s >= 1")  # fmt: skip
    if ":" not in args.rendezvous:
        raise UserError(f"--rendezvous {args.rendezvous!r}: expected HOST:PORT")
    if not args.passthrough:
        raise UserError("no train.py arguments: add them after --, e.g. -- --config smoke")
    config, overrides = split_train_args(args.passthrough)
    cfg = load_config(config, overrides)
    check_world_sizes(cfg, nmin, nmax, args.procs_per_node)
    cmd = agent_command(args, nmin, nmax, args.job_id or default_job_id())
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return supervise(cmd, Path(cfg.run.dir), args.max_restarts, args.rendezvous)
