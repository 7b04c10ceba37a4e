"""The trainer's state: what a checkpoint holds to continue a run exactly, beside the run's identity.

Built before both the trainer and the checkpointer: the trainer advances it step by step, the checkpointer saves
it (``state_dict``) and restores it (``load_state_dict``), and neither needs the other to be built. Its parts:
the step, samples, tokens and FLOPs counted so far, the data position (the training loader's, attached once the
data is open) and this rank's RNG states. The checkpointer keeps the RNG states out of the client state that
every rank shares: they go to a file of this rank's (``rng_rank{R}.pt``, ``training.checkpoint.storage``), and
where they cannot carry over (a resume at another world size) the streams are re-seeded from the step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.log import get_logger
from training import collectives

log = get_logger("train")


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's RNGs from ``seed`` (a run's initial weights, a rank's dropout stream)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    """This process's RNG states: Python's, numpy's, torch's and, off the CPU, the accelerator's."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    acc = collectives.accelerator()
    if acc.device_name() != "cpu":  # CUDA, HPU, ...: through DeepSpeed's accelerator abstraction
        states["accelerator"] = acc.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Continue the RNG streams ``rng_states`` returned (one saved before the accelerator abstraction too)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    acc = collectives.accelerator()
    device_state = states.get("accelerator", states.get("cuda"))  # "cuda": checkpoints before the abstraction
    if device_state is not None and acc.device_name() != "cpu":
        acc.set_rng_state(device_state)


@dataclass
class TrainState:
    seed: int = 0
    """``train.seed``: with the rank, the seed of a rank's dropout stream (``reseed``)."""
    rank: int = 0
    step: int = 0
    samples: int = 0
    tokens: int = 0
    """Positions computed (``training.metrics``' convention), every rank's, since the run's first step."""
    flops: float = 0.0
    """Their training FLOPs (``model.flops``)."""
    loader: Any = field(default=None, repr=False, compare=False)
    """The training loader, whose position a checkpoint holds (``attach``)."""

    def attach(self, loader: Any) -> None:
        """The training loader, once the data is open: its position goes out and comes back with the state."""
        self.loader = loader

    def to_dict(self) -> dict[str, Any]:
        """The counters (the finish event's and the summary's)."""
        return {"step": self.step, "samples": self.samples, "tokens": self.tokens, "flops": self.flops}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of it: the counters, the data position and (``rng``) this rank's RNG states."""
        return {**self.to_dict(), "loader": self.loader.state_dict(), "rng": rng_states()}

    def load_state_dict(self, client: dict[str, Any]) -> None:
        """Continue from a checkpoint's client state (``state_dict``'s keys; one from before FLOPs were counted
        too). Without ``rng`` (a resume at another world size: no rank's streams carry over) every stream is
        re-seeded from the step, as ``reseed`` does."""
        self.step, self.samples, self.tokens = client["step"], client["samples"], client["tokens"]
        self.flops = float(client.get("flops", 0.0))
        if "flops" not in client:  # a checkpoint from before the counting convention (training.metrics)
            log.warning(
                f"the checkpoint at step {client['step']} counted every position as a token and no FLOPs: the "
                "run's tokens count padding up to it, computed tokens after it, and its FLOPs start here"
            )
        self.loader.load_state_dict(client["loader"])
        if client.get("rng") is not None:
            set_rng_states(client["rng"])
        else:
            self.reseed(self.step)

    def reseed(self, step: int) -> None:
        """This rank's RNG streams from ``step``, where the saved ones cannot carry over (another world size)."""
        seed_everything(self.seed + 1000 * self.rank + step)
