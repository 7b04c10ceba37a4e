"""Shard directories at scale: manifests as the only metadata, checks at start-up, `data verify`,
`data convert`, read amplification at many ranks, the GPT shuffle, and refusals of incomplete or foreign
data (real shards of the enwiki sample)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import UserError
from data import h5format
from data.loader import STATE_VERSION, PretrainingLoader
from tests.conftest import REPO, run_env
from tests.test_data_gpt import data_cli, expect_error
from tests.test_loader import NAMES, batch_keys, file_keys


def bert_args(text: Path, vocab: Path, out: Path, *, shards: int, dupe: int) -> list[str]:
    """`python -m data bert` arguments for the enwiki sample text."""
    return [
        "bert",
        "--text",
        str(text),
        "--vocab",
        str(vocab),
        "--out",
        str(out),
        "--shards",
        str(shards),
        "--dupe-factor",
        str(dupe),
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def bert(wiki_text_dir: Path, wiki_vocab: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "bert"
    data_cli(*bert_args(wiki_text_dir, wiki_vocab, out, shards=6, dupe=1), "--workers", "2")
    return out


@pytest.fixture(scope="module")
def gpt(wiki_text_dir: Path, bpe: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "gpt"
    data_cli(
        "gpt",
        "--text",
        str(wiki_text_dir),
        "--tokenizer",
        str(bpe),
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--shards",
        "4",
        "--workers",
        "2",
        "--no-progress",
    )
    return out


def bert_loader(path, world=1, rank=0, mb=64, ga=1, **kw) -> PretrainingLoader:
    return PretrainingLoader(
        path, "bert", micro_batch=mb, grad_accum=ga, dp_rank=rank, dp_world=world, seed=5, num_workers=0, **kw
    )


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_format_2_layout_and_manifest(bert: Path, gpt: Path) -> None:
    for d, kind in ((bert, "bert"), (gpt, "gpt")):
        man = json.loads((d / "manifest.json").read_text())
        assert man["format_version"] == 2 and man["chunk_rows"] == h5format.UNIT_ROWS[kind]
        for rec in man["shards"]:
            f = d / rec["file"]
            assert rec["file_bytes"] == f.stat().st_size and rec["sha256"] == h5format.sha256_file(f)
            with h5py.File(f) as h:
                for name in h5format.SCHEMAS[kind]:
                    assert h[name].chunks[0] == h5format.UNIT_ROWS[kind], (f, name)


def test_interrupted_writer_is_refused(wiki_text_dir: Path, wiki_vocab: Path, bert: Path, tmp_path: Path) -> None:
    """SIGKILL `data bert` once a shard is finished: what is left is refused, named, with the fix; so is a
    directory holding finished shards and temporaries but no manifest."""
    out = tmp_path / "killed"
    p = subprocess.Popen(
        [sys.executable, "-m", "data", *bert_args(wiki_text_dir, wiki_vocab, out, shards=8, dupe=3)],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(out.rglob("bert-00000.h5")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "the writer finished before it could be interrupted"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "manifest.json").exists()
    with pytest.raises(UserError, match=r"killed: no manifest.json.*interrupted.*--overwrite.*data convert"):
        bert_loader(out)
    # the state the issue describes: finished shards and temporaries side by side, no manifest
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in sorted(bert.glob("*.h5"))[:5]:
        shutil.copy(f, partial / f.name)
    (partial / ".bert-00005.h5.abc.tmp").write_bytes(b"\0" * 100)
    for path in (partial, partial / "bert-00000.h5"):
        with pytest.raises(UserError, match=rf"{path}: no manifest.json"):
            bert_loader(path)
    assert bert_loader(partial, require_manifest=False).samples_per_epoch > 0  # the explicit opt-in


def test_startup_checks_against_the_manifest(bert: Path, tmp_path: Path) -> None:
    man = json.loads((bert / "manifest.json").read_text())
    # a listed shard missing
    d = copy_dir(bert, tmp_path / "missing")
    (d / "bert-00003.h5").unlink()
    with pytest.raises(UserError, match=r"manifest.json: lists shard .*bert-00003.h5 which does not exist"):
        bert_loader(d)
    # a shard of another size (a copy cut short)
    d = copy_dir(bert, tmp_path / "truncated")
    with open(d / "bert-00002.h5", "r+b") as f:
        f.truncate(man["shards"][2]["file_bytes"] // 2)
    with pytest.raises(UserError, match=r"bert-00002.h5: \d+ bytes but .*manifest.json records \d+: .*data verify"):
        bert_loader(d)
    # a row count that disagrees: found at start-up by the one rank whose share holds the shard, and by
    # any reader that opens it later
    d = copy_dir(bert, tmp_path / "rows")
    edited = json.loads((d / "manifest.json").read_text())
    edited["shards"][1]["instances"] += 1
    (d / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(UserError, match=r"bert-00001.h5: \d+ rows but .*manifest.json records \d+"):
        bert_loader(d, world=2, rank=1)
    ld = bert_loader(d, world=2, rank=0, mb=8)  # shard 1 is rank 1's to check
    with pytest.raises(UserError, match=r"bert-00001.h5: \d+ rows but .*manifest.json records \d+"):
        it = iter(ld)
        for _ in range(ld.steps_per_epoch):
            next(it)
    # fewer samples than one global batch
    total = sum(r["instances"] for r in man["shards"])
    with pytest.raises(UserError, match=rf"manifest.json: {total} samples, fewer than one global batch"):
        bert_loader(bert, mb=total, ga=2)


def test_each_shard_opened_once_per_job_at_startup(bert: Path, monkeypatch) -> None:
    """At start-up rank r of W opens only shards r, r+W, ... (the real h5py.File, counted)."""
    opened: list[str] = []
    real = h5py.File

    def counting(name, *a, **kw):
        opened.append(Path(name).name)
        return real(name, *a, **kw)

    monkeypatch.setattr(h5py, "File", counting)
    n = len(json.loads((bert / "manifest.json").read_text())["shards"])
    per_rank = []
    for rank in range(4):
        opened.clear()
        bert_loader(bert, world=4, rank=rank, mb=8)
        per_rank.append(sorted(opened))
    assert sorted(f for r in per_rank for f in r) == [f"bert-{i:05d}.h5" for i in range(n)]
    assert all(len(r) <= -(-n // 4) for r in per_rank)


def test_read_amplification_at_many_ranks(bert: Path, gpt: Path) -> None:
    """Every rank decodes (whole chunks counted) at most 1.5x the rows it trains on, and the step's samples
    are those of one rank: BERT micro-batch 64 on 1-64 ranks, GPT global batch 1536 on 1-512 ranks."""
    for kind, path, G, ga, worlds, steps in (
        ("bert", bert, 64 * 64, 1, (1, 2, 8, 64), 2),
        ("gpt", gpt, 1536, 3, (1, 8, 64, 512), 3),
    ):

        def make(world: int, rank: int, kind=kind, path=path, G=G, ga=ga) -> PretrainingLoader:
            return PretrainingLoader(
                path,
                kind,
                micro_batch=G // (ga * world),
                grad_accum=ga,
                dp_rank=rank,
                dp_world=world,
                seed=3,
                num_workers=0,
            )

        ref = []
        one = make(1, 0)
        it = iter(one)
        for _ in range(steps):
            ref.append(np.concatenate([next(it)["input_ids"].numpy() for _ in range(ga)]))
        for world in worlds:
            parts: list[list[np.ndarray]] = [[] for _ in range(steps)]
            worst = 0.0
            for rank in range(world):
                ld = make(world, rank)
                it = iter(ld)
                for s in range(steps):
                    parts[s].append(np.concatenate([next(it)["input_ids"].numpy() for _ in range(ga)]))
                worst = max(worst, ld.read_stats.amplification)
            assert worst <= 1.5, f"{kind} at {world} ranks: a rank decoded {worst:.2f}x the rows it used"
            for s in range(steps):
                assert np.array_equal(np.concatenate(parts[s]), ref[s]), f"{kind} {world} ranks step {s}"


def test_gpt_windows_shuffled_across_the_stream(gpt: Path) -> None:
    """The windows of a step lie all over the token stream: the mean distance between two windows of a
    step, in windows of the source stream, is near N/3 (uniform draws), not a few contiguous stretches."""
    ld = PretrainingLoader(gpt, "gpt", micro_batch=64, grad_accum=1, dp_rank=0, dp_world=1, seed=3, num_workers=0)
    first = np.concatenate([[0], np.cumsum(ld.counts)])
    n = ld.samples_per_epoch
    dists = []
    for step in range(5):
        shard, row = ld.order.locate(0, np.arange(step * 64, (step + 1) * 64))
        src = first[shard] + row  # windows are packed in stream order inside shards, shards in text order
        dists.append(np.abs(src[:, None] - src[None, :])[np.triu_indices(64, 1)].mean())
    assert 0.25 * n < np.mean(dists) < 0.42 * n, (np.mean(dists), n)


def test_verify_and_its_errors(bert: Path, tmp_path: Path) -> None:
    p = data_cli("verify", str(bert))
    assert "6 bert shard(s)" in p.stdout and "SHA-256 match the manifest" in p.stdout
    d = copy_dir(bert, tmp_path / "flipped")
    shard = d / "bert-00004.h5"
    raw = bytearray(shard.read_bytes())
    with h5py.File(shard) as f:
        offset = f["input_ids"].id.get_chunk_info(0).byte_offset  # inside compressed data: size unchanged
    raw[offset + 10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    expect_error(data_cli("verify", str(d), check=False), "bert-00004.h5: SHA-256", "manifest.json records")
    expect_error(data_cli("verify", str(tmp_path), check=False), "no manifest.json")


def test_convert_nvidia_shards(bert: Path, wiki_vocab: Path, tmp_path: Path) -> None:
    """gzip, int64, 1,024-row chunks, no attributes -> format 2 with the vocabulary's attributes; the rows
    and their order are kept; another vocabulary is refused."""
    nv = tmp_path / "nv"
    nv.mkdir()
    src = sorted(bert.glob("*.h5"))[:3]
    for i, f in enumerate(src):
        with h5py.File(f) as s, h5py.File(nv / f"wikicorpus_en_training_{i}.hdf5", "w") as d:
            for k in NAMES:
                a = s[k][:].astype("i8" if k in ("input_ids", "masked_lm_ids") else s[k].dtype)
                d.create_dataset(k, data=a, compression="gzip", chunks=(min(1024, len(a)), *a.shape[1:]))
    out = tmp_path / "conv"
    expect_error(data_cli("convert", "--src", str(nv), "--out", str(out), check=False), "give --vocab")
    small = tmp_path / "small-vocab.txt"
    small.write_text("\n".join(wiki_vocab.read_text().split("\n")[:1000]) + "\n")
    expect_error(
        data_cli("convert", "--src", str(nv), "--out", str(out), "--vocab", str(small), check=False),
        "wikicorpus_en_training_",
        "outside the vocabulary of 1000",
    )
    assert not out.exists(), "a refused conversion leaves nothing behind"
    p = data_cli("convert", "--src", str(nv), "--out", str(out), "--vocab", str(wiki_vocab), "--workers", "2")
    assert "3 bert shard(s)" in p.stdout
    data_cli("verify", str(out))
    ld = bert_loader(out, mb=8, drop_last=False)
    assert ld.attrs["vocab_sha256"] == h5format.sha256_file(wiki_vocab) and ld.unit_rows == 64
    for i, f in enumerate(src):
        assert file_keys(out / f"bert-{i:05d}.h5") == file_keys(f)
    it = iter(ld)
    got = [k for _ in range(ld.steps_per_epoch) for k in batch_keys(next(it))]
    assert Counter(got[: ld.samples_per_epoch]) == Counter(k for f in src for k in file_keys(f))


def test_resume_refuses_other_data_and_old_states(bert: Path, tmp_path: Path) -> None:
    ld = bert_loader(bert, mb=8)
    next(iter(ld))
    state = ld.state_dict()
    assert state["version"] == STATE_VERSION and state["data"].endswith("manifest.json")
    other = copy_dir(bert, tmp_path / "other")
    man = json.loads((other / "manifest.json").read_text())
    man["settings"]["seed"] = 999  # another build of the data
    (other / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(
        UserError,
        match=r"loader state: the checkpoint was taken on another data set \(.*bert/manifest"
        r".json, id [0-9a-f]{12}\) than .*other/manifest.json",
    ):
        bert_loader(other, mb=8).load_state_dict(state)
    with pytest.raises(UserError, match=r"loader state: version 1 .* cannot be continued"):
        bert_loader(bert, mb=8).load_state_dict({**state, "version": 1})
    same = bert_loader(bert, mb=8)
    same.load_state_dict(state)  # the same data in another process: accepted
    assert os.fspath(same.shards.manifest).endswith("manifest.json")


def test_format_1_directories_are_read_and_converted(bert: Path, tmp_path: Path) -> None:
    """A format-1 directory (1,024-row chunks, a manifest without sizes or hashes) still loads, in units of
    its chunks, and `data convert` rewrites it as format 2 with the same rows."""
    v1 = tmp_path / "v1"
    v1.mkdir()
    man = json.loads((bert / "manifest.json").read_text())
    for rec in man["shards"]:
        with h5py.File(bert / rec["file"]) as s, h5py.File(v1 / rec["file"], "w") as d:
            for k in NAMES:
                a = s[k][:]
                d.create_dataset(k, data=a, compression="lzf", chunks=(min(1024, len(a)), *a.shape[1:]))
            d.attrs.update({**s.attrs, "format_version": 1})
        for k in ("file_bytes", "sha256"):
            rec.pop(k)
    man.pop("chunk_rows")
    man["format_version"] = 1
    (v1 / "manifest.json").write_text(json.dumps(man))
    ld = bert_loader(v1, mb=8, drop_last=False)
    assert ld.unit_rows == 1024
    it = iter(ld)
    got = [k for _ in range(ld.steps_per_epoch) for k in batch_keys(next(it))]
    want = [k for f in sorted(bert.glob("*.h5")) for k in file_keys(f)]
    assert Counter(got[: ld.samples_per_epoch]) == Counter(want)
    p = data_cli("verify", str(v1))
    assert "format version 1 records no hashes" in p.stdout
    out = tmp_path / "v2"
    data_cli("convert", "--src", str(v1), "--out", str(out))
    data_cli("verify", str(out))
    assert [k for f in sorted(out.glob("*.h5")) for k in file_keys(f)] == want
    assert bert_loader(out).unit_rows == 64
