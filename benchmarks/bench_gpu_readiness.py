"""Is unpadded BERT ready for a GPU? Four figures measured on the CPU, so that GPU minutes measure speed rather
than find these problems:

1. **Memory traffic outside the matmuls**, per token and layer, forward and backward, eager BF16, for each
   attention kernel (``model.unpad_attention``). Counted per kernel call by ``common/bytecount.py`` (each tensor
   argument read once, each output written once) over a 2-layer model minus a 1-layer one, on meta tensors (the
   calls a CUDA run makes, no data; on the CPU the counts are the same); the unit is one ``[T, hidden]`` BF16
   tensor read or written (2 bytes x hidden per token). Of it, the attention operator's calls. Two calls differ
   from CUDA's: dropout is ``bernoulli_`` + ``div_`` + ``mul`` here (one fused ``native_dropout`` on CUDA), and
   the padded kernel's masked SDPA runs as its math decomposition (its ``[B, heads, m, m]`` scores count as
   other calls; CUDA's memory-efficient kernel keeps them on chip). ``jagged`` does not run on meta tensors.
2. **Host synchronisations per training step on the accelerator path**: calls of ``Tensor.item``, ``tolist``
   and ``__bool__`` on a device tensor; ``nonzero``, ``masked_select``, boolean indexing and index assignment;
   copies from the device to the host. The model's
   forward and backward, then a LANS step (``impl="auto"``: the flat-partition path) over the model's parameters
   as one ZeRO-like flat partition. On meta tensors, with the attention operator's flash branch taken: they take
   every branch a CUDA tensor takes (neither is a CPU tensor) and hold no values, so a read is found, not
   answered. (Fake CUDA tensors would be closer, but a CPU build of torch cannot index them: its device guard
   needs CUDA.)
3. **Compiled layers** (``model.compile``, inductor on the CPU, FP32): graphs after micro-batch 2 and after
   micro-batch 5 of five that differ in token count, longest row and number of rows, and graph breaks.
4. **Optimizer bytes per parameter and step**, LANS and LAMB, each path the counter can see, on one layer's
   parameters (of ``--model``) as a flat partition split in fragments as ZeRO splits it; fp32 master weights
   and gradients, as DeepSpeed's BF16 optimizer hands them over. A path whose work the counter cannot see
   (the C++ kernels are not operators) fails rather than counts zero: ``cpu`` and
   ``fused`` are not listed (``fused``'s compiled frames run eagerly under a dispatch mode, so a count would
   describe its eager ops, not its kernels).

    python benchmarks/bench_gpu_readiness.py --tokens 16384 --rows 128 --compile ""   # phase 1's micro-batch
    python benchmarks/bench_gpu_readiness.py --tokens 256 --rows 4 --compile varlen --json   # CI's toy size

Prints one table per part, and with ``--json`` one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from common.bytecount import ByteCounter, op_class
from data.loader import unpadding_index
from model.bert import BertSpec
from model.build import build_model
from model.registry import get_spec
from model.unpad import KERNELS
from training.optim.zero_map import GroupLayout

SEQ_LEN = 128
PREDICTIONS = 20
VOCAB = 1024  # the embeddings and the head cancel out of the per-layer figures


def micro_batch(tokens: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """``rows`` sequences of width SEQ_LEN with about ``tokens`` real tokens in all, of different lengths, with
    the loader's unpadding keys (on the host)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.rand(rows, generator=g) + 0.5) * tokens / rows
    lengths = lengths.clamp(PREDICTIONS + 2, SEQ_LEN).long()
    mask = (torch.arange(SEQ_LEN) < lengths.unsqueeze(1)).long()
    positions = torch.stack([torch.randperm(int(n) - 1, generator=g)[:PREDICTIONS] + 1 for n in lengths])
    batch = {
        "input_ids": torch.randint(5, VOCAB, (rows, SEQ_LEN), generator=g) * mask,
        "token_type_ids": torch.zeros(rows, SEQ_LEN, dtype=torch.long),
        "attention_mask": mask,
        "masked_lm_positions": positions.sort(1).values,
        "masked_lm_ids": torch.randint(5, VOCAB, (rows, PREDICTIONS), generator=g),
        "masked_lm_weights": torch.ones(rows, PREDICTIONS),
        "next_sentence_labels": torch.randint(0, 2, (rows, 1), generator=g),
        "min_seqlen": lengths.min(),
    }
    batch.update(unpadding_index(mask))
    return batch


