"""The README and docs/ stay true to the code: every relative link resolves (the file, and the heading its
anchor names), every command they show is accepted by its parser, and every ``bash scripts/...`` names a
script that exists. Parsing runs nothing: each CLI's ``build_parser()`` (train.py's ``parse_args``) only.

Placeholders are replaced before parsing: an UPPER_CASE word (``N``, ``RUN_DIR``) by ``1``, ``...`` and
``[...]`` dropped, ``[--flag value]`` kept as ``--flag value``. A dotted override (``section.key=value``)
must name a field of training/config.py's dataclasses. docs/gpu-notes.md and docs/upstream/ are records of
what was run at the time: their links are checked, their commands are not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import shlex
import typing
from pathlib import Path

import pytest

import train
from data.__main__ import build_parser as data_parser
from launch.__main__ import build_parser as launch_parser
from model.__main__ import build_parser as model_parser
from training import config as config_module
from training.__main__ import build_parser as training_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RECORDS = ("docs/gpu-notes.md", "docs/upstream/")  # commands as they were run then, not checked


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not ours to check here
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{_rel(page)}: {link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{_rel(page)}: {link} (no heading #{anchor} in {path.relative_to(REPO)})")
    return broken


def test_every_relative_link_resolves() -> None:
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, f"broken links: {broken}"


def test_the_link_checker_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    page = REPO / "docs" / "faults.md"
    assert not broken_links(page)
    anchors = _anchors(page)
    assert "when-nodes-fail" in anchors and "one-job-one-fault" in anchors
    assert _anchor("Metrics: FLOPs, MFU, goodput") == "metrics-flops-mfu-goodput"


# ---- commands


def _snippets(page: Path) -> list[str]:
    """Code the page shows: each line of a fenced block (backslash continuations joined, a trailing ``#``
    comment dropped) and each inline code span (line breaks inside it read as spaces)."""
    text = page.read_text()
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            out.append(re.sub(r"\s+#\s.*$", "", line))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [s.strip() for s in out if s.strip()]


ELIDED = "<elided>"  # a ``...`` standing for arguments the page does not show


def _stub(command: str) -> list[str]:
    command = command.replace("[...]", " ")
    command = re.sub(r"\[(--[^\]]+)\]", r"\1", command)
    words = []
    for w in shlex.split(command):
        if w == "...":
            # the value of the option before it, or arguments left out
            words.append("1" if words and words[-1].startswith("--") else ELIDED)
        else:
            w = w.removesuffix("...")  # MODULE...: one or more
            words.append("1" if re.fullmatch(r"[A-Z][A-Z0-9_]*", w) else w)
    return words


def _is_field(key: str) -> bool:
    owner: typing.Any = config_module.Config
    for part in key.split("."):
        if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):
            return False
        hints = typing.get_type_hints(owner, vars(config_module))
        if part not in hints or part not in {f.name for f in dataclasses.fields(owner)}:
            return False
        owner = hints[part]
        args = [a for a in typing.get_args(owner) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):  # Optional[Section]
            owner = args[0]
    return True


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when ``parser`` accepts ``args``, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def _train_args(args: list[str]) -> list[str]:
    """Problems with train.py's arguments: its parser, and each dotted override a config field."""
    problems = []
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = train.parse_args([a for a in args if a != ELIDED])
    except SystemExit as e:
        return [] if e.code == 0 else [err.getvalue().strip().splitlines()[-1]]
    for override in ns.overrides:
        key, eq, _ = override.partition("=")
        if not eq or not _is_field(key):
            problems.append(f"{override!r} names no config field")
    return problems


CLIS = {"data": data_parser, "training": training_parser, "launch": launch_parser, "model": model_parser}
SUBCOMMAND_ONLY = re.compile(r"[a-z]+")


