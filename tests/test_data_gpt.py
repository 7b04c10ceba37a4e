"""``python -m data gpt``: packing (no lost target, no padding), attributes, local datasets, the GPT loader,
bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from tokenizers import Tokenizer

from data.loader import PretrainingLoader
from tests.conftest import data_cli, expect_error


def shard_documents(path: Path, source: str) -> list[str]:
    """The documents of a shard read independently from its ``source`` attribute (file:start-end;...)."""
    docs: list[str] = []
    for seg in source.split(";"):
        name, rng = seg.rsplit(":", 1)
        start, end = map(int, rng.split("-"))
        files = list(path.rglob(name)) if path.is_dir() else [path]
        data = files[0].read_bytes()[start:end].decode("utf-8")
        for block in data.replace("\r", "").split("\n\n"):
            sents = [ln.strip() for ln in block.split("\n") if ln.strip()]
            if sents:
                docs.append(" ".join(sents))
    return docs


def windows_to_stream(w: np.ndarray) -> np.ndarray:
    """Undo the one-token overlap: w[0] then w[i][1:]."""
    return np.concatenate([w[0], *[x[1:] for x in w[1:]]]) if len(w) else np.zeros(0, w.dtype)


def check_packing(out: Path, text: Path, tok_path: Path, seq_len: int) -> int:
    tok = Tokenizer.from_file(str(tok_path))
    eod = tok.token_to_id("<|endoftext|>")
    man = json.loads((out / "manifest.json").read_text())
    total = 0
    for s in man["shards"]:
        with h5py.File(out / s["file"]) as f:
            w = f["input_ids"][:]
            attrs = dict(f.attrs)
        assert w.shape[1] == seq_len + 1 and w.dtype == np.uint16  # vocab < 65536
        assert (w[1:, 0] == w[:-1, -1]).all(), "consecutive windows overlap by one token"
        for k in (
            "format",
            "format_version",
            "tokenizer_sha256",
            "vocab_size",
            "eod_id",
            "seq_len",
            "source",
        ):
            assert k in attrs, k
        assert attrs["tokenizer_sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
        assert attrs["eod_id"] == eod and attrs["seq_len"] == seq_len
        docs = shard_documents(text, attrs["source"])
        expected = np.concatenate([np.array(tok.encode(d, add_special_tokens=False).ids + [eod]) for d in docs])
        stream = windows_to_stream(w)
        assert len(expected) - len(stream) == attrs["dropped_tokens"] == s["dropped_tokens"] < seq_len + 1
        assert np.array_equal(stream, expected[: len(stream)]), "windows are the document stream, in order, no padding"
        # decoding reproduces the documents, separated by the end-of-document token
        pieces = np.split(stream, np.nonzero(stream == eod)[0] + 1)
        for doc, ids in zip(docs, pieces[:-1]):
            assert ids[-1] == eod
            assert tok.decode(ids[:-1].tolist()) == tok.decode(tok.encode(doc).ids)
        total += len(w)
    return total


def test_packing_text(wiki_text_dir: Path, bpe: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpt"
    p = data_cli(
        "gpt",
        "--text",
        str(wiki_text_dir),
        "--tokenizer",
        str(bpe),
        "--out",
        str(out),
        "--seq-len",
        "128",
        "--shards",
        "3",
        "--workers",
        "2",
        "--no-progress",
    )
    n = check_packing(out, wiki_text_dir, bpe, 128)
    assert n > 1000 and "dropped" in p.stdout
    # same windows with one worker
    data_cli(
        "gpt",
        "--text",
        str(wiki_text_dir),
        "--tokenizer",
        str(bpe),
        "--out",
        str(tmp_path / "w1"),
        "--seq-len",
        "128",
        "--shards",
        "3",
        "--no-progress",
    )
    for f in sorted(out.glob("*.h5")):
        with h5py.File(f) as a, h5py.File(tmp_path / "w1" / f.name) as b:
            assert np.array_equal(a["input_ids"][:], b["input_ids"][:])
    # the GPT loader: [B, seq_len + 1] long windows that are rows of the shards
    ld = PretrainingLoader(
        out,
        "gpt",
        micro_batch=4,
        grad_accum=2,
        dp_rank=0,
        dp_world=1,
        num_workers=1,
        expect={"seq_len": 128, "tokenizer_sha256": hashlib.sha256(bpe.read_bytes()).hexdigest()},
    )
    rows = {r.tobytes() for f in sorted(out.glob("*.h5")) for r in h5py.File(f)["input_ids"][:].astype(np.int64)}
    it = iter(ld)
    for _ in range(5):
        b = next(it)
        assert b["input_ids"].shape == (4, 129) and b["input_ids"].dtype.is_floating_point is False
        assert all(r.numpy().tobytes() in rows for r in b["input_ids"])


def test_local_datasets_jsonl_and_parquet(wiki_text_dir: Path, bpe: Path, tmp_path: Path) -> None:
    docs = shard_documents(wiki_text_dir, f"{sorted(wiki_text_dir.rglob('*.txt'))[0].name}:0-400000")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": docs}), parquet)
    tok = Tokenizer.from_file(str(bpe))
    eod = tok.token_to_id("<|endoftext|>")
    expected = np.concatenate([np.array(tok.encode(d, add_special_tokens=False).ids + [eod]) for d in docs])
    for src in (jsonl, parquet):
        out = tmp_path / f"out-{src.suffix[1:]}"
        data_cli(
            "gpt",
            "--dataset",
            str(src),
            "--text-field",
            "body",
            "--tokenizer",
            str(bpe),
            "--out",
            str(out),
            "--seq-len",
            "64",
            "--no-progress",
        )
        with h5py.File(out / "gpt-00000.h5") as f:
            stream = windows_to_stream(f["input_ids"][:])
        assert len(stream) > 1000 and np.array_equal(stream, expected[: len(stream)])
    p = data_cli("gpt", "--dataset", str(jsonl), "--tokenizer", str(bpe), "--out", str(tmp_path / "x"), check=False)
    expect_error(p, "no field 'text'", "--text-field")


def test_real_neox_tokenizer(wiki_text_dir: Path, shared_neox_tokenizer: Path, tmp_path: Path) -> None:
    one = sorted(wiki_text_dir.rglob("*.txt"))[0]
    out = tmp_path / "neox"
    data_cli(
        "gpt",
        "--text",
        str(one),
        "--tokenizer",
        str(shared_neox_tokenizer),
        "--out",
        str(out),
        "--seq-len",
        "512",
        "--no-progress",
    )
    assert check_packing(out, one, shared_neox_tokenizer, 512) > 50


def test_bad_input(wiki_text_dir: Path, bpe: Path, wiki_vocab: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # a tokenizer.json without an end-of-document token: a WordPiece one built from the BERT vocab
    from tokenizers import BertWordPieceTokenizer

    no_eod = tmp_path / "wordpiece.json"
    BertWordPieceTokenizer(str(wiki_vocab)).save(str(no_eod))
    expect_error(
        data_cli("gpt", "--text", str(wiki_text_dir), "--tokenizer", str(no_eod), "--out", str(out), check=False),
        "wordpiece.json",
        "end-of-document",
    )
    expect_error(
        data_cli("gpt", "--text", str(tmp_path / "missing"), "--tokenizer", str(bpe), "--out", str(out), check=False),
        "missing",
    )
    expect_error(
        data_cli(
            "gpt", "--dataset", str(tmp_path / "none.jsonl"), "--tokenizer", str(bpe), "--out", str(out), check=False
        ),
        "none.jsonl",
    )
    bad_json = tmp_path / "tok.json"
    bad_json.write_text("{not json")
    expect_error(
        data_cli("gpt", "--text", str(wiki_text_dir), "--tokenizer", str(bad_json), "--out", str(out), check=False),
        "tok.json",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("\n \n")
    expect_error(
        data_cli("gpt", "--text", str(empty), "--tokenizer", str(bpe), "--out", str(out), check=False),
        "empty corpus",
    )
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("One short sentence.\n")
    expect_error(
        data_cli(
            "gpt", "--text", str(tiny), "--tokenizer", str(bpe), "--out", str(out), "--seq-len", "2048", check=False
        ),
        "fewer than one window",
    )
    assert not any(out.glob("*.h5")), "no shard left behind"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    expect_error(
        data_cli("gpt", "--text", str(wiki_text_dir), "--tokenizer", str(bpe), "--out", str(busy), check=False),
        "--overwrite",
    )
    assert (busy / "x").read_text() == "keep"


def test_typed_api_summary_and_eval_set(wiki_text_dir: Path, bpe: Path, tmp_path: Path) -> None:
    """``build_gpt_shards`` in-process: its summary is the manifest's totals; an EvalSet over the windows."""
    from common.errors import UserError
    from data.gpt import build_gpt_shards
    from data.loader import EvalSet

    out = tmp_path / "gpt"
    summary = build_gpt_shards(bpe, out, text=wiki_text_dir, seq_len=64, shards=2)
    man = json.loads((out / "manifest.json").read_text())
    assert summary["out"] == str(out) and summary["shards"] == len(man["shards"]) == 2
    for k in ("samples", "tokens", "documents", "dropped_tokens"):
        assert summary[k] == man["totals"][k], k
    rows = 0
    for f in sorted(out.glob("*.h5")):
        with h5py.File(f) as h:
            rows += len(h["input_ids"])
            if f.name == man["shards"][0]["file"]:
                first = h["input_ids"][:10].astype(np.int64)
    assert summary["samples"] == rows > 10
    # 10 samples over 2 ranks: 5 each, in 2 micro-batches of at most 4 rows (3 then 2)
    got = [list(EvalSet(out, "gpt", 10, micro_batch=4, dp_rank=r, dp_world=2)) for r in (0, 1)]
    assert [[tuple(b["input_ids"].shape) for b in g] for g in got] == [[(3, 65), (2, 65)]] * 2
    union = np.concatenate([b["input_ids"].numpy() for g in got for b in g])
    assert np.array_equal(union, first)
    with pytest.raises(UserError, match="exactly one source"):
        build_gpt_shards(bpe, tmp_path / "none")
    with pytest.raises(UserError, match="not empty"):
        build_gpt_shards(bpe, out, text=wiki_text_dir, seq_len=64)
    assert json.loads((out / "manifest.json").read_text()) == man, "a refused run changed the output"
    assert not (tmp_path / "none").exists()
