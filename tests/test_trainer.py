"""The training loop and its checkpointer in this process, against a real DeepSpeed engine at world size 1 (gloo):
the start a run makes (``training.start.prepare``: data, engine, trainer, checkpointer, resume), then
``Trainer.train`` with its checkpointer's three calls, read from the objects themselves. The process group and
what a start changes in the process (threads, determinism, the SIGTERM handler, the environment) are undone
after the test."""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import deepspeed.comm
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.net import free_port
from model.family import Family
from tests.conftest import smoke
from training import events, ownership, start
from training.checkpoint import storage as checkpoint
from training.config import load_config


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """One rank in this process; afterwards its process group destroyed and the process as it was."""
    env = dict(os.environ)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    sigterm = signal.getsignal(signal.SIGTERM)
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    pg_timeout = c10d.default_pg_timeout
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        ownership.release()  # the run's owner's mark and its renewal thread, as train.py's main releases them
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()  # DeepSpeed's cached groups with torch's
        c10d.default_pg_timeout = pg_timeout
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, sigterm)


def _train(data: dict[str, Path], run_dir: Path, *settings: str) -> tuple[dict, dict[str, torch.Tensor], list]:
    """One start of a run in this process: its performance figures, its final weights and its checkpoint
    events."""
    same = ("train.steps=6", "train.global_batch=4", "train.micro_batch=4", "train.eval_every=0")
    same += ("deepspeed.precision=fp32", "checkpoint.every=2", "checkpoint.keep=10", "checkpoint.async_save=true")
    cfg = load_config("smoke", smoke(data, run_dir, *same, "train.deterministic=true", *settings)[2:])
    started = start.prepare(cfg)
    assert started is not None
    trainer = started.trainer
    try:
        perf = trainer.train()
        assert perf["save_s"] == trainer.clock.save_s > 0  # the saves were paused out of the window
        weights = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
    finally:
        trainer.close()
    saves = [e for e in events.read(run_dir) if e["event"] == "checkpoint"]
    return perf, weights, saves


def trainer_kernel(run_dir: Path) -> str:
    """The one ``attention_kernel`` every row of the run's metrics.jsonl records."""
    (kernel,) = {json.loads(line)["attention_kernel"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    return kernel


def test_the_loop_saves_through_its_checkpointer_and_resumes_exactly(bert_data, tmp_path, world_of_one, monkeypatch):
    """Every 2 steps in the background (the commit after every rank's files are durable, as the step's
    collective reports), the last step synchronously at the end; a run stopped at step 3 saves it, and its
    resume continues to the same weights, bit for bit, as the run that went straight through. Whether a run
    unpads is decided once per start (``Family.unpadded``, by its plan), and every builder is given the answer."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    asked: list[bool] = []
    unpadded = Family.unpadded
    monkeypatch.setattr(Family, "unpadded", lambda family, setting: asked.append(setting) or unpadded(family, setting))
    perf, weights, saves = _train(bert_data, straight)
    assert asked == [True]  # the smoke recipe's BERT, model.unpad=true: one call during the whole start
    assert perf["stopped"] == "" and perf["measured_steps"] > 0
    # the kernel the model's forward ran, read through the family record (FP32: padded on a GPU, saying why)
    cpu = not torch.cuda.is_available()
    assert perf["attention_kernel"] == trainer_kernel(straight) == ("varlen-cpu" if cpu else "padded")
    assert (perf["attention_kernel_reason"] is None) == cpu
    assert [(e["step"], "write_s" in e) for e in saves] == [(2, True), (4, True), (6, False)]
    ckpt_dir = straight / "checkpoints"
    assert checkpoint.read_latest(ckpt_dir) == checkpoint.tag_for(6)
    assert all(checkpoint.tag_problem(ckpt_dir, checkpoint.tag_for(s)) is None for s in (2, 4, 6))

    perf, _, saves = _train(bert_data, stopped, "train.stop_at_step=3")
    assert perf["stopped"] == "stop_at_step"
    assert [(e["step"], "write_s" in e) for e in saves] == [(2, True), (3, False)]

    perf, resumed, saves = _train(bert_data, stopped)
    assert len(asked) == 3  # one per start, a resumed one included
    assert perf["stopped"] == ""
    assert [e["step"] for e in saves] == [2, 3, 4, 6] and {e["attempt"] for e in saves[2:]} == {2}
    assert resumed.keys() == weights.keys()
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)
