"""Shared fixtures: the real enwiki sample (from the gensim wheel), its text, and a vocabulary built from
it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# The real vocabulary and tokenizer: ../shared/data beside the checkout, or where WIKIPRETRAIN_SHARED_DATA says
# (scripts/gpu.sh: the GPU bundle's copy, since ../shared does not travel).
SHARED_DATA = Path(os.environ.get("WIKIPRETRAIN_SHARED_DATA") or REPO.parent / "shared" / "data")


def run_env() -> dict[str, str]:
    """Environment for subprocesses (CLI, deepspeed launcher) that must import the project."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launcher(ranks: int, port: int | None = None) -> list[str]:
    """The DeepSpeed launcher for ``ranks`` local CPU ranks, through this interpreter.

    CI runs pytest as .venv/bin/python without activating the venv, so no ``deepspeed`` script is on PATH.
    """
    port = port or 29500 + os.getpid() % 1000
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(port),
    ]


# Two workers: the README's test command runs the suite under pytest-xdist (``-n 2``). Much of it waits (on
# start-ups, rendezvous, timeouts, a rank that hangs on purpose), so a second worker fills the idle core. A
# worker runs whole modules (their module fixtures start work ahead, ``TwoAtATime``), the modules with time
# bounds one after another on one worker (``SERIAL``), and the longest first (``FIRST``) so that both workers
# end together. Without ``-n`` nothing here changes the run.
SERIAL = ("tests/test_train_faults.py", "tests/test_train_twonode.py", "tests/test_launch_twonode.py")
FIRST = (
    "timed",
    "tests/test_train.py",
    "tests/test_benchmarks.py",
    "tests/test_elastic.py",
    "tests/test_bundle.py",
    "tests/test_gpu_calls.py",
)
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker computes on one thread (OpenMP's): two share two cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _work_unit(nodeid: str) -> str:
    """What one worker runs in one go: the test's module, or ``timed`` for the modules of ``SERIAL``."""
    module = nodeid.split("::", 1)[0]
    return "timed" if module in SERIAL else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``-n N`` (``--dist load``, xdist's default): work units of ``_work_unit``, in collection order."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # collection order: ``FIRST`` first
    return ByModule(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """The GPU tier's concurrent lanes (scripts/gpu.sh call2) share one device: ``$WIKIPRETRAIN_DEVICE_MEMORY_GIB``
    caps this process as it caps every rank a test starts, for the tests that compute in the pytest process."""
    if os.environ.get("WIKIPRETRAIN_DEVICE_MEMORY_GIB"):  # training.devices.MEMORY_CAP_ENV
        import torch  # on call (start-up time): only where a cap is asked for

        if torch.cuda.is_available():
            from training.engine import cap_device_memory

            cap_device_memory()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist, the units of ``FIRST`` ahead of the rest (a stable sort: each module's order is kept)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {unit: i for i, unit in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(FIRST)))


_shared: list[Path] = []  # the folders ``built_once`` gave this process


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> Path:
    """A session fixture's folder ``name``, filled by ``build(folder)`` once per run: under xdist by the first
    worker that asks, in the run's temporary folder, the other waiting for it and reading the same files;
    else in this session's. The tests read it and copy what they change."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent  # the workers' temporary folders are in it
    folder, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with (root / f"shared-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when ``build`` raises
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed left
            folder.mkdir()
            build(folder)
            done.touch()
    _shared.append(folder)
    return folder


class _Popened:
    """A rank started as a fresh interpreter (``python``, ``-u`` unless ``buffered``, in ``cwd``, with ``umask``);
    its output read as it comes (a rank's DataLoader workers hold its pipes until they notice it is gone)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path | str = REPO,
        python: str | Path = sys.executable,
        buffered: bool = False,
        umask: int | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [str(python), *([] if buffered else ["-u"]), *argv],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=None if umask is None else (lambda: os.umask(umask)),
        )
        self.out = ("", "")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        self.out = self.proc.communicate()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def output(self) -> tuple[str, str]:
        self.reader.join(timeout=60)
        return self.out


class _Forked:
    """A rank forked by the ``tests.prefork`` server; its output in files, read once it has ended."""

    def __init__(
        self,
        server: _PreforkServer,
        argv: list[str],
        env: dict[str, str],
        files: Path,
        cwd: Path | str = REPO,
        umask: int | None = None,
    ) -> None:
        self.server, self.files = server, (files.with_suffix(".stdout"), files.with_suffix(".stderr"))
        self.pid = server.spawn(argv, env, *self.files, cwd=cwd, umask=umask)

    def poll(self) -> int | None:
        return self.server.exit_of(self.pid)

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def output(self) -> tuple[str, str]:
        deadline = time.monotonic() + 60
        while self.poll() is None and time.monotonic() < deadline:  # its exit, as the server reaped it
            time.sleep(0.05)
        out, err = (f.read_text(errors="replace") if f.exists() else "" for f in self.files)
        return out, err


class _PreforkServer:
    """A ``tests.prefork`` server, its libraries imported under ``env``; ended with the session."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.log = Path(tempfile.mkdtemp(prefix="prefork-")) / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.prefork"],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.exits: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.lock, self.changed, self.next_id = threading.Lock(), threading.Condition(), 0
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)  # the imports: seconds
        first = self.proc.stdout.readline() if ready else b""
        if json.loads(first or "{}").get("ready") is not True:
            self.close()
            raise RuntimeError(f"tests.prefork did not start:\n{self.log.read_text()[-3000:]}")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "id" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                    self.exits.pop(msg["pid"], None)  # a reused pid: the earlier child's exit is not this one's
                else:
                    self.exits[msg["pid"]] = msg["returncode"]
                self.changed.notify_all()

    def exit_of(self, pid: int) -> int | None:
        """The exit code of this server's child ``pid``; None while it runs. A child whose server has ended
        without reporting it counts as failed (its exit will never be known)."""
        code = self.exits.get(pid)
        if code is None and self.proc.poll() is not None and not self.reader.is_alive():
            return SERVER_LOST
        return code

    def alive(self) -> bool:
        return self.proc.poll() is None

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a rank with this environment may be forked here: it differs from the server's only in
        keys that nothing preloaded reads at import."""
        from tests.prefork import FORKABLE_ENV, FORKABLE_PREFIXES

        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k in FORKABLE_ENV or k.startswith(FORKABLE_PREFIXES) for k in differ)

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        cwd: Path | str = REPO,
        umask: int | None = None,
    ) -> int:
        """Fork a rank running ``argv`` with ``env`` in ``cwd`` (with ``umask``, else the server's), its output
        into the two files; its pid."""
        assert self.proc.stdin is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            req = {"id": ident, "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout), "umask": umask}
            self.proc.stdin.write((json.dumps({**req, "stderr": str(stderr)}) + "\n").encode())
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: ident in self.pids, timeout=60):
                raise RuntimeError(f"tests.prefork did not fork:\n{self.log.read_text()[-3000:]}")
            return self.pids.pop(ident)

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.log.parent, ignore_errors=True)


SERVER_LOST = -255  # the exit code of a forked rank whose server ended before reporting it
_servers: list[_PreforkServer] = []
_servers_lock = threading.Lock()
_failed: list[str] = []  # a server that did not start: the session's ranks start fresh
MAX_SERVERS = 3  # one per environment that changes what the preloaded libraries read at import


def _may_fork() -> bool:
    """Whether test processes may be forked here: not on a GPU machine (no fork after CUDA is initialised), and
    not where ``WIKIPRETRAIN_TEST_PREFORK=0`` asks for fresh interpreters."""
    if os.environ.get("WIKIPRETRAIN_TEST_PREFORK", "1") == "0":
        return False
    import torch

    return not torch.cuda.is_available()


def _prefork(env: dict[str, str]) -> _PreforkServer | None:
    """A prefork server that may fork a rank with ``env`` (started with ``env`` if none may yet), or None
    where ranks must start fresh: a GPU machine (no fork after CUDA is initialised), ``MAX_SERVERS`` running
    already (a warning in pytest's summary: correct, but 5 s slower per rank), or
    ``WIKIPRETRAIN_TEST_PREFORK=0``. Thread-safe: runs start from ``TwoAtATime``'s threads."""
    with _servers_lock:  # two threads that find no server start one, not two
        if _failed:
            return None
        _servers[:] = [s for s in _servers if s.alive()]  # one that died (killed, out of memory) is replaced
        for server in _servers:
            if server.takes(env):
                return server
        if not _may_fork():
            return None
        if len(_servers) == MAX_SERVERS:
            message = f"prefork: {MAX_SERVERS} servers running; a rank starts as a fresh interpreter"
            warnings.warn(message, stacklevel=3)
            return None
        try:
            _servers.append(_PreforkServer(env))
        except RuntimeError as e:  # correct without it, 5 s slower per rank
            warnings.warn(f"prefork: {e}; ranks start as fresh interpreters", stacklevel=3)
            _failed.append(str(e))
            return None
        return _servers[-1]


@pytest.fixture(scope="session", autouse=True)
def _close_prefork():
    yield
    for server in _servers:
        server.close()


def _is_checkpoint_file(path: Path) -> bool:
    """A file a run's checkpoint holds and a resume, an export or a conversion reads (of DeepSpeed or ours)."""
    name = path.name
    return (
        name.endswith(("_model_states.pt", "_optim_states.pt"))
        or (name.startswith("rng_rank") and name.endswith(".pt"))
        or any(p.name.startswith("universal-") for p in path.parents)
    )


@pytest.fixture(scope="session", autouse=True)
def _checkpoints_within_the_allowlist(tmp_path_factory):
    """At the end of the session: every checkpoint file the suite wrote (ZeRO 0-3, BF16 and FP32, LANS, LAMB,
    AdamW, background saves, universal conversions) names no global beyond ``training.checkpoint.safeload.ALLOWED``, so
    a restricted load reads it. The doctored copies of test_untrusted_checkpoints.py and files the tests
    damaged on purpose (no longer a zip) are left out, and counted."""
    yield
    import torch

    from training.checkpoint.safeload import allowed_names

    allowed, checked, damaged, beyond = allowed_names(), 0, 0, []
    roots = [tmp_path_factory.getbasetemp(), *dict.fromkeys(_shared)]  # and what ``built_once`` shared
    for path in sorted(p for root in roots for p in root.rglob("*.pt")):
        if "doctored" in path.parts or not _is_checkpoint_file(path):
            continue
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except (RuntimeError, ValueError, OSError):  # truncated or overwritten by a fault test
            damaged += 1
            continue
        checked += 1
        if unsafe - allowed:
            beyond.append(f"{path}: {sorted(unsafe - allowed)}")
    print(f"\ncheckpoint files checked against the allowlist: {checked} ({damaged} damaged on purpose, left out)")
    assert checked or not damaged, "every checkpoint file the suite wrote was unreadable"
    assert not beyond, "checkpoint files name globals beyond training.checkpoint.safeload.ALLOWED:\n" + "\n".join(
        beyond[:20]
    )


def _start(
    argv: list[str],
    env: dict[str, str],
    files: Path,
    cwd: Path | str = REPO,
    umask: int | None = None,
    fork: bool = True,
    **fresh: Any,
) -> _Popened | _Forked:
    """``python -u ARGV`` in ``cwd`` (the repository root): forked by the prefork server where ``fork`` and
    ``env`` allow, else a fresh interpreter (``fresh``: ``_Popened``'s other arguments). A test-only
    ``sitecustomize`` is named by ``WIKIPRETRAIN_TEST_SITECUSTOMIZE`` (its folder): on PYTHONPATH for a fresh
    interpreter, run after the fork by a forked one (``tests.prefork``)."""
    from tests.prefork import SITECUSTOMIZE_ENV

    server = _prefork(env) if fork else None
    if server is not None:
        return _Forked(server, argv, env, files, cwd, umask)
    if env.get(SITECUSTOMIZE_ENV):
        env = {**env, "PYTHONPATH": env[SITECUSTOMIZE_ENV] + os.pathsep + env.get("PYTHONPATH", "")}
    return _Popened(argv, env, cwd, umask=umask, **fresh)


def run_python(
    args: list[str],
    timeout: float = 300,
    env: dict | None = None,
    *,
    cwd: Path | str = REPO,
    umask: int | None = None,
    fresh: bool = False,
    python: str | Path | None = None,
    buffered: bool = False,
) -> subprocess.CompletedProcess:
    """``python ARGS`` (a script or ``-m MODULE``, or interpreter options such as ``-c CODE`` or ``-S`` first)
    as one process in ``cwd`` (the repository root), with ``umask`` (else this process's), its output captured,
    as ``subprocess.run`` would (``TimeoutExpired`` past ``timeout``).

    Forked by the prefork server where its environment allows, else a fresh interpreter: always for interpreter
    options, for ``python`` (another interpreter, a venv's), for ``buffered`` (stdout and stderr buffered as a
    plain ``python`` has them, not ``-u``), and for ``fresh`` (an environment that the preloaded libraries
    read at import, or a one-off one that a server of its own would be started for)."""
    fork = not (fresh or python or buffered) and (args[0] == "-m" or not args[0].startswith("-"))
    popen = {"python": python or sys.executable, "buffered": buffered}
    files = Path(tempfile.mkdtemp(prefix="python-"))
    try:
        proc = _start(args, env or run_env(), files / "proc", cwd, umask, fork, **popen)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.signal(signal.SIGKILL)
                proc.output()
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.05)
        out, err = proc.output()
    finally:
        shutil.rmtree(files, ignore_errors=True)
    return subprocess.CompletedProcess(args, proc.poll() or 0, out, err)


