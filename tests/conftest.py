"""Shared fixtures: the real enwiki sample (from the gensim wheel), its text, and a vocabulary built from it."""

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
