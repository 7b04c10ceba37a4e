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
import shutil
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_path
from common.errors import UserError
from common.log import get_logger
from data import h5format
from data.documents import Source, add_source_arguments
from data.formats import BERT
from data.instances import BertSettings, SpecialIds, build_pairs, materialize, truncate_pairs
from data.shards import ShardDir, ShardJob, run_from_args, run_shard_jobs
from data.text import write_text_files
from data.tokenize_text import InputShard, list_text_files, plan_shards, tokenize_sentences
from data.tokenizer import CachedBertTokenizer, check_bert_vocab, vocab_sha256

log = get_logger("data.bert")
WRITE_BATCH = 4096
_TOKENIZERS: dict[tuple, CachedBertTokenizer] = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument(
        "--vocab",
        required=True,
        help="WordPiece vocab.txt, or a Hugging Face tokenizer.json with BERT's WordPiece pipeline (as "
        "bert-base-uncased ships); must contain [CLS] [SEP] [MASK] [PAD]",
    )
    p.add_argument("--out", required=True, help="output dir for bert-NNNNN.h5 shards and manifest.json")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-pred", type=int, default=20, help="max masked positions per instance")
    p.add_argument("--dupe-factor", type=int, default=5, help="passes over the corpus with different masks/splits")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--workers", type=int, default=1, help="worker processes (output does not depend on it)")
    p.add_argument("--shards", type=int, default=0, help="number of output shards (0: one per 32 MiB of text)")
    p.add_argument("--whole-word-masking", action="store_true")
    p.add_argument("--lowercase", dest="lowercase", action="store_true", default=True, help="uncased vocab (default)")
    p.add_argument("--cased", dest="lowercase", action="store_false", help="cased vocab: keep case and accents")
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    p.add_argument("--no-progress", action="store_true")


