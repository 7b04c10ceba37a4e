"""The repository passes its own lint, format and type checks (configured in pyproject.toml; CI runs them
too).

The tools are the ones installed beside the interpreter running the tests (the project's virtualenv, dev
extra); a tool that is not installed there is skipped, with the reason, rather than failed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.skip(f"{tool} is not installed in {BIN} (pip install -e '.[dev]')")
    return subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "tool, args",
    [
        ("ruff", ("check", ".")),
        ("ruff", ("format", "--check", ".")),
    ],
    ids=["ruff-check", "ruff-format"],
)
def test_ruff(tool: str, args: tuple[str, ...]) -> None:
    r = _run(tool, *args, timeout=120)
    assert r.returncode == 0, f"{tool} {' '.join(args)} failed:\n{r.stdout}{r.stderr}"


def test_mypy() -> None:
    # files and strictness come from [tool.mypy] in pyproject.toml
    r = _run("mypy", timeout=600)
    assert r.returncode == 0, f"mypy failed:\n{r.stdout}{r.stderr}"
