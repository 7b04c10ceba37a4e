"""Any corpus in (``data.documents``): Hugging Face's ``wikimedia/wikipedia`` parquet layout, JSONL, csv, Arrow and
``save_to_disk`` inputs written from the enwiki sample's articles feed ``data text``, ``data bert``, ``data vocab``
and ``data gpt``; a dataset gives the same shards as its text layout; bad input is one line on every builder."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import UserError, run_cli
from data.__main__ import main
from data.bert import build_bert_shards
from data.documents import Document, document_sentences, is_heading
from data.text import build_text
from tests.conftest import data_cli, expect_error, run_env, run_python, smoke

ARTICLES = 10  # of the sample's 97: a few hundred KB of text, enough for four shards of instances
HEADING = "Early life"
BERT = ("--seq-len", "64", "--max-pred", "10", "--dupe-factor", "1")
BERT_KW = {"seq_len": 64, "max_pred": 10, "dupe_factor": 1}


def _articles(text_dir: Path) -> list[dict[str, str]]:
    """The sample's first articles in the ``wikimedia/wikipedia`` layout: id, url, title, text (paragraphs of
    three sentences separated by blank lines, a heading line after the first paragraph)."""
    first = sorted(text_dir.glob("*.txt"))[0].read_text(encoding="utf-8")
    rows = []
    for i, block in enumerate([b for b in first.split("\n\n") if b.strip()][:ARTICLES]):
        lines = block.split("\n")
        paras = [" ".join(lines[j : j + 3]) for j in range(0, len(lines), 3)]
        paras.insert(1, HEADING)
        title = f"Article {i}"
        rows.append({"id": str(1000 + i), "url": f"https://en.wikipedia.org/wiki/{i}", "title": title, "text": ""})
        rows[-1]["text"] = "\n\n".join(paras)
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, wiki_text_dir: Path) -> dict[str, Path]:
    """The same articles as parquet, JSONL, csv, Arrow, a saved Dataset and a saved DatasetDict; and the text
    layout ``data text`` writes from the parquet."""
    import datasets
    import pyarrow as pa
    import pyarrow.csv as pc
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    rows = _articles(wiki_text_dir)
    table = pa.Table.from_pylist(rows)
    paths = {"parquet": root / "wiki.parquet", "jsonl": root / "wiki.jsonl", "csv": root / "wiki.csv"}
    pq.write_table(table, paths["parquet"], row_group_size=4)
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pc.write_csv(table, paths["csv"])
    paths["arrow"] = root / "wiki.arrow"
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=3)
    ds = datasets.Dataset.from_list(rows)
    paths["saved"] = root / "saved"
    ds.save_to_disk(str(paths["saved"]))
    paths["saved_dict"] = root / "saved_dict"
    datasets.DatasetDict({"train": ds.select(range(2)), "validation": ds}).save_to_disk(str(paths["saved_dict"]))
    paths["text"] = root / "text"
    data_cli("text", "--dataset", str(paths["parquet"]), "--out", str(paths["text"]))
    return paths


def _shards(d: Path) -> dict[str, tuple[dict[str, np.ndarray], dict[str, str]]]:
    out = {}
    for f in sorted(d.glob("*.h5")):
        with h5py.File(f) as h:
            out[f.name] = ({k: h[k][:] for k in h}, {k: str(v) for k, v in h.attrs.items()})
    return out


def assert_same_shards(a: Path, b: Path) -> None:
    """Every dataset array equal; the attributes too, except the dataset's name."""
    sa, sb = _shards(a), _shards(b)
    assert sa.keys() == sb.keys() and sa
    for name in sa:
        (da, aa), (db, ab) = sa[name], sb[name]
        assert da.keys() == db.keys()
        for k in da:
            assert np.array_equal(da[k], db[k]), (name, k)
        aa.pop("dataset", None), ab.pop("dataset", None)
        assert aa == ab, name