def device_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The micro-batch on the meta device, as ``training.devices.to_device`` moves it (the unpadding's host keys
    stay on the host)."""
    from model.unpad import HOST_KEYS

    return {k: v if k in HOST_KEYS else v.to("meta") for k, v in batch.items()}


def model_of(spec: BertSpec, layers: int, kernel: str, dtype: torch.dtype, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    s = get_spec(spec.name, layers=layers, vocab_size=VOCAB, dropout=dropout)
    return build_model(s, unpad=True, unpad_kernel=kernel).to(dtype).train()


@contextlib.contextmanager
def flash_on_meta() -> Iterator[None]:
    """The attention operator's flash branch taken for meta tensors (they then run its fake implementation)."""
    import model.attention as A

    real = A.flash_usable
    A.flash_usable = lambda device, *a, **k: torch.device(device).type == "meta" or real(device, *a, **k)
    try:
        yield
    finally:
        A.flash_usable = real


# ---- 1: bytes outside the matmuls ------------------------------------------------------------------------


def layer_bytes(spec: BertSpec, kernel: str, tokens: int, rows: int) -> dict[str, float]:
    """Per layer and token, in [T, hidden] BF16 units: non-matmul and attention bytes, forward and backward."""
    batch = micro_batch(tokens, rows, seed=1)
    real = int(batch["attention_mask"].sum())
    on_device = device_batch(batch)
    counted: dict[int, dict[str, Any]] = {}
    for layers in (1, 2):
        model = model_of(spec, layers, kernel, torch.bfloat16).to("meta")
        with flash_on_meta(), ByteCounter() as fwd:
            loss = model(**on_device)["loss"]
        with ByteCounter() as bwd:
            loss.backward()
        counted[layers] = {"fwd": fwd, "bwd": bwd}
    unit = real * spec.hidden * 2
    out: dict[str, Any] = {}
    for phase in ("fwd", "bwd"):
        one, two = counted[1][phase].by_class, counted[2][phase].by_class
        nonmatmul = (sum(two.values()) - two["matmul"]) - (sum(one.values()) - one["matmul"])
        out[f"{phase}_nonmatmul"] = nonmatmul / unit
        out[f"{phase}_attention"] = (two["attention"] - one["attention"]) / unit
        ops = counted[2][phase].by_op - counted[1][phase].by_op  # the second layer's
        top = [(name, moved / unit) for name, moved in ops.most_common() if op_class(name) != "matmul"][:4]
        out[f"{phase}_top"] = [f"{name.split('::')[-1]} {units:.1f}" for name, units in top]
    return out


# ---- 2: host synchronisations on the accelerator path ---------------------------------------------------------------


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A device-to-host copy (``.cpu()``, ``.to("cpu")``, ``host.copy_(device)``): the host waits for it."""
    if name == "_to_copy":
        return torch.device(kwargs.get("device") or args[0].device).type == "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and isinstance(args[1], torch.Tensor) and args[1].device.type != "cpu"
    return False


class _SyncOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators whose output size depends on device values (the host must wait to size it), boolean
    index assignment, and copies from the device to the host; one count per call from the model's code (a
    boolean index's own ``nonzero`` inside is the same wait)."""

    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        counted = on_device and (
            name in ("nonzero", "masked_select")
            or (name in ("index", "index_put", "index_put_") and _bool_index(args[1]))
            or _to_host(name, args, kwargs)
        )
        if not counted or self.inside:
            return func(*args, **kwargs)
        self.found.append(name)
        if any(t.device.type == "meta" for t in tensors):  # stand-ins where meta tensors have no answer
            if name == "masked_select":
                return args[0].new_empty(0)
            if name == "_to_copy":
                return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if name == "copy_":
                return args[0]
        self.inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.inside = False


