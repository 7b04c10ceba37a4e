"""Ranks forked from one interpreter that has already imported the heavy libraries.

A rank started as a fresh interpreter spends about 5 s of CPU importing torch, transformers and DeepSpeed
(1 s of it ``torch._inductor``, which every ZeRO engine pulls in through DeepSpeed's Muon module) before it
reads its arguments, and the suite starts ranks dozens of times. DeepSpeed's own tests keep their worker
processes between tests for the same reason (``reuse_dist_env``); PyTorch's ``MultiProcessTestCase`` forks its
ranks. Here one server process does those imports once and forks a child per rank, which then runs the script
as ``python -u SCRIPT ARGS`` (or ``-m MODULE``) would: ``runpy`` as ``__main__``, its own argv, ``sys.path[0]``,
environment, working directory, stdin on /dev/null, unbuffered stdout and stderr into files, and the usual
interpreter exit (exit code, ``atexit``, uncaught exceptions).

Only third-party libraries are imported ahead, and only those that read nothing from the environment at import
that a rank could set differently: ``tests.conftest`` sends a rank to a server whose environment differs from
the rank's only in the launcher's keys and the project's own (``FORKABLE_ENV``), starting one per other
environment, and never on a machine with a GPU (a process must not fork after initialising CUDA). The
project's modules load in the child, under the rank's environment. What still differs from a fresh
interpreter: ranks forked by one server share its ``str`` hash seed, and what the preloaded imports print goes
to the server's log, not to the rank's stderr.

Protocol (JSON lines): the harness writes ``{"id", "argv", "env", "cwd", "umask", "stdout", "stderr"}`` to the
server's stdin (``umask`` null: the server's); the server answers ``{"id", "pid"}`` at once and ``{"pid",
"returncode"}`` (``Popen``'s convention: -N for signal N) when that child ends. The server ends when its stdin
closes.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import runpy
import select
import sys

LIBC = ctypes.CDLL(None)

PRELOAD = (
    "numpy",
    "h5py",
    "psutil",
    "yaml",
    "tokenizers",
    "torch",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by every ZeRO engine (torch._inductor: 1 s)
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt_neox.modeling_gpt_neox",
)
# What may differ between a forked rank and the server: what the launcher sets per rank, pytest's name of the
# test, what the libraries read when used rather than at import (set in the pytest process by the code under
# test: the engine's cuBLAS setting, torch.compile's cache and its compiled kernels' pointer, the tokenizers'
# thread pool, the datasets library, which is not preloaded), what ``import deepspeed`` sets (the server has it
# too), and the project's own variables (its modules are not preloaded).
FORKABLE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR")
FORKABLE_ENV += ("MASTER_PORT", "PYTEST_CURRENT_TEST")
FORKABLE_ENV += ("CUBLAS_WORKSPACE_CONFIG", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
FORKABLE_ENV += ("RAYON_RS_NUM_CPUS", "HF_DATASETS_OFFLINE", "PYTORCH_NVML_BASED_CUDA_CHECK")
FORKABLE_PREFIXES = ("WIKIPRETRAIN_", "WANDB_")
SITECUSTOMIZE_ENV = "WIKIPRETRAIN_TEST_SITECUSTOMIZE"
"""A folder whose ``sitecustomize.py`` a rank runs at start-up: on PYTHONPATH for a fresh interpreter, run by
the child after the fork here (the server's own start-up imported none)."""


def serve(requests: int, replies: int) -> dict | None:
    """Fork a child per request and report its pid, then its exit; in a child, return its request. None once
    the harness has closed ``requests``."""
    children: set[int] = set()
    pending = b""

    def reply(msg: dict) -> None:
        os.write(replies, (json.dumps(msg) + "\n").encode())

    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests, 1 << 20)
            if not chunk:
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                LIBC.fflush(None)  # nothing of the server's C stdio buffers is written again by the child
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    os.close(replies)
                    return req
                children.add(pid)
                reply({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def become(req: dict, set_by_imports: dict[str, str]) -> str | None:
    """In a forked child: take the rank's working directory, umask, environment (with what the preloaded imports
    set in it, as they would have), stdin, stdout, stderr, argv and ``sys.path[0]``, and a numpy global seed of
    its own; the script's path (None for ``-m MODULE``, whose name is then ``sys.argv[0]``)."""
    os.chdir(req["cwd"])
    if req.get("umask") is not None:
        os.umask(req["umask"])
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in set_by_imports.items():  # e.g. deepspeed's PYTORCH_NVML_BASED_CUDA_CHECK
        os.environ.setdefault(key, value)
    import numpy

    numpy.random.seed()  # from the OS, as at a fresh import (Python's own random reseeds itself at a fork)
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        if opened != fd:  # fd 0, the requests' pipe, was closed after the fork: /dev/null takes its number
            os.dup2(opened, fd)
            os.close(opened)
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 (the process's stdin, kept open)
    # as ``python -u``: unbuffered binary layer, text written through, C stdio's stdout unbuffered
    LIBC.setvbuf(ctypes.c_void_p.in_dll(LIBC, "stdout"), None, 2, 0)  # _IONBF
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding, "backslashreplace", write_through=True
    )
    if req["argv"][0] == "-m":  # ``python -m MODULE``: runpy sets argv[0] to the module's file
        sys.argv, sys.path[0] = list(req["argv"][1:]), os.getcwd()
        return None
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    return os.path.abspath(sys.argv[0])  # __file__ absolute, as Python gives a script since 3.9


def main() -> None:
    replies = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to the server's stderr, not into the replies
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    import torch

    if torch.cuda.is_available():  # the harness does not send ranks here on a GPU machine; never fork after CUDA
        sys.exit("prefork: a CUDA device is present; ranks must start as fresh interpreters")
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the forking thread: locks the others hold would never be released
        sys.exit(f"prefork: the preloaded libraries started {threads - 1} thread(s); a fork would lose them")
    os.write(replies, b'{"ready": true}\n')
    req = serve(0, replies)
    if req is None:
        return
    script = become(req, set_by_imports)
    hooks = os.environ.get(SITECUSTOMIZE_ENV)
    if hooks:  # what a fresh interpreter with this folder on PYTHONPATH imports at start-up (tests/conftest.py)
        path = os.path.join(hooks, "sitecustomize.py")  # exec, not runpy: that would change sys.argv[0]
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), {"__name__": "sitecustomize", "__file__": path})
    if script is None:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")  # as __main__, with the script's __file__


if __name__ == "__main__":
    main()