def test_wikipedia_layout_reads_as_sentences(corpus: dict[str, Path], wiki_text_dir: Path) -> None:
    """Paragraphs split into sentences, headings dropped, one blank line after each article; each article's
    sentences are the sample's (the paragraphs were made of them)."""
    text = (corpus["text"] / "text_00000.txt").read_text(encoding="utf-8")
    docs = [d.split("\n") for d in text.split("\n\n") if d]
    assert len(docs) == ARTICLES and HEADING not in text.split("\n")
    first = sorted(wiki_text_dir.glob("*.txt"))[0].read_text(encoding="utf-8").split("\n\n")
    for got, want in zip(docs, first):
        assert " ".join(got) == " ".join(want.split("\n"))
    man = json.loads((corpus["text"] / "manifest.json").read_text())
    assert man["counts"]["documents_written"] == ARTICLES and man["source"] == str(corpus["parquet"])
    assert is_heading("See also") and is_heading("History of the town") and not is_heading("It rained.")
    doc = Document("Intro one. Intro two.\n\nHistory\n\nLater  text here.", "paragraphs", "7", "T")
    assert document_sentences(doc) == ["Intro one.", "Intro two.", "Later text here."]


@pytest.mark.parametrize("kind", ["jsonl", "csv", "arrow", "saved", "saved_dict"])
def test_every_input_type_gives_the_same_text(kind: str, corpus: dict[str, Path], tmp_path: Path) -> None:
    split = "validation" if kind == "saved_dict" else "train"
    build_text(tmp_path / "t", dataset=str(corpus[kind]), split=split)
    assert (tmp_path / "t" / "text_00000.txt").read_bytes() == (corpus["text"] / "text_00000.txt").read_bytes()


def test_bert_dataset_equals_text_then_bert(corpus: dict[str, Path], wiki_vocab: Path, tmp_path: Path) -> None:
    """``data bert --dataset P`` equals ``data text --dataset P`` then ``data bert --text``: at the default shard
    size and at ``--shards 4``, with one worker and two."""
    for shards in (0, 4):
        text_path = tmp_path / f"text-{shards}"
        build_bert_shards(corpus["text"], wiki_vocab, text_path, shards=shards, **BERT_KW)
        for workers in (1, 2):
            out = tmp_path / f"ds-{shards}-{workers}"
            if (shards, workers) == (4, 2):  # one through the command line
                flags = ("--shards", "4", "--workers", "2", "--no-progress", *BERT)
                data_cli(
                    "bert", "--dataset", str(corpus["parquet"]), "--vocab", str(wiki_vocab), "--out", str(out), *flags
                )
            else:
                build_bert_shards(
                    None, wiki_vocab, out, dataset=str(corpus["parquet"]), shards=shards, workers=workers, **BERT_KW
                )
            assert_same_shards(text_path, out)
            assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in text_path.iterdir())
        assert (len(list(text_path.glob("*.h5"))) > 1) == (shards > 0)  # fewer than 4 when articles are long
    man = json.loads((tmp_path / "ds-4-2" / "manifest.json").read_text())
    assert man["settings"]["dataset"] == str(corpus["parquet"]) and man["totals"]["documents"] == ARTICLES


