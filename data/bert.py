"""``python -m data bert``: text shards -> BERT MLM/NSP instances in NVIDIA's HDF5 schema.

Each input shard (a byte range of the corpus, cut at document boundaries) becomes one output shard
``bert-NNNNN.h5``, built by one worker process with its own seed derived from (seed, shard index): the
output does not depend on ``--workers``. Peak memory per worker is bounded by one input shard: its
token array (4 bytes/token), the instance index (5 x 8 bytes/instance) and one batch of rows being
written; instances are shuffled by index and written in batches, never held as full rows.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_path
from common.errors import UserError
from common.log import get_logger
from data import h5format
from data.instances import BertSettings, SpecialIds, build_pairs, materialize, truncate_pairs
from data.tokenize_text import (
    CachedBertTokenizer,
    InputShard,
    check_bert_vocab,
    list_text_files,
    plan_shards,
    tokenize_sentences,
)

log = get_logger("data.bert")
WRITE_BATCH = 4096
_TOKENIZERS: dict[tuple, CachedBertTokenizer] = {}
MIN_SEQ_LEN = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--text",
        required=True,
        help="text dir (or one .txt file): one sentence per line, blank line between documents",
    )
    p.add_argument(
        "--vocab", required=True, help="WordPiece vocab.txt (must contain [CLS] [SEP] [MASK] [PAD])"
    )
    p.add_argument("--out", required=True, help="output dir for bert-NNNNN.h5 shards and manifest.json")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-pred", type=int, default=20, help="max masked positions per instance")
    p.add_argument(
        "--dupe-factor", type=int, default=5, help="passes over the corpus with different masks/splits"
    )
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--workers", type=int, default=1, help="worker processes (output does not depend on it)")
    p.add_argument(
        "--shards", type=int, default=0, help="number of output shards (0: one per 32 MiB of text)"
    )
    p.add_argument("--whole-word-masking", action="store_true")
    p.add_argument(
        "--lowercase", dest="lowercase", action="store_true", default=True, help="uncased vocab (default)"
    )
    p.add_argument(
        "--cased", dest="lowercase", action="store_false", help="cased vocab: keep case and accents"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    p.add_argument("--no-progress", action="store_true")


def validate_settings(args: argparse.Namespace) -> BertSettings:
    """Settings that cannot produce valid instances are refused before anything is written.

    seq_len >= 8 and seq_len >= max_pred + 3: [CLS] A [SEP] B [SEP] needs 3 specials and at least one
    token on each side, and every prediction needs a non-special position.
    """
    if args.seq_len < MIN_SEQ_LEN:
        raise UserError(f"--seq-len {args.seq_len}: must be >= {MIN_SEQ_LEN}")
    if args.max_pred < 1:
        raise UserError(f"--max-pred {args.max_pred}: must be >= 1")
    if args.seq_len < args.max_pred + 3:
        raise UserError(
            f"--seq-len {args.seq_len} too small for --max-pred {args.max_pred}: need seq_len >= max_pred + 3"
        )
    if not 0.0 < args.masked_lm_prob < 1.0:
        raise UserError(f"--masked-lm-prob {args.masked_lm_prob}: must be in (0, 1)")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        raise UserError(f"--short-seq-prob {args.short_seq_prob}: must be in [0, 1]")
    if args.dupe_factor < 1:
        raise UserError(f"--dupe-factor {args.dupe_factor}: must be >= 1")
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be >= 1")
    return BertSettings(
        seq_len=args.seq_len,
        max_pred=args.max_pred,
        masked_lm_prob=args.masked_lm_prob,
        dupe_factor=args.dupe_factor,
        short_seq_prob=args.short_seq_prob,
        whole_word_masking=args.whole_word_masking,
    )


def _shard_task(
    shard: InputShard,
    out_file: str,
    vocab: str,
    lowercase: bool,
    s: BertSettings,
    seed: int,
    attrs: dict[str, Any],
    tok_threads: int,
) -> dict[str, Any]:
    """Build and write one output shard; runs in a worker process (or inline for --workers 1)."""
    if tok_threads:
        os.environ.setdefault("RAYON_RS_NUM_CPUS", str(tok_threads))
    t0 = time.perf_counter()
    words = check_bert_vocab(vocab)
    index = {w: i for i, w in enumerate(words)}
    pool = np.array(
        [i for i, w in enumerate(words) if not (w.startswith("[") and w.endswith("]"))], dtype=np.int32
    )
    sp = SpecialIds(index["[PAD]"], index["[CLS]"], index["[SEP]"], index["[MASK]"], len(words), pool)
    is_subword = np.array([w.startswith("##") for w in words], dtype=bool)
    # one tokenizer (and its chunk cache) per worker process, reused across shards: speed only, the
    # ids are the same either way, so the output still depends only on (seed, shard)
    key = (vocab, lowercase, h5format.sha256_file(vocab))
    tok = _TOKENIZERS.get(key)
    if tok is None:
        _TOKENIZERS.clear()
        tok = _TOKENIZERS[key] = CachedBertTokenizer(vocab, lowercase)
    ts = tokenize_sentences(tok, shard)
    t_tok = time.perf_counter()
    ss = np.random.SeedSequence([seed, shard.index])
    rng_pairs, rng_trunc, rng_shuffle, rng_mask = (
        np.random.Generator(np.random.PCG64(c)) for c in ss.spawn(4)
    )
    n_inst = 0
    if ts.num_docs:
        pairs = build_pairs(ts, s, rng_pairs)
        pairs = truncate_pairs(pairs, s.seq_len - 3, rng_trunc)
        pairs = pairs.take(rng_shuffle.permutation(len(pairs)))  # shuffled within the shard, as NVIDIA does
        n_inst = len(pairs)
    t_build = time.perf_counter()
    t_mat = 0.0
    S, P = s.seq_len, s.max_pred
    with atomic_path(out_file) as tmp, h5py.File(tmp, "w") as f:
        h5format.write_attrs(
            f, {**attrs, "shard_index": shard.index, "source": shard.describe(), "num_instances": n_inst}
        )
        ds = {
            name: h5format.create_dataset(
                f,
                name,
                (n_inst, S if name in ("input_ids", "input_mask", "segment_ids") else P)
                if rank == 2
                else (n_inst,),
                dt,
            )
            for name, (rank, dt, _) in h5format.BERT_SCHEMA.items()
        }
        for start in range(0, n_inst, WRITE_BATCH):
            idx = np.arange(start, min(n_inst, start + WRITE_BATCH))
            tm = time.perf_counter()
            rows = materialize(ts.tokens, pairs.take(idx), s, sp, is_subword, rng_mask)
            t_mat += time.perf_counter() - tm
            for name, arr in rows.items():
                ds[name][start : start + len(idx)] = arr
    return {
        "index": shard.index,
        "file": Path(out_file).name,
        "instances": n_inst,
        "documents": ts.num_docs,
        "sentences": ts.num_sentences,
        "tokens": len(ts.tokens),
        "bytes": shard.nbytes,
        "source": shard.describe(),
        "seconds": round(time.perf_counter() - t0, 3),
        # where the time went (setup+tokenize, pair walk, row assembly+masking, HDF5 write)
        "seconds_tokenize": round(t_tok - t0, 3),
        "seconds_pairs": round(t_build - t_tok, 3),
        "seconds_rows": round(t_mat, 3),
        "seconds_write": round(time.perf_counter() - t_build - t_mat, 3),
    }


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = validate_settings(args)
    files = list_text_files(args.text)
    words = check_bert_vocab(args.vocab)
    out = Path(args.out)
    plan = plan_shards(files, args.shards)
    h5format.prepare_out_dir(out, args.overwrite)
    vocab_sha = h5format.sha256_file(args.vocab)
    settings = {
        "seq_len": s.seq_len,
        "max_pred": s.max_pred,
        "masked_lm_prob": s.masked_lm_prob,
        "dupe_factor": s.dupe_factor,
        "short_seq_prob": s.short_seq_prob,
        "seed": args.seed,
        "whole_word_masking": s.whole_word_masking,
        "lowercase": bool(args.lowercase),
        "vocab_sha256": vocab_sha,
        "vocab_size": len(words),
        "vocab_file": Path(args.vocab).name,
        "num_shards": len(plan),
    }
    attrs = {"format": h5format.BERT_FORMAT, "format_version": h5format.FORMAT_VERSION, **settings}
    workers = min(args.workers, len(plan))
    tok_threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else 0
    tasks = [
        (
            sh,
            str(out / f"bert-{sh.index:05d}.h5"),
            str(args.vocab),
            bool(args.lowercase),
            s,
            args.seed,
            attrs,
            tok_threads,
        )
        for sh in plan
    ]
    from tqdm import tqdm

    bar = tqdm(
        total=sum(sh.nbytes for sh in plan),
        unit="B",
        unit_scale=True,
        desc="bert instances",
        disable=True if args.no_progress else None,
    )  # None: only on a terminal
    results: list[dict[str, Any]] = []
    ok = False
    try:
        if workers <= 1:
            for t in tasks:
                results.append(_shard_task(*t))
                bar.update(t[0].nbytes)
        else:
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
                futs = {ex.submit(_shard_task, *t): t[0].nbytes for t in tasks}
                for fut in as_completed(futs):
                    results.append(fut.result())
                    bar.update(futs[fut])
        ok = True
    finally:
        bar.close()
        if not ok:  # a failed run leaves no shards that a manifest does not describe
            for t in tasks:
                Path(t[1]).unlink(missing_ok=True)
    results.sort(key=lambda r: r["index"])
    total_inst = sum(r["instances"] for r in results)
    if total_inst == 0:
        for r in results:
            (out / r["file"]).unlink(missing_ok=True)
        raise UserError(f"{args.text}: empty corpus (no tokens after tokenization)")
    h5format.write_manifest(out, "bert", results, settings)
    secs = time.perf_counter() - t0
    summary = {
        "documents": sum(r["documents"] for r in results),
        "sentences": sum(r["sentences"] for r in results),
        "input_tokens": sum(r["tokens"] for r in results),
        "instances": total_inst,
        "shards": len(results),
        "seconds": round(secs, 2),
        "instances_per_s": round(total_inst / secs, 1),
        "input_tokens_per_s": round(sum(r["tokens"] for r in results) / secs, 1),
    }
    print(
        f"bert: {summary['documents']} documents, {summary['sentences']} sentences, {summary['input_tokens']} input tokens"
        f" -> {total_inst} instances in {summary['shards']} shard(s) under {out} in {secs:.1f}s"
        f" ({summary['instances_per_s']:.0f} instances/s, {summary['input_tokens_per_s']:.0f} input tokens/s)",
        flush=True,
    )
    args._summary = summary
    return 0
