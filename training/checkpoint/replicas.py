"""Whether the data-parallel replicas hold the same parameters after training, bit for bit (ZeRO 0-2), checked
on the devices: each rank's checksum is written to ``replicas/rank<N>.json`` and compared across ranks."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch

from common.atomic import atomic_write_json
from common.log import get_logger
from common.net import own_address
from training import collectives

log = get_logger("training.checkpoint.replicas")

_DIGEST_CHUNK = 1 << 20  # words per partial sum: no int64 overflow (see replica_checksum)


def replica_checksum(module: torch.nn.Module) -> str:
    """A hash of every parameter and buffer's exact bits, computed where they live (one small copy to the host).

    Each tensor is read as unsigned words (4 bytes; 2 for 16-bit dtypes; 1 for 8-bit), and every chunk of
    ``_DIGEST_CHUNK`` words gives two integer sums: of the words, and of the words weighted by
    ``(position % 2048) + 1``. Integer sums do not depend on the reduction order, so equal replicas give equal
    hashes on any device; one flipped bit changes the first sum by a power of two (never by 0); a swap of two
    different words changes the second. No sum can overflow int64: words < 2^32, weights <= 2^11, 2^20 terms.
    """
    sums: list[torch.Tensor] = []
    names = []
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().contiguous().reshape(-1)
        size = t.element_size()
        width, mask = (
            (torch.int32, 0xFFFFFFFF) if size >= 4 else ((torch.int16, 0xFFFF) if size == 2 else (torch.uint8, 0xFF))
        )
        words = t.view(width)
        names.append(f"{name}:{t.dtype}:{t.numel()}")
        for chunk in words.split(_DIGEST_CHUNK):
            w = chunk.to(torch.int64) & mask
            weights = torch.arange(len(w), device=w.device, dtype=torch.int64).remainder_(2048).add_(1)
            sums.append(torch.stack([w.sum(), (w * weights).sum()]))
    h = hashlib.sha256("\n".join(names).encode())
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.hexdigest()


def write_replica_digest(run_dir: Path, module: torch.nn.Module, rank: int, world: int) -> bool:
    """Each rank records a checksum of its replica (``replica_checksum``, on its device) and where it ran, and
    the ranks compare theirs: False (with one line on rank 0 naming the ranks that differ from rank 0) when
    the replicas are not bit for bit the same."""
    digest = replica_checksum(module)
    info = {
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "params_sha256": digest,
        "address": own_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
    }
    atomic_write_json(run_dir / "replicas" / f"rank{rank}.json", info)
    digests = collectives.all_gather_object(digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ and rank == 0:
        where = run_dir / "replicas"
        log.error(f"the replicas differ after training: the parameters of rank(s) {differ} are not rank 0's ({where})")
    return not differ
