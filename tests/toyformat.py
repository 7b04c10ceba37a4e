"""A third shard format, defined only here: its record and its builder.

It comes in as any format from outside the package does, through ``data.formats=[tests.toyformat]``
(``data.formats.load_formats``); no file outside tests/ names it. Its windows are GPT's tokens cut without overlap,
under another dataset name (``tokens``, which the loader hands the model as ``input_ids``), another count key
(``windows``), format attribute and unit of order: the loader, the manifest reader and the checks ask the record.
The toy family (tests/toyfamily.py) trains on it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.atomic import atomic_path
from data import h5format
from data.documents import document_text, text_layout_documents
from data.formats import Field, ShardFormat
from data.shards import ShardDir
from data.tokenizer import load_tokenizer, vocab_sha256


def _tokenizer_attrs(tokenizer: str, lowercase: bool | None) -> dict[str, Any]:
    tok, eod, _ = load_tokenizer(tokenizer)
    return {
        "tokenizer_sha256": vocab_sha256(tokenizer),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eod_id": eod,
    }


FORMAT = ShardFormat(
    name="toy",
    format_attr="wikipretrain-toy",
    schema={"tokens": Field(2, "u2", ("u2", "i4"), "seq_len+1", "input_ids")},
    unit_rows=2,
    consistent_keys=("seq_len", "tokenizer_sha256", "vocab_size", "eod_id"),
    tokenizer_kind="tokenizer.json",
    hash_key="tokenizer_sha256",
    uses_max_pred=False,
    count_key="windows",
    tokenizer_flag="--tokenizer",
    tokenizer_attrs=_tokenizer_attrs,
    tokenizer_keys=("tokenizer_sha256", "vocab_size", "eod_id"),
    recognise=lambda f: f.attrs.get("format") == "wikipretrain-toy",
    token_datasets=("tokens",),
)


def build_toy_shards(text: Path, tokenizer: Path, out: Path, *, seq_len: int, shards: int = 2) -> dict[str, Any]:
    """The text layout under ``text`` -> ``shards`` files of windows of ``seq_len + 1`` tokens (documents joined
    by the end-of-document id, cut without overlap) and ``manifest.json`` under ``out``; returns the totals."""
    t0 = time.perf_counter()
    tok, eod, _ = load_tokenizer(str(tokenizer))
    ids: list[int] = []
    docs = [document_text(doc) for doc in text_layout_documents(text)]
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [*enc.ids, eod]
    n = len(ids) // (seq_len + 1)
    windows = np.asarray(ids[: n * (seq_len + 1)], dtype=FORMAT.schema["tokens"].dtype).reshape(n, seq_len + 1)
    settings = {"seq_len": seq_len, **_tokenizer_attrs(str(tokenizer), None)}
    results = []
    with ShardDir(out, FORMAT.name, overwrite=False) as dest:
        for index, part in enumerate(np.array_split(windows, shards)):
            with atomic_path(dest.path(index)) as tmp, h5py.File(tmp, "w") as f:
                attrs = {"format": FORMAT.format_attr, "format_version": h5format.FORMAT_VERSION, **settings}
                h5format.write_attrs(f, attrs)
                h5format.create_dataset(f, "tokens", part.shape, "u2", FORMAT.unit_rows)[:] = part
            record = {"index": index, "file": dest.path(index).name, FORMAT.count_key: len(part)}
            results.append({**record, **h5format.shard_record(dest.path(index))})
        return dest.commit(results, settings, t0, rates=())
