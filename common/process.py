"""Ending a process whose work is done, without the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_fast(rc: int | None) -> NoReturn:
    """Exit with ``rc`` after what a normal exit does that matters, without the rest.

    Done here: the ``atexit`` handlers (``multiprocessing``'s child cleanup, ``weakref.finalize`` objects,
    wandb's), logging's and Python's stdio flushes, and C's (``fflush(NULL)``: lines C++ code printed, NCCL's
    debug output). A Python file object left open and unflushed would lose its buffer: the training process
    closes what it writes. Skipped: module finalisation, where a training process with torch,
    DeepSpeed and ``transformers`` loaded spends 1.5-2 s in C++ destructors after its last line (measured on the
    2-core CI machine), every rank of every job. A process with a non-daemon thread still running exits the
    normal way, which waits for it, after ending its process group if one is still up (:func:`end_process_group`).
    """
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        if "torch.distributed" in sys.modules:  # the teardown runs after all: no process group left to it
            end_process_group()
        sys.exit(rc)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader is gone
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # no C library to ask: nothing of C's to flush
        ctypes.CDLL(None).fflush(None)
    os._exit(int(rc or 0))


def end_process_group() -> None:
    """Destroy this process's default process group, if it has one: its C++ threads (gloo's workers, the
    store's) are joined here, while the interpreter still runs. One left to interpreter teardown can be
    destroyed while still joinable, and the process dies of SIGABRT (``terminate called without an active
    exception``) after its work is done: a benchmark's or a test's worker then reads as failed. Every process
    that starts a group ends it in a ``finally`` with this (``tests/test_process_groups.py`` holds the code to
    it), or leaves through :func:`exit_fast` / ``os._exit``, which run no C++ destructor."""
    import torch.distributed as dist  # on call (start-up time): the launchers import this module without torch

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
