"""Shared fixtures: the real enwiki sample (from the gensim wheel), its text, and a vocabulary built from
it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


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
