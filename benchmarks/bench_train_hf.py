"""The peer of ``bench_train.py``: Hugging Face ``transformers.Trainer`` on our HDF5 shards, one process,
BF16, on the CPU or one GPU (``--device cuda``).

BERT runs as ``BertForPreTraining`` (MLM head over every position, dense ``labels`` with -100 except at the
masked positions, ``next_sentence_label``); GPT-NeoX as ``GPTNeoXForCausalLM`` with ``labels=input_ids``. The
Hugging Face configs are built from our registry (``model.bert.hf_config`` / ``model.neox.hf_config``), so the
weights are the same shapes as in ``train.py``. A ``TrainerCallback`` starts the clock after ``--warmup``
optimizer steps and stops it after the last one (no evaluation, no saving); one JSON line goes to ``--out``,
with the process CPU time of the same window (this process only; the DataLoader worker is another process).

    python benchmarks/bench_train_hf.py --model bert-debug --data DIR --steps 35 --warmup 5 --out r.json

``Trainer`` needs ``accelerate`` (>= 1.1), which the project does not depend on: install it (or put a
``pip install --target`` directory of it on PYTHONPATH, as ``bench_train.py --peer-site`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from common.errors import UserError, run_cli
from data import h5format
from data.formats import BERT, GPT


class BertShards(torch.utils.data.Dataset):
    """Our BERT shard rows as the dense tensors ``BertForPreTraining`` takes (shards read into memory
    once)."""

    def __init__(self, path: str | Path) -> None:
        files = h5format.list_shards(path, BERT.name).files
        cols: dict[str, list[np.ndarray]] = {}
        for f in files:
            with h5py.File(f, "r") as h:
                for k in (
                    "input_ids",
                    "segment_ids",
                    "input_mask",
                    "masked_lm_positions",
                    "masked_lm_ids",
                    "next_sentence_labels",
                ):
                    cols.setdefault(k, []).append(h[k][:])
        self.cols = {k: np.concatenate(v) for k, v in cols.items()}

    def __len__(self) -> int:
        return len(self.cols["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        c = self.cols
        ids = torch.from_numpy(c["input_ids"][i].astype(np.int64))
        pos = torch.from_numpy(c["masked_lm_positions"][i : i + 1].astype(np.int64))
        lm = torch.from_numpy(c["masked_lm_ids"][i : i + 1].astype(np.int64))
        return {
            "input_ids": ids,
            "token_type_ids": torch.from_numpy(c["segment_ids"][i].astype(np.int64)),
            "attention_mask": torch.from_numpy(c["input_mask"][i].astype(np.int64)),
            "labels": dense_mlm_labels(pos, lm, len(ids))[0],
            "next_sentence_label": torch.tensor(int(c["next_sentence_labels"][i]), dtype=torch.long),
        }


def dense_mlm_labels(positions: torch.Tensor, ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, P] masked positions and ids -> [B, seq_len] labels, -100 where nothing is predicted.

    As in our loader, a row's predictions run up to its first zero position (position 0 is [CLS]).
    """
    real = torch.cumprod((positions != 0).long(), dim=1).bool()
    labels = torch.full((positions.size(0), seq_len), -100, dtype=torch.long)
    # padded slots all point at position 0 and write -100 there, which no real prediction uses
    labels.scatter_(1, positions, torch.where(real, ids, torch.full_like(ids, -100)))
    return labels


