"""PretrainingLoader on real BERT shards: 2 real ranks (forked or spawned, gloo), exact resume, world-size change,
order, bounded buffers, NVIDIA-made shards and schema errors."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist

from common.errors import UserError
from common.net import free_port
from data.h5format import BERT_SCHEMA
from data.loader import EvalSet, PretrainingLoader
from tests.conftest import data_bert, run_in_ranks, run_python

NAMES = list(BERT_SCHEMA)  # the datasets of a BERT shard, NVIDIA's names and order
ORDER = {"unit_rows": 16}  # many units even on the small sample


def row_key(ids, mask, seg, pos, lm, nsl) -> str:
    parts = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (ids, mask, seg, pos, lm, [nsl])]
    return hashlib.blake2b(np.concatenate(parts).tobytes(), digest_size=12).hexdigest()


def batch_keys(b: dict[str, torch.Tensor]) -> list[str]:
    return [
        row_key(
            *(
                b[k][i].numpy()
                for k in (
                    "input_ids",
                    "attention_mask",
                    "token_type_ids",
                    "masked_lm_positions",
                    "masked_lm_ids",
                )
            ),
            int(b["next_sentence_labels"][i]),
        )
        for i in range(len(b["input_ids"]))
    ]


def file_keys(path: Path) -> list[str]:
    with h5py.File(path) as f:
        a = [f[k][:] for k in NAMES]
    return [row_key(*(x[i] for x in a)) for i in range(len(a[0]))]


def take_steps(it, steps: int, grad_accum: int) -> list[list[str]]:
    return [[k for _ in range(grad_accum) for k in batch_keys(next(it))] for _ in range(steps)]


@pytest.fixture(scope="module")
def shards(wiki_text_dir: Path, wiki_vocab: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("loader") / "bert"
    p = run_python(
        data_bert(
            wiki_text_dir, wiki_vocab, out, "--dupe-factor", "1", "--shards", "3", "--seed", "3", "--no-progress"
        ),
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def all_keys(shards: Path) -> list[str]:
    keys = [k for f in sorted(shards.glob("*.h5")) for k in file_keys(f)]
    assert len(set(keys)) == len(keys), "precondition: instances are distinct rows"
    return keys


def loader(path, world=1, rank=0, mb=8, ga=2, workers=0, seed=11, **kw) -> PretrainingLoader:
    return PretrainingLoader(
        path,
        "bert",
        micro_batch=mb,
        grad_accum=ga,
        dp_rank=rank,
        dp_world=world,
        seed=seed,
        num_workers=workers,
        **{**ORDER, **kw},
    )


def _rank_main(rank: int, world: int, shard_dir: str, out: str, port: int) -> None:
    """One data-parallel rank: 5 steps, a checkpoint after step 3, then a resumed loader for steps 4-5."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ld = loader(shard_dir, world=world, rank=rank, mb=4, ga=2, workers=1)
        it = iter(ld)
        first = take_steps(it, 3, 2)
        state = ld.state_dict()
        rest = take_steps(it, 2, 2)
        resumed = loader(shard_dir, world=world, rank=rank, mb=4, ga=2, workers=1)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint round trip gives
        again = take_steps(iter(resumed), 2, 2)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"steps": first + rest, "resumed": again, "state": state})
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_disjoint_resume_and_world_change(shards: Path, all_keys: list[str], tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    run_in_ranks(_rank_main, (2, str(shards), str(out), free_port()), nprocs=2)
    ranks = json.loads(out.read_text())
    ref = take_steps(iter(loader(shards, mb=8, ga=2)), 5, 2)  # 1 rank, same global batch of 16
    for k in range(5):
        r0, r1 = ranks[0]["steps"][k], ranks[1]["steps"][k]
        assert len(r0) == len(r1) == 8
        assert not set(r0) & set(r1), f"step {k}: ranks share samples"
        assert set(r0) | set(r1) == set(ref[k]), f"step {k}: 2 ranks and 1 rank see different samples"
        assert r0 + r1 == ref[k], "rank r holds the r-th slice of the global batch"
    assert len({s for k in range(5) for s in ref[k]}) == 80  # no sample twice within the epoch
    for r in range(2):  # resume on the same world size continues with the very next samples
        assert ranks[r]["resumed"] == ranks[r]["steps"][3:5]
        assert ranks[r]["state"]["global_samples"] == 3 * 16
    # world size 2 -> 1 with the same global batch (micro 8 x accum 2)
    one = loader(shards, mb=8, ga=2)
    one.load_state_dict(ranks[0]["state"])
    cont = take_steps(iter(one), 2, 2)
    for j in range(2):
        assert cont[j] == ranks[0]["steps"][3 + j] + ranks[1]["steps"][3 + j]
    # world 2 -> 1 with the same global batch but micro 4 x accum 4: same samples per step
    one4 = loader(shards, mb=4, ga=4)
    one4.load_state_dict(ranks[0]["state"])
    assert take_steps(iter(one4), 1, 4)[0] == cont[0]


def test_resume_exact_in_process_and_with_workers(shards: Path) -> None:
    for workers in (0, 2):
        ld = loader(shards, mb=5, ga=3, workers=workers)
        it = iter(ld)
        take_steps(it, 4, 3)
        state = ld.state_dict()
        expected = take_steps(it, 3, 3)
        new = loader(shards, mb=5, ga=3, workers=workers)
        new.load_state_dict(state)
        assert take_steps(iter(new), 3, 3) == expected
    # prefetching workers produce the same sequence as the in-process reader
    a = take_steps(iter(loader(shards, workers=0)), 6, 2)
    b = take_steps(iter(loader(shards, workers=2)), 6, 2)
    assert a == b


@pytest.mark.parametrize("unpad", [False, True])
def test_workers_hand_out_the_in_process_batches(shards: Path, unpad: bool) -> None:
    """Workers unpack whole transfers of micro-batches (``_unpack_group``) and the loader hands out views of
    them: every key of every micro-batch equals the in-process reader's, over an epoch's end (micro-batches of
    5 rows: transfers that are not whole units, and an epoch tail)."""
    got = {}
    for workers in (0, 2):
        ld = loader(shards, mb=5, ga=3, workers=workers, unpad=unpad, drop_last=False)
        it = iter(ld)
        got[workers] = [next(it) for _ in range(ld.steps_per_epoch * 3 + 6)]
    for a, b in zip(got[0], got[2], strict=True):
        assert a.keys() == b.keys() and ("cu_seqlens" in a) == unpad
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_epochs_seeds_and_full_coverage(shards: Path, all_keys: list[str]) -> None:
    n = len(all_keys)
    ld = loader(shards, mb=7, ga=1, drop_last=False)
    assert ld.samples_per_epoch == n and ld.steps_per_epoch == -(-n // 7)
    it = iter(ld)
    epoch0 = [k for s in take_steps(it, ld.steps_per_epoch, 1) for k in s]
    epoch1 = [k for s in take_steps(it, ld.steps_per_epoch, 1) for k in s]
    assert Counter(epoch0[:n]) == Counter(all_keys), "an epoch visits every sample once"
    assert epoch0[n:] == epoch0[: len(epoch0) - n], "the last partial step wraps to the epoch's start"
    assert Counter(epoch1[:n]) == Counter(all_keys)
    assert epoch0[:200] != epoch1[:200], "epochs are shuffled differently"
    assert ld.state_dict()["epoch"] == 2
    same = take_steps(iter(loader(shards, mb=7, ga=1, drop_last=False)), 30, 1)
    assert [k for s in same for k in s] == epoch0[:210], "same seed, same order"
    other = take_steps(iter(loader(shards, mb=7, ga=1, seed=12, drop_last=False)), 30, 1)
    assert [k for s in other for k in s] != epoch0[:210]
    # the shuffle reaches across shards: the first 64 samples are four units from all over the data set
    assert len(set(epoch0[:64]) & set(all_keys[:64])) < 32


def test_buffer_bounded_independent_of_shard_size(shards: Path, tmp_path: Path) -> None:
    small = sorted(shards.glob("*.h5"))[0]
    big = tmp_path / "big.h5"
    with h5py.File(small) as src, h5py.File(big, "w") as dst:
        for k in NAMES:
            dst.create_dataset(k, data=np.concatenate([src[k][:]] * 10), chunks=True, compression="lzf")
        for k, v in src.attrs.items():
            dst.attrs[k] = v
    peaks = []
    for path in (small, big):
        ld = loader(path, mb=16, ga=1, drop_last=False, require_manifest=False)
        it = iter(ld)
        for _ in range(ld.steps_per_epoch):
            next(it)
        assert ld.buffer_samples == 2 * (16 + 2 * 16)
        assert 0 < ld.peak_buffered_samples <= ld.buffer_samples
        peaks.append(ld.peak_buffered_samples)
    assert peaks[1] <= peaks[0] + 16  # the 10x shard did not grow the buffer (one unit of slack: tails)


def test_batch_fields(shards: Path, wiki_vocab: Path) -> None:
    b = next(iter(loader(shards, mb=6, ga=1)))
    assert set(b) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "masked_lm_positions",
        "masked_lm_ids",
        "masked_lm_weights",
        "next_sentence_labels",
        "min_seqlen",  # the shortest row, on the host: a padded model needs no mask when it is the full width
    }
    for k, v in b.items():
        assert v.dtype == (torch.float32 if k == "masked_lm_weights" else torch.long), k
    assert b["input_ids"].shape == (6, 128) and b["masked_lm_positions"].shape == (6, 20)
    assert b["next_sentence_labels"].shape == (6,)
    assert b["min_seqlen"].shape == () and int(b["min_seqlen"]) == int(b["attention_mask"].sum(1).min())
    w, pos = b["masked_lm_weights"], b["masked_lm_positions"]
    assert torch.equal(w, (torch.cumprod((pos != 0).long(), dim=1)).float())
    assert (w.sum(1) > 0).all() and ((w == 0) == (pos == 0)).all()
    cls = wiki_vocab.read_text().split("\n").index("[CLS]")
    assert (b["input_ids"][:, 0] == cls).all()
    ld = loader(shards, mb=6, ga=1)
    assert ld.attrs["seq_len"] == 128 and ld.attrs["max_pred"] == 20 and len(ld.attrs["vocab_sha256"]) == 64


def test_nvidia_made_shard(shards: Path, tmp_path: Path) -> None:
    """gzip, int64/int32 datasets, no attributes: read, lengths inferred, vocab unknown."""
    src = sorted(shards.glob("*.h5"))[0]
    nv = tmp_path / "nv" / "wikicorpus_en_training_0.hdf5"
    nv.parent.mkdir()
    with h5py.File(src) as s, h5py.File(nv, "w") as d:
        for k in NAMES:
            dt = "i8" if k in ("input_ids", "masked_lm_ids") else s[k].dtype
            d.create_dataset(k, data=s[k][:].astype(dt), compression="gzip")
    with pytest.raises(UserError, match=r"wikicorpus_en_training_0.hdf5: no manifest.json.*data convert"):
        loader(nv, mb=8, ga=1)  # shards made elsewhere need an explicit opt-in
    ld = loader(
        nv.parent,
        mb=8,
        ga=1,
        drop_last=False,
        expect={"seq_len": 128, "max_pred": 20, "vocab_sha256": "x" * 64},
        require_manifest=False,
    )
    assert ld.attrs["seq_len"] == 128 and ld.attrs["max_pred"] == 20 and "vocab_sha256" not in ld.attrs
    it = iter(ld)
    got = [k for _ in range(ld.steps_per_epoch) for k in batch_keys(next(it))]
    assert Counter(got[: ld.samples_per_epoch]) == Counter(file_keys(src))
    with pytest.raises(UserError, match=r"seq_len=128 but expected 512"):
        loader(nv.parent, expect={"seq_len": 512}, require_manifest=False)


def test_schema_and_expect_errors(shards: Path, tmp_path: Path) -> None:
    src = sorted(shards.glob("*.h5"))[0]
    with pytest.raises(UserError, match=r"manifest.json: attribute vocab_sha256='[0-9a-f]+' but expected 'abc'"):
        loader(shards, expect={"vocab_sha256": "abc"})
    with pytest.raises(UserError, match=r"seq_len=128 but expected 512"):
        loader(shards, expect={"seq_len": 512})

    def variant(name: str, edit) -> Path:
        p = tmp_path / f"{name}.h5"
        with h5py.File(src) as s, h5py.File(p, "w") as d:
            for k in NAMES:
                d.create_dataset(k, data=s[k][:])
            edit(d)
        return p

    cases = {
        "missing": (lambda d: d.__delitem__("masked_lm_ids"), "missing dataset 'masked_lm_ids'"),
        "rank": (
            lambda d: (
                d.__delitem__("next_sentence_labels"),
                d.create_dataset("next_sentence_labels", data=np.zeros((3, 2))),
            )[0],
            "next_sentence_labels",
        ),
        "dtype": (
            lambda d: (
                d.__delitem__("input_ids"),
                d.create_dataset("input_ids", data=np.zeros((len(d["input_mask"]), 128), "f4")),
            )[0],
            "dtype float32",
        ),
        "rows": (
            lambda d: (
                d.__delitem__("segment_ids"),
                d.create_dataset("segment_ids", data=np.zeros((5, 128), "i1")),
            )[0],
            "rows",
        ),
        "width": (
            lambda d: (
                d.__delitem__("masked_lm_ids"),
                d.create_dataset("masked_lm_ids", data=np.zeros((len(d["input_mask"]), 19), "i4")),
            )[0],
            "'masked_lm_ids' is 19 wide, expected max_pred=20",
        ),
    }
    for name, (edit, needle) in cases.items():
        p = variant(name, edit)
        with pytest.raises(UserError) as e:
            loader(p, require_manifest=False)
        assert str(p) in str(e.value) and needle in str(e.value), str(e.value)
    with pytest.raises(UserError, match="no such shard"):
        loader(tmp_path / "none-*.h5")
    # resume refusals name what differs
    ld = loader(shards, mb=4, ga=2)
    it = iter(ld)
    next(it)
    mid = ld.state_dict()
    with pytest.raises(UserError, match="middle of a step"):
        loader(shards, world=2, rank=1, mb=4, ga=1).load_state_dict(mid)
    with pytest.raises(UserError, match="seed=11 but this loader has 12"):
        loader(shards, seed=12).load_state_dict(mid)


def test_eval_set_fixed_and_split_over_any_world(shards: Path, all_keys: list[str]) -> None:
    """The first n samples in storage order, the same on every pass; for world sizes 1, 2 and 3 the ranks'
    shares are disjoint, their union in rank order is exactly those n samples, and every rank runs the
    same number of micro-batches of at most micro_batch rows."""
    first_shard = json.loads((shards / "manifest.json").read_text())["shards"][0]["instances"]
    n = first_shard + 7  # not a multiple of 2 or 3, and crosses into the second shard
    for world in (1, 2, 3):
        shares, lengths = [], set()
        for rank in range(world):
            ev = EvalSet(shards, "bert", n, micro_batch=8, dp_rank=rank, dp_world=world)
            batches = list(ev)
            assert [batch_keys(b) for b in batches] == [batch_keys(b) for b in ev], "a second pass differs"
            assert all(0 < len(b["input_ids"]) <= 8 for b in batches)
            assert len(batches) == len(ev) and sum(len(b["input_ids"]) for b in batches) == ev.num_samples
            lengths.add(len(batches))
            shares.append([k for b in batches for k in batch_keys(b)])
        assert len(lengths) == 1, f"world {world}: ranks run different numbers of micro-batches {lengths}"
        union = [k for share in shares for k in share]
        assert union == all_keys[:n] and len(set(union)) == n, f"world {world}"
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    b = next(iter(EvalSet(shards, "bert", 5, micro_batch=8, dp_rank=0, dp_world=1)))
    assert set(b) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "masked_lm_positions",
        "masked_lm_ids",
        "masked_lm_weights",
        "next_sentence_labels",
        "min_seqlen",  # the shortest row, on the host: a padded model needs no mask when it is the full width
    }
    assert b["input_ids"].shape == (5, 128)
    total = len(all_keys)
    with pytest.raises(UserError, match=rf"{total} samples, fewer than the {total + 1} evaluation"):
        EvalSet(shards, "bert", len(all_keys) + 1, micro_batch=8, dp_rank=0, dp_world=1)
    with pytest.raises(UserError, match="different numbers of forward passes; use a multiple of 3"):
        EvalSet(shards, "bert", 2, micro_batch=8, dp_rank=0, dp_world=3)
    with pytest.raises(UserError, match="different numbers of forward passes; use a multiple of 2"):
        EvalSet(shards, "bert", 7, micro_batch=1, dp_rank=1, dp_world=2)
    assert len(EvalSet(shards, "bert", 8, micro_batch=1, dp_rank=1, dp_world=2)) == 4


def test_collated_micro_batches_come_back_whole_with_empty_and_scalar_parts() -> None:
    """A worker's transfer form (``_collate``) and back (``_uncollate``): an empty part (an unpadding index with
    no real token) and 0-d values keep every later micro-batch's slice in place."""
    from data.loader import _collate, _uncollate

    parts = [
        {"idx": torch.empty(0, dtype=torch.long), "n": torch.tensor(3), "rows": torch.zeros(2, 4)},
        {"idx": torch.tensor([5, 6]), "n": torch.tensor(4), "rows": torch.ones(2, 4)},
        {"idx": torch.tensor([7]), "n": torch.tensor(5), "rows": torch.full((1, 4), 2.0)},
    ]
    back = list(_uncollate(*_collate(parts)))
    assert len(back) == 3
    for a, b in zip(parts, back, strict=True):
        assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)
