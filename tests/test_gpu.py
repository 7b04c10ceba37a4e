"""The GPU tier (``pytest -m cuda``): train.py runs with real DeepSpeed on the GPU.

Here: one-GPU runs under NCCL (bert-debug and neox-debug, ZeRO 1 and 2, BF16, LANS and AdamW; deterministic
resume; export with logits equal to the training model's), FP32 accuracy against a float64 CPU run, and LANS
on its intended path. Also on the tier, from tests/test_train.py (marked ``cuda`` there, run on the CPU in
CI too): 2 ranks sharing the one GPU under gloo (``conftest.start_ranks(one_device=True)``: both with
``LOCAL_RANK=0``), which exercises ZeRO-2 partitioning with ``overlap_comm`` on and off (the two must train the
same), LANS's per-tensor all-reduce, the step reduction, the background save's vote, a resume, and ZeRO-3
under ``zero.Init``. ``scripts/gpu.sh`` installs from the offline bundle and runs this tier on a GPU machine.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_python
from tests.test_train import common, deepspeed, gpt_data, losses  # noqa: F401 (gpt_data: a fixture)
from training import events

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the GPU tier runs on a GPU machine (bash scripts/gpu.sh BUNDLE)",
    ),
]

NCCL = ("deepspeed.backend=nccl", "run.threads_per_rank=0", "data.num_workers=2")


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def assert_mfu(s: dict) -> None:
    """On a device the peak table knows (H100, H200, ...), MFU is a number in (0, 1]: a misread device name
    (MFU None) fails here."""
    from training.devices import peak_flops

    if peak_flops(s["device_kind"]) is not None:
        assert s["mfu"] is not None and 0 < s["mfu"] <= 1, s["mfu"]
    else:
        assert s["mfu"] is None, (s["device_kind"], s["mfu"])


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("optimizer", ["lans", "adamw"])
def test_bert_trains_on_one_gpu(bert_data, tmp_path, zero, optimizer):
    run_dir = tmp_path / "run"
    res = deepspeed(
        common(
            bert_data,
            run_dir,
            *NCCL,
            f"deepspeed.zero_stage={zero}",
            f"optimizer.name={optimizer}",
            "deepspeed.precision=bf16",
        ),
        ranks=1,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["device_kind"] != "cpu" and s["zero_stage"] == zero and s["steps"] == 8
    assert_mfu(s)
    assert "using the eager foreach implementation" not in res.stderr  # LANS/LAMB did not fall back
    ls = losses(run_dir)
    assert all(v == v for v in ls.values()) and ls[8] < ls[1]


def test_lamb_activation_checkpointing_and_background_saves_on_one_gpu(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    res = deepspeed(
        common(
            bert_data,
            run_dir,
            *NCCL,
            "optimizer.name=lamb",
            "model.activation_checkpointing=true",
            "checkpoint.async_save=true",
            "checkpoint.every=2",
        ),
        ranks=1,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["optimizer"] == "lamb" and s["steps"] == 8
    assert_mfu(s)
    saves = [e for e in events.read(run_dir) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6, 8] and all("write_s" in e for e in saves[:3]), saves
    ls = losses(run_dir)
    assert all(v == v for v in ls.values()) and ls[8] < ls[1]


def test_neox_trains_on_one_gpu(gpt_data, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = [
        "--config",
        "smoke",
        "model.name=neox-debug",
        f"run.dir={run_dir}",
        f"data.train={gpt_data['train']}",
        f"data.eval={gpt_data['eval']}",
        f"data.vocab={gpt_data['vocab']}",
        "data.seq_len=128",
        "optimizer.name=adamw",
        "optimizer.lr=1e-3",
        "schedule.kind=cosine_warmup",
        "deepspeed.zero_stage=2",
        "train.steps=8",
        "train.global_batch=8",
        "train.micro_batch=4",
        "train.eval_samples=32",
        "logging.every=1",
        "checkpoint.every=4",
        *NCCL,
    ]
    res = deepspeed(args, ranks=1)
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["family"] == "neox" and s["steps"] == 8 and s["eval_perplexity"] < 4000


def test_deterministic_resume_is_exact_on_gpu(bert_data, tmp_path):
    det = (*NCCL, "train.deterministic=true", "deepspeed.zero_stage=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert deepspeed(common(bert_data, straight, *det), ranks=1).returncode == 0
    first = deepspeed(common(bert_data, resumed, *det, "train.stop_at_step=4"), ranks=1)
    assert first.returncode == 3, first.stderr[-3000:]
    second = deepspeed(common(bert_data, resumed, *det), ranks=1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(resumed) == losses(straight)  # bit for bit


def test_export_from_a_gpu_run(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    assert deepspeed(common(bert_data, run_dir, *NCCL), ranks=1).returncode == 0
    out = tmp_path / "hf"
    res = run_python(["-m", "training", "export", str(run_dir / "checkpoints"), "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    from transformers import AutoModelForPreTraining

    from model.registry import get_spec
    from training.checkpoint.export import consolidated_state
    from training.checkpoint.storage import read_latest

    exported = AutoModelForPreTraining.from_pretrained(out).cuda().eval()
    ckpt = run_dir / "checkpoints"
    state = consolidated_state(ckpt, read_latest(ckpt))
    spec = get_spec("bert-debug", vocab_size=exported.config.vocab_size, dropout=0.0)
    from model.registry import family_of

    training_model = family_of(spec).build(spec, "sdpa")
    training_model.load_state_dict(state)
    training_model = training_model.cuda().eval()
    ids = torch.randint(1000, exported.config.vocab_size, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = training_model.hf(input_ids=ids, attention_mask=mask).prediction_logits
        theirs = exported(input_ids=ids, attention_mask=mask).prediction_logits
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), (ours - theirs).abs().max()


def _fp32_vs_fp64_errors(batch: dict, device: str) -> tuple[float, float]:
    """bert-debug (dropout 0) loss and gradients on ``batch``: the FP32 run on ``device`` and the FP32 CPU
    run, each as its largest relative error against the float64 CPU run of the same weights and samples."""
    from model.registry import family_of, get_spec

    spec = get_spec("bert-debug", vocab_size=8000, dropout=0.0)
    torch.manual_seed(0)
    reference = family_of(spec).build(spec, "sdpa")

    def run(dev: str, dtype: torch.dtype) -> list[torch.Tensor]:
        import copy

        model = copy.deepcopy(reference).to(device=dev, dtype=dtype).train()
        out = model(**{k: v.to(dev) for k, v in batch.items()})
        out["loss"].backward()
        return [out["loss"].detach().double().cpu()] + [
            p.grad.detach().double().cpu() for p in model.parameters() if p.grad is not None
        ]

    exact = run("cpu", torch.float64)

    # A gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores it) is noise in
    # float64 too; each tensor's error is relative to its own norm, but at least a thousandth of the whole.
    floor = 1e-3 * float(torch.cat([e.flatten() for e in exact[1:]]).norm())

    def error(got: list[torch.Tensor]) -> float:
        """The largest relative error of the loss and of each parameter's gradient."""
        return max(float((g - e).norm()) / max(float(e.norm()), floor) for g, e in zip(got, exact))

    return error(run(device, torch.float32)), error(run("cpu", torch.float32))