def hf_bert_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our loader's micro-batch -> the keyword arguments of ``BertForPreTraining``."""
    return {
        "input_ids": batch["input_ids"],
        "token_type_ids": batch["token_type_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": dense_mlm_labels(batch["masked_lm_positions"], batch["masked_lm_ids"], batch["input_ids"].size(1)),
        "next_sentence_label": batch["next_sentence_labels"],
    }


def check_same_task(peer: torch.nn.Module, spec, data: str | Path, micro_batch: int) -> float:
    """Our sparse-head model with the peer's weights must give the peer's loss on a batch of our loader.

    Shows that the dense labels encode exactly our MLM targets and weights (FP32, eval mode); returns the
    relative difference, raises when it exceeds 1e-4.
    """
    from data.loader import PretrainingLoader
    from model.bert import BertPretraining

    loader = PretrainingLoader(
        data, BERT.name, micro_batch=micro_batch, grad_accum=1, dp_rank=0, dp_world=1, num_workers=0
    )
    batch = next(iter(loader))
    with torch.random.fork_rng(devices=[]):
        ours = BertPretraining(spec)
    ours.hf.load_state_dict(peer.state_dict())
    ours.eval()
    was_training = peer.training
    peer.eval()
    with torch.no_grad():
        a = float(ours(**batch)["loss"])
        b = float(peer(**hf_bert_inputs(batch)).loss)
    peer.train(was_training)
    rel = abs(a - b) / max(abs(b), 1e-12)
    if rel > 1e-4:
        raise UserError(f"peer and our model disagree on the same batch: loss {b:.6f} vs {a:.6f}")
    return rel


class GptShards(torch.utils.data.Dataset):
    """Our packed GPT windows (seq_len + 1 tokens) as ``input_ids = labels =`` the first seq_len tokens.

    ``GPTNeoXForCausalLM`` shifts the labels itself, so it runs the same seq_len positions as our model does.
    """

    def __init__(self, path: str | Path) -> None:
        rows = []
        for f in h5format.list_shards(path, GPT.name).files:
            with h5py.File(f, "r") as h:
                rows.append(h["input_ids"][:])
        self.rows = np.concatenate(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.rows[i, :-1].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def build_peer_model(name: str, vocab_size: int, attention: str = "sdpa") -> torch.nn.Module:
    """The Hugging Face pre-training model whose config is our registry model's."""
    from model.registry import get_spec

    spec = get_spec(name, vocab_size=vocab_size)
    if spec.family == "bert":
        from model.bert import build_hf_bert

        return build_hf_bert(spec, attention)
    from transformers import GPTNeoXForCausalLM

    from model.neox import hf_config

    return GPTNeoXForCausalLM(hf_config(spec, attention))


def peer_attention_kernel(model: torch.nn.Module, family: str) -> str | None:
    """The record's ``attention_kernel``, named as ``train.py``'s summary names its own (``model.unpad``): BERT's
    ``transformers`` attention (``sdpa``: ``F.scaled_dot_product_attention``; ``eager``) over the padded rows
    with a key mask, every position computed (``sdpa-padded``); None for GPT-NeoX, whose full causal windows
    need no unpadding kernel on either side (its summary records null too)."""
    if family != "bert":
        return None
    return f"{model.config._attn_implementation}-padded"


def _peak_rss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="registry name (bert-debug, bert-10m, neox-debug, ...)")
    p.add_argument("--data", required=True, help="directory of our HDF5 shards (bert or gpt, as the model)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in all (warm-up included)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before the clock starts")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.1, help="lr warm-up as a fraction of --steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True, help="JSON file for the result")
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the Trainer on the GPU (BF16 autocast, fp32 weights, its default fused AdamW); the clock "
        "synchronises the device at its two marks; $WIKIPRETRAIN_DEVICE_MEMORY_GIB caps it as it does train.py",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps <= args.warmup:
        raise UserError(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    if args.global_batch % args.micro_batch:
        raise UserError(f"--global-batch={args.global_batch} is not a multiple of --micro-batch={args.micro_batch}")
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device")
        if torch.cuda.device_count() > 1:  # the Trainer would run DataParallel over all of them
            raise UserError(
                f"--device cuda: {torch.cuda.device_count()} GPUs visible; give one (CUDA_VISIBLE_DEVICES=N)"
            )
        from training.engine import cap_device_memory

        cap_device_memory()
    try:
        import accelerate  # noqa: F401  (Trainer's hard requirement; fail with a clear line, not deep inside)
        from transformers import Trainer, TrainerCallback, TrainingArguments
    except ImportError as e:
        raise UserError(f"transformers.Trainer is not usable ({e}); pip install 'accelerate>=1.1.0'") from None

    from model.registry import family_of, get_spec

    spec = get_spec(args.model)
    fmt = family_of(spec).format
    kind = fmt.name
    info = h5format.inspect_shard(h5format.list_shards(args.data, kind).files[0], kind)
    vocab_size = int(info.attrs["vocab_size"])
    seq_len = int(info.attrs["seq_len"])
    dataset = BertShards(args.data) if fmt is BERT else GptShards(args.data)
    torch.manual_seed(args.seed)
    model = build_peer_model(args.model, vocab_size)
    if fmt is BERT:
        # BertForPreTraining takes **kwargs but ignores ``num_items_in_batch`` (its loss is a plain mean), so
        # the Trainer would neither divide the loss by the accumulation steps nor normalise by the item
        # count: the gradients would be grad_accum times too large. Declaring it makes the Trainer divide, as
        # for any model.
        model.accepts_loss_kwargs = False
        same_task_rel_diff = check_same_task(
            model, get_spec(args.model, vocab_size=vocab_size), args.data, min(args.micro_batch, 4)
        )  # on the host, before the Trainer moves the model: a few rows show the labels are the same task
    else:
        same_task_rel_diff = None

    class Clock(TrainerCallback):
        """Starts after ``warmup`` optimizer steps, stops after the last one."""

        def __init__(self) -> None:
            self.t0: float | None = None
            self.t1: float | None = None
            self.cpu0 = self.cpu1 = 0.0

        def on_step_end(self, a, state, control, **kw):  # TrainerCallback's signature
            if cuda and state.global_step in (args.warmup, args.steps):
                torch.cuda.synchronize()
            if state.global_step == args.warmup:
                self.t0, self.cpu0 = time.perf_counter(), time.process_time()
                probe.open()
            if state.global_step == args.steps:
                probe.close()
                self.t1, self.cpu1 = time.perf_counter(), time.process_time()

    from bench_train_ours import StepProbe  # a sibling: a script's directory is on sys.path

    from common.packages import installed_version

    probe = StepProbe(cuda=cuda)
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="bench_train_hf_") as out_dir:
        targs = TrainingArguments(
            output_dir=out_dir,
            use_cpu=not cuda,
            bf16=True,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.global_batch // args.micro_batch,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=args.warmup_ratio,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-6,
            max_grad_norm=1.0,
            dataloader_num_workers=args.workers,
            dataloader_drop_last=True,
            report_to=[],
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="steps",
            logging_steps=args.steps,  # one loss read-back, at the end
            disable_tqdm=True,
            seed=args.seed,
            torch_compile=args.compile,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[clock])
        try:
            result = trainer.train()
        except torch.OutOfMemoryError:
            raise UserError(f"--micro-batch={args.micro_batch} runs out of device memory ({args.model})") from None
    if clock.t0 is None or clock.t1 is None:
        raise UserError("the Trainer did not reach the measured steps")
    seconds = clock.t1 - clock.t0
    measured = args.steps - args.warmup
    seqs = measured * args.global_batch / seconds
    # MFU as train.py counts it, of what the peer computes: every position of every row, its heads dense
    from model.flops import training_flops_per_token
    from training.devices import peak_flops

    dense_head = seq_len if fmt is BERT else None  # BertForPreTraining's MLM head runs at every position
    flops_per_token = training_flops_per_token(get_spec(args.model, vocab_size=vocab_size), seq_len, dense_head)
    peak = peak_flops(torch.cuda.get_device_name() if cuda else "cpu", ("bfloat16", "float32"))
    record = {
        "model": args.model,
        "family": spec.family,
        "seq_len": seq_len,
        "micro_batch": args.micro_batch,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "measured_steps": measured,
        "seconds": seconds,
        "cpu_seconds": clock.cpu1 - clock.cpu0,
        "sequences_per_sec": seqs,
        "sequences_per_cpu_sec": measured * args.global_batch / (clock.cpu1 - clock.cpu0),
        "tokens_per_sec": seqs * seq_len,
        "flops_per_token": flops_per_token,
        "mfu": seqs * seq_len * flops_per_token / peak if peak else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else _peak_rss(),
        **probe.result(measured),
        "compile": args.compile,
        "attention_kernel": peer_attention_kernel(model, spec.family),
        "threads": torch.get_num_threads(),
        "optimizer": str(targs.optim.value if hasattr(targs.optim, "value") else targs.optim),
        "final_loss": float(result.training_loss),
        "same_task_rel_diff": same_task_rel_diff,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": installed_version("transformers"),
        },
    }
    Path(args.out).write_text(json.dumps(record) + "\n", encoding="utf-8")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(main))
