"""Prove the unpadded attention operator (``torch.ops.wikipretrain.varlen_attn``, model/attention.py) on a device,
in one process sized for under two minutes on an H100 (not yet run on one); CI runs it on the CPU so it never rots.

    python scripts/check_attention.py --device cuda --json $OUT/opcheck.json   # the GPU call: bert-large's layer
    python scripts/check_attention.py --device cpu --size bert-debug           # CI (tests/test_check_attention.py)

On CUDA in BF16 (the flash kernel's dtype: ``aten._flash_attention_forward/_backward``); on the CPU in FP32 (the
CPU kernel's dtype wherever BF16 is emulated), its opcheck in BF16 too. The checks, one line each:

1. ``opcheck_forward`` / ``opcheck_backward``: ``torch.library.opcheck`` of the operator and of its backward op
   (schema, autograd registration, the fake implementation against the real kernel, AOTAutograd with dynamic
   shapes), dropout 0 and the size's dropout, with q/k/v the fused projection's views
   (``model.unpad.qkv_projection``: slices of one ``[T, 3, heads, head_dim]`` output) and ``cu_seqlens`` from
   ``model.unpad.packing`` (int32, exact host ``max_seqlen``) with a sequence of length 0. Figure: failed tests.
2. ``dropout_masks_agree``, ``dropout_kept_fraction``, ``dropout_scale``: with q = k = 0 every probability is
   1/n, and with v the identity (per head, ``head_dim == n``) the output shows the kept mask M of the forward
   pass (``out[i, j] = M[i, j] / (n (1 - p))``); with the incoming gradient the identity too, ``dV[j, i]`` shows
   the mask the backward pass used. The two masks must be equal (the CPU kernel redraws its mask from a seed
   drawn from the default CPU generator; flash replays the philox seed and offset it returned as ``rng_state``);
   the kept fraction must be within 0.006 of 1 - p over 1,048,576 probabilities (Hoeffding: a fair draw leaves
   it with probability below 1e-16 even after flash's 8-bit threshold, which keeps 230/256 = 0.8984 at p = 0.1);
   each kept output must be 1 / (n (1 - p)) within one rounding of the dtype.
3. ``checkpoint_gradients``: the fused QKV projection, the operator with the size's dropout and an output
   projection, under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and without, each after
   ``torch.manual_seed`` (which seeds the CUDA generator too): the gradients must be bitwise equal, since the
   recomputation replays the same kernels and the same mask (checkpointing restores the generators). Under
   ``torch.use_deterministic_algorithms`` (as ``train.deterministic`` sets it): flash's backward otherwise adds
   dQ with atomics, in an order that changes from run to run, and its deterministic mode is what a resumed run
   that must repeat uses. A run with another seed must give other gradients (the comparison could fail).
4. ``compiled_graph``, ``compiled_vs_float64``: one layer of ``--size`` (dropout 0), compiled as the product
   compiles it (``model.compile.compile_blocks``: the ``packed_call`` of ``Family.compile_scope``,
   ``torch.compile(dynamic=True)``), on a few thousand packed tokens (CUDA) or a few hundred (CPU): one graph or
   more, no graph break, no fallback to eager; and against a float64 copy of the layer (``padded`` on CUDA, where
   the operator has no float64 kernel): max |compiled - float64| <= 2 x max |eager - float64| on the output, the
   input's gradient and every parameter's gradient, where an eager error below a floor counts as the floor: 4
   roundings (``finfo.eps``) in BF16, 8 in FP32 (``FLOOR_ROUNDINGS``), of the largest reference value of the
   tensor's module (the output alone; a Linear's weight and bias together). The key bias's exact gradient is 0
   (softmax ignores a shift shared by all keys): both sides hold rounding noise there.

Prints one line per check (name, PASS/FAIL, figure, bound); ``--json`` writes every check with the device, torch
and CUDA versions, rewritten after each check (a run cut short keeps what it measured). Exit 0: all passed; 1: a
check failed (an error inside a check fails that check, its traceback on stderr, and the rest still run); 2: bad
usage, one line (``--device cuda`` without a CUDA device, or where the operator does not run flash).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the project's packages, wherever the script is started from
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

DEFAULT_SIZE = {"cuda": "bert-large", "cpu": "bert-debug"}
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
KEPT_FRACTION_BOUND = 0.006
COMPILE_RATIO = 2.0
FLOOR_ROUNDINGS = {torch.bfloat16: 4, torch.float32: 8}
"""Check 4's floor, in roundings (``finfo.eps``) of the largest reference value of a tensor's module (see the
module docstring). FP32 takes 8: there the compiled layer's sums over the tokens (bias and LayerNorm gradients)
add in another order than eager's, which shows at FP32's rounding: over 100 seeds of bert-debug's layer (CPU,
default kernels) and 60 more held to AVX2, compiled reached 9.1 roundings where eager stayed below 8, and
with a floor of 4 one seed in 100 went past 2x. In BF16 an FP32 sum's order is far below one rounding."""


