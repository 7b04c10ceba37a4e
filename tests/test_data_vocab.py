"""``python -m data vocab``: WordPiece vocab.txt and byte-level BPE tokenizer.json trained on the sample."""

from __future__ import annotations

import collections
import re
import subprocess
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer
from transformers import BertTokenizerFast

from common.errors import UserError
from data.vocab import WORDPIECE_SPECIALS, load_vocab_checked, train_bpe
from tests.conftest import run_python

BERT_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "data", "vocab", *args])


def bert_tokenizer(vocab: Path) -> BertTokenizerFast:
    # transformers 5 takes the file as ``vocab=``; ``vocab_file=`` is silently ignored there
    return BertTokenizerFast(vocab=str(vocab))


def corpus_words(text_dir: Path) -> collections.Counter:
    words: collections.Counter = collections.Counter()
    for f in sorted(text_dir.glob("wiki_*.txt")):
        words.update(re.findall(r"[a-z]+", f.read_text(encoding="utf-8").lower()))
    return words


def test_wordpiece_vocab_has_bert_layout(wiki_vocab: Path) -> None:
    vocab = load_vocab_checked(wiki_vocab)
    assert len(vocab) == 8000
    assert {t: vocab[t] for t in BERT_IDS} == BERT_IDS
    assert all(vocab[f"[unused{i}]"] == i + 1 for i in range(99))
    pieces = [t for t in vocab if t.startswith("##")]
    assert len(pieces) > 500, "WordPiece continuation pieces use the ## prefix"
    assert not [t for t in vocab if t not in WORDPIECE_SPECIALS and t != t.lower()], "uncased vocab"
    assert "é" not in vocab and "e" in vocab, "accents stripped"


def test_wordpiece_matches_shared_bert_vocab_layout(wiki_vocab: Path, shared_bert_vocab: Path) -> None:
    ours, bert = load_vocab_checked(wiki_vocab), load_vocab_checked(shared_bert_vocab)
    assert {t: ours[t] for t in BERT_IDS} == {t: bert[t] for t in BERT_IDS}


def test_wordpiece_tokenizes_with_transformers(wiki_vocab: Path, wiki_text_dir: Path) -> None:
    tok = bert_tokenizer(wiki_vocab)
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (
        0,
        100,
        101,
        102,
        103,
    )
    # the corpus' 300 most frequent words are whole tokens
    frequent = [w for w, _ in corpus_words(wiki_text_dir).most_common(300)]
    assert all(tok.tokenize(w) == [w] for w in frequent), [w for w in frequent if tok.tokenize(w) != [w]]
    sentence = "Anarchism is a political philosophy. Émile Durkheim studied Zürich's xylophonists."
    pieces = tok.tokenize(sentence)
    assert pieces[:6] == ["anarchism", "is", "a", "political", "philosophy", "."]
    assert "[UNK]" not in pieces and any(p.startswith("##") for p in pieces)
    # pieces glue back to the lowercased, accent-stripped text
    norm = "".join(c for c in unicodedata.normalize("NFD", sentence.lower()) if unicodedata.category(c) != "Mn")
    assert "".join(p.removeprefix("##") for p in pieces) == norm.replace(" ", "")
    ids = tok(sentence)["input_ids"]
    assert ids[0] == 101 and ids[-1] == 102
    # the tokenizers library's own BERT tokenizer on the same file gives the same ids
    assert BertWordPieceTokenizer(str(wiki_vocab)).encode(sentence).ids == ids


def test_cased_wordpiece_keeps_case(wiki_text_dir: Path, tmp_path: Path) -> None:
    res = cli(str(wiki_text_dir), "--out", str(tmp_path / "cased.txt"), "--size", "3000", "--cased")
    assert res.returncode == 0, res.stderr
    vocab = load_vocab_checked(tmp_path / "cased.txt")
    assert {t: vocab[t] for t in BERT_IDS} == BERT_IDS
    assert "The" in vocab and "the" in vocab
    tok = BertTokenizerFast(vocab=str(tmp_path / "cased.txt"), do_lower_case=False)
    assert tok.tokenize("The Anarchism")[0] == "The"


def test_bpe_tokenizer_round_trips(wiki_text_dir: Path, tmp_path: Path) -> None:
    out = train_bpe(wiki_text_dir, tmp_path / "tokenizer.json", 2000)
    tok = Tokenizer.from_file(str(out))
    assert tok.get_vocab_size() == 2000
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|padding|>") == 1
    for text in [
        "Anarchism is a political philosophy.",
        " leading space, tabs\tand\nnewlines",
        "Österreichs größte Bibliothek; 東京は日本の首都である。 emoji 🙂",
    ]:
        enc = tok.encode(text)
        assert tok.decode(enc.ids) == text
    # frequent English words are single tokens with the byte-level space marker
    assert len(tok.encode(" the").ids) == 1 and tok.encode(" the").tokens == ["Ġthe"]


def test_bpe_via_cli(wiki_text_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok.json"
    res = cli(str(wiki_text_dir), "--out", str(out), "--size", "600", "--kind", "bpe")
    assert res.returncode == 0, res.stderr
    assert Tokenizer.from_file(str(out)).get_vocab_size() == 600


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("missing", ["--size", "1000"], "no such directory"),
        ("empty_dir", ["--size", "1000"], "empty corpus: no .txt shards"),
        ("blank_files", ["--size", "1000"], "empty corpus: 2 .txt file(s) but no text"),
        ("ok", ["--size", "10"], "--size 10 is too small"),
        ("ok", ["--size", "200", "--kind", "bpe"], "--size 200 is too small"),
        (
            "ok",
            ["--size", "1000", "--kind", "bpe", "--lowercase"],
            "--lowercase applies to --kind wordpiece only",
        ),
    ],
)
def test_vocab_bad_input(setup: str, args: list[str], message: str, tmp_path: Path, wiki_text_dir: Path) -> None:
    d = {
        "missing": tmp_path / "nope",
        "empty_dir": tmp_path / "empty",
        "blank_files": tmp_path / "blank",
    }.get(setup, wiki_text_dir)
    if setup == "empty_dir":
        d.mkdir()
    if setup == "blank_files":
        d.mkdir()
        (d / "wiki_00000.txt").write_text("\n\n")
        (d / "wiki_00001.txt").write_text("")
    out = tmp_path / "vocab.txt"
    res = cli(str(d), "--out", str(out), *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not out.exists()
    if setup != "ok":
        assert str(d) in lines[0]


def test_load_vocab_checked_errors(tmp_path: Path, wiki_vocab: Path) -> None:
    no_mask = tmp_path / "no_mask.txt"
    no_mask.write_text("".join(t + "\n" for t in wiki_vocab.read_text().splitlines() if t != "[MASK]"))
    with pytest.raises(UserError, match=rf"^{re.escape(str(no_mask))}: not a BERT vocab: .*\[MASK\]"):
        load_vocab_checked(no_mask)
    with pytest.raises(UserError, match="no such vocab file"):
        load_vocab_checked(tmp_path / "absent.txt")
    (tmp_path / "tok.json").write_text('{"model": {}}')
    with pytest.raises(UserError, match="tokenizer.json"):
        load_vocab_checked(tmp_path / "tok.json")
    dup = tmp_path / "dup.txt"
    dup.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nthe\n")
    with pytest.raises(UserError, match="duplicate token 'the' on lines 6 and 7"):
        load_vocab_checked(dup)
