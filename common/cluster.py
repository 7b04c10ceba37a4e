"""How many nodes (machines) this job spans, read from what the launcher or the scheduler sets.

Each launcher names it differently, and WORLD_SIZE / LOCAL_WORLD_SIZE only works under torchrun:

* DeepSpeed's launcher (``deepspeed/launcher/launch.py``, started on every node by the runner over pdsh/ssh
  or by hand with ``--no_ssh``) sets ``CROSS_SIZE`` = nodes, ``CROSS_RANK`` = node rank and ``LOCAL_SIZE`` =
  ranks on this node; it sets no LOCAL_WORLD_SIZE.
* torchrun sets ``GROUP_WORLD_SIZE`` = nodes (agents) and ``LOCAL_WORLD_SIZE`` = ranks on this node.
* Slurm sets ``SLURM_STEP_NUM_NODES`` inside ``srun``, ``SLURM_JOB_NUM_NODES`` (and the older
  ``SLURM_NNODES``) for the allocation; DeepSpeed's Slurm runner starts ranks with ``srun`` directly, so
  only these are set.
* AWS Batch multi-node parallel jobs set ``AWS_BATCH_JOB_NUM_NODES``.

The launcher's own figure wins over the scheduler's: a job may use fewer nodes than it was allocated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from common.errors import UserError

# In order of precedence: the process launcher's count, then the scheduler's.
NODE_COUNT_VARIABLES = (
    "CROSS_SIZE",  # DeepSpeed launcher
    "GROUP_WORLD_SIZE",  # torchrun
    "SLURM_STEP_NUM_NODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "AWS_BATCH_JOB_NUM_NODES",
)


def _positive(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None
    if value <= 0:
        raise UserError(f"environment variable {name}={raw!r} must be a positive node count")
    return value


def node_count(env: Mapping[str, str] = os.environ) -> int:
    """Nodes in this job: 1 when no launcher or scheduler says otherwise (a plain single-process run)."""
    for name in NODE_COUNT_VARIABLES:
        if env.get(name, "").strip():
            return _positive(env, name)
    if env.get("WORLD_SIZE", "").strip() and env.get("LOCAL_WORLD_SIZE", "").strip():
        # torchrun before GROUP_WORLD_SIZE existed; equal ranks per node, as torchrun requires
        world, local = _positive(env, "WORLD_SIZE"), _positive(env, "LOCAL_WORLD_SIZE")
        if world % local:
            raise UserError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
        return world // local
    return 1
