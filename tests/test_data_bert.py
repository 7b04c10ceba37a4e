"""``python -m data bert`` on the real enwiki sample: NVIDIA-reader invariants, determinism, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data.tokenizer import CachedBertTokenizer, bert_tokenizer, encode_lines
from tests.conftest import REPO, data_cli, expect_error, run_env

NAMES = [
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
]


def bert(text: Path, vocab: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return data_cli("bert", "--text", str(text), "--vocab", str(vocab), "--out", str(out), "--no-progress", *extra)


def vocab_ids(vocab: Path) -> dict[str, int]:
    return {w: i for i, w in enumerate(vocab.read_text(encoding="utf-8").split("\n")) if w}


class NvidiaStyleReader:
    """Reads a shard the way NVIDIA's ``pretraining_dataset`` (run_pretraining.py) does."""

    def __init__(self, path: Path, max_pred: int) -> None:
        with h5py.File(path, "r") as f:
            self.inputs = [np.asarray(f[k][:]) for k in NAMES]
        self.max_pred = max_pred

    def __len__(self) -> int:
        return len(self.inputs[0])

    def __getitem__(self, index: int) -> list[torch.Tensor]:
        input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels = [
            torch.from_numpy(np.asarray(x[index].astype(np.int64))) for x in self.inputs
        ]
        masked_lm_labels = torch.ones(input_ids.shape, dtype=torch.long) * -1
        index = self.max_pred
        padded_mask_indices = (masked_lm_positions == 0).nonzero()
        if len(padded_mask_indices) != 0:
            index = padded_mask_indices[0].item()
        masked_lm_labels[masked_lm_positions[:index]] = masked_lm_ids[:index]
        return [input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels]


@pytest.fixture(scope="module")
def phase1(wiki_text_dir: Path, wiki_vocab: Path, tmp_path_factory) -> dict:
    """The same corpus and seed built with 2 workers and with 1 (3 shards, dupe factor 2)."""
    base = tmp_path_factory.mktemp("bert")
    settings = ["--seq-len", "128", "--max-pred", "20", "--dupe-factor", "2", "--shards", "3", "--seed", "7"]
    p2 = bert(wiki_text_dir, wiki_vocab, base / "w2", *settings, "--workers", "2")
    bert(wiki_text_dir, wiki_vocab, base / "w1", *settings, "--workers", "1")
    return {"w2": base / "w2", "w1": base / "w1", "stdout": p2.stdout}


def load_all(out: Path) -> dict[str, np.ndarray]:
    man = json.loads((out / "manifest.json").read_text())
    arrays: dict[str, list[np.ndarray]] = {k: [] for k in NAMES}
    for s in man["shards"]:
        with h5py.File(out / s["file"], "r") as f:
            for k in NAMES:
                arrays[k].append(f[k][:])
    return {k: np.concatenate(v) for k, v in arrays.items()}


def check_instances(out: Path, vocab: Path, seq_len: int, max_pred: int) -> dict[str, float]:
    """NVIDIA-reader view of every instance; returns the masking statistics."""
    ids = vocab_ids(vocab)
    CLS, SEP, PAD, MASK = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"], ids["[MASK]"]
    man = json.loads((out / "manifest.json").read_text())
    n_mask = n_same = n_other = n_pred = n_tokens = n_random = n_inst = 0
    for s in man["shards"]:
        reader = NvidiaStyleReader(out / s["file"], max_pred)
        assert len(reader) == s["instances"] > 0
        with h5py.File(out / s["file"], "r") as f:
            assert f["input_ids"].dtype == np.int32 and f["input_mask"].dtype == np.int8
            assert f["masked_lm_positions"].shape == (len(reader), max_pred)
            assert f.attrs["seq_len"] == seq_len and f.attrs["max_pred"] == max_pred
            raw_pos = f["masked_lm_positions"][:]
            raw_lm = f["masked_lm_ids"][:]
        for i in range(len(reader)):
            input_ids, segment_ids, input_mask, labels, nsl = reader[i]
            x = input_ids.numpy()
            length = int(input_mask.sum())
            assert input_mask[:length].all() and not input_mask[length:].any(), "mask must be 1 exactly over tokens"
            assert x[0] == CLS
            seps = np.nonzero(x == SEP)[0]
            assert len(seps) == 2 and seps[1] == length - 1, seps
            assert (x[length:] == PAD).all()
            seg = segment_ids.numpy()
            assert (
                (seg[: seps[0] + 1] == 0).all() and (seg[seps[0] + 1 : length] == 1).all() and (seg[length:] == 0).all()
            )
            assert seps[0] >= 2 and seps[1] - seps[0] >= 2, "A and B hold at least one token each"
            pos = np.nonzero(labels.numpy() >= 0)[0]
            k = len(pos)
            expected = min(max_pred, max(1, int(np.rint(length * 0.15))))
            assert k == expected, (k, expected, length)
            assert (np.diff(raw_pos[i, :k]) > 0).all(), "positions ascending"
            assert (raw_pos[i, k:] == 0).all() and (raw_lm[i, k:] == 0).all(), "zero padded"
            assert (pos > 0).all() and (pos < length - 1).all() and (pos != seps[0]).all(), "never on specials"
            orig = labels.numpy()[pos]
            assert not np.isin(orig, [CLS, SEP, PAD]).any()
            n_mask += int((x[pos] == MASK).sum())
            n_same += int((x[pos] == orig).sum())
            n_other += int(((x[pos] != MASK) & (x[pos] != orig)).sum())
            n_pred += k
            n_tokens += length
            n_random += int(nsl)
            n_inst += 1
    return {
        "mask": n_mask / n_pred,
        "same": n_same / n_pred,
        "other": n_other / n_pred,
        "pred_rate": n_pred / n_tokens,
        "random_next": n_random / n_inst,
        "instances": n_inst,
    }


