"""Training FLOPs per token and peak FLOP/s per device: the only inputs to MFU.

Convention (PaLM appendix B; torchtitan and llm.c use the same):

    training FLOPs per token = 6 * N_matmul + 12 * L * d_model * S

* ``N_matmul`` counts the weights a token is multiplied by: every transformer-layer weight and the output
  projection. Embedding *lookups* (token, position, token-type) cost no matmul FLOPs and are left out.
  6 = 2 (multiply-add) x 3 (forward + backward, backward being twice the forward).
* ``12 * L * d_model * S`` is attention's QK^T and AV (2 matmuls x 2 FLOPs x d_model x S per layer per token,
  x 3 for training). Causal models are *not* halved (PaLM's convention), so MFU is comparable across
  families.
* BERT's heads follow what the sparse model computes: the MLM head (transform + vocabulary decoder) runs at
  ``max_pred`` gathered positions per sequence, so it counts ``max_pred / S`` of a token's share; the pooler
  and NSP classifier run once per sequence (1 / S).
* Activation recomputation is not counted: these are *model* FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

import functools
import time

import torch

from model.build import build_model
from model.registry import ModelSpec

# Peak dense BF16 tensor FLOP/s per device (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 SXM": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100 NVL": 835.0e12,
    "H200": 989.4e12,
    "GH200": 989.4e12,
    "A100": 312.0e12,
    "A10G": 70.0e12,
    "L4": 121.0e12,
    "Gaudi2": 432.0e12,
}


def _layer_and_head_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(weights in transformer layers + final norm, per-prediction head weights, per-sequence head weights)."""
    model = build_model(spec, device="meta")
    layers = pred_head = seq_head = 0
    for name, p in model.named_parameters():  # tied decoder weight appears once, under the embedding name
        n = p.numel()
        if name.endswith(
            ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight")
        ):
            continue
        if name.endswith("embed_in.weight"):
            continue
        if ".cls.predictions." in name or name.endswith(("embed_out.weight", "lm_head.weight")):
            pred_head += n
        elif ".pooler." in name or ".cls.seq_relationship." in name:
            seq_head += n
        else:
            layers += n
    if spec.family == "bert":
        pred_head += spec.hidden * spec.padded_vocab  # the decoder matmul uses the tied embedding matrix
    return layers, pred_head, seq_head


@functools.cache
def training_flops_per_token(spec: ModelSpec, seq_len: int, max_pred: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) under the convention in this module's docstring."""
    layers, pred_head, seq_head = _layer_and_head_params(spec)
    attention = 12 * spec.layers * spec.hidden * seq_len
    if spec.family == "bert":
        if max_pred is None:
            raise ValueError("BERT FLOPs need max_pred (MLM predictions per sequence)")
        head = pred_head * max_pred / seq_len + seq_head / seq_len
    else:
        head = pred_head  # the LM head runs at every position
    return 6.0 * (layers + head) + attention


def device_kind() -> str:
    """A name from ``PEAK_BF16_FLOPS`` for the current accelerator, or ``"cpu"``."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for kind in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if kind.replace(" SXM", "") in name:
            if kind == "H100 SXM" and ("PCIe" in name or "NVL" in name):
                continue
            return kind
    return name


@functools.cache
def measure_cpu_bf16_peak(size: int = 1024, seconds: float = 1.0) -> float:
    """Measured BF16 matmul FLOP/s of this process on the CPU (with its current thread count).

    CPUs have no datasheet number that fits; the best sustained square BF16 matmul is the honest ceiling.
    """
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    torch.mm(a, b)
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * size**3 / dt)
    return best


def peak_flops(kind: str | None = None) -> float:
    """Peak dense BF16 FLOP/s of one device of ``kind`` (default: this process's device)."""
    kind = kind or device_kind()
    if kind == "cpu":
        return measure_cpu_bf16_peak()
    if kind not in PEAK_BF16_FLOPS:
        raise KeyError(
            f"no peak BF16 FLOP/s known for device {kind!r}; add it to model.flops.PEAK_BF16_FLOPS"
        )
    return PEAK_BF16_FLOPS[kind]
