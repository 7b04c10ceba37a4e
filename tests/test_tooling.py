"""The repository passes its own lint, format, type and spelling checks (configured in pyproject.toml; CI
runs them too).

The tools are the ones installed beside the interpreter running the tests (the project's virtualenv, dev
extra); a tool that is not installed there is skipped, with the reason, rather than failed.
"""

from __future__ import annotations

import ast
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


def test_codespell() -> None:
    # what is checked and skipped, and the few real words it would flag, come from [tool.codespell]
    r = _run("codespell", timeout=120)
    assert r.returncode == 0, f"codespell found misspellings:\n{r.stdout}{r.stderr}"


def test_one_logging_style() -> None:
    """Log messages are f-strings, as in the rest of the project: no ``%``-style arguments after them."""

    calls = {"debug", "info", "warning", "error", "exception", "critical"}
    found = []
    for top in ("common", "data", "model", "training", "launch", "benchmarks", "scripts", "train.py"):
        for path in sorted((REPO / top).rglob("*.py")) if (REPO / top).is_dir() else [REPO / top]:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in calls
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in {"log", "logger"}
                    and len(node.args) > 1
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"log calls with %-style arguments (use an f-string): {found}"


def test_every_fmt_skip_says_why() -> None:
    """A statement kept out of ruff's formatting carries its reason on the same line (``# fmt: skip  # why``);
    a bare ``# fmt: skip`` is a habit the project dropped (178 of them once)."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True).stdout.split()
    bare = re.compile(r"#\s*fmt:\s*skip\s*$")
    found = [
        f"{f}:{n}" for f in files for n, line in enumerate((REPO / f).read_text().splitlines(), 1) if bare.search(line)
    ]
    assert not found, f"'# fmt: skip' without a reason: {found}"
