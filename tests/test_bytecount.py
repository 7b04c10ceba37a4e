"""The byte counter (``common/bytecount.py``) and the readiness report's host-sync finder
(``benchmarks/bench_gpu_readiness.py``), on small tensors whose figures are known."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.bytecount import ByteCounter, InvisibleWork, op_class
from tests.conftest import REPO

N = 1000


def test_each_call_reads_its_inputs_and_writes_its_outputs_once() -> None:
    a, b = torch.ones(N), torch.ones(N)
    with ByteCounter() as bc:
        torch.randn(N).bernoulli_(0.5)  # fills its tensor: written, not read (randn: writes 1)
        c = a + b  # read 2, write 1
        a.add_(b)  # read a and b, write a
        a.view(10, 100)  # a view: nothing
        torch.empty(N)  # an allocation: nothing
        torch.add(a, b, out=c)  # out= is written, not read
        a.add_(a)  # one tensor, read once and written once
    assert bc.by_op == {
        "aten::randn": 4 * N,
        "aten::bernoulli_": 4 * N,
        "aten::add": 2 * 3 * 4 * N,
        "aten::add_": 3 * 4 * N + 2 * 4 * N,
    }
    assert bc.total == 13 * 4 * N and bc.calls["aten::add"] == 2
    assert op_class("aten::addmm") == "matmul" and op_class("wikipretrain::varlen_attn") == "attention"


def test_a_custom_op_counts_by_its_arguments_and_its_mutations() -> None:
    import training.optim.elementwise  # noqa: F401  (registers the flat-partition operators)

    w, r, c = torch.ones(N), torch.ones(N), torch.ones(N)
    frag, a = torch.zeros(N, dtype=torch.int32), torch.ones(1, 2)
    with ByteCounter(watch=[w]) as bc:  # w changes, written by the operator: seen
        torch.ops.wikipretrain.lans_flat_update(w, r, c, frag, a, True)
    assert torch.equal(w, torch.full((N,), 3.0))
    # reads w, r, c, frag and a; writes w; nothing inside the operator is counted
    assert dict(bc.by_op) == {"wikipretrain::lans_flat_update": 4 * N * 4 + 8 + 4 * N}


def test_a_write_the_counter_cannot_see_fails_rather_than_counts_zero() -> None:
    w = torch.ones(N)
    with pytest.raises(InvisibleWork, match="watched tensor 0"), ByteCounter(watch=[w]):
        w.numpy()[:] = 2.0  # numpy writes the memory: no operator call
    with ByteCounter(watch=[w]):
        w.mul_(2)  # seen: no error


def test_the_sync_finder_finds_each_kind_of_device_read() -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu_readiness", REPO / "benchmarks/bench_gpu_readiness.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x, host = torch.ones(5, device="meta"), torch.ones(5)
    with bench.counting_syncs() as found:
        x.nonzero()
        x.sum().item()
        bool(x.sum())
        x.tolist()
        x.masked_select(x > 0)
        x[x > 0]
        x[x > 0] = 1.0
        x.cpu()
        host.copy_(x)
        host.sum().item(), host.nonzero(), host[host > 0]  # host tensors: no sync
        x[1:3], x + 1, x.to("meta"), x.copy_(host)  # no read of device values
    assert found == [
        "nonzero",
        "item",
        "__bool__",
        "tolist",
        "masked_select",
        "index",
        "index_put_",
        "_to_copy",
        "copy_",
    ]
    assert "item" not in vars(torch.Tensor) and torch.ones(2).sum().item() == 2.0  # the patches are gone