@contextlib.contextmanager
def counting_syncs() -> Iterator[list[str]]:
    """Inside: every read of a device (meta) tensor's values is recorded by name (the patched methods return a
    stand-in value, so that the step goes on to find the next one)."""
    found: list[str] = []
    names = ("item", "tolist", "__bool__")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    own = {name for name in names if name in vars(torch.Tensor)}  # the others are inherited: removed after

    def patched(name: str, standin: Any) -> Callable:
        def method(self, *args, **kwargs):
            if self.device.type == "meta":
                found.append(name)
                return standin
            return originals[name](self, *args, **kwargs)

        return method

    from torch.fx.experimental import _config as fx_config

    torch.Tensor.item = patched("item", 1)  # type: ignore[method-assign]
    torch.Tensor.tolist = patched("tolist", [])  # type: ignore[method-assign]
    torch.Tensor.__bool__ = patched("__bool__", True)  # type: ignore[method-assign]
    try:  # (a meta nonzero then assumes every element is nonzero, rather than raise)
        with _SyncOps(found), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            yield found
    finally:
        for name, method in originals.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


def host_syncs(spec: BertSpec, kernel: str, tokens: int, rows: int) -> dict[str, Any]:
    """Host syncs of one training step on the accelerator path: the model's forward and backward, and a LANS
    step over its parameters as one flat partition. On meta tensors: they take every branch a CUDA tensor takes
    (neither is a CPU tensor), and hold no values, so a read of one is found, not answered. (Fake CUDA tensors
    would be closer, but a CPU build of torch cannot index them: its device guard needs CUDA.)"""
    from training.optim import lans as L

    on_device = device_batch(micro_batch(tokens, rows, seed=2))
    model = model_of(spec, 2, kernel, torch.bfloat16).to("meta")
    numels = [p.numel() for p in model.parameters()]
    with flash_on_meta(), counting_syncs() as model_syncs:
        model(**on_device)["loss"].backward()
    flat = torch.nn.Parameter(torch.zeros(sum(numels), device="meta"))
    flat.grad = torch.zeros_like(flat)
    opt = L.LANS([flat], lr=1e-3)
    opt.set_layouts({id(flat): GroupLayout.split_first(numels, numels[0] // 2, process_group=object())})
    saved = L.allreduce_sums
    L.allreduce_sums = lambda sums, pg: sums  # one rank
    try:
        with counting_syncs() as opt_syncs:
            opt.step()
    finally:
        L.allreduce_sums = saved
    return {
        "model": len(model_syncs),
        "optimizer": len(opt_syncs),
        "impl": opt.last_impl,
        "what": model_syncs + opt_syncs,
    }


# ---- 3: compiled layers ----------------------------------------------------------------------------------


def compiled_graphs(spec: BertSpec, kernel: str, tokens: int) -> dict[str, int]:
    """Graphs after micro-batch 2 and after micro-batch 5 (each of another token count, longest row and
    number of rows), and graph breaks, training a 1-layer model with its layers compiled whole."""
    from torch._dynamo.utils import counters

    from model import compile as mc

    torch._dynamo.reset()
    counters.clear()
    model = model_of(spec, 1, kernel, torch.float32)
    done = mc.compile_blocks(model)
    counts = []
    for i, rows in enumerate((4, 3, 5, 2, 6)):
        batch = micro_batch(tokens * (i + 3) // 5, rows, seed=10 + i)
        model(**batch)["loss"].backward()
        counts.append(mc.compile_count())
    return {
        "after_2": counts[1],
        "after_5": counts[-1],
        "breaks": sum(counters["graph_break"].values()),
        "whole": int(mc.whole_layers(model)),
        "eager_fallback": int(done.failed is not None),
    }


# ---- 4: optimizer bytes ----------------------------------------------------------------------------------


def optimizer_bytes(spec: BertSpec, impls: list[str]) -> dict[str, float]:
    """Bytes per parameter of the second step (the first builds state and compiles), LANS and LAMB."""
    from training.optim import lans as L

    layer = model_of(spec, 1, "varlen", torch.float32).hf.bert.encoder.layer[0]
    numels = [p.numel() for p in layer.parameters()]
    saved = L.allreduce_sums
    L.allreduce_sums = lambda sums, pg: sums  # one rank
    out = {}
    try:
        for cls in (L.LANS, L.LAMB):
            for impl in impls:
                torch.manual_seed(0)
                flat = torch.nn.Parameter(torch.randn(sum(numels)))
                opt = cls([flat], lr=1e-3, impl=impl)
                opt.set_layouts({id(flat): GroupLayout.split_first(numels, numels[0] // 2, process_group=object())})
                for _ in range(2):
                    flat.grad = torch.randn_like(flat)
                    st = opt.state.get(flat, {})
                    watch = [flat, st["exp_avg"], st["exp_avg_sq"]] if st else [flat]
                    with ByteCounter(watch=watch) as bc:
                        opt.step()
                out[f"{cls.__name__}_{impl}"] = bc.total / flat.numel()
                assert opt.last_impl == impl, (impl, opt.last_impl)
    finally:
        L.allreduce_sums = saved
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-large")
    ap.add_argument("--tokens", type=int, default=512, help="real tokens per micro-batch asked (rows cut at 128)")
    ap.add_argument("--rows", type=int, default=6, help="sequences per micro-batch")
    ap.add_argument(
        "--kernels", default="varlen,padded", help="attention kernels for parts 1 and 2 (jagged: not on meta)"
    )
    ap.add_argument("--compile", default="varlen,padded", help="kernels for part 3 ('' skips it)")
    ap.add_argument("--optimizers", default="multi,foreach", help="optimizer paths for part 4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="also print every figure as one JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = get_spec(args.model)
    if not isinstance(spec, BertSpec):
        ap.error(f"--model {args.model}: a BERT size")
    kernels = [k for k in args.kernels.split(",") if k]
    for flag, names in (("--kernels", kernels), ("--compile", [k for k in args.compile.split(",") if k])):
        if unknown := sorted(set(names) - set(KERNELS)):
            ap.error(f"{flag} {','.join(unknown)}: not an attention kernel (one of {', '.join(KERNELS)})")
    real = int(micro_batch(args.tokens, args.rows, seed=1)["attention_mask"].sum())
    report: dict[str, Any] = {"model": spec.name, "tokens": real, "rows": args.rows, "torch": torch.__version__}

    print(f"{spec.name} layer shapes (hidden {spec.hidden}, {spec.heads} heads); torch {torch.__version__}")
    print(
        f"\n1. bytes outside the matmuls per token and layer, eager BF16 ([T, hidden] BF16 units; {real} real "
        f"tokens in {args.rows} rows of {SEQ_LEN})"
    )
    print(f"  {'kernel':8} {'fwd':>7} {'of it attention':>16} {'bwd':>7} {'of it attention':>16}")
    report["bytes"] = {}
    for kernel in kernels:
        b = report["bytes"][kernel] = layer_bytes(spec, kernel, args.tokens, args.rows)
        print(
            f"  {kernel:8} {b['fwd_nonmatmul']:7.1f} {b['fwd_attention']:16.1f} {b['bwd_nonmatmul']:7.1f} "
            f"{b['bwd_attention']:16.1f}"
        )
        print(f"  {'':8} largest forward: {', '.join(b['fwd_top'])}; backward: {', '.join(b['bwd_top'])}")

    print("\n2. host syncs per training step on the accelerator path (meta tensors, BF16)")
    report["syncs"] = {}
    for kernel in kernels:
        s = report["syncs"][kernel] = host_syncs(spec, kernel, args.tokens, args.rows)
        print(
            f"  {kernel:8} model {s['model']}, optimizer ({s['impl']}) {s['optimizer']}"
            + (f": {', '.join(s['what'])}" if s["what"] else "")
        )

    report["compile"] = {}
    if args.compile:
        print("\n3. compiled layers (inductor, FP32, 5 micro-batches of other shapes)")
        for kernel in [k for k in args.compile.split(",") if k]:
            c = report["compile"][kernel] = compiled_graphs(spec, kernel, args.tokens)
            print(
                f"  {kernel:8} graphs after 2: {c['after_2']}, after 5: {c['after_5']}; graph breaks {c['breaks']}; "
                f"whole layers {'yes' if c['whole'] else 'no'}"
            )

    print("\n4. optimizer bytes per parameter and step (one layer's tensors as a ZeRO flat partition, fp32)")
    report["optimizer"] = optimizer_bytes(spec, [i for i in args.optimizers.split(",") if i])
    for name, per_param in report["optimizer"].items():
        print(f"  {name:14} {per_param:6.1f}")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
