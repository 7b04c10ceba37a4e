"""PretrainingLoader throughput (samples/s per process) and peak RSS on a small and a 10x larger BERT shard,
with our lzf shards, uncompressed shards and NVIDIA-style gzip shards; peer: NVIDIA's HDF5
``pretraining_dataset`` (the whole shard loaded into memory, then one sample at a time under a torch
DataLoader with a RandomSampler), measured in the same run on the same files.

    python benchmarks/bench_loader.py [--micro-batch 64] [--seconds 4]

Each configuration runs in its own process so that its peak RSS (``ru_maxrss`` of the process and its
DataLoader workers) is its own. Needs no ../shared: the shard is built from the enwiki sample.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.h5format import BERT_SCHEMA  # noqa: E402

NAMES = list(BERT_SCHEMA)  # the datasets of a BERT shard, NVIDIA's names and order


def run_ours(path: str, workers: int, mb: int, seconds: float) -> dict:
    from data.loader import PretrainingLoader

    ld = PretrainingLoader(
        path, "bert", micro_batch=mb, grad_accum=1, dp_rank=0, dp_world=1, num_workers=workers
    )
    it = iter(ld)
    for _ in range(20):  # warm-up: worker start, first windows
        next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += len(next(it)["input_ids"])
    return {"samples_per_s": n / (time.perf_counter() - t0), "buffer_samples": ld.buffer_samples}


def run_peer(path: str, workers: int, mb: int, seconds: float) -> dict:
    """NVIDIA's HDF5 ``pretraining_dataset`` (run_pretraining.py before its switch to parquet; the same class
    is in ``distillation/utils/data_utils.py``): loads the whole shard with ``f[key][:]``, then indexes one
    sample at a time under a DataLoader with a RandomSampler."""
    import torch
    from torch.utils.data import DataLoader, Dataset, RandomSampler

    class PretrainingDataset(Dataset):
        def __init__(self, input_file: str, max_pred_length: int) -> None:
            f = h5py.File(input_file, "r")
            self.inputs = [np.asarray(f[key][:]) for key in NAMES]  # NVIDIA loads the whole shard into memory
            f.close()
            self.max_pred_length = max_pred_length

        def __len__(self) -> int:
            return len(self.inputs[0])

        def __getitem__(self, index: int):
            input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels = [
                torch.from_numpy(input[index].astype(np.int64))
                if indice < 5
                else torch.from_numpy(np.asarray(input[index].astype(np.int64)))
                for indice, input in enumerate(self.inputs)
            ]
            masked_lm_labels = torch.zeros(input_ids.shape, dtype=torch.long) - 1
            index = self.max_pred_length
            padded_mask_indices = (masked_lm_positions == 0).nonzero()
            if len(padded_mask_indices) != 0:
                index = padded_mask_indices[0].item()
            masked_lm_labels[masked_lm_positions[:index]] = masked_lm_ids[:index]
            return [input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels]

    ds = PretrainingDataset(path, 20)
    dl = DataLoader(ds, sampler=RandomSampler(ds), batch_size=mb, num_workers=workers, drop_last=True)
    n, t0 = 0, None
    for i, b in enumerate(dl):
        if i == 20:
            t0 = time.perf_counter()
        elif t0 is not None:
            n += len(b[0])
            if time.perf_counter() - t0 > seconds:
                break
    return {"samples_per_s": n / (time.perf_counter() - t0), "buffer_samples": len(ds)}


def child(args: argparse.Namespace) -> int:
    import torch  # noqa: F401  (the baseline includes torch, which both loaders need)

    import data.loader  # noqa: F401

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn = run_ours if args.child == "ours" else run_peer
    r = fn(args.path, args.workers, args.micro_batch, args.seconds)
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r["peak_rss_mib"] = max(self_kb, kids_kb) / 1024
    r["rss_growth_mib"] = (self_kb - base_kb) / 1024  # the reading process above its post-import baseline
    print("@@" + json.dumps(r))
    return 0


def measure(kind: str, path: Path, workers: int, mb: int, seconds: float) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--path", str(path), "--workers", str(workers),
           "--micro-batch", str(mb), "--seconds", str(seconds)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if p.returncode or not line:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(line[-1][2:])


def build_shards(work: Path) -> dict[str, Path]:
    from data.sample import sample_dump_path
    from data.vocab import train_wordpiece
    from data.wiki import extract_dump

    text = work / "text"
    extract_dump([sample_dump_path()], text, workers=1, shards=1)
    vocab_path = REPO.parent / "shared" / "data" / "bert-base-uncased-vocab.txt"
    vocab = vocab_path if vocab_path.exists() else train_wordpiece(text, work / "vocab.txt", 8000)
    out = work / "bert"
    subprocess.run([sys.executable, "-m", "data", "bert", "--text", str(text), "--vocab", str(vocab), "--out",
                    str(out), "--shards", "1", "--no-progress"],
                   check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    small = out / "bert-00000.h5"
    files = {"small lzf": small}
    with h5py.File(small) as src:
        arrays = {k: src[k][:] for k in NAMES}
        attrs = dict(src.attrs)
    for label, reps, comp, dt in (
        ("10x lzf", 10, "lzf", None),
        ("10x none", 10, None, None),
        ("10x gzip NVIDIA", 10, "gzip", "nv"),
    ):
        p = work / (label.replace(" ", "_") + ".h5")
        with h5py.File(p, "w") as f:
            for k, a in arrays.items():
                data = np.concatenate([a] * reps)
                f.create_dataset(
                    k, data=data, chunks=(1024, *data.shape[1:]) if comp != "gzip" else True, compression=comp
                )
            if dt != "nv":  # NVIDIA's shards carry no attributes
                for k, v in attrs.items():
                    f.attrs[k] = v
        files[label] = p
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--child")
    ap.add_argument("--path")
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        files = build_shards(Path(tmp))
        for label, path in files.items():
            with h5py.File(path) as f:
                n = len(f["input_ids"])
            size = path.stat().st_size / 2**20
            configs = [("ours", 0), ("ours", 1), ("ours", 2)]
            if label in ("small lzf", "10x gzip NVIDIA"):
                configs += [("peer", 0), ("peer", 1)]
            for kind, workers in configs:
                r = measure(kind, path, workers, args.micro_batch, args.seconds)
                rows.append((label, n, size, kind, workers, r))
    print(
        f"\nBERT seq 128 loader, micro-batch {args.micro_batch}, {os.cpu_count()} CPUs, load avg "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'shard':<16} {'samples':>8} {'MiB':>6} {'loader':<26} {'workers':>7} {'samples/s':>10} "
        f"{'peak RSS MiB':>13} {'growth MiB':>11} {'buffer rows':>12}"
    )
    for label, n, size, kind, workers, r in rows:
        name = "PretrainingLoader" if kind == "ours" else "NVIDIA pretraining_dataset"
        print(
            f"{label:<16} {n:>8} {size:>6.1f} {name:<26} {workers:>7} {r['samples_per_s']:>10.0f} "
            f"{r['peak_rss_mib']:>13.0f} {r['rss_growth_mib']:>11.0f} {r['buffer_samples']:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