def test_fp32_on_the_gpu_is_as_accurate_as_fp32_on_the_cpu(bert_data):
    """With dropout 0 and TF32 off, the GPU's FP32 loss and gradients are no further from a float64 CPU run
    of the same samples than 2x the FP32 CPU run's distance."""
    from data.loader import PretrainingLoader

    loader = PretrainingLoader(
        bert_data["train"], "bert", micro_batch=8, grad_accum=1, dp_rank=0, dp_world=1, num_workers=0
    )
    batch = next(iter(loader))
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        gpu, cpu = _fp32_vs_fp64_errors(batch, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    assert cpu > 0 and gpu <= 2 * cpu, (gpu, cpu)


def test_lans_takes_its_intended_path_on_the_gpu():
    """impl=auto resolves to the flat-partition path ("multi") on CUDA; tensors that are not a ZeRO partition
    go to the compiled kernels, with no fallback warning."""
    import warnings

    from training.optim.lans import LANS

    params = [
        torch.nn.Parameter(torch.randn(300, 300, device="cuda")),
        torch.nn.Parameter(torch.randn(300, device="cuda")),
    ]
    opt = LANS(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns: here it fails the test
        opt.step()
    assert opt.last_impl == "multi" and opt.flat_group_steps == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_hands_out_pinned_batches_on_cuda(bert_data, workers):
    """pin_memory: the DataLoader's thread (or, without workers, the read) pins every device key, and the
    batches equal those of an unpinned loader."""
    from data.loader import PretrainingLoader
    from model.unpad import HOST_KEYS

    def first(pin: bool) -> list[dict]:
        loader = PretrainingLoader(
            bert_data["train"],
            "bert",
            micro_batch=4,
            grad_accum=2,
            dp_rank=0,
            dp_world=1,
            num_workers=workers,
            unpad=True,
            pin_memory=pin,
        )
        it = iter(loader)
        return [next(it) for _ in range(3)]

    for pinned, plain in zip(first(True), first(False)):
        assert pinned.keys() == plain.keys()
        for k, v in pinned.items():
            assert torch.equal(v, plain[k]), k
            assert v.is_pinned() or k in HOST_KEYS, k


def test_a_micro_batch_out_of_device_memory_is_one_line(bert_data, tmp_path):
    """bert-large at micro-batch 4096 (about 390 GB of activations at seq 128: more than any one GPU): one line
    naming train.micro_batch, the peak memory and half the micro-batch, no traceback, exit 2, nothing saved."""
    run_dir = tmp_path / "run"
    res = deepspeed(
        common(
            bert_data,
            run_dir,
            *NCCL,
            "model.name=bert-large",
            "train.global_batch=4096",
            "train.micro_batch=4096",
            "train.eval_every=0",
            "deepspeed.precision=bf16",
        ),
        ranks=1,
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[0].startswith("error: train.micro_batch=4096 runs out of device memory on rank 0 (")
    assert " GiB of " in lines[0] and lines[0].endswith("try train.micro_batch=2048"), lines[0]
    assert not (run_dir / "checkpoints" / "latest").exists()


def test_lans_flat_partition_path_has_no_host_sync_on_the_gpu():
    """The accelerators' LANS path on a ZeRO-like flat partition (a tensor in two fragments, others whole): no
    host sync in a step (CUDA's sync-debug warnings counted by common.syncs), every group step taken whole, and
    the same weights as the foreach path on the same layout after 3 steps."""
    from common.syncs import count_host_syncs
    from tests.test_lans import split_layout
    from training.optim.lans import LANS

    numels = [300_000, 700, 5]
    torch.manual_seed(0)
    init = torch.randn(sum(numels), device="cuda")
    grads = [torch.randn(sum(numels), device="cuda") for _ in range(4)]
    out = {}
    for impl in ("multi", "foreach"):
        flat = torch.nn.Parameter(init.clone())
        layout = split_layout(numels, 100_000)  # one rank: the all-reduce returns the sums
        opt = LANS([flat], lr=1e-2, impl=impl)
        opt.set_layouts({id(flat): layout})
        it = iter(grads)

        def step(flat=flat, opt=opt, it=it):
            flat.grad = next(it).clone()
            opt.step()

        syncs = count_host_syncs(step, steps=3, warmup=1)
        out[impl] = (flat.detach().clone(), syncs, opt.flat_group_steps)
    (w, syncs, taken), (w_ref, _, _) = out["multi"], out["foreach"]
    assert syncs.total == 0, syncs
    assert taken == 4
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["varlen", "padded"])
def test_unpadded_bert_step_has_no_host_sync_on_the_gpu(bert_data, kernel):
    """BERT on its real tokens with each CUDA attention kernel (``varlen``: the flash operator, the default;
    ``padded``), forward and backward in BF16 autocast, fed the loader's unpadding keys (their host copies: exact
    kernel sizes): no host sync in a step (CUDA's sync-debug warnings counted by common.syncs)."""
    from common.syncs import count_host_syncs
    from data.loader import PretrainingLoader
    from model.build import build_model
    from model.registry import get_spec
    from training.devices import to_device

    loader = PretrainingLoader(
        bert_data["train"], "bert", micro_batch=8, grad_accum=1, dp_rank=0, dp_world=1, unpad=True, pin_memory=True
    )
    it = iter(loader)
    batches = [to_device(next(it), torch.device("cuda")) for _ in range(4)]  # moved before the counting
    model = build_model(get_spec("bert-debug", vocab_size=8000), unpad=True, unpad_kernel=kernel).cuda().train()
    feed = iter(batches)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**next(feed))["loss"]
        loss.backward()

    syncs = count_host_syncs(step, steps=3, warmup=1)
    assert syncs.total == 0, syncs


def _flash_case(lengths: list[int], heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    from model.unpad import packing

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], device="cuda")
    return [x.to("cuda", dtype).requires_grad_() for x in (q, k, v)], packing(mask)