@dataclass
class Check:
    """One check's outcome: ``figure <= bound`` (and whatever else it names in ``detail``) is a pass."""

    name: str
    passed: bool
    figure: float | None
    bound: float
    detail: dict[str, Any] = field(default_factory=dict)
    """Printed on its line, and in the JSON."""
    data: dict[str, Any] = field(default_factory=dict)
    """In the JSON only (per-tensor figures)."""
    seconds: float = 0.0
    """Of the check's group (one run measures several checks)."""

    def line(self) -> str:
        figure = "-" if self.figure is None else f"{self.figure:.4g}"
        extra = "  ".join(f"{k}={_short(v)}" for k, v in self.detail.items())
        return f"{self.name:<24} {'PASS' if self.passed else 'FAIL'}  {figure} (bound {self.bound:.4g})  {extra}"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every bad-usage exit of the project
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# ------------------------------------------------------------------------------------------------ inputs


class AttentionBlock(nn.Module):
    """The fused QKV projection (``model.unpad.qkv_projection``: it reads ``query``, ``key``, ``value``,
    ``num_attention_heads`` and ``attention_head_size``, as on ``transformers``' self-attention), the operator,
    an output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        self.num_attention_heads, self.attention_head_size = heads, hidden // heads

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from model.unpad import qkv_projection

        return qkv_projection(self, x)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, p: float) -> torch.Tensor:
        from model.attention import attention

        q, k, v = self.qkv(x)
        return self.dense(attention(q, k, v, cu_seqlens, max_seqlen, p).reshape(x.size(0), -1))


def pack_of(lengths: list[int], device: torch.device) -> Any:
    """``model.unpad.packing`` of rows with these real lengths, as a training step gets it: the loader's keys
    made on the host (``data.loader.unpadding_index``: int32 ``cu_seqlens``, host ``max_seqlen``), the mask on
    the device."""
    from data.loader import unpadding_index
    from model.unpad import packing

    width = max(max(lengths), 1)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.int32)
    pack = packing(mask.to(device), **unpadding_index(mask))
    assert pack.cu_seqlens.dtype == torch.int32 and isinstance(pack.max_seqlen, int), pack
    return pack


def lengths_of(count: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------------ checks


def check_opcheck(device: torch.device, dtypes: list[torch.dtype], hidden: int, heads: int, p: float) -> list[Check]:
    """1. ``torch.library.opcheck`` of the operator and of its backward op, dropout 0 and ``p``."""
    from model import attention as A

    lengths = [37, 0, 130, 1, 64] if device.type == "cuda" else [5, 0, 17, 9, 1]
    pack = pack_of(lengths, device)
    results: dict[str, dict[str, str]] = {"opcheck_forward": {}, "opcheck_backward": {}}
    for dtype in dtypes:
        torch.manual_seed(0)
        block = AttentionBlock(hidden, heads).to(device, dtype)
        x = torch.randn(sum(lengths), hidden, device=device, dtype=dtype)
        q, k, v = block.qkv(x)  # views of one [T, 3, heads, head_dim] output, requiring grad
        assert q.data_ptr() != k.data_ptr() and not q.is_contiguous() and q.requires_grad
        for dropout in (0.0, p):
            tag = f"{str(dtype).removeprefix('torch.')} p={dropout:g}"
            args = (q, k, v, pack.cu_seqlens, pack.max_seqlen, dropout)
            forward = torch.library.opcheck(A.varlen_attn, args, raise_exception=False)
            out, lse, rng_state, unused = A.varlen_attn(*args)
            grad = torch.randn_like(out)
            saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse, rng_state, unused)
            back_args = (grad, *saved, pack.cu_seqlens, pack.max_seqlen, dropout)
            backward = torch.library.opcheck(A.varlen_attn_backward, back_args, raise_exception=False)
            for name, outcome in (("opcheck_forward", forward), ("opcheck_backward", backward)):
                for test, result in outcome.items():
                    results[name][f"{tag} {test}"] = result if result == "SUCCESS" else _one_line(result)
    checks = []
    for name, outcome in results.items():
        failed = {t: r for t, r in outcome.items() if r != "SUCCESS"}
        detail: dict[str, Any] = {"tests": len(outcome), "lengths": lengths}
        detail.update(failed)
        checks.append(Check(name, not failed and len(outcome) > 0, float(len(failed)), 0.0, detail))
    return checks


def check_dropout(device: torch.device, dtype: torch.dtype, p: float) -> list[Check]:
    """2. The forward's and the backward's dropout masks, the kept fraction and the kept values' scale."""
    from model.attention import attention

    n, heads, count = 128, 16, 4  # 4 sequences of 128, 16 heads of 128: 1,048,576 probabilities
    pack = pack_of([n] * count, device)
    q = torch.zeros(n * count, heads, n, device=device, dtype=dtype)
    eye = torch.eye(n, device=device, dtype=dtype).repeat(count, 1).unsqueeze(1).expand(-1, heads, -1)
    v = eye.contiguous().requires_grad_()
    torch.manual_seed(0)
    out = attention(q, q, v, pack.cu_seqlens, pack.max_seqlen, p)
    (dv,) = torch.autograd.grad(out, [v], grad_outputs=eye.contiguous())
    # [sequence, head, query i, key j]: out rows are queries, its columns keys; dV rows are keys, its columns queries
    forward_mask = (out > 0).view(count, n, heads, n).permute(0, 2, 1, 3)
    backward_mask = (dv > 0).view(count, n, heads, n).permute(0, 2, 3, 1)
    mismatched = int((forward_mask != backward_mask).sum())
    total = forward_mask.numel()
    kept = forward_mask.float().mean().item()
    want = 1 / (n * (1 - p))
    kept_values = out[out > 0].double()
    scale = (kept_values / want - 1).abs().max().item() if kept_values.numel() else math.inf
    if (out[out <= 0] != 0).any():  # a dropped probability is exactly 0, never negative
        scale = math.inf
    eps = torch.finfo(dtype).eps
    hoeffding = 2 * math.exp(-2 * total * (KEPT_FRACTION_BOUND - 0.0016) ** 2)
    return [
        Check(
            "dropout_masks_agree",
            mismatched == 0 and 0 < kept < 1,
            float(mismatched),
            0.0,
            {"probabilities": total, "p": p},
        ),
        Check(
            "dropout_kept_fraction",
            abs(kept - (1 - p)) <= KEPT_FRACTION_BOUND,
            abs(kept - (1 - p)),
            KEPT_FRACTION_BOUND,
            {"kept": kept, "expected": 1 - p, "flake_probability_below": hoeffding},
        ),
        Check("dropout_scale", scale <= eps, scale, eps, {"kept_value": want}),
    ]


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms`` as ``train.deterministic`` sets it (``training.engine``: new memory
    not filled), then as it was."""
    settings: Any = torch.utils.deterministic  # its fill_uninitialized_memory is not in torch's type stubs
    before = torch.are_deterministic_algorithms_enabled(), settings.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        settings.fill_uninitialized_memory = before[1]


def check_checkpoint(device: torch.device, dtype: torch.dtype, hidden: int, heads: int, p: float) -> list[Check]:
    """3. The same gradients with and without activation checkpointing, dropout ``p``."""
    from torch.utils.checkpoint import checkpoint

    lengths = lengths_of(8, 1, 300, seed=3) if device.type == "cuda" else lengths_of(4, 1, 40, seed=3)
    pack = pack_of(lengths, device)
    torch.manual_seed(1)
    block = AttentionBlock(hidden, heads).to(device, dtype)
    x = torch.randn(sum(lengths), hidden, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(sum(lengths), hidden, device=device, dtype=dtype)
    inputs = [x, *block.parameters()]

    def grads(seed: int, checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        args = (x, pack.cu_seqlens, pack.max_seqlen, p)
        out = checkpoint(block, *args, use_reentrant=False) if checkpointed else block(*args)
        return list(torch.autograd.grad(out, inputs, grad_outputs=weight))

    with deterministic():
        plain, checked, other = grads(5, False), grads(5, True), grads(6, False)
    difference = max((a.double() - b.double()).abs().max().item() for a, b in zip(plain, checked))
    control = max((a.double() - b.double()).abs().max().item() for a, b in zip(plain, other))
    bitwise = all(torch.equal(a, b) for a, b in zip(plain, checked))
    detail = {"tokens": sum(lengths), "p": p, "another_seed_differs_by": control}
    return [Check("checkpoint_gradients", bitwise and control > 0, difference, 0.0, detail)]


def check_compiled_layer(device: torch.device, dtype: torch.dtype, size: str, seed: int = 0) -> list[Check]:
    """4. One compiled layer of ``size`` against eager, both against float64, dropout 0; no graph break.
    ``seed``: of the weights, the lengths and the inputs."""
    from torch._dynamo.utils import counters

    from model import compile as mc
    from model import unpad
    from model.build import build_model
    from model.registry import get_spec

    spec = get_spec(size, layers=1, dropout=0.0, vocab_size=512)  # the layer alone matters: a small vocabulary
    torch.manual_seed(seed)
    model = build_model(spec, device=device).to(dtype).train()
    ((layer, attribute, eager),) = mc.compile_scope(model)
    if attribute != "packed_call":
        raise AssertionError(f"{size}: the product compiles {attribute}, not the whole layer (packed_call)")
    reference = copy.deepcopy(layer).double()  # before compile_blocks replaces the layer's packed_call
    torch._dynamo.reset()
    counters.clear()
    done = mc.compile_blocks(model)
    compiled = getattr(layer, attribute)

    lengths = lengths_of(16, 64, 384, seed + 4) if device.type == "cuda" else lengths_of(6, 8, 64, seed + 4)
    pack = pack_of(lengths, device)
    fields = (pack.indices, pack.cu_seqlens, pack.max_seqlen, pack.batch, pack.seq_len)
    ref_kernel = "varlen" if device.type == "cpu" else "padded"  # flash has no float64: SDPA's math kernel
    g = torch.Generator().manual_seed(seed + 5)
    x64 = torch.randn(sum(lengths), spec.hidden, generator=g, dtype=torch.float64).to(dtype).double()
    w64 = torch.randn(sum(lengths), spec.hidden, generator=g, dtype=torch.float64).to(dtype).double()
    x64, w64 = x64.to(device), w64.to(device)
    names = [n for n, _ in layer.named_parameters()]

    def run(fn: Callable[..., torch.Tensor], module: nn.Module, kind: torch.dtype, kernel: str) -> list[torch.Tensor]:
        x = x64.to(kind).requires_grad_()
        out = fn(x, *fields, kernel)
        grads = torch.autograd.grad(out, [x, *module.parameters()], grad_outputs=w64.to(kind))
        return [t.detach().double() for t in (out, *grads)]

    reference_call = functools.partial(unpad.packed_layer, reference, spec.pre_layernorm)
    want = run(reference_call, reference, torch.float64, ref_kernel)
    got_eager = run(eager, layer, dtype, "varlen")
    got_compiled = run(compiled, layer, dtype, "varlen")
    stats = mc.compile_stats() or {}
    graph = Check(
        "compiled_graph",
        done.failed is None and stats.get("compiled_graphs", 0) >= 1 and stats.get("graph_breaks", 1) == 0,
        float(stats.get("graph_breaks", -1)),
        0.0,
        {"compiled_graphs": stats.get("compiled_graphs"), "fell_back": done.failed, "tokens": sum(lengths)},
    )

    labels = ["output", "input.grad", *(f"{n}.grad" for n in names)]
    groups = ["output", "input", *(n.rsplit(".", 1)[0] for n in names)]  # a parameter's module
    scale: dict[str, float] = {}
    for group, ref in zip(groups, want):
        scale[group] = max(scale.get(group, 0.0), ref.abs().max().item())
    rounding = FLOOR_ROUNDINGS[dtype] * torch.finfo(dtype).eps
    ratios, errors, worst = {}, {}, ("", 0.0, 0.0, 0.0)
    for label, group, ref, e, c in zip(labels, groups, want, got_eager, got_compiled):
        eager_err, compiled_err = (e - ref).abs().max().item(), (c - ref).abs().max().item()
        floor = rounding * scale[group]
        ratios[label] = compiled_err / max(eager_err, floor, torch.finfo(torch.float64).tiny)
        errors[label] = {"eager": eager_err, "compiled": compiled_err, "floor": floor}
        if ratios[label] >= worst[1]:
            worst = (label, ratios[label], compiled_err, eager_err)
    output_err = [(t[0] - want[0]).abs().max().item() for t in (got_eager, got_compiled)]
    detail = {
        "worst": worst[0],
        "its_compiled_err": worst[2],
        "its_eager_err": worst[3],
        "output_eager_err": output_err[0],
        "output_compiled_err": output_err[1],
        "tensors": len(labels),
    }
    worst_ratio = max(ratios.values())
    data = {"ratios": ratios, "errors": errors, "lengths": lengths}
    return [graph, Check("compiled_vs_float64", worst_ratio <= COMPILE_RATIO, worst_ratio, COMPILE_RATIO, detail, data)]


def _one_line(error: Any) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


# ------------------------------------------------------------------------------------------------ main


def describe(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        info["device"] = "cpu"
    return info


def preflight(args: argparse.Namespace) -> torch.device:
    """Bad usage, found before any check runs: raises UsageError with one line."""
    from model.bert import SIZES

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    names = [s.name for s in SIZES]
    if args.size not in names:
        raise UsageError(f"--size {args.size}: not a BERT size ({', '.join(names)})")
    if args.json is not None and not args.json.parent.is_dir():
        raise UsageError(f"--json {args.json}: its folder {args.json.parent} does not exist")
    device = torch.device(args.device)
    if device.type == "cuda":
        from model import attention as A

        spec = next(s for s in SIZES if s.name == args.size)
        head_dim = spec.hidden // spec.heads
        if not A.flash_usable(device, DTYPE["cuda"], head_dim):
            capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
            reason = A.FLASH_SCHEMA_PROBLEM or f"compute capability {capability}, head size {head_dim}"
            raise UsageError(f"--device cuda: the operator does not run flash here ({reason}); CUDA runs padded")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--json", type=Path, help="write every check, the device and the versions here")
    parser.add_argument("--size", help="check 4's BERT size (default: bert-large on CUDA, bert-debug on the CPU)")
    args = parser.parse_args(argv)
    args.size = args.size or DEFAULT_SIZE[args.device]
    if args.device == "cuda":  # before cuBLAS starts: deterministic matmuls for check 3
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        device = preflight(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from model.registry import get_spec

    spec = get_spec(args.size)
    p = spec.dropout or 0.1  # checks 1-3 drop something
    dtype = DTYPE[device.type]
    opcheck_dtypes = [dtype] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    record: dict[str, Any] = {**describe(device), "size": args.size, "dtype": str(dtype).removeprefix("torch.")}
    record["checks"] = []
    steps: list[tuple[str, Callable[[], list[Check]]]] = [
        ("opcheck", lambda: check_opcheck(device, opcheck_dtypes, spec.hidden, spec.heads, p)),
        ("dropout", lambda: check_dropout(device, dtype, p)),
        ("checkpoint", lambda: check_checkpoint(device, dtype, spec.hidden, spec.heads, p)),
        ("compiled", lambda: check_compiled_layer(device, dtype, args.size)),
    ]
    print(f"{record['device']}, torch {record['torch']}, CUDA {record['cuda']}, {record['dtype']}, {args.size}")
    start = time.perf_counter()
    for group, run in steps:
        t0 = time.perf_counter()
        try:
            checks = run()
        except Exception as e:  # an error fails its check; the others still run
            traceback.print_exc()
            checks = [Check(group, False, None, 0.0, {"error": _one_line(e)})]
        if device.type == "cuda":
            torch.cuda.synchronize()
        for check in checks:
            check.seconds = round(time.perf_counter() - t0, 2)
            print(check.line(), flush=True)
            record["checks"].append(asdict(check))
        record["passed"] = all(c["passed"] for c in record["checks"])
        record["seconds"] = round(time.perf_counter() - start, 2)
        if args.json is not None:
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(args.json)
    passed = record["passed"]
    print(f"{'all passed' if passed else 'FAILED'} in {record['seconds']:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