def test_nvidia_reader_invariants(phase1: dict, wiki_vocab: Path) -> None:
    stats = check_instances(phase1["w2"], wiki_vocab, 128, 20)
    assert stats["instances"] > 5000
    assert 0.13 <= stats["pred_rate"] <= 0.16, stats
    assert abs(stats["mask"] - 0.8) < 0.02, stats
    assert abs(stats["same"] - 0.1) < 0.015, stats
    assert abs(stats["other"] - 0.1) < 0.015, stats
    # single-sentence chunks are always random-next (Google's rule), so slightly above one half
    assert 0.45 <= stats["random_next"] <= 0.60, stats
    assert "instances/s" in phase1["stdout"] and "input tokens/s" in phase1["stdout"]


def test_segments_come_from_the_corpus(phase1: dict, wiki_text_dir: Path, wiki_vocab: Path) -> None:
    """A and B (masks undone) are contiguous runs of a document's tokens; actual-next B follows A directly."""
    tok = bert_tokenizer(wiki_vocab, True)
    docs: list[list[int]] = [[]]
    for f in sorted(wiki_text_dir.rglob("*.txt")):
        for line in f.read_text(encoding="utf-8").split("\n"):
            line = line.strip()
            if not line:
                docs.append([])
            else:
                docs[-1].extend(tok.encode(line, add_special_tokens=False).ids)
        docs.append([])
    corpus = b"".join(np.asarray(d + [-1], dtype=np.int32).tobytes() for d in docs if d)

    def contains(seq: np.ndarray) -> bool:
        needle = seq.astype(np.int32).tobytes()
        at = corpus.find(needle)
        while at != -1 and at % 4:
            at = corpus.find(needle, at + 1)
        return at != -1

    data = load_all(phase1["w1"])
    SEP = vocab_ids(wiki_vocab)["[SEP]"]
    rng = np.random.default_rng(0)
    checked = {0: 0, 1: 0}
    for i in rng.choice(len(data["input_ids"]), 600, replace=False):
        x = data["input_ids"][i].copy()
        k = int((data["masked_lm_positions"][i] != 0).sum())
        x[data["masked_lm_positions"][i, :k]] = data["masked_lm_ids"][i, :k]
        length = int(data["input_mask"][i].sum())
        s1 = int(np.nonzero(x == SEP)[0][0])
        a, b = x[1:s1], x[s1 + 1 : length - 1]
        assert contains(a) and contains(b)
        nsl = int(data["next_sentence_labels"][i])
        if nsl == 0 and length < 128:  # untruncated (a truncated pair has exactly seq_len tokens)
            assert contains(np.concatenate([a, b])), "actual next: B follows A in the document"
            checked[0] += 1
        checked[1] += nsl
    assert checked[0] > 20 and checked[1] > 200, checked


