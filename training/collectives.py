"""Every collective this project issues goes through this module, on the communication device.

A process group started with ``nccl`` (or Gaudi's ``hccl``) has no backend for CPU tensors, and gloo none for
CUDA tensors. The rule that keeps the accelerator path correct by construction: callers hand in Python numbers
or tensors, and the tensors that enter a collective are always placed on ``comm_device()`` here. A static test
(tests/test_collectives.py) checks that no other module calls ``torch.distributed`` collectives.

Device calls go through DeepSpeed's accelerator abstraction (``get_accelerator()``), not ``torch.cuda``, so
the same code runs on CUDA, Gaudi (HPU) and CPU.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def accelerator():
    """DeepSpeed's accelerator of this process (CUDA, HPU, CPU...)."""
    from deepspeed.accelerator import get_accelerator  # deferred: importing DeepSpeed takes seconds

    return get_accelerator()


def comm_device(group: Any = None) -> torch.device:
    """The device collective tensors live on: the current accelerator, or the CPU under gloo."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(accelerator().current_device_name())


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    """In-place all-reduce of a tensor already on ``comm_device()`` (checked: a wrong device is a bug)."""
    if tensor.device.type != comm_device(group).type:
        raise RuntimeError(f"collective tensor on {tensor.device}, expected {comm_device(group)}")
    if not _active(group):
        return None
    return dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)


def reduced(tensor: torch.Tensor, op: str = "sum", *, group: Any = None) -> torch.Tensor:
    """The all-reduced value of a tensor wherever it lives: moved to the communication device and back."""
    if not _active(group):
        return tensor
    dev = comm_device(group)
    if tensor.device.type == dev.type:
        all_reduce_(tensor, op, group=group)
        return tensor
    moved = tensor.to(dev)
    all_reduce_(moved, op, group=group)
    return moved.to(tensor.device)


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite each tensor with rank ``src``'s, in place, wherever it lives (through the communication
    device)."""
    if not _active():
        return
    dev = comm_device()
    for t in tensors:
        local = t.data  # a new view at every access: held once, so that the identity test below means it
        moved = local if local.device.type == dev.type else local.to(dev)
        dist.broadcast(moved, src=src)
        if moved is not local:
            local.copy_(moved)


def all_reduce_values(values: Sequence[float], op: str = "sum", dtype=torch.float64) -> list[float]:
    """All-reduce a few Python numbers in one collective; a host read follows (use outside the hot loop)."""
    t = torch.tensor(list(values), dtype=dtype, device=comm_device())
    all_reduce_(t, op)
    return t.tolist()


def barrier() -> None:
    if _active():
        if comm_device().type == "cpu":
            dist.barrier()
        else:  # NCCL's barrier guesses a device from the rank; an all-reduce on ours is exact
            all_reduce_(torch.zeros(1, device=comm_device()))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (pickled through a tensor on the communication device)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=comm_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# How torch.distributed's backends word a peer that stopped answering or went away (gloo, NCCL).
_TIMED_OUT = "a collective timed out (deepspeed.timeout_s): another rank is hung or gone"
_PEER_LOST = {
    "timed out": _TIMED_OUT,
    "collective operation timeout": _TIMED_OUT,  # NCCL's watchdog
    # gloo: the op that timed out closes every pair of its context; the others (a second group's, the next one)
    # get this instead of the timeout
    "application timeout caused pair closure": _TIMED_OUT,
    # NCCL under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (engine.start): the watchdog aborted the communicators
    "was aborted": "another rank is hung or gone (NCCL aborted the communicator)",
    "connection reset by peer": "another rank is gone (its connection was reset)",
    "connection closed by peer": "another rank is gone (its connection was closed)",
    "broken pipe": "another rank is gone (broken pipe)",
    "remote process exited": "another rank is gone (its process exited)",
}


def peer_lost(error: BaseException) -> str | None:
    """What a collective's error says about the peers, in words, or None when it is not about a peer.

    Only errors of a started process group's backend count: a rendezvous that times out (a wrong
    MASTER_ADDR, a node missing from the hostfile) is a launch problem, not a lost peer, and so is a device
    error that happens to say "timed out"."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(error).lower()
    if not (isinstance(error, dist.DistError) or "gloo" in text or "nccl" in text):
        return None
    return next((why for key, why in _PEER_LOST.items() if key in text), None)


def first_failure(problem: str | None) -> tuple[str, str, int] | None:
    """Every rank reports its problem (None: fine) in one all-gather; returns the first (problem, host, rank)
    in rank order, the same on every rank, or None. Also a barrier."""
    reports = all_gather_object((problem, socket.gethostname(), rank()))
    return next(((p, host, r) for p, host, r in reports if p), None)