def check_command(words: list[str]) -> list[str]:
    """Problems with one command line (already stubbed); [] when its parser accepts it."""
    if "train.py" in words and not (len(words) > 2 and words[:3] == ["python", "-m", "launch"]):
        return _train_args(words[words.index("train.py") + 1 :])
    if words[:2] == ["python", "-m"]:
        cli, args = words[2], words[3:]
    elif "--module" in words:  # deepspeed ... --module launch commbench ...
        i = words.index("--module")
        cli, args = words[i + 1], words[i + 2 :]
    else:
        return []
    parser = CLIS[cli]()
    passthrough: list[str] = []
    if "--" in args:  # launch elastic ... -- TRAIN_ARGS
        i = args.index("--")
        args, passthrough = args[:i], args[i + 1 :]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not args:  # a mention of the CLI
        return []
    if all(SUBCOMMAND_ONLY.fullmatch(a) or a.startswith("--") for a in args) and "=" not in "".join(args):
        # a mention of a subcommand, or of its options (``python -m data gpt --dataset``)
        if args[0] not in sub.choices:
            return [f"no subcommand {args[0]!r}"]
        known = {o for a in sub.choices[args[0]]._actions for o in a.option_strings}
        return [f"{args[0]} has no option {a}" for a in args[1:] if a.startswith("--") and a not in known]
    elided = ELIDED in args
    args = [a for a in args if a != ELIDED]
    problem = _parse(parser, args)
    problems = [] if problem is None or (elided and "arguments are required" in problem) else [problem]
    return problems + (_train_args(passthrough) if passthrough else [])


COMMAND = re.compile(
    r"(?:^|\s)((?:python -m (?:data|training|launch|model)(?=\s|$)|(?:deepspeed|torchrun|python)\b[^|;]*?\btrain\.py\b"
    r"|deepspeed\b[^|;]*?--module launch\b).*)"
)


def commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        if _rel(page).startswith(RECORDS):
            continue
        for snippet in _snippets(page):
            m = COMMAND.search(snippet)
            if m and not re.search(r"\b(?:data|training|launch|model) [a-z]+\|", m.group(1)):
                found.append((_rel(page), m.group(1)))
    return found


def test_the_docs_show_commands_of_every_cli() -> None:
    shown = " ".join(c for _, c in commands())
    for cli in ("python -m data", "python -m training export", "python -m launch", "python -m model", "train.py"):
        assert cli in shown, f"no command of {cli} found in the docs: the extraction missed them"


def test_every_command_the_docs_show_is_accepted_by_its_parser() -> None:
    bad = []
    for page, command in commands():
        bad += [f"{page}: {command}: {p}" for p in check_command(_stub(command))]
    assert not bad, "commands the parsers refuse:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "command, problem",
    [
        ("python -m data bert --text text/ --vocab v.txt --out h5 --seq-lenn 128", "unrecognized arguments"),
        ("python -m data gpt --datasett", "has no option --datasett"),
        ("python -m launch render slurm --mode elastic --nodes 4 ...", None),
        ("python -m launch render slurm --mode elastic --nodes 4", "arguments are required"),
        ("python -m data wiki", None),
        ("python -m data wikis", "no subcommand"),
        ("python train.py --config smoke train.stpes=3", "names no config field"),
        ("python train.py --config smoke logging.wandb.project=x train.steps=3", None),
        (
            "python -m launch elastic --nodes 2 --procs-per-node 1 --rendezvous H:1 -- --config X checkpoint.everyy=3",
            "names no config field",
        ),
        ("python -m training export RUN_DIR/checkpoints --out hf/ --families MODULE...", None),
    ],
)
def test_the_command_checker_refuses_what_it_should(command: str, problem: str | None) -> None:
    problems = check_command(_stub(command))
    if problem is None:
        assert problems == []
    else:
        assert problems and problem in problems[0], problems


def test_every_script_the_docs_run_exists() -> None:
    missing = []
    for page in PAGES:
        if _rel(page).startswith(RECORDS):
            continue
        for script in re.findall(r"\bbash (scripts/[\w./-]+)", page.read_text()):
            if not (REPO / script).is_file():
                missing.append(f"{_rel(page)}: {script}")
    assert not missing, f"scripts the docs run that do not exist: {missing}"
