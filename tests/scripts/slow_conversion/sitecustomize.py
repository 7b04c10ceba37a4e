"""A universal conversion that takes longer than the job's collective timeout, on any machine.

With this folder as the rank's test ``sitecustomize`` (``tests.prefork.SITECUSTOMIZE_ENV``) and
``WIKIPRETRAIN_TEST_CONVERSION_DELAY_S=S`` in the environment, a train.py rank waits S seconds before it
starts converting a checkpoint to the universal format (rank 0 alone converts), and says so on stderr. The
conversion's own length depends on the machine (4-5 s on a 2-core CI runner, under a second on a fast one);
the delay does not.
"""

import os
import sys
import time

_delay = float(os.environ.get("WIKIPRETRAIN_TEST_CONVERSION_DELAY_S") or 0)
if _delay > 0 and sys.argv[0].endswith("train.py"):
    from training.checkpoint import storage

    _convert = storage._convert

    def _late_convert(*args, **kwargs):
        print(f"test hook: the conversion starts {_delay:g} s late", file=sys.stderr, flush=True)
        time.sleep(_delay)
        return _convert(*args, **kwargs)

    storage._convert = _late_convert
