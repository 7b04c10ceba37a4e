"""Every process that starts a process group ends it (a static check of the source).

A group left to the interpreter's teardown can have its C++ threads (gloo's, the store's) destroyed while still
joinable: the process dies of SIGABRT (``terminate called without an active exception``) after its work is done,
and a benchmark's or test's worker reads as failed, under load and only sometimes. So every call of
``init_distributed`` or ``init_process_group`` sits in a function that, in a ``try`` begun by that call (or
around it), ends the group in its ``finally`` (``common.process.end_process_group``, or
``destroy_process_group``) or leaves the process there (``exit_fast``, ``os._exit``: no C++ teardown at all).

The one call outside that rule is train.py's own path: ``training.engine.start`` starts the group inside
``training.start``'s ``run``, which only train.py's ``main`` calls, inside a ``try`` whose ``finally`` ends the
group; train.py's ``__main__`` leaves through ``exit_fast``. That chain is checked here too.
"""

from __future__ import annotations

import ast
import subprocess

from tests.conftest import REPO

STARTS = {"init_distributed", "init_process_group"}
ENDS = {"end_process_group", "destroy_process_group", "exit_fast", "_exit"}
TRAIN_PATH = ("training/engine.py", "start")  # train.py's own start: checked by test_train_py_ends_its_group
START = "training/start.py"  # the run train.py's main starts (training.start.run)


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _calls(node: ast.AST, names: set[str]) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and _name(n) in names]


TRIES = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


def _starts(tree: ast.AST) -> set[str]:
    """The names a start is called by in ``tree``: STARTS, and what they are imported as."""
    aliases = {
        a.asname
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
        if a.name in STARTS and a.asname
    }
    return STARTS | aliases


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ends_in_finally(node: ast.AST) -> bool:
    """A ``finally`` that, whatever happens in it, ends the default group: one of its own statements (not under
    a condition, nor in a function it defines) is a call of an end, ``destroy_process_group`` with no group."""
    return any(
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and _name(stmt.value) in ENDS
        and not (_name(stmt.value) == "destroy_process_group" and (stmt.value.args or stmt.value.keywords))
        for stmt in getattr(node, "finalbody", [])
    )