def test_vocab_dataset_equals_text_then_vocab(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Byte-level BPE (deterministic): the same ``tokenizer.json`` from the dataset as from its text layout.
    (WordPiece training orders tied pairs by a hash, differently from run to run on the same text.)"""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    data_cli("vocab", "--dataset", str(corpus["jsonl"]), "--out", str(a), "--size", "600", "--kind", "bpe")
    data_cli("vocab", str(corpus["text"]), "--out", str(b), "--size", "600", "--kind", "bpe")
    assert a.read_bytes() == b.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json"]  # the dataset's text layout was removed


BUILDERS = {
    "text": lambda src, out, res: ["text", *src, "--out", str(out)],
    "bert": lambda src, out, res: ["bert", *src, "--vocab", str(res["vocab"]), "--out", str(out), "--no-progress"],
    "vocab": lambda src, out, res: ["vocab", *src, "--out", str(out / "vocab.txt"), "--size", "300"],
    "gpt": lambda src, out, res: ["gpt", *src, "--tokenizer", str(res["bpe"]), "--out", str(out), "--no-progress"],
}


def _bad_inputs(root: Path, corpus: dict[str, Path]) -> list[tuple[list[str], tuple[str, ...]]]:
    """(source flags, what the error line says) for each bad input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    numbers = root / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), numbers)
    empty = root / "empty.jsonl"
    empty.write_text("")
    blank = root / "blank.parquet"
    pq.write_table(pa.table({"text": pa.array(["", None], pa.string())}), blank)
    truncated = root / "truncated.parquet"
    truncated.write_bytes(corpus["parquet"].read_bytes()[:-100])
    mixed = root / "mixed"
    mixed.mkdir()
    (mixed / "a.parquet").write_bytes(corpus["parquet"].read_bytes())
    (mixed / "b.jsonl").write_bytes(corpus["jsonl"].read_bytes())
    no_state = root / "no_state"
    no_state.mkdir()
    (no_state / "dataset_info.json").write_text("{}")
    ds = ["--dataset"]
    return [
        ([*ds, str(corpus["parquet"]), "--text-field", "body"], ("no field 'body'", "fields: id, url, title, text")),
        ([*ds, str(corpus["csv"]), "--text-field", "body"], ("wiki.csv", "no field 'body'")),
        ([*ds, str(corpus["saved"]), "--text-field", "body"], ("data-00000-of-00001.arrow", "no field 'body'")),
        ([*ds, str(numbers)], ("numbers.parquet", "holds int64, not text")),
        ([*ds, str(empty)], ("empty.jsonl", "empty dataset")),
        ([*ds, str(blank)], ("blank.parquet", "empty dataset")),
        ([*ds, str(truncated)], ("truncated.parquet", "cannot read as parquet")),
        ([*ds, str(root / "nothing-*.parquet")], ("nothing-*.parquet", "no such dataset file, directory or glob")),
        ([*ds, str(mixed)], ("mixed", "mixes dataset file types")),
        ([*ds, str(no_state)], ("no_state", "without state.json")),
        ([*ds, str(corpus["saved_dict"]), "--split", "test"], ("no split 'test'", "validation")),
    ]


