"""The background save's commit protocol on 2 real ranks (spawn + gloo), without DeepSpeed: each rank's part
is reported through the step's collective (``StepReduction``), the tag is committed only once every rank's
files are durable, and a failed write reaches every rank as the same one line, the tag removed and ``latest``
untouched. The DeepSpeed runs (exact resume, a full disk) are in test_train.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.errors import UserError
from common.net import free_port
from training import checkpoint
from training.trainer import StepReduction

LATE_STEPS = 3  # rank 1 starts its part this many steps after rank 0


def _rank_main(rank: int, world: int, ckpt: str, fail_rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ckpt_dir = Path(ckpt)
        tag_dir = ckpt_dir / checkpoint.tag_for(10)
        tag_dir.mkdir(parents=True, exist_ok=True)
        target = tag_dir / f"part_rank{rank}.pt"
        if rank == fail_rank:  # a write that cannot succeed: its directory is a file
            (tag_dir / "not_a_dir").write_text("")
            target = tag_dir / "not_a_dir" / "part.pt"
        writes = [({"w": torch.full((256, 256), float(rank)), "step": 10}, str(target))]
        client = {"step": 10} if rank == 0 else None
        reduction = StepReduction(torch.device("cpu"))
        reduction.name_pieces({"loss": torch.zeros(())})
        seen: list[tuple[int, bool]] = []  # (ranks written, failed) as every step's collective told
        save = None
        step = 0
        while True:
            step += 1
            if save is None and (rank == 0 or step > LATE_STEPS):
                save = checkpoint.BackgroundSave(ckpt_dir, 10, rank, writes, client)
            reduction.launch(step, torch.zeros(1), False, save)
            reduction.read()
            seen.append((reduction.saves_written, reduction.save_failed))
            if reduction.save_failed or reduction.saves_written == world or step > 2000:
                break
        result: dict = {"seen": seen, "error": None}
        assert save is not None
        if reduction.save_failed:
            try:
                save.finish(keep=3)
            except UserError as e:
                result["error"] = str(e)
        elif reduction.saves_written == world:
            save.commit(keep=3)
        dist.barrier()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(ckpt: Path, out: Path, fail_rank: int) -> list[dict]:
    out.mkdir()
    mp.spawn(_rank_main, args=(2, str(ckpt), fail_rank, str(out), free_port()), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_commit_waits_for_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ranks = run_ranks(ckpt, tmp_path / "out", fail_rank=-1)
    seen = ranks[0]["seen"]
    assert seen == ranks[1]["seen"]  # every rank learns the same thing at the same step
    assert all(written < 2 for written, _ in seen[:LATE_STEPS]), "counted before rank 1 had written"
    assert seen[-1] == [2, False] and not any(failed for _, failed in seen)
    assert checkpoint.read_latest(ckpt) == "step00000010"
    assert checkpoint.tag_problem(ckpt, "step00000010") is None
    files = json.loads((ckpt / "step00000010" / "COMPLETE").read_text())["files"]
    assert {"part_rank0.pt", "part_rank1.pt", "client_state.json"} <= set(files)
    assert torch.load(ckpt / "step00000010" / "part_rank1.pt")["w"].eq(1.0).all()


def test_a_failed_write_reaches_every_rank_as_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("step00000005\n")  # what an earlier commit left: untouched
    ranks = run_ranks(ckpt, tmp_path / "out", fail_rank=1)
    assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[0]["seen"][-1][1], "both ranks saw the failure"
    assert ranks[0]["error"] == ranks[1]["error"]
    error = ranks[0]["error"]
    assert error.startswith(f"saving checkpoint {ckpt / 'step00000010'} (in the background) failed on node ")
    assert "(rank 1): " in error and "not_a_dir" in error and "\n" not in error
    assert not (ckpt / "step00000010").exists()  # rank 0 removed the partial tag
    assert (ckpt / "latest").read_text() == "step00000005\n"