def _ended(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``call`` is inside a ``try`` whose ``finally`` ends the group, or is the statement just before
    one; without leaving its function on the way up."""
    node: ast.AST = call
    while not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        parent = parents[node]
        if isinstance(parent, TRIES) and node in getattr(parent, "body", []) and _ends_in_finally(parent):
            return True
        if isinstance(node, ast.stmt):  # the statement that starts the group, then the try that ends it
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(parent, field, None)
                if isinstance(block, list) and node in block:
                    after = block[block.index(node) + 1 : block.index(node) + 2]
                    if after and isinstance(after[0], TRIES) and _ends_in_finally(after[0]):
                        return True
        node = parent
    return False


def _function(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> str:
    node: ast.AST = call
    while not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        node = parents[node]
    return node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else "<module>"


def unended_starts(source: str, path: str) -> list[str]:
    """``path:line in function`` for each start of a process group in ``source`` that is not ended."""
    tree = ast.parse(source, path)
    parents = _parents(tree)
    found = []
    for call in _calls(tree, _starts(tree)):
        where = (path, _function(call, parents))
        if where != TRAIN_PATH and not _ended(call, parents):
            found.append(f"{path}:{call.lineno} in {where[1]}()")
    return found


def python_files() -> list[str]:
    """The repository's Python files, committed or not (what git does not ignore)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(p for p in out.splitlines() if (REPO / p).is_file())


def _example(body: str) -> str:
    """A function ``f`` whose body is ``body``'s lines (``|`` marks one level of indentation)."""
    return "def f():\n" + "".join("    " + line.replace("|", "    ") + "\n" for line in body.split(";"))


def test_the_check_tells_an_ended_group_from_one_left_to_teardown() -> None:
    """The checker itself: what it must flag and what it must pass."""
    bad = {
        "left": _example("dist.init_process_group('gloo');work()"),
        "try too late": _example("deepspeed.init_distributed();work();try:;|more();finally:;|end_process_group()"),
        "no finally": _example("dist.init_process_group('gloo');try:;|work();except Exception:;|pass"),
        "module level": "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
        "inner function": _example(
            "try:;|def g():;||dist.init_process_group('gloo');|g();finally:;|end_process_group()"
        ),
        "ended if": _example("dist.init_process_group('gloo');try:;|work();finally:;|if rank:;||end_process_group()"),
        "a subgroup": _example("deepspeed.init_distributed();try:;|work();finally:;|dist.destroy_process_group(g)"),
        "aliased": "from torch.distributed import init_process_group as ipg\n" + _example("ipg('gloo');work()"),
    }
    for what, source in bad.items():
        assert unended_starts(source, "x.py"), what
    good = {
        "try after": _example("deepspeed.init_distributed();try:;|work();finally:;|end_process_group()"),
        "inside": _example("try:;|if a:;||dist.init_process_group('g');|work();finally:;|dist.destroy_process_group()"),
        "os._exit": _example("dist.init_process_group('gloo');try:;|work();finally:;|os._exit(0)"),
        "exit_fast": _example("deepspeed.init_distributed();try:;|work();finally:;|exit_fast(0)"),
    }
    for what, source in good.items():
        assert unended_starts(source, "x.py") == [], what
    train_path = bad["left"].replace("def f", "def " + TRAIN_PATH[1])
    assert unended_starts(train_path, TRAIN_PATH[0]) == []  # train.py's path, checked apart


def test_every_process_group_started_is_ended() -> None:
    files = python_files()
    assert "train.py" in files and "tests/test_process_groups.py" in files, files[:5]
    starts, unended = 0, []
    for path in files:
        source = (REPO / path).read_text()
        if path == "tests/test_process_groups.py" or not any(s in source for s in STARTS):
            continue  # (this file's starts are the checker's examples, in strings)
        starts += len(_calls(ast.parse(source, path), STARTS))
        unended += unended_starts(source, path)
    assert starts >= 10, f"only {starts} starts of a process group found: is the scan reading the repository?"
    assert unended == [], (
        "these start a process group and leave it to the interpreter's teardown (SIGABRT at exit, now and then): "
        "end it in a finally (common.process.end_process_group) or leave through exit_fast: " + ", ".join(unended)
    )


def test_train_py_ends_its_group() -> None:
    """train.py's path: ``engine.start`` is called by ``training.start``'s ``prepare`` alone (``run``'s first
    call), ``run`` by train.py's ``main`` inside a ``try`` that ends the group in its ``finally``, and
    ``__main__`` leaves through ``exit_fast(main())``."""
    start_tree = ast.parse((REPO / START).read_text())
    funcs = {n.name: n for n in start_tree.body if isinstance(n, ast.FunctionDef)}
    starts = [c for c in _calls(funcs["prepare"], {"start"}) if ast.unparse(c.func) == "ds_engine.start"]
    assert len(starts) == 1, "training.start's prepare() starts the process group through ds_engine.start(cfg)"
    assert _calls(funcs["run"], {"prepare"}), "training.start's run() starts through prepare()"
    tree = ast.parse((REPO / "train.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    ended = [
        t
        for t in ast.walk(main)
        if isinstance(t, ast.Try)
        and any(c for s in t.body for c in _calls(s, {"run"}) if ast.unparse(c.func) == "start.run")
        and _ends_in_finally(t)
    ]
    assert ended, "train.py's main() calls start.run() inside a try whose finally ends the process group"
    entry = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert entry and "exit_fast(main())" in ast.unparse(entry[0]), "train.py leaves through exit_fast(main())"
    others = [p for p in python_files() if p != START and _calls_engine_start(ast.parse((REPO / p).read_text()))]
    assert others == [], f"training.engine.start is {START}'s alone; also called in {others}"


def _calls_engine_start(tree: ast.AST) -> bool:
    imported = any(
        isinstance(n, ast.ImportFrom) and n.module == "training.engine" and any(a.name == "start" for a in n.names)
        for n in ast.walk(tree)
    )
    called = any(ast.unparse(c.func) in ("ds_engine.start", "engine.start") for c in _calls(tree, {"start"}))
    return imported or called