def _shard_task(
    shard: InputShard,
    out_file: str,
    vocab: str,
    lowercase: bool,
    s: BertSettings,
    seed: int,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    """Build and write one output shard; runs in a worker process (or inline for --workers 1)."""
    t0 = time.perf_counter()
    words = check_bert_vocab(vocab)
    index = {w: i for i, w in enumerate(words)}
    pool = np.array([i for i, w in enumerate(words) if not (w.startswith("[") and w.endswith("]"))], dtype=np.int32)
    sp = SpecialIds(index["[PAD]"], index["[CLS]"], index["[SEP]"], index["[MASK]"], len(words), pool)
    is_subword = np.array([w.startswith("##") for w in words], dtype=bool)
    # one tokenizer (and its chunk cache) per worker process, reused across shards: speed only, the
    # ids are the same either way, so the output still depends only on (seed, shard)
    key = (vocab, lowercase, vocab_sha256(vocab))
    tok = _TOKENIZERS.get(key)
    if tok is None:
        _TOKENIZERS.clear()
        tok = _TOKENIZERS[key] = CachedBertTokenizer(vocab, lowercase)
    ts = tokenize_sentences(tok, shard)
    t_tok = time.perf_counter()
    ss = np.random.SeedSequence([seed, shard.index])
    rng_pairs, rng_trunc, rng_shuffle, rng_mask = (np.random.Generator(np.random.PCG64(c)) for c in ss.spawn(4))
    n_inst = 0
    if ts.num_docs:
        pairs = build_pairs(ts, s, rng_pairs)
        pairs = truncate_pairs(pairs, s.seq_len - 3, rng_trunc)
        pairs = pairs.take(rng_shuffle.permutation(len(pairs)))  # shuffled within the shard, as NVIDIA does
        n_inst = len(pairs)
    t_build = time.perf_counter()
    t_mat = 0.0
    real_tokens = real_squares = 0
    S, P = s.seq_len, s.max_pred
    with atomic_path(out_file) as tmp, h5py.File(tmp, "w") as f:
        h5format.write_attrs(
            f, {**attrs, "shard_index": shard.index, "source": shard.describe(), "num_instances": n_inst}
        )
        ds = {
            name: h5format.create_dataset(
                f,
                name,
                (n_inst, fld.row_width(S, P)) if fld.rank == 2 else (n_inst,),
                fld.dtype,
                BERT.unit_rows,
            )
            for name, fld in BERT.schema.items()
        }
        for start in range(0, n_inst, WRITE_BATCH):
            idx = np.arange(start, min(n_inst, start + WRITE_BATCH))
            tm = time.perf_counter()
            rows = materialize(ts.tokens, pairs.take(idx), s, sp, is_subword, rng_mask)
            t_mat += time.perf_counter() - tm
            lengths = rows["input_mask"].sum(axis=1, dtype=np.int64)
            real_tokens += int(lengths.sum())
            real_squares += int((lengths * lengths).sum())
            for name, arr in rows.items():
                ds[name][start : start + len(idx)] = arr
    return {
        "index": shard.index,
        "file": Path(out_file).name,
        "instances": n_inst,
        **h5format.shard_record(out_file),
        "documents": ts.num_docs,
        "sentences": ts.num_sentences,
        "tokens": len(ts.tokens),
        # real (unpadded) tokens of the rows and the sum of their lengths squared: the padding fraction and the
        # attention FLOPs an unpadded model computes (``launch report``'s projections)
        "real_tokens": real_tokens,
        "real_tokens_squared": real_squares,
        "bytes": shard.nbytes,
        "source": shard.describe(),
        "seconds": round(time.perf_counter() - t0, 3),
        # where the time went (setup+tokenize, pair walk, row assembly+masking, HDF5 write)
        "seconds_tokenize": round(t_tok - t0, 3),
        "seconds_pairs": round(t_build - t_tok, 3),
        "seconds_rows": round(t_mat, 3),
        "seconds_write": round(time.perf_counter() - t_build - t_mat, 3),
    }


def build_bert_shards(
    text: str | os.PathLike | None,
    vocab: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dataset: str | None = None,
    text_field: str = "text",
    split: str = "train",
    seq_len: int = 128,
    max_pred: int = 20,
    dupe_factor: int = 5,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    whole_word_masking: bool = False,
    lowercase: bool = True,
    seed: int = 12345,
    workers: int = 1,
    shards: int = 0,
    overwrite: bool = False,
    progress: bool | None = False,
) -> dict[str, Any]:
    """Documents -> ``bert-NNNNN.h5`` shards and ``manifest.json`` under ``out``; returns the totals.

    One source: ``text`` (NVIDIA's layout) or ``dataset`` (``data.documents``: local files, a saved
    dataset, a dump; documents in ``text_field``, ``split`` of a saved ``DatasetDict``). A dataset is first
    written in the text layout (``data.text``, sentence splitting in ``workers`` processes) into the
    staging folder and read back from there, so the output equals ``data text`` then ``data bert --text``.
    ``shards=0``: one output shard per 32 MiB of text. The output depends on ``seed`` and the data,
    never on ``workers``. ``progress=None`` shows a bar only on a terminal. Raises ``UserError``
    (nothing left behind) on bad settings, a bad vocabulary, an empty corpus or a non-empty ``out``
    without ``overwrite``.
    """
    t0 = time.perf_counter()
    s = BertSettings(seq_len, max_pred, masked_lm_prob, dupe_factor, short_seq_prob, whole_word_masking)
    if workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1")
    source = Source(None if text is None else str(text), dataset, text_field, split)
    if text is not None:
        plan_shards(list_text_files(text), shards)  # a missing path, no text: before anything is written
    else:
        source.check()
    words = check_bert_vocab(vocab, lowercase)
    if shards < 0:
        raise UserError(f"--shards {shards}: must be >= 0 (0 = automatic)")
    with ShardDir(out, BERT.name, overwrite) as dest:
        text_dir = Path(text) if text is not None else dest.stage / "text"
        if text is None:
            text_dir.mkdir()
            write_text_files(source, text_dir, workers=workers)
        plan = plan_shards(list_text_files(text_dir), shards)
        settings = _settings(s, seed, lowercase, vocab, words, len(plan), dataset or "")
        results = _build(dest, plan, vocab, lowercase, s, seed, settings, workers, progress)
        if text is None:
            shutil.rmtree(text_dir)
        if sum(r["instances"] for r in results) == 0:
            raise UserError(f"{source.name}: empty corpus (no tokens after tokenization)")
        return dest.commit(results, settings, t0, rates=("instances", "tokens"))


def _settings(
    s: BertSettings, seed: int, lowercase: bool, vocab: str | os.PathLike, words: list[str], n: int, source: str
) -> dict[str, Any]:
    """The manifest's settings (and every shard's attributes); ``source``: the dataset, "" for text."""
    return {
        "seq_len": s.seq_len,
        "max_pred": s.max_pred,
        "masked_lm_prob": s.masked_lm_prob,
        "dupe_factor": s.dupe_factor,
        "short_seq_prob": s.short_seq_prob,
        "seed": seed,
        "whole_word_masking": s.whole_word_masking,
        "lowercase": bool(lowercase),
        "vocab_sha256": vocab_sha256(vocab),
        "vocab_size": len(words),
        "vocab_file": Path(vocab).name,
        "num_shards": n,
        **({"dataset": source} if source else {}),
    }


def _build(
    dest: ShardDir,
    plan: list[InputShard],
    vocab: str | os.PathLike,
    lowercase: bool,
    s: BertSettings,
    seed: int,
    settings: dict[str, Any],
    workers: int,
    progress: bool | None,
) -> list[dict[str, Any]]:
    """Run one job per input shard; returns the shard records."""
    attrs = {"format": BERT.format_attr, "format_version": h5format.FORMAT_VERSION, **settings}
    jobs = [
        ShardJob((sh, str(dest.path(sh.index)), str(vocab), bool(lowercase), s, seed, attrs), sh.nbytes) for sh in plan
    ]
    return run_shard_jobs(
        _shard_task,
        jobs,
        workers=min(workers, len(plan)),
        desc="bert instances",
        unit="B",
        total=sum(sh.nbytes for sh in plan),
        progress=progress,
    )


REPORT = (
    "bert: {documents} documents, {sentences} sentences, {tokens} input tokens -> {instances} instances"
    " in {shards} shard(s) under {out} in {seconds:.1f}s ({instances_per_s:.0f} instances/s,"
    " {tokens_per_s:.0f} input tokens/s)"
)


def run(args: argparse.Namespace) -> int:
    """``python -m data bert``: the flags are :func:`build_bert_shards`'s parameters."""
    return run_from_args(build_bert_shards, REPORT, args)