def test_deterministic_across_workers(phase1: dict, wiki_text_dir: Path, wiki_vocab: Path, tmp_path: Path) -> None:
    man1 = json.loads((phase1["w1"] / "manifest.json").read_text())
    man2 = json.loads((phase1["w2"] / "manifest.json").read_text())
    assert [s["instances"] for s in man1["shards"]] == [s["instances"] for s in man2["shards"]]
    assert len(man1["shards"]) == 3 and man1["totals"]["instances"] == sum(s["instances"] for s in man1["shards"])
    for s in man1["shards"]:
        with h5py.File(phase1["w1"] / s["file"]) as a, h5py.File(phase1["w2"] / s["file"]) as b:
            for k in NAMES:
                assert np.array_equal(a[k][:], b[k][:]), (s["file"], k)
            assert dict(a.attrs).keys() == dict(b.attrs).keys()
            for k in a.attrs:
                assert np.all(a.attrs[k] == b.attrs[k]), k
            for k in (
                "format",
                "format_version",
                "vocab_sha256",
                "vocab_size",
                "seq_len",
                "max_pred",
                "masked_lm_prob",
                "dupe_factor",
                "short_seq_prob",
                "seed",
                "whole_word_masking",
                "lowercase",
                "source",
            ):
                assert k in a.attrs, k
    # another seed gives other instances
    bert(wiki_text_dir, wiki_vocab, tmp_path / "s8", "--dupe-factor", "2", "--shards", "3", "--seed", "8")
    with h5py.File(phase1["w1"] / "bert-00000.h5") as a, h5py.File(tmp_path / "s8" / "bert-00000.h5") as b:
        assert not np.array_equal(a["input_ids"][:100], b["input_ids"][:100])


def test_cached_tokenizer_matches_library(wiki_text_dir: Path, wiki_vocab: Path, shared_bert_vocab: Path) -> None:
    lines = [
        ln.strip() for f in sorted(wiki_text_dir.rglob("*.txt")) for ln in f.read_text(encoding="utf-8").split("\n")
    ]
    lines = [ln for ln in lines if ln]
    lines += [
        "Hello\x0bworld ÀccÉnts naïve 中文字 tab\there __x__ $5+3=8 ~`|^ a  b   c",
        "a" * 150,
        "x\x7fy \u0301x İstanbul ΣΑΣ \u3000full\u3000width",
    ]
    for vocab in (wiki_vocab, shared_bert_vocab):
        for lowercase in (True, False):
            ref_flat, ref_lens = encode_lines(bert_tokenizer(vocab, lowercase), lines)
            cached = CachedBertTokenizer(vocab, lowercase)
            for _ in range(2):  # cold and warm cache
                flat, lens = cached.encode_lines(lines)
                assert np.array_equal(lens, ref_lens) and np.array_equal(flat, ref_flat)


