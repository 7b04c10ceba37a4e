"""Collectives on the accelerator, by construction: only training/collectives.py calls torch.distributed's
collectives, and it places every tensor on the communication device (NCCL has no CPU backend)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "broadcast", "barrier", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send",
    "recv", "isend", "irecv", "monitored_barrier",
}  # fmt: skip
ALLOWED = {Path("training/collectives.py")}
PACKAGES = ("common", "data", "model", "training", "launch", "benchmarks")


def project_modules() -> list[Path]:
    files = [REPO / "train.py"]
    for pkg in PACKAGES:
        files += sorted((REPO / pkg).rglob("*.py"))
    return files


def collective_calls(path: Path) -> list[str]:
    """``dist.X(...)`` / ``torch.distributed.X(...)`` / ``deepspeed.comm.X(...)`` calls and imports of X."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("torch.distributed", "deepspeed.comm"):
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.module in ("torch.distributed", "deepspeed.comm"):
                found += [f"from {node.module} import {a.name}" for a in node.names if a.name in COLLECTIVES]
            if node.module in ("torch", "deepspeed"):
                aliases |= {a.asname or a.name for a in node.names if a.name in ("distributed", "comm")}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in COLLECTIVES
            and ast.unparse(node.func.value) in aliases | {"dist"}
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_only_the_collectives_module_issues_collectives():
    offenders = {}
    for path in project_modules():
        rel = path.relative_to(REPO)
        if rel in ALLOWED:
            continue
        calls = collective_calls(path)
        if calls:
            offenders[str(rel)] = calls
    assert not offenders, f"collectives outside training/collectives.py: {offenders}"


def test_the_rule_sees_a_violation(tmp_path):
    """The checker itself: a module calling dist.all_reduce is caught, in each spelling."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import barrier\nimport torch\n"
        "def f(t):\n    dist.all_reduce(t)\n    d2.broadcast(t, 0)\n"
        "    torch.distributed.all_gather([t], t)\n"
    )
    calls = collective_calls(bad)
    assert len(calls) == 4, calls


def test_collective_tensors_live_on_the_communication_device():
    """A CPU tensor handed to the module under a non-CPU backend is refused, not sent into NCCL."""
    import torch

    from training import collectives

    dev = collectives.comm_device()
    assert dev.type == "cpu"  # no process group on the test machine: the accelerator here is the CPU
    t = torch.ones(2, device=dev)
    collectives.all_reduce_(t)  # a single process: no-op, but the device check runs
    assert t.tolist() == [1.0, 1.0]
    if torch.cuda.is_available():
        pytest.skip("device mismatch check needs a CPU-only process")
    meta = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match="expected cpu"):
        collectives.all_reduce_(meta)
