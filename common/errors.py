"""User errors: bad input is reported as one line and a non-zero exit, never as a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

EXIT_USER_ERROR = 2
# SIGTERM, a launcher gone or train.stop_at_step (a rank: the current step finished, a checkpoint was saved), or
# launch elastic itself signalled: the scheduler requeues the job, which resumes from its last checkpoint.
EXIT_PREEMPTED = 3
# A rank is hung or gone (a collective timed out or lost its peer, or its data loader stalled): the job
# ends and resumes from its last checkpoint. Not a preemption (3).
EXIT_PEER_LOST = 4
SUPERVISED_ENV = "WIKIPRETRAIN_ELASTIC_SUPERVISED"
"""Set by ``launch elastic`` for its agent and ranks: a rank that ends on bad input waits (``USER_ERROR_WAIT_S``
at most) for the supervisor, which reads its ``user_error`` event and ends the agent, so the agent never
reports the rank's exit as a failure of its own (one line, not two). Where no ``user_error`` event is read (a
rank-local error on a rank other than 0 that is not a ``RankError``, a supervisor gone) the rank ends after the
wait and the agent goes on as before: 10 s more per such attempt, never a hang."""
USER_ERROR_WAIT_S = 10.0


class UserError(Exception):
    """A problem with what the user gave us (a file, a key, a value). The message names it."""


class RankError(UserError):
    """A UserError of this rank alone (another rank need not hit it, e.g. running out of device memory): its
    line is printed by every rank that raises it, not by local rank 0 only."""


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a CLI entry point; a UserError becomes ``error: <message>`` on stderr and exit code 2."""
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    return int(rc or 0)