def test_whole_word_masking_and_real_vocab_phase2(wiki_text_dir: Path, shared_bert_vocab: Path, tmp_path: Path) -> None:
    """Phase 2 shapes with the real bert-base-uncased vocab; masked words are masked whole."""
    out = tmp_path / "p2"
    bert(
        wiki_text_dir,
        shared_bert_vocab,
        out,
        "--seq-len",
        "512",
        "--max-pred",
        "80",
        "--dupe-factor",
        "1",
        "--whole-word-masking",
        "--workers",
        "2",
    )
    stats = check_instances(out, shared_bert_vocab, 512, 80)
    assert abs(stats["mask"] - 0.8) < 0.04 and 0.12 <= stats["pred_rate"] <= 0.16, stats
    words = shared_bert_vocab.read_text(encoding="utf-8").split("\n")
    sub = np.array([w.startswith("##") for w in words] + [False])
    data = load_all(out)
    whole_checked = 0
    for i in range(len(data["input_ids"])):
        x = data["input_ids"][i].copy()
        k = int((data["masked_lm_positions"][i] != 0).sum())
        pos = data["masked_lm_positions"][i, :k]
        x[pos] = data["masked_lm_ids"][i, :k]
        masked = np.zeros(len(x), bool)
        masked[pos] = True
        length = int(data["input_mask"][i].sum())
        for j in range(2, length - 1):
            if sub[x[j]] and words[x[j - 1]] not in ("[CLS]", "[SEP]"):
                assert masked[j] == masked[j - 1], "a ## piece is masked together with the piece before it"
                whole_checked += int(masked[j])
    assert whole_checked > 50


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_input(wiki_text_dir: Path, wiki_vocab: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    missing = data_cli(
        "bert", "--text", str(tmp_path / "nope"), "--vocab", str(wiki_vocab), "--out", str(out), check=False
    )
    expect_error(missing, "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("\n\n   \n")
    expect_error(
        data_cli("bert", "--text", str(empty), "--vocab", str(wiki_vocab), "--out", str(out), check=False),
        "empty corpus",
    )
    bad_vocab = tmp_path / "vocab.txt"
    bad_vocab.write_text(
        "\n".join(w for w in wiki_vocab.read_text().split("\n") if w not in ("[CLS]", "[MASK]")) + "\n"
    )
    expect_error(
        data_cli("bert", "--text", str(wiki_text_dir), "--vocab", str(bad_vocab), "--out", str(out), check=False),
        "vocab.txt",
    )
    expect_error(
        data_cli(
            "bert",
            "--text",
            str(wiki_text_dir),
            "--vocab",
            str(wiki_vocab),
            "--out",
            str(out),
            "--seq-len",
            "16",
            check=False,
        ),
        "--seq-len 16",
        "--max-pred 20",
    )
    expect_error(
        data_cli(
            "bert",
            "--text",
            str(wiki_text_dir),
            "--vocab",
            str(wiki_vocab),
            "--out",
            str(out),
            "--seq-len",
            "6",
            "--max-pred",
            "1",
            check=False,
        ),
        "--seq-len 6",
    )
    assert not out.exists(), "nothing written for refused input"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    expect_error(
        data_cli("bert", "--text", str(wiki_text_dir), "--vocab", str(wiki_vocab), "--out", str(busy), check=False),
        "--overwrite",
    )
    assert (busy / "keep.txt").read_text() == "mine" and len(list(busy.iterdir())) == 1


def test_rerun_after_interruption(wiki_text_dir: Path, wiki_vocab: Path, tmp_path: Path) -> None:
    """A run killed mid-way leaves temp files and shards without a manifest; the rerun starts clean."""
    out = tmp_path / "out"
    args = [
        "bert",
        "--text",
        str(wiki_text_dir),
        "--vocab",
        str(wiki_vocab),
        "--out",
        str(out),
        "--dupe-factor",
        "3",
        "--shards",
        "4",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "data", *args],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    t0 = time.time()
    while time.time() - t0 < 60 and not any(out.glob("*")) and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    # simulate the other possible leftover states too: a temp file and an orphan shard
    out.mkdir(exist_ok=True)
    (out / ".bert-00001.h5.abc.tmp").write_bytes(b"partial")
    (out / "bert-00003.h5").write_bytes(b"stale")
    p = data_cli(*args, check=False)
    expect_error(p, "--overwrite")
    data_cli(*args, "--overwrite")
    names = sorted(x.name for x in out.iterdir())
    assert names == ["bert-00000.h5", "bert-00001.h5", "bert-00002.h5", "bert-00003.h5", "manifest.json"], names
    with h5py.File(out / "bert-00003.h5") as f:
        assert f.attrs["format"] == "wikipretrain-bert"


def test_typed_api_and_overwrite_keeps_output_until_success(
    wiki_text_dir: Path, wiki_vocab: Path, tmp_path: Path
) -> None:
    """``build_bert_shards`` in-process: the summary is the manifest's totals; a failed ``overwrite`` run
    leaves the previous output byte for byte; a successful one with fewer shards removes the stale shard
    only."""
    from common.errors import UserError
    from data.bert import build_bert_shards

    out = tmp_path / "out"
    settings = {"seq_len": 64, "max_pred": 10, "dupe_factor": 1, "seed": 5}
    with pytest.raises(UserError, match="--seq-len 12 too small for --max-pred 10"):
        build_bert_shards(wiki_text_dir, wiki_vocab, out, **{**settings, "seq_len": 12})
    assert not out.exists()
    summary = build_bert_shards(wiki_text_dir, wiki_vocab, out, shards=2, **settings)
    man = json.loads((out / "manifest.json").read_text())
    assert summary["shards"] == 2 and summary["out"] == str(out)
    for k in ("instances", "documents", "sentences", "tokens"):
        assert summary[k] == man["totals"][k] > 0, k
    assert summary["instances"] == len(load_all(out)["input_ids"])
    (out / "README").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n\n", encoding="utf-8")
    with pytest.raises(UserError, match="empty corpus"):
        build_bert_shards(blank, wiki_vocab, out, overwrite=True, **settings)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a failed rerun changed the output"
    again = build_bert_shards(wiki_text_dir, wiki_vocab, out, shards=1, overwrite=True, **settings)
    assert sorted(p.name for p in out.iterdir()) == ["README", "bert-00000.h5", "manifest.json"]
    assert again["instances"] == json.loads((out / "manifest.json").read_text())["totals"]["instances"]
