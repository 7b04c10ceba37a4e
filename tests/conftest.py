"""Shared fixtures: the real enwiki sample (from the gensim wheel), its text, and a vocabulary built from
it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The real vocabulary and tokenizer: ../shared/data beside the checkout, or where WIKIPRETRAIN_SHARED_DATA says
# (scripts/gpu.sh: the GPU bundle's copy, since ../shared does not travel).
SHARED_DATA = Path(os.environ.get("WIKIPRETRAIN_SHARED_DATA") or REPO.parent / "shared" / "data")


def run_env() -> dict[str, str]:
    """Environment for subprocesses (CLI, deepspeed launcher) that must import the project."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launcher(ranks: int, port: int | None = None) -> list[str]:
    """The DeepSpeed launcher for ``ranks`` local CPU ranks, through this interpreter.

    CI runs pytest as .venv/bin/python without activating the venv, so no ``deepspeed`` script is on PATH.
    """
    port = port or 29500 + os.getpid() % 1000
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(port),
    ]


def start_ranks(
    script: list[str], ranks: int, timeout: float = 300, env: dict | None = None, one_device: bool = False
) -> subprocess.CompletedProcess:
    """``ranks`` processes of ``script`` (a path and its arguments) on this machine, with the environment the
    DeepSpeed launcher gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_*, MASTER_*), started
    directly: the launcher's own two interpreter start-ups are seconds per job, and the tests of the launcher's
    behaviour (signals, a rank lost) start it themselves. ``one_device``: every rank with ``LOCAL_RANK=0``, to
    share this machine's one GPU (DeepSpeed would otherwise ask for a ``cuda:1`` that does not exist).

    As the launcher: when a rank fails, the others get SIGTERM (after 5 s: ranks that stop together, exit 3
    after a save, end on their own) and 30 s before they are killed; the exit code is the first failure seen;
    the output is every rank's, in rank order."""
    from common.net import free_port

    base = {
        **(env or run_env()),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(ranks),
        "LOCAL_SIZE": "1" if one_device else str(ranks),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
    }
    procs = []
    for r in range(ranks):
        local = 0 if one_device else r
        procs.append(
            subprocess.Popen(
                [sys.executable, "-u", script[0], f"--local_rank={local}", *script[1:]],
                cwd=REPO,
                env={**base, "RANK": str(r), "LOCAL_RANK": str(local)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs: list[tuple[str, str]] = [("", "")] * ranks
    readers = [
        threading.Thread(target=lambda i=i: outs.__setitem__(i, procs[i].communicate()), daemon=True)
        for i in range(ranks)
    ]
    for t in readers:
        t.start()
    deadline, failed_at, first_code, terminated = time.monotonic() + timeout, None, 0, False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None:
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            if failed:  # the exit code the launcher reports: the first failure it sees
                failed_at, first_code = time.monotonic(), failed[0]
        elif not terminated and time.monotonic() - failed_at > 5:  # the others, stopping on their own (exit
            terminated = True  # 3 after a save), have had the launcher's poll interval and more
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        if failed_at is not None and time.monotonic() - failed_at > 35:
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in readers:
        t.join(timeout=60)  # a rank's DataLoader workers hold its pipes until they notice it is gone
    rc = first_code or next((p.returncode for p in procs if p.returncode), 0)  # killed at the timeout: -9
    return subprocess.CompletedProcess(script, rc, "".join(o for o, _ in outs), "".join(e for _, e in outs))


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    from data.sample import sample_dump_path

    return sample_dump_path()


@pytest.fixture(scope="session")
def shared_bert_vocab() -> Path:
    p = SHARED_DATA / "bert-base-uncased-vocab.txt"
    if not p.exists():
        pytest.skip(f"real BERT vocab not found at {p} (../shared is absent in a user's clone)")
    return p


@pytest.fixture(scope="session")
def shared_neox_tokenizer() -> Path:
    p = SHARED_DATA / "gpt-neox-20b-tokenizer.json"
    if not p.exists():
        pytest.skip(f"GPT-NeoX tokenizer not found at {p} (../shared is absent in a user's clone)")
    return p


WIKI_FIXTURE_SHARDS = 4


@pytest.fixture(scope="session")
def wiki_text_dir(tmp_path_factory, sample_dump) -> Path:
    """The enwiki sample extracted once per session (2 worker processes, 4 shards) by ``data.wiki``."""
    from data.wiki import extract_dump

    out = tmp_path_factory.mktemp("wikitext") / "text"
    extract_dump([sample_dump], out, workers=2, shards=WIKI_FIXTURE_SHARDS)
    return out


@pytest.fixture(scope="session")
def wiki_vocab(tmp_path_factory, wiki_text_dir) -> Path:
    """An 8000-entry uncased WordPiece ``vocab.txt`` (bert-base layout of special tokens) built on the
    sample."""
    from data.vocab import train_wordpiece

    return train_wordpiece(wiki_text_dir, tmp_path_factory.mktemp("vocab") / "vocab.txt", 8000)


@pytest.fixture(scope="session")
def bpe(wiki_text_dir: Path, tmp_path_factory) -> Path:
    """A 2000-entry byte-level BPE ``tokenizer.json`` with ``<|endoftext|>``, built on the sample."""
    from data.vocab import train_bpe

    return train_bpe(wiki_text_dir, tmp_path_factory.mktemp("bpe") / "tokenizer.json", 2000)


@pytest.fixture
def logs(caplog):
    """Records of the application's logger (which does not propagate to the root logger caplog watches)."""
    import logging

    logger = logging.getLogger("wikipretrain")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="wikipretrain")
    yield caplog
    logger.removeHandler(caplog.handler)