def test_bad_input_is_one_line_on_every_builder(
    corpus: dict[str, Path], wiki_vocab: Path, bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2, one line naming the file and the problem, no traceback, nothing left in ``--out``. In this process
    (``python -m data``'s ``main`` under ``run_cli``, as ``__main__`` runs it): 44 commands, no start-up each."""
    res = {"vocab": wiki_vocab, "bpe": bpe}
    out = tmp_path / "out"
    capsys.readouterr()
    for src, needles in _bad_inputs(tmp_path, corpus):
        for builder, argv in BUILDERS.items():
            out.mkdir(exist_ok=True)
            rc = run_cli(main, argv(src, out, res))
            err = capsys.readouterr().err.strip()
            expect_error(subprocess.CompletedProcess(argv, rc, "", err), *needles)
            assert not list(out.iterdir()), (builder, src, list(out.iterdir()))


def test_missing_pyarrow_names_the_extra(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Without the optional package (an importable ``pyarrow`` that fails, first on the path): one line naming
    ``pip install 'wikipretrain[datasets]'``."""
    fake = tmp_path / "site" / "pyarrow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('pyarrow is not installed')\n")
    env = run_env()
    env["PYTHONPATH"] = f"{fake.parent}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = tmp_path / "out"
    p = run_python(["-m", "data", "text", "--dataset", str(corpus["parquet"]), "--out", str(out)], env=env, fresh=True)
    expect_error(p, "pip install 'wikipretrain[datasets]'")
    assert not out.exists()


def test_wordpiece_tokenizer_json(
    corpus: dict[str, Path], wiki_vocab: Path, bpe: Path, bert_data: dict[str, Path], tmp_path: Path
) -> None:
    """A Hugging Face ``tokenizer.json`` with BERT's WordPiece pipeline is the same vocabulary as its ``vocab.txt``:
    the same shards (every array; the attributes but the file's name), the same recorded identity, and shards made
    from ``vocab.txt`` train with ``data.vocab`` set to the ``tokenizer.json``. Other pipelines: one line each."""
    from tokenizers import BertWordPieceTokenizer

    from data.tokenizer import vocab_sha256

    as_json = tmp_path / "vocab.json"
    BertWordPieceTokenizer(str(wiki_vocab)).save(str(as_json))
    assert vocab_sha256(as_json) == vocab_sha256(wiki_vocab)
    a, b = tmp_path / "from-txt", tmp_path / "from-json"
    build_bert_shards(corpus["text"], wiki_vocab, a, **BERT_KW)
    build_bert_shards(corpus["text"], as_json, b, **BERT_KW)
    for d in (a, b):  # the vocabulary's file name is the one attribute that may differ
        for f in d.glob("*.h5"):
            with h5py.File(f, "r+") as h:
                del h.attrs["vocab_file"]
    assert_same_shards(a, b)
    spec = json.loads(as_json.read_text())
    cases = {
        "bpe": (bpe, (), "BERT needs a WordPiece model"),
        "cased": (as_json, ("--cased",), "lowercase=True but --cased"),
        "pre": (dict(spec, pre_tokenizer={"type": "Whitespace"}), (), "pre-tokenizer Whitespace is not BERT's"),
        "norm": (dict(spec, normalizer={"type": "NFC"}), (), "normalizer NFC is not BERT's"),
    }
    for name, (tok, flags, needle) in cases.items():
        if isinstance(tok, dict):
            (tmp_path / f"{name}.json").write_text(json.dumps(tok))
            tok = tmp_path / f"{name}.json"
        out = tmp_path / f"bad-{name}"
        argv = ["bert", "--text", str(corpus["text"]), "--vocab", str(tok), "--out", str(out), *flags]
        expect_error(data_cli(*argv, check=False), Path(tok).name, needle)
        assert not out.exists()
    # Shards made from vocab.txt train with data.vocab set to the tokenizer.json: a run reads data.vocab only where
    # it opens its shards (training.build.open_data), which is done here in-process, as a run's start does it (the
    # launched runs of tests/test_train.py and others train on these shards with the vocab.txt).
    from training.build import open_data
    from training.config import load_config
    from training.start import static_plan

    run = tmp_path / "run"
    cfg = load_config(
        "smoke", smoke({**bert_data, "vocab": as_json}, run, "train.micro_batch=4", "data.num_workers=0")[2:]
    )
    plan = static_plan(cfg.model, cfg.data)  # the smoke recipe's BERT
    assert plan.family.name == "bert"
    opened = open_data(cfg.data, cfg.train, plan, 1, 0, 1, 1.0)
    try:
        assert opened.kind == "bert" and opened.vocab_sha256 == opened.attrs["vocab_sha256"] == vocab_sha256(wiki_vocab)
        batch = next(iter(opened.loader))
        assert batch["input_ids"].shape == (4, 128) and int(batch["input_ids"].max()) < opened.attrs["vocab_size"]
    finally:
        opened.loader.close()
    cfg.data.vocab = str(bpe)  # another vocabulary: refused in one line naming the attribute
    with pytest.raises(UserError, match=r"attribute vocab_sha256='[0-9a-f]+' but expected '[0-9a-f]+'$"):
        open_data(cfg.data, cfg.train, plan, 1, 0, 1, 1.0)


def test_format_registry_names_the_known_formats() -> None:
    """Outside its record no code compares a format name: an unknown one is refused by the registry in one line,
    and the records say what ``h5format``, ``convert`` and ``verify`` ask."""
    from data import h5format
    from data.formats import BERT, GPT, format_of_attr, get_format, register_format

    with pytest.raises(Exception, match=r"unknown shard format 'toy' \(known: bert, gpt"):
        get_format("toy")
    assert format_of_attr("wikipretrain-gpt") is GPT and format_of_attr("other") is None
    assert h5format.SCHEMAS["bert"] is BERT.schema and h5format.UNIT_ROWS["gpt"] == 1
    assert BERT.infer({"input_ids": (5, 128), "masked_lm_positions": (5, 20), "masked_lm_ids": (5, 19)}) == {
        "seq_len": 128,
        "max_pred": 20,
    }
    with pytest.raises(Exception, match="format attribute 'wikipretrain-bert' is 'bert'"):
        register_format(dataclasses.replace(BERT, name="bert2"))
