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
- the global batch must divide at every world size the job may shrink or grow to: checked before the start;
- a rank that dies of a signal (NCCL's watchdog aborts a rank, SIGABRT, with no word of ours; the OOM
  killer's SIGKILL; a crash's SIGSEGV) gets what train.py gives a lost peer: one line naming the rank, its
  local rank and pid, the host and the signal, and a ``failure`` event (``rank``, ``why``, ``signal``,
  ``host``) that goodput and the per-segment figures count, at every restart the agent makes, not only the
  last. The agent learns the exit status first-hand: it runs in a process of ours (``python -m
  launch.elastic --run-dir=DIR -m torch.distributed.run ...``: torchrun's own ``main``, in-process), whose
  agent is torch's ``LocalElasticAgent`` with ``_monitor_workers`` (the hook ``SimpleElasticAgent`` leaves
  to its subclasses) extended to read the ``ProcessFailure`` of each failed rank; no log line is parsed.
  A spent budget still ends the job with exit 1;
- the agent itself killed (the OOM killer's SIGKILL, or a signal that did not come through this command)
  is not a spent budget: its ranks see their launcher gone, save and exit 3 (``launcher_lost`` events),
  and the job ends with one line saying so, the step they saved, and code 3 for the scheduler to requeue:
  the next start resumes from that checkpoint, as after a preemption. Ranks that did not stop in order
  (no ``launcher_lost`` or ``sigterm`` event) end the job with exit 1.
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

from common.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, SUPERVISED_ENV, UserError
from common.packages import python_path
from training import events, ownership
from training.config import Config, gradient_accumulation, load_config

REPO = Path(__file__).resolve().parents[1]
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


def agent_command(args: argparse.Namespace, nmin: int, nmax: int, job_id: str, run_dir: Path) -> list[str]:
    """torchrun's agent, run by ``agent_main`` (this module as ``__main__``), which follows its ranks' deaths.

    The command line still names ``torch.distributed.run``: the ranks' launcher watch (training.trainer's
    ``launcher_chain``) and whoever reads ``ps`` recognise the agent by it.
    """
    conf = f"last_call_timeout={args.last_call_s},join_timeout={args.join_timeout_s}"
    conf += f",is_host={str(hosts_rendezvous(args.rendezvous)).lower()}"
    return [
        sys.executable,
        "-m",
        "launch.elastic",
        f"--run-dir={run_dir}",
        "-m",
        "torch.distributed.run",
        f"--nnodes={nmin}:{nmax}",
        f"--nproc-per-node={args.procs_per_node}",
        f"--max-restarts={args.max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rendezvous}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf={conf}",
        "--monitor-interval=1",
        *([f"--local-addr={args.local_addr}"] if args.local_addr else []),
        str(REPO / "train.py"),
        *args.passthrough,
    ]


def default_job_id() -> str:
    for name in ("SLURM_JOB_ID", "AWS_BATCH_JOB_ID"):
        v = os.environ.get(name, "").split("#")[0]  # AWS Batch node ids are "<job>#<node>"
        if v:
            return v
    return "wp-elastic"


# What a signal that ends a process usually means, for the line that reports it.
SIGNAL_HINTS = {
    "SIGABRT": "an abort: under NCCL, its watchdog's once a collective failed or timed out: see its lines",
    "SIGKILL": "the kernel's OOM killer (see dmesg) or a kill -9",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or the storage of a mapped file gone",
}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _hinted(name: str) -> str:
    hint = SIGNAL_HINTS.get(name)
    return f"{name} ({hint})" if hint else name


def rank_died(
    run_dir: Path, rank: int, local_rank: int, pid: int, signum: int, failures: int, max_restarts: int
) -> None:
    """A rank of this node ended by a signal: its ``failure`` event and one line, as train.py's own for a lost
    peer. ``failures`` counts this agent's failed rounds, this one included: the agent restarts while they
    are within ``max_restarts``."""
    name, host = signal_name(signum), socket.gethostname()
    why = f"died of {name} on host {host} (local rank {local_rank}, pid {pid})"
    events.record(run_dir, "failure", rank=rank, why=why, signal=name, host=host, local_rank=local_rank, pid=pid)
    if failures <= max_restarts:
        restart = f"restart {failures} of {max_restarts}"
        then = f"the elastic agent restarts the job from its last checkpoint ({restart})"
    else:
        then = (
            f"the elastic agent's restart budget is spent (--max-restarts {max_restarts}): the job ends "
            "here and resumes from its last checkpoint on the next start"
        )
    print(
        f"error: rank {rank} (local rank {local_rank}, pid {pid}) on host {host} died of {_hinted(name)}; {then}",
        file=sys.stderr,
        flush=True,
    )


def agent_main(argv: list[str]) -> int:
    """``python -m launch.elastic --run-dir=DIR -m torch.distributed.run ARGS``: torchrun's ``main`` in this
    process, its agent extended to report each rank that dies of a signal (``rank_died``).

    torchrun's ``launch_agent`` builds the agent from the name ``LocalElasticAgent`` of its module
    (torch.distributed.launcher.api, as since torch 1.9; read in 2.13): that name is bound to a subclass whose
    ``_monitor_workers`` (``SimpleElasticAgent``'s extension point, called once a monitor interval) reads the
    ``ProcessFailure`` (global rank, local rank, pid, exit code) of every failed round before the agent
    restarts or ends the job. A job that fails ends with exit 1 without torchrun's ``ChildFailedError``
    traceback (every failed rank has said why: train.py's line or ``rank_died``'s), a signal to the agent
    with 128 + its number after the agent has stopped the ranks.
    """
    if len(argv) < 3 or not argv[0].startswith("--run-dir=") or argv[1:3] != ["-m", "torch.distributed.run"]:
        print(
            "error: usage: python -m launch.elastic --run-dir=DIR -m torch.distributed.run ARGS (run by "
            "python -m launch elastic)",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    run_dir, torchrun_args = Path(argv[0].split("=", 1)[1]), argv[3:]

    # on call (start-up time): only the agent's process loads torch; `launch elastic`, which imports this module
    # to start it, does not
    import torch
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    class Agent(LocalElasticAgent):
        failures = 0  # failed rounds, as the agent counts them against --max-restarts

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                self.failures += 1
                for rank, f in sorted(result.failures.items()):
                    if f.exitcode < 0:  # ended by a signal: no line of train.py's, no event
                        rank_died(
                            run_dir,
                            rank,
                            f.local_rank,
                            f.pid,
                            -f.exitcode,
                            self.failures,
                            worker_group.spec.max_restarts,
                        )
            return result

    if getattr(launcher_api, "LocalElasticAgent", None) is not LocalElasticAgent:  # a torch that builds it
        # elsewhere would silently lose the reports: say so instead
        print(
            f"error: torch {torch.__version__}: torch.distributed.launcher.api no longer builds "
            "LocalElasticAgent; launch elastic cannot follow its ranks",
            file=sys.stderr,
        )
        return 1
    launcher_api.LocalElasticAgent = Agent  # type: ignore[misc]
    sys.argv = ["torch.distributed.run", *torchrun_args]
    try:
        torchrun.main(torchrun_args)
    except ChildFailedError:
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def supervise(
    cmd: list[str],
    run_dir: Path,
    max_restarts: int,
    endpoint: str,
    grace_s: float = 120.0,
    holding: ownership.Holding | None = None,
) -> int:
    """Run the agent; end it at once on bad input; map its outcome to our exit codes.

    A signal to this process (the scheduler's preemption: Slurm signals every process of the step, AWS Batch
    the container's first one) is passed to the agent once, which stops its ranks (they save) without a
    restart, and the job ends with 3. A SIGTERM that reaches ranks alone comes from their agent (stopping them
    for a restart, when nodes join) or is a failure of that rank: the agent restarts the job.

    ``holding``: this job's owner's marks (``training.ownership``), held here for the whole job: the agent and
    its ranks get the token and run under them, its restarts included. A mark taken over by another job ends
    the agent and its ranks at once, with one line and exit 4.
    """
    path = run_dir / events.EVENTS
    offset0 = offset = path.stat().st_size if path.exists() else 0
    signalled: list[int] = []
    # A node that joins a later rendezvous round (one coming back) waits forever for the workers' store
    # address if the agents share their rendezvous store with the workers: the others built it in their first
    # round and never publish it again (torch 2.13, dynamic_rendezvous.next_rendezvous). Opt out of sharing.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", SUPERVISED_ENV: "1"}
    # torchrun's agent gives its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down with SIGABRT) unless its
    # own environment holds a value: 2, so a NCCL failure ends each rank through our one-line handler (the
    # rank applies deepspeed.nccl_async_error_handling over whatever it inherits).
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    # The agent and its ranks run where this command was started, as under torchrun or the deepspeed launcher:
    # relative paths (run.dir, data.*, --config) name the same files for the ranks as for this process, which
    # follows run.dir's events. This repository's packages come first on their path.
    env["PYTHONPATH"] = python_path(str(REPO))
    if holding is not None:
        env[ownership.TOKEN_ENV] = holding.token
    agent = subprocess.Popen(cmd, env=env, start_new_session=True)  # signals come through us, once
    seen: dict[int, psutil.Process] = {}

    def forward(signum, frame) -> None:  # a signal handler's signature
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
            if holding is not None and holding.lost:  # the renewal thread found another job's mark
                _kill_tree(agent.pid)
                agent.wait()
                print(f"error: launch elastic: {holding.lost}", file=sys.stderr, flush=True)
                return ownership.EXIT_FENCED
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
        print(
            f"launch elastic: {name}: the ranks stopped after saving; the job ends with code "
            f"{EXIT_PREEMPTED} for the scheduler to requeue",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    signum = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + signal.NSIG else None  # agent_main's 128 + N
    if signum is not None:
        return agent_killed(run_dir, offset0, agent.pid, signum, killed=rc < 0)
    if not started:
        print(
            f"error: the elastic agent ended (exit code {rc}) before training started: see its lines above "
            f"(rendezvous {endpoint})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(
        "error: the job failed and the elastic agent's restart budget is spent "
        f"(--max-restarts {max_restarts}); the failures are in {path}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def agent_killed(run_dir: Path, offset: int, pid: int, signum: int, killed: bool) -> int:
    """The agent ended by a signal that did not come through this command (the OOM killer's SIGKILL): its
    ranks saw their launcher gone (or, for a signal the agent could handle, were stopped by it), saved and
    exited 3. Exit 3 (requeue: the next start resumes from that save) when they recorded the stop, else 1."""
    evs = events.read_from(run_dir, offset)[0]  # this job's events
    started = [i for i, e in enumerate(evs) if e["event"] == "start"]
    last = evs[started[-1] :] if started else []  # the agent's last round of ranks: their start and stop
    stops = [int(e["step"]) for e in last if e["event"] in ("launcher_lost", "sigterm") and "step" in e]
    saves = [int(e["step"]) for e in last if e["event"] == "checkpoint" or e["event"] == "start"]
    how = "was killed by" if killed else "got"  # SIGKILL; or a signal torchrun handles: it stopped its ranks
    name, host = _hinted(signal_name(signum)), socket.gethostname()
    what = f"the elastic agent (pid {pid}) on host {host} {how} {name}"
    if not started or not stops:
        when = "before training started" if not started else "and its ranks did not stop in order"
        print(
            f"error: {what} {when}: the job ends here and resumes from its last checkpoint on the next start",
            file=sys.stderr,
            flush=True,
        )
        return 1
    stopped, resume = max(stops), max(saves)
    saved = "saved it" if resume == stopped else f"its last checkpoint is step {resume}"
    print(
        f"error: {what}; its ranks stopped after step {stopped} and {saved}: the job ends with code "
        f"{EXIT_PREEMPTED} and resumes from step {resume} on the next start",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PREEMPTED


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", required=True, help="node count: N, or MIN:MAX (a job that shrinks and grows)")
    p.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (one per accelerator)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after failures before the job ends")
    p.add_argument("--rendezvous", required=True, help="HOST:PORT of the c10d rendezvous (the first node)")
    p.add_argument("--job-id", default=None, help="rendezvous id (default: the Slurm or AWS Batch job id)")
    p.add_argument(
        "--last-call-s",
        type=int,
        default=30,
        help="once MIN nodes are in, how long a rendezvous waits for more (seconds)",
    )
    p.add_argument(
        "--join-timeout-s",
        type=int,
        default=600,
        help="how long a rendezvous waits for MIN nodes before failing (seconds)",
    )
    p.add_argument(
        "--local-addr", default=None, help="this node's address for the others (default: its host name resolved)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the agent's command and exit")


def run(args: argparse.Namespace) -> int:
    nmin, nmax = parse_nodes(args.nodes)
    if args.procs_per_node < 1 or args.max_restarts < 0 or args.last_call_s < 0 or args.join_timeout_s < 1:
        raise UserError("need --procs-per-node >= 1, --max-restarts >= 0, --last-call-s >= 0 and --join-timeout-s >= 1")
    if ":" not in args.rendezvous:
        raise UserError(f"--rendezvous {args.rendezvous!r}: expected HOST:PORT")
    if not args.passthrough:
        raise UserError("no train.py arguments: add them after --, e.g. -- --config smoke")
    config, overrides = split_train_args(args.passthrough)
    cfg = load_config(config, overrides)
    check_world_sizes(cfg, nmin, nmax, args.procs_per_node)
    job = args.job_id or default_job_id()
    run_dir = Path(cfg.run.dir)
    cmd = agent_command(args, nmin, nmax, job, run_dir)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return own_and_supervise(cfg, args, cmd, job)


def own_and_supervise(cfg: Config, args: argparse.Namespace, cmd: list[str], job: str) -> int:
    """Take the run's owner's marks before the agent starts, hold them for the whole job (``supervise``) and
    release them at its end. The rendezvous host's ``launch elastic`` takes them; the other nodes' join under
    them, and are refused as it is when a live job of another rendezvous holds the run."""
    run_dir = Path(cfg.run.dir)
    dirs = [run_dir, Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"]
    job = ownership.job_id(job) or job  # and the scheduler's attempt: a requeued job is another job here
    holding = None
    if "is_host=true" in next(a for a in cmd if a.startswith("--rdzv-conf=")):
        holding = ownership.acquire(
            dirs,
            stale_s=cfg.run.owner_stale_s,
            takeover=cfg.run.takeover,
            role="launch elastic",
            job=job,
            rendezvous=args.rendezvous,
            run_dir=run_dir,
        )
        holding.on_lost = lambda line: None  # supervise() ends the agent with the line
    else:
        ownership.joinable(dirs, cfg.run.owner_stale_s, job, args.rendezvous)
    try:
        return supervise(cmd, run_dir, args.max_restarts, args.rendezvous, holding=holding)
    finally:
        if holding is not None:
            holding.release(run_dir)


if __name__ == "__main__":  # the agent process that supervise() starts (agent_command)
    sys.exit(agent_main(sys.argv[1:]))