def start_train(args: list[str], files: Path, env: dict[str, str] | None = None) -> _Popened | _Forked:
    """``train.py ARGS`` as one process (world size 1) left running: forked by the prefork server where its
    environment allows, else a fresh interpreter; its output in ``files`` (a path less its suffix) or read as
    it comes. The handle has ``pid``, ``poll()``, ``signal(sig)`` and ``output()``."""
    return _start(["train.py", *args], env or run_env(), files)


def data_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m data ARGS`` (``run_python``, 600 s at most); with ``check``, an exit other than 0 fails the
    test with both streams."""
    p = run_python(["-m", "data", *args], timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def expect_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    """A CLI's user error: exit 2 and one line ``error: ...`` on stderr, no traceback, holding every needle."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def start_ranks(
    script: list[str],
    ranks: int,
    timeout: float = 300,
    env: dict | None = None,
    one_device: bool = False,
) -> subprocess.CompletedProcess:
    """``ranks`` processes of ``script`` (a path and its arguments) on this machine, with the environment the
    DeepSpeed launcher gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_*, MASTER_*), started
    directly: the launcher's own two interpreter start-ups are seconds per job, and the tests of the launcher's
    behaviour (signals, a rank lost) start it themselves. Each rank is forked by the ``tests.prefork`` server
    (torch, transformers and DeepSpeed already imported) where its environment allows, else a fresh
    interpreter. ``one_device``: every rank with ``LOCAL_RANK=0``, to share this machine's one GPU (DeepSpeed
    would otherwise ask for a ``cuda:1`` that does not exist).

    As the launcher: when a rank fails, the others get SIGTERM (after 5 s: ranks that stop together, exit 3
    after a save, end on their own) and 30 s before they are killed; the exit code is the first failure seen;
    the output is every rank's, in rank order."""
    from common.net import free_port

    base = {
        **(env or run_env()),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(ranks),
        "LOCAL_SIZE": "1" if one_device else str(ranks),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
    }
    files = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs: list[_Popened | _Forked] = []
    try:
        for r in range(ranks):
            local = 0 if one_device else r
            argv = [script[0], f"--local_rank={local}", *script[1:]]
            rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(local)}
            procs.append(_start(argv, rank_env, files / f"rank{r}"))
        deadline, failed_at, first_code, terminated = time.monotonic() + timeout, None, 0, False
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed_at is None:
                failed = [p.poll() for p in procs if p.poll() not in (None, 0)]
                if failed:  # the exit code the launcher reports: the first failure it sees
                    failed_at, first_code = time.monotonic(), failed[0]
            elif not terminated and time.monotonic() - failed_at > 5:  # the others, stopping on their own
                terminated = True  # (exit 3 after a save), have had the launcher's poll interval and more
                for p in procs:
                    p.signal(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > 35:
                break
            time.sleep(0.1)
    finally:  # also when a rank could not be started: none is left waiting for its peers
        for p in procs:
            p.signal(signal.SIGKILL)
    outs = [p.output() for p in procs]
    shutil.rmtree(files, ignore_errors=True)
    codes = [p.poll() for p in procs]
    rc = first_code or next((c for c in codes if c), 0)  # killed at the timeout: -9
    return subprocess.CompletedProcess(script, rc or 0, "".join(o for o, _ in outs), "".join(e for _, e in outs))


def run_in_ranks(fn, args: tuple, nprocs: int, timeout: float = 300) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, as ``torch.multiprocessing.spawn``, but forked from this
    process where no CUDA device exists (the ranks then skip the 4 s of importing torch, the test module and what
    it imports; a process must not fork after initialising CUDA) and ``WIKIPRETRAIN_TEST_PREFORK`` is not 0.
    The tests that use it build their own gloo process group and touch nothing of pytest's. A rank that fails
    raises here, as with ``spawn``; ranks still running after ``timeout`` are killed and the test fails."""
    import torch.multiprocessing as mp

    if not _may_fork():
        ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    else:
        ctx = mp.start_processes(_one_thread, args=(fn, *args), nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{fn.__name__}: ranks still running after {timeout:g} s")


def _one_thread(rank: int, fn, *args) -> None:
    """A forked rank computes on one thread, as DataLoader workers do: OpenMP's pool, once used by the parent,
    does not survive a fork (its first parallel region would wait forever)."""
    import torch

    torch.set_num_threads(1)
    fn(rank, *args)


def module_tests(request, prefix: str) -> set[str]:
    """The names (less ``prefix``) of the tests this session runs from the module of ``request``: what a module
    fixture that starts their work in advance starts (``-k``, ``--lf`` and the like leave the others out)."""
    return {item.name.removeprefix(prefix) for item in request.session.items if item.path == request.path}


class TwoAtATime:
    """Tests' work started ahead of them, two at a time in the background (runs that mostly wait: start-ups,
    timeouts); ``runs(key)`` is key's result and folder, once done (a run that raised raises there)."""

    def __init__(self, name: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=name)
        self.runs: dict[str, tuple[Future[Any], Path]] = {}

    def start(self, key: str, where: Path, fn: Callable[..., Any], *args: Any) -> None:
        self.runs[key] = (self.pool.submit(fn, *args), where)

    def __call__(self, key: str) -> tuple[Any, Path]:
        future, where = self.runs[key]
        return future.result(), where

    def close(self, end: Callable[[], None] = lambda: None) -> None:
        """Cancel what has not started, ``end`` what runs (a failure or ^C left it), then wait for it."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        end()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    from data.sample import sample_dump_path

    return sample_dump_path()


@pytest.fixture(scope="session")
def shared_bert_vocab() -> Path:
    p = SHARED_DATA / "bert-base-uncased-vocab.txt"
    if not p.exists():
        pytest.skip(f"real BERT vocab not found at {p} (../shared is absent in a user's clone)")
    return p


@pytest.fixture(scope="session")
def shared_neox_tokenizer() -> Path:
    p = SHARED_DATA / "gpt-neox-20b-tokenizer.json"
    if not p.exists():
        pytest.skip(f"GPT-NeoX tokenizer not found at {p} (../shared is absent in a user's clone)")
    return p


WIKI_FIXTURE_SHARDS = 4


@pytest.fixture(scope="session")
def wiki_text_dir(tmp_path_factory, sample_dump) -> Path:
    """The enwiki sample extracted once per session (2 worker processes, 4 shards) by ``data.wiki``."""
    from data.wiki import extract_dump

    def build(root: Path) -> None:
        extract_dump([sample_dump], root / "text", workers=2, shards=WIKI_FIXTURE_SHARDS)

    return built_once(tmp_path_factory, "wikitext", build) / "text"


@pytest.fixture(scope="session")
def wiki_vocab(tmp_path_factory, wiki_text_dir) -> Path:
    """An 8000-entry uncased WordPiece ``vocab.txt`` (bert-base layout of special tokens) built on the
    sample."""
    from data.vocab import train_wordpiece

    root = built_once(tmp_path_factory, "vocab", lambda root: train_wordpiece(wiki_text_dir, root / "vocab.txt", 8000))
    return root / "vocab.txt"


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory, wiki_text_dir, wiki_vocab) -> dict[str, Path]:
    """BERT seq-128 shards of the enwiki sample: the first text shards for training, the last for eval."""

    def build(root: Path) -> None:
        shards = sorted(Path(wiki_text_dir).glob("*.txt"))
        assert len(shards) >= 2
        train_text, eval_text = root / "text-train", root / "text-eval"
        train_text.mkdir()
        eval_text.mkdir()
        for s in shards[:-1]:
            (train_text / s.name).write_bytes(s.read_bytes())
        (eval_text / shards[-1].name).write_bytes(shards[-1].read_bytes())
        for name, text, dupe in (("train", train_text, "2"), ("eval", eval_text, "1")):
            flags = ("--seq-len", "128", "--max-pred", "20", "--dupe-factor", dupe)
            res = run_python(data_bert(text, wiki_vocab, root / name, *flags), timeout=600)
            assert res.returncode == 0, res.stderr

    root = built_once(tmp_path_factory, "bertdata", build)
    return {"vocab": Path(wiki_vocab), "train": root / "train", "eval": root / "eval"}


@pytest.fixture(scope="session")
def bpe(wiki_text_dir: Path, tmp_path_factory) -> Path:
    """A 2000-entry byte-level BPE ``tokenizer.json`` with ``<|endoftext|>``, built on the sample."""
    from data.vocab import train_bpe

    root = built_once(tmp_path_factory, "bpe", lambda root: train_bpe(wiki_text_dir, root / "tokenizer.json", 2000))
    return root / "tokenizer.json"


@pytest.fixture
def logs(caplog):
    """Records of the application's logger (which does not propagate to the root logger caplog watches)."""
    import logging

    logger = logging.getLogger("wikipretrain")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="wikipretrain")
    yield caplog
    logger.removeHandler(caplog.handler)


