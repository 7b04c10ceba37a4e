"""The replica check after training (``training.checkpoint.replicas``): a checksum of the exact bits, compared across
ranks, that one flipped bit in one rank's copy fails."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.net import free_port
from tests.conftest import run_in_ranks
from training.checkpoint.replicas import replica_checksum, write_replica_digest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8))
    m[2].to(torch.bfloat16)
    m.register_buffer("seen", torch.tensor([3, 1 << 40], dtype=torch.int64))
    return m


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    words = t.data.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
    words[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(words.dtype)


@pytest.mark.parametrize(("param", "bits"), [("0.weight", 32), ("1.bias", 32), ("2.weight", 16)])
def test_one_flipped_bit_anywhere_changes_the_checksum(param: str, bits: int) -> None:
    model = _model()
    want = replica_checksum(model)
    assert replica_checksum(copy.deepcopy(model)) == want  # the same bits: the same checksum
    for bit in range(bits):  # every bit of a word, in words at the start, middle and end
        for index in (0, 17, dict(model.named_parameters())[param].numel() - 1):
            flipped = copy.deepcopy(model)
            _flip(dict(flipped.named_parameters())[param], index, bit)
            assert replica_checksum(flipped) != want, (param, index, bit)


def test_swapped_values_and_buffers_change_the_checksum() -> None:
    model = _model()
    want = replica_checksum(model)
    swapped = copy.deepcopy(model)
    w = swapped[0].weight.data.view(-1)
    w[[3, 4]] = w[[4, 3]].clone()
    assert not torch.equal(w, model[0].weight.data.view(-1))
    assert replica_checksum(swapped) != want  # the same words in another order
    other = copy.deepcopy(model)
    other.seen[1] += 1 << 33  # a high bit of an int64 buffer
    assert replica_checksum(other) != want


def _rank(rank: int, world: int, port: int, out: str, flip: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        if flip and rank == 1:
            _flip(model[0].weight, 100, 7)
        agree = write_replica_digest(Path(out), model, rank, world)
        Path(out, f"agree{rank}.json").write_text(json.dumps(agree))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flip", [False, True])
def test_the_ranks_compare_their_replicas(tmp_path: Path, flip: bool) -> None:
    """Two ranks (gloo): equal replicas agree; one flipped bit in rank 1's copy makes both ranks see it, and
    the two files differ."""
    run_in_ranks(_rank, (2, free_port(), str(tmp_path), flip), nprocs=2)
    agree = [json.loads((tmp_path / f"agree{r}.json").read_text()) for r in range(2)]
    digests = [json.loads((tmp_path / "replicas" / f"rank{r}.json").read_text())["params_sha256"] for r in range(2)]
    assert agree == [not flip, not flip]
    assert (digests[0] != digests[1]) == flip