def test_flash_varlen_attention_against_padded_and_float64():
    """The operator's flash branch (BF16, bert-large's 16 heads of 64, 24 sequences of 1-512 tokens) against
    float64 written out, forward and gradients: no further than 2x the padded kernel's BF16 error; and the
    installed torch's flash ops pass the schema check (the flash branch is on)."""
    from model import attention as A
    from model.unpad import default_kernel, varlen_attention

    assert A.FLASH_SCHEMA_PROBLEM is None and A.flash_usable(torch.device("cuda"), torch.bfloat16, 64)
    assert default_kernel("cuda", torch.bfloat16, 64) == "varlen"
    lengths = torch.randint(1, 513, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    (q, k, v), pack = _flash_case(lengths, 16, 64, torch.bfloat16)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        a, b, c = (x[start : start + n].transpose(0, 1) for x in ref)
        outs.append((torch.softmax(a @ b.transpose(-1, -2) / 8.0, -1) @ c).transpose(0, 1))
        start += n
    want = torch.cat(outs)
    want_grads = torch.autograd.grad((want * weight).sum(), ref)
    errors = {}
    for kernel in ("varlen", "padded"):
        out = varlen_attention(q, k, v, pack, 0.0, kernel)
        got_grads = torch.autograd.grad((out.double() * weight.cuda()).sum(), (q, k, v))
        errors[kernel] = [(out.double().cpu() - want).abs().max().item()]
        errors[kernel] += [(g.double().cpu() - w).abs().max().item() for g, w in zip(got_grads, want_grads)]
    print(f"max |error| vs float64 (out, dq, dk, dv): {errors}")
    assert all(f <= 2 * p + 1e-3 for f, p in zip(errors["varlen"], errors["padded"])), errors


def test_flash_varlen_dropout_keeps_one_minus_p():
    """q = k = 0 makes every probability 1/n and v = the identity shows each kept one (1 / (n (1 - p))) and each
    dropped one (0): over 16 heads x 4 sequences of 128 (1,048,576 probabilities) the kept fraction is within 1%
    of 1 - p, and the same seed keeps the same ones."""
    from model.attention import attention

    p, n, heads = 0.1, 128, 16
    lengths = [n] * 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.zeros(sum(lengths), heads, n, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(n, device="cuda", dtype=torch.bfloat16).repeat(len(lengths), 1).unsqueeze(1)
    v = v.expand(-1, heads, -1).contiguous()
    torch.manual_seed(0)
    kept = attention(q, q, v, cu, n, p) > 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01 * (1 - p)
    torch.manual_seed(0)
    assert torch.equal(attention(q, q, v, cu, n, p) > 0, kept)