def deepspeed(
    args: list[str], ranks: int = 2, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """train.py on ``ranks`` ranks, started as the DeepSpeed launcher starts them (``start_ranks``); on a
    machine with one GPU (the GPU tier) the ranks share it, under gloo."""
    one = ranks > 1 and shares_one_gpu()
    return start_ranks(["train.py", *args, *(["deepspeed.backend=gloo"] if one else [])], ranks, timeout, env, one)


def shares_one_gpu() -> bool:
    import torch

    return torch.cuda.device_count() == 1


def data_bert(text: Path, vocab: Path, out: Path, *flags: str) -> list[str]:
    """The arguments of ``python`` (``run_python``) that write BERT shards of the text files in ``text`` to
    ``out``: ``-m data bert``."""
    return ["-m", "data", "bert", "--text", str(text), "--vocab", str(vocab), "--out", str(out), *flags]


def smoke(data: dict[str, Path], run_dir: Path, *settings: str) -> list[str]:
    """train.py's arguments for the smoke recipe on ``bert_data``, writing to ``run_dir``, then ``settings``."""
    return [
        "--config",
        "smoke",
        f"run.dir={run_dir}",
        f"data.train={data['train']}",
        f"data.eval={data['eval']}",
        f"data.vocab={data['vocab']}",
        *settings,
    ]


# The setting of the runs that test what happens around training (faults, agents, nodes, saving, logging), not
# BF16 arithmetic: a CPU without native BF16 (AVX2) emulates it, several times slower. The straight run and the
# runs compared with it keep BF16.
FP32 = "deepspeed.precision=fp32"


def common(data: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return smoke(
        data,
        run_dir,
        "train.steps=8",
        "train.global_batch=16",
        "train.micro_batch=4",
        "logging.every=1",
        "checkpoint.every=4",
        "train.eval_every=4",
        "train.eval_samples=32",
        "train.deterministic=true",  # the resume tests below must still repeat exactly
        *extra,
    )


@pytest.fixture(scope="session")
def straight_run(bert_data, tmp_path_factory) -> Path:
    """The smoke recipe's 8 steps on 2 ranks (checkpoints at steps 4 and 8), run once: the tests that read it
    copy what they change."""

    def build(root: Path) -> None:
        shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
        res = deepspeed(common(bert_data, root / "run"))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        shm_new = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - shm_before
        (root / "shm_new.json").write_text(json.dumps(sorted(map(str, shm_new))))

    return built_once(tmp_path_factory, "straight", build) / "run"
