"""A rank that calls ``os.abort()`` on cue, as NCCL's watchdog does from its thread on a failed collective.

With this folder on PYTHONPATH and ``WP_ABORT_ON_CUE=PATH`` in the environment, a train.py rank of the job's
first round (TORCHELASTIC_RESTART_COUNT 0) starts a thread at interpreter start-up that aborts the process
once PATH exists: it dies of SIGABRT, without a line or an event of its own (no core file is written). Every
other process (the agent, a restarted rank, a DataLoader worker) is left alone. Python imports
``sitecustomize`` from the path at start-up: train.py itself has no test hook.
"""

import os
import sys
import threading
import time


def _abort_on(cue: str) -> None:
    while not os.path.exists(cue):
        time.sleep(0.1)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


_cue = os.environ.get("WP_ABORT_ON_CUE")
if _cue and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and sys.argv[0].endswith("train.py"):
    threading.Thread(target=_abort_on, args=(_cue,), name="abort-on-cue", daemon=True).start()
