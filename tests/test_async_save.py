"""The background save's commit protocol on 2 real ranks (forked or spawned, gloo), without DeepSpeed: each rank's part
is reported through the step's collective (``StepReduction``), the tag is committed only once every rank's
files are durable, and a failed write reaches every rank as the same one line, the tag removed and ``latest``
untouched. The DeepSpeed runs (exact resume, a full disk) are in test_train.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import UserError
from common.net import free_port
from common.process import end_process_group
from tests.conftest import run_in_ranks
from training import collectives, events
from training.checkpoint import saving
from training.checkpoint import storage as checkpoint
from training.trainer import StepReduction

LATE_STEPS = 3  # rank 1's write is held back this many steps


class HeldBack:
    """Pickles (in rank 1's writer thread) only once ``flag`` exists: a write still in progress."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        deadline = time.monotonic() + 120
        while not os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        return (str, ("released",))


def _rank_main(rank: int, world: int, ckpt: str, fail_rank: int, out: str, port: int) -> None:
    """The trainer's protocol, step by step: report in the step's collective; when every rank's files are
    durable rank 0 commits; the next step's collective says whether the commit stood; a failure anywhere
    ends in ``finish`` on every rank."""
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
        release = Path(out) / "release"
        state = {"w": torch.full((256, 256), float(rank)), "held": HeldBack(str(release)) if rank == 1 else 0}
        client = {"step": 10} if rank == 0 else None
        save = saving.BackgroundSave(ckpt_dir, 10, rank, [(state, str(target))], client)
        reduction = StepReduction(torch.device("cpu"), n_carried=2)  # what Checkpointer.flags() reports
        reduction.name_pieces({"loss": torch.zeros(())})
        seen: list[tuple[int, bool]] = []  # (ranks written, failed) as every step's collective told
        deadline = time.monotonic() + 120
        step = 10
        while time.monotonic() < deadline:
            step += 1
            if rank == 1 and step == 10 + LATE_STEPS:
                release.touch()
            reduction.launch(step, torch.zeros(1), carried=[float(save.written), float(save.failed)])
            reduction.read()
            written, failed = round(reduction.carried[0]), reduction.carried[1] > 0
            seen.append((written, failed))
            if failed or save.committed:
                break
            if written == world:
                save.commit(keep=3)
            time.sleep(0.005)
        result: dict = {"seen": seen, "error": None, "committed": save.committed}
        try:
            save.finish(keep=3)
        except UserError as e:
            result["error"] = str(e)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(ckpt: Path, out: Path, fail_rank: int) -> list[dict]:
    out.mkdir()
    run_in_ranks(_rank_main, (2, str(ckpt), fail_rank, str(out), free_port()), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_commit_waits_for_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ranks = run_ranks(ckpt, tmp_path / "out", fail_rank=-1)
    seen = ranks[0]["seen"]
    assert seen == ranks[1]["seen"]  # every rank learns the same thing at the same step
    assert all(written < 2 for written, _ in seen[: LATE_STEPS - 1]), "counted while rank 1 was writing"
    assert seen[-1] == [2, False] and not any(failed for _, failed in seen)
    assert ranks[0]["committed"] and ranks[0]["error"] is None and ranks[1]["error"] is None
    assert checkpoint.read_latest(ckpt) == "step00000010"
    assert checkpoint.tag_problem(ckpt, "step00000010") is None
    files = json.loads((ckpt / "step00000010" / "COMPLETE").read_text())["files"]
    assert {"part_rank0.pt", "part_rank1.pt", "client_state.json"} <= set(files)
    part = torch.load(ckpt / "step00000010" / "part_rank1.pt", weights_only=False)
    assert part["w"].eq(1.0).all() and part["held"] == "released"


def test_a_failed_write_reaches_every_rank_as_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("step00000005\n")  # what an earlier commit left: untouched
    ranks = run_ranks(ckpt, tmp_path / "out", fail_rank=1)
    assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[0]["seen"][-1][1], "both ranks saw the failure"
    assert ranks[0]["error"] == ranks[1]["error"] and not ranks[0]["committed"]
    error = ranks[0]["error"]
    assert error.startswith(f"saving checkpoint {ckpt / 'step00000010'} (in the background) failed on node ")
    assert "(rank 1): " in error and "not_a_dir" in error and "\n" not in error
    assert not (ckpt / "step00000010").exists()  # rank 0 removed the partial tag
    assert (ckpt / "latest").read_text() == "step00000005\n"


def test_a_failed_commit_reaches_every_rank_as_one_line(tmp_path: Path) -> None:
    """Every rank's files are durable but rank 0 cannot write ``latest`` (here it is a directory): the next
    step's collective tells rank 1, and both end with rank 0's line; the tag is removed."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "latest").mkdir(parents=True)
    ranks = run_ranks(ckpt, tmp_path / "out", fail_rank=-1)
    assert ranks[0]["seen"] == ranks[1]["seen"]
    assert ranks[0]["seen"][-2] == [2, False] and ranks[0]["seen"][-1][1], "the commit's failure came a step later"
    assert ranks[0]["error"] == ranks[1]["error"] and "(rank 0): " in ranks[0]["error"]
    assert not (ckpt / "step00000010").exists()


def _peer_lost_main(rank: int, ckpt: str, out: str, port: int) -> None:
    """Rank 1 votes its files written and dies; rank 0 commits and finds it gone in the vote on the commit."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        if rank == 1:
            collectives.first_failure(None)  # the vote on the writes
            os._exit(0)  # gone before the vote on the commit
        tag_dir = Path(ckpt) / checkpoint.tag_for(10)
        tag_dir.mkdir(parents=True)
        state = [({"w": torch.ones(4)}, str(tag_dir / "part.pt"))]
        save = saving.BackgroundSave(Path(ckpt), 10, 0, state, {"step": 10})
        try:
            save.finish(keep=3, on_commit=lambda tag: events.record(Path(out), "checkpoint", step=10, tag=tag))
            why = None
        except RuntimeError as e:  # train.py ends the rank here, with this reason
            why = collectives.peer_lost(e) or f"not a lost peer: {e}"
        Path(out, "rank0.json").write_text(json.dumps({"why": why}))
    finally:
        end_process_group()


def test_a_peer_lost_in_the_commit_vote_leaves_the_commit_with_its_event(tmp_path: Path) -> None:
    """The commit is on disk (the next start resumes from it) when a peer is lost in the vote on it: its
    ``checkpoint`` event is already written, so the run's events name every checkpoint it can resume from."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_in_ranks(_peer_lost_main, (str(ckpt), str(out), free_port()), nprocs=2, timeout=120)
    why = json.loads((out / "rank0.json").read_text())["why"]
    assert why and not why.startswith("not a lost peer"), f"the vote on the commit: {why}"
    assert checkpoint.latest_complete(ckpt) == "step00000010"
    assert [(e["event"], e["tag"]) for e in events.read(out)] == [("checkpoint", "step00000010")]


def test_host_buffers_are_reused_save_after_save_and_never_while_a_writer_reads(tmp_path: Path) -> None:
    """The background save's host copies: the second save copies into the first one's buffers (the same memory),
    the copies are the tensors as they were at the copy, tied views stay one tensor, a view of a larger storage
    is copied alone, a buffer whose shape changed is replaced, and a save that starts while another's writer
    holds the pool gets buffers of its own. The written files load as the state that was copied."""
    pool = saving.HostBuffers()
    base = torch.arange(40, dtype=torch.float32)
    w = torch.randn(6, 4)
    state = {"w": w, "tied": [w, w], "slice": base[10:20], "bf16": torch.ones(3, dtype=torch.bfloat16), "n": 7}

    def copy(state: dict):
        copies = pool.start()
        return saving._host_copy(state, copies), copies

    first, copies = copy(state)
    assert first["tied"][0] is first["tied"][1] is first["w"] and first["n"] == 7
    assert first["slice"].untyped_storage().nbytes() == 10 * 4 and torch.equal(first["slice"], base[10:20])
    ptrs = {k: first[k].data_ptr() for k in ("w", "slice", "bf16")}
    was = w.clone()
    w.add_(1.0)  # training goes on: the copy does not change
    assert not torch.equal(first["w"], w)
    # held: a second save meanwhile gets fresh memory
    second, other = copy(state)
    assert {second[k].data_ptr() for k in ptrs}.isdisjoint(ptrs.values())
    other.release()  # not the pool's: releasing it does not free the first save's buffers
    third, _ = copy(state)
    assert {third[k].data_ptr() for k in ptrs}.isdisjoint(ptrs.values())
    # the first save's writer, then a new save: the same memory, the new values
    target = tmp_path / "part.pt"
    save = saving.BackgroundSave(tmp_path, 1, 0, [(first, str(target))], None, copies=copies)
    save._thread.join()
    assert save.written and torch.equal(torch.load(target)["w"], was)
    again, _ = copy(state)
    assert {k: again[k].data_ptr() for k in ptrs} == ptrs and torch.equal(again["w"], w)
    pool.release()
    state["w"] = torch.zeros(2, 2)  # another shape (tied too): a new buffer for it, the others kept
    state["tied"] = [state["w"], state["w"]]
    changed, _ = copy(state)
    assert changed["w"].shape == (2, 2) and changed["slice"].data_ptr() == ptrs["slice"]
