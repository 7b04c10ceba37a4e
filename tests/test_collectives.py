"""Collectives on the accelerator, by construction: only training/collectives.py calls torch.distributed's
collectives, and it places every tensor on the communication device (NCCL has no CPU backend)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

COLLECTIVES = {
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "monitored_barrier",
}
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


def _calls_in_order(func: ast.FunctionDef) -> list[str]:
    """The dotted names of the calls in a function's body, in source order."""
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
    return [ast.unparse(c.func) for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_each_rank_binds_its_device_before_any_collective():
    """engine.start() binds LOCAL_RANK's device before the process group exists, and training.start's prepare()
    (run()'s first call) calls start() before anything that can issue a collective (the start-up checks' object
    collectives used to run on cuda:0 on every rank)."""
    start = _calls_in_order(_function(REPO / "training/engine.py", "start"))
    assert "bind_device" in start and "deepspeed.init_distributed" in start, start
    assert start.index("bind_device") < start.index("deepspeed.init_distributed"), start
    bind = _calls_in_order(_function(REPO / "training/engine.py", "bind_device"))
    assert "acc.set_device" in bind and "device_for" in bind, bind
    prepare = _calls_in_order(_function(REPO / "training/start.py", "prepare"))  # run()'s start, before anything
    assert _calls_in_order(_function(REPO / "training/start.py", "run"))[0] == "prepare"
    first_start = prepare.index("ds_engine.start")
    before = prepare[:first_start]
    assert not [c for c in before if c.startswith(("collectives.", "checkpoint.", "check_run_dir"))], before


def test_device_for_a_local_rank(monkeypatch):
    from common.errors import UserError
    from training.engine import device_for

    assert [device_for(r, 8) for r in range(8)] == list(range(8))
    assert device_for(0, 1) == 0  # two ranks sharing one GPU both start with LOCAL_RANK=0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(UserError) as e:
        device_for(2, 2)
    text = str(e.value)
    assert "LOCAL_RANK=2" in text and "shows 2" in text and "CUDA_VISIBLE_DEVICES=2,3" in text, text
    with pytest.raises(UserError, match="LOCAL_RANK=0 has no device of its own: this node shows 0"):
        device_for(0, 0)


def test_peer_lost_reads_gloo_and_nccl_errors(tmp_path):
    """The errors a lost or hung peer raises, in gloo's and NCCL's words (NCCL's after the watchdog aborted
    the communicators: engine.start sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2), are read as a lost peer; a
    device error or one raised before any process group exists is not."""
    import torch.distributed as dist

    from training.collectives import _TIMED_OUT, peer_lost

    nccl_abort = RuntimeError("NCCL communicator was aborted on rank 1. Original reason for failure was: ...")
    watchdog = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, ...)")
    gloo_reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    # gloo: an op that times out closes its context's pairs; the next op on them raises this (reproduced with a
    # 2-rank gloo group whose peer slept past the timeout)
    closed = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:208] Application timeout caused pair closure"
    )
    device = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert peer_lost(gloo_reset) is None  # no process group yet: a launch problem, not a lost peer
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert peer_lost(nccl_abort) == "another rank is hung or gone (NCCL aborted the communicator)"
        assert peer_lost(watchdog) == _TIMED_OUT
        assert peer_lost(gloo_reset) == "another rank is gone (its connection was reset)"
        assert peer_lost(closed) == _TIMED_OUT
        assert peer_lost(device) is None
    finally:
        dist.destroy_process_group()


def test_a_nccl_rank_takes_its_error_handling_from_the_config():
    """torchrun gives its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and a user may export anything: the rank
    cannot tell them apart, so deepspeed.nccl_async_error_handling decides, with one line when it differs."""
    from training.engine import nccl_error_handling

    assert nccl_error_handling(2, None) == ("2", None)
    assert nccl_error_handling(2, "2") == ("2", None)
    value, note = nccl_error_handling(2, "1")
    assert value == "2"
    assert note == (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 in the environment (torchrun gives its workers 1); running with "
        "deepspeed.nccl_async_error_handling=2"
    )
    value, note = nccl_error_handling(3, "2")  # a user who wants torch's default says so in the config
    assert value == "3" and note is not None and "=3" in note


def test_a_nccl_timeout_dumps_the_flight_recorder_into_the_run_directory(tmp_path):
    from training.engine import FLIGHT_RECORDER_ENTRIES, flight_recorder_env, flight_recorder_file, flight_recorder_note

    env = flight_recorder_env(tmp_path / "run", {})
    assert env == {
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "run" / "nccl_trace_rank_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "run" / "nccl_trace_rank_"),
    }
    assert flight_recorder_file(5, env) == str(tmp_path / "run" / "nccl_trace_rank_5")
    # what the user exported stays (either of torch's names); no dump configured, no file named
    mine = flight_recorder_env(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": "/x/fr_"})
    assert mine["TORCH_FR_BUFFER_SIZE"] == "64" and mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/x/fr_"
    assert flight_recorder_file(0, {}) is None
    # the error line names the dump once torch has written it, and says so when it did not appear
    assert flight_recorder_note(5, env, wait_s=0.3) == (
        f"; no NCCL flight-recorder dump appeared at {tmp_path / 'run' / 'nccl_trace_rank_5'} within 0.3 s"
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "nccl_trace_rank_5").write_bytes(b"dump")
    assert flight_recorder_note(5, env) == f"; NCCL flight recorder: {tmp_path / 'run' / 'nccl_trace_rank_5'}"
    assert flight_recorder_note(5, {}) == ""
    assert flight_recorder_file(0, {**env, "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) is None
