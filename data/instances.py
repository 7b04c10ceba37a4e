"""BERT MLM/NSP instances, Google's ``create_pretraining_data.py`` recipe, built with numpy.

The recipe (per document, per dupe): pick a target length (``short_seq_prob`` of the time a random
shorter one), pack whole sentences until the target is reached, split them at a random point into A
and B, replace B by a random span of another document half of the time (the sentences not used are
put back), truncate the pair to fit (always from the longer side, front or back at random), then
mask ``min(max_pred, max(1, round(len * masked_lm_prob)))`` non-special positions 80/10/10.

Only the packing walk is a Python loop (one iteration per instance, on integer offsets: A and B are
always contiguous token ranges). Truncation, row assembly and masking are array operations over
thousands of instances at a time. The randomness is distributionally the same as Google's (e.g. the
front/back truncation coin flips become a binomial draw) but not the same stream.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from common.errors import UserError
from data.tokenize_text import TokenizedShard

MIN_SEQ_LEN = 8


@dataclass(frozen=True)
class BertSettings:
    """What defines the instances (defaults: NVIDIA's phase 1). Checked on creation: settings that
    cannot produce valid instances are refused before anything is written.

    seq_len >= 8 and seq_len >= max_pred + 3: [CLS] A [SEP] B [SEP] needs 3 specials and at least one
    token on each side, and every prediction needs a non-special position.
    """

    seq_len: int = 128
    max_pred: int = 20
    masked_lm_prob: float = 0.15
    dupe_factor: int = 5
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < MIN_SEQ_LEN:
            raise UserError(f"--seq-len {self.seq_len}: must be >= {MIN_SEQ_LEN}")
        if self.max_pred < 1:
            raise UserError(f"--max-pred {self.max_pred}: must be >= 1")
        if self.seq_len < self.max_pred + 3:
            raise UserError(
                f"--seq-len {self.seq_len} too small for --max-pred {self.max_pred}: need seq_len >= max_pred + 3"
            )
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise UserError(f"--masked-lm-prob {self.masked_lm_prob}: must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UserError(f"--short-seq-prob {self.short_seq_prob}: must be in [0, 1]")
        if self.dupe_factor < 1:
            raise UserError(f"--dupe-factor {self.dupe_factor}: must be >= 1")


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    # ids a "random token" replacement draws from: the vocab without bracketed specials ([CLS], [SEP],
    # [PAD], [MASK], [UNK], [unusedN]). Google's script draws from the whole vocab, which can put a
    # stray [SEP] or [CLS] inside a sequence; we don't.
    random_pool: np.ndarray | None = None


@dataclass
class PairSpecs:
    """Instances before materialization: A = tokens[a0:a1], B = tokens[b0:b1]."""

    a0: np.ndarray
    a1: np.ndarray
    b0: np.ndarray
    b1: np.ndarray
    is_random_next: np.ndarray

    def __len__(self) -> int:
        return len(self.a0)

    def take(self, idx: np.ndarray) -> PairSpecs:
        return PairSpecs(self.a0[idx], self.a1[idx], self.b0[idx], self.b1[idx], self.is_random_next[idx])


def build_pairs(shard: TokenizedShard, s: BertSettings, rng: np.random.Generator) -> PairSpecs:
    """The sentence-packing walk: returns A/B token ranges (before truncation) for every instance."""
    max_num = s.seq_len - 3
    cum = shard.sent_off.tolist()
    doc_off = shard.doc_off.tolist()
    n_docs = len(doc_off) - 1
    n_sent = len(cum) - 1
    a0s, a1s, b0s, b1s = array("q"), array("q"), array("q"), array("q")
    rnd = array("b")
    for _ in range(s.dupe_factor):
        # every chunk consumes at least one sentence, so n_sent draws per stream are enough
        u_short = rng.random(n_docs).tolist()
        u_target = rng.random(n_docs).tolist()
        u_split = rng.random(n_sent + 1).tolist()
        u_next = rng.random(n_sent + 1).tolist()
        u_doc = rng.random(n_sent + 1).tolist()
        u_start = rng.random(n_sent + 1).tolist()
        k = 0
        for d in range(n_docs):
            s0, s1 = doc_off[d], doc_off[d + 1]
            target = max_num
            if u_short[d] < s.short_seq_prob:
                target = 2 + int(u_target[d] * (max_num - 1))  # randint(2, max_num)
            i = s0
            while i < s1:
                e = bisect_left(cum, cum[i] + target, i + 1, s1)  # chunk = sentences [i, e)
                n = e - i
                a_end = 1 if n < 2 else 1 + int(u_split[k] * (n - 1))
                a0, a1 = cum[i], cum[i + a_end]
                if n == 1 or u_next[k] < 0.5:
                    target_b = target - (a1 - a0)
                    rd = d
                    if n_docs > 1:
                        rd = int(u_doc[k] * (n_docs - 1))
                        rd += rd >= d
                    r0, r1 = doc_off[rd], doc_off[rd + 1]
                    rs = r0 + int(u_start[k] * (r1 - r0))
                    re_ = bisect_left(cum, cum[rs] + target_b, rs + 1, r1)
                    b0, b1 = cum[rs], cum[re_]
                    rnd.append(1)
                    i += a_end  # put the unused sentences back
                else:
                    b0, b1 = a1, cum[e]
                    rnd.append(0)
                    i = e
                a0s.append(a0)
                a1s.append(a1)
                b0s.append(b0)
                b1s.append(b1)
                k += 1
    return PairSpecs(
        np.frombuffer(a0s, dtype=np.int64).copy(),
        np.frombuffer(a1s, dtype=np.int64).copy(),
        np.frombuffer(b0s, dtype=np.int64).copy(),
        np.frombuffer(b1s, dtype=np.int64).copy(),
        np.frombuffer(rnd, dtype=np.int8).copy(),
    )


def truncate_pairs(p: PairSpecs, max_num: int, rng: np.random.Generator) -> PairSpecs:
    """Google's truncate_seq_pair in closed form: removals go to the longer side (ties to B), front or back
    with probability 1/2 each, so each side's front count is Binomial(removals, 1/2)."""
    la, lb = p.a1 - p.a0, p.b1 - p.b0
    excess = np.maximum(la + lb - max_num, 0)
    d = la - lb
    ra = np.where(d > 0, np.minimum(excess, d), 0)
    rb = np.where(d < 0, np.minimum(excess, -d), 0)
    rest = excess - ra - rb
    rb = rb + (rest + 1) // 2
    ra = ra + rest // 2
    fa = rng.binomial(ra, 0.5)
    fb = rng.binomial(rb, 0.5)
    return PairSpecs(p.a0 + fa, p.a1 - (ra - fa), p.b0 + fb, p.b1 - (rb - fb), p.is_random_next)


def materialize(
    tokens: np.ndarray,
    p: PairSpecs,
    s: BertSettings,
    sp: SpecialIds,
    is_subword: np.ndarray | None,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Rows [CLS] A [SEP] B [SEP] [PAD]..., segment ids, input mask and the masked LM predictions."""
    n, S, P = len(p), s.seq_len, s.max_pred
    la = (p.a1 - p.a0)[:, None]
    lb = (p.b1 - p.b0)[:, None]
    length = la + lb + 3
    pos = np.arange(S, dtype=np.int64)[None, :]
    # token index = pos + offset, with one offset for A (pos <= la) and one for B; specials patched after
    off = np.where(pos <= la, p.a0[:, None] - 1, p.b0[:, None] - la - 2)
    src = pos + off
    np.clip(src, 0, len(tokens) - 1, out=src)
    input_mask = pos < length
    ids = np.where(input_mask, tokens[src], sp.pad)
    r = np.arange(n)
    ids[:, 0] = sp.cls
    ids[r, la[:, 0] + 1] = sp.sep
    ids[r, length[:, 0] - 1] = sp.sep
    segment_ids = (pos >= la + 2) & input_mask
    cand = input_mask.copy()
    cand[:, 0] = False
    cand[r, la[:, 0] + 1] = False
    cand[r, length[:, 0] - 1] = False

    num_pred = np.minimum(P, np.maximum(1, np.rint(length[:, 0] * s.masked_lm_prob).astype(np.int64)))
    if s.whole_word_masking:
        positions = _whole_word_positions(ids, cand, num_pred, P, is_subword, rng)
    else:
        keys = rng.random((n, S), dtype=np.float32)
        keys[~cand] = 2.0
        kth = min(P, S) - 1
        part = np.argpartition(keys, kth, axis=1)[:, :P]
        pk = np.take_along_axis(keys, part, axis=1)
        order = np.argsort(pk, axis=1)
        positions = np.take_along_axis(part, order, axis=1)  # candidates by ascending key
        keep = np.arange(P)[None, :] < num_pred[:, None]
        keep &= np.take_along_axis(cand, positions, axis=1)  # fewer candidates than num_pred
        positions = np.where(keep, positions, S)
    positions.sort(axis=1)
    valid = positions < S
    safe = np.where(valid, positions, 0)
    labels = np.where(valid, np.take_along_axis(ids, safe, axis=1), 0)
    u = rng.random((n, P), dtype=np.float32)
    if sp.random_pool is not None:
        random_ids = sp.random_pool[rng.integers(0, len(sp.random_pool), size=(n, P))]
    else:
        random_ids = rng.integers(0, sp.vocab_size, size=(n, P), dtype=np.int32)
    repl = np.where(u < 0.8, sp.mask, np.where(u < 0.9, labels, random_ids))
    rows, cols = np.nonzero(valid)
    ids[rows, safe[rows, cols]] = repl[rows, cols]
    return {
        "input_ids": ids.astype(np.int32),
        "input_mask": input_mask.astype(np.int8),
        "segment_ids": segment_ids.astype(np.int8),
        "masked_lm_positions": np.where(valid, positions, 0).astype(np.int32),
        "masked_lm_ids": labels.astype(np.int32),
        "next_sentence_labels": p.is_random_next.astype(np.int8),
    }


def _whole_word_positions(
    ids: np.ndarray,
    cand: np.ndarray,
    num_pred: np.ndarray,
    P: int,
    is_subword: np.ndarray | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Whole-word masking: a "##" piece belongs to the word before it; words are drawn in random order and
    taken whole while they fit in num_pred (Google's rule: a word that would overflow is skipped)."""
    n, S = ids.shape
    assert is_subword is not None
    cont = is_subword[ids] & cand
    start = cand & ~cont
    # a continuation right after a special token starts its own word (as in Google's code)
    prev_cand = np.zeros_like(cand)
    prev_cand[:, 1:] = cand[:, :-1]
    start |= cont & ~prev_cand
    word = np.cumsum(start, axis=1) - 1  # word index per position (valid where cand)
    out = np.full((n, P), S, dtype=np.int64)
    for r in range(n):
        cpos = np.nonzero(cand[r])[0]
        if len(cpos) == 0:
            continue
        w = word[r, cpos]
        bounds = np.nonzero(np.diff(w))[0] + 1
        groups = np.split(cpos, bounds)
        order = rng.permutation(len(groups))
        chosen: list[int] = []
        budget = int(num_pred[r])
        for g in order:
            grp = groups[g]
            if len(chosen) >= budget:
                break
            if len(chosen) + len(grp) > budget:
                continue
            chosen.extend(grp.tolist())
        out[r, : len(chosen)] = chosen
    return out
