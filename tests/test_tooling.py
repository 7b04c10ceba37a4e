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


# The packages whose imports inside functions must say why (the product; tests and benchmarks import freely).
PRODUCT = ("common", "data", "model", "training", "launch", "train.py")


def _product_files() -> list[Path]:
    files: list[Path] = []
    for top in PRODUCT:
        path = REPO / top
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _comment_lines(source: str) -> tuple[set[int], set[int]]:
    """(lines holding a comment, lines holding nothing but a comment), from the tokenizer: a ``#`` inside a
    string is no comment."""
    import io
    import tokenize

    comments, alone = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
            if not tok.line[: tok.start[1]].strip():
                alone.add(tok.start[0])
    return comments, alone


def unexplained_imports(path: Path, root: Path = REPO) -> list[str]:
    """``path:line`` of every import inside a function without a reason: a comment on one of its lines, or a
    comment line right above it, or right above the run of consecutive imports it belongs to (one reason for
    a block such as ``import deepspeed`` / ``import torch``)."""
    source = path.read_text()
    comments, alone = _comment_lines(source)
    imports = {
        node.lineno: node
        for fn in ast.walk(ast.parse(source, str(path)))
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    explained: set[int] = set()  # the last line of each explained import, for the one below it
    missing = []
    for line in sorted(imports):
        end = imports[line].end_lineno or line
        above = line - 1
        if comments & set(range(line, end + 1)) or above in alone or above in explained:
            explained.add(end)
        else:
            missing.append(f"{path.relative_to(root)}:{line}")
    return missing


def test_every_import_inside_a_function_says_why() -> None:
    """An import inside a function is there for a reason (start-up time, an optional extra, a cycle avoided),
    written beside it (``# on call (start-up time): ...``); one without a reason belongs at the top."""
    missing = [where for path in _product_files() for where in unexplained_imports(path)]
    assert not missing, f"imports inside functions without a reason (say why, or move them to the top): {missing}"


def test_the_checker_of_imports_sees_reasons_and_their_absence(tmp_path: Path) -> None:
    mod = tmp_path / "sample.py"
    mod.write_text(
        "def f():\n"
        "    import json\n"  # no reason
        "    # on call: a reason for the block below\n"
        "    import os\n"
        "    import sys\n"
        "\n"
        "    import re\n"  # a blank line ends the block
        "    from io import (\n"
        "        StringIO,  # on call: a reason inside the statement\n"
        "    )\n"
        "    s = '# not a comment'\n"
        "    import csv\n"  # the string above is no reason
        "    return json, os, sys, re, StringIO, s, csv\n"
        "\n"
        "import math  # at module level: no reason needed\n"
    )
    assert unexplained_imports(mod, tmp_path) == [f"sample.py:{n}" for n in (2, 7, 12)]


def test_every_noqa_names_a_selected_rule() -> None:
    """A ``# noqa: CODE`` for a rule ruff does not select ([tool.ruff.lint] select) does nothing but look like a
    decision; its reason belongs in a plain comment."""
    import re
    import subprocess

    select = re.search(r"^\s*select\s*=\s*\[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert select, "pyproject.toml: no [tool.ruff.lint] select"
    prefixes = re.findall(r'"([A-Z]+)"', select.group(1))
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True).stdout.split()
    unused = []
    for name in files:
        for n, line in enumerate((REPO / name).read_text().splitlines(), 1):
            for codes in re.findall(r"#\s*noqa:\s*([A-Z0-9, ]+)", line):
                for code in re.findall(r"[A-Z]+[0-9]+", codes):
                    if re.match(r"[A-Z]+", code).group() not in prefixes:  # type: ignore[union-attr]
                        unused.append(f"{name}:{n}: {code}")
    assert not unused, f"noqa markers for rules ruff does not select: {unused}"
