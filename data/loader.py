"""Distributed, exactly resumable loaders for the BERT and GPT HDF5 shards.

Order. The shards are cut into units of ``unit_rows`` consecutive rows, aligned with the shards' HDF5
chunks (format 2: 64 BERT rows, one GPT window; see ``data.h5format``). Per epoch, a keyed pseudo-random
permutation (from ``seed`` and the epoch) orders all full units of the data set; each shard's short tail
unit, if any, follows in a shuffled order at the end of the epoch. The units' rows, in that order, are one
global sequence of all samples. Optimizer step k consumes global positions [k*G, (k+1)*G) of it,
G = micro_batch * grad_accum * dp_world; rank r takes the contiguous slice [r*L, (r+1)*L),
L = micro_batch * grad_accum, micro-batch m the m-th micro_batch of that slice. So the samples of a step
do not depend on how many ranks share it, and the resume point (epoch, position in the epoch) is a count
of global samples that any world size can continue from.

Reads. When L is a multiple of ``unit_rows`` (NVIDIA's phase-1 batch of 65,536 on up to 1,024 ranks;
any GPT batch), a rank's slice is whole units and it decodes exactly the rows it trains on: the read
amplification (HDF5 rows decompressed, whole chunks counted, over rows handed out; ``read_stats``) is 1,
whatever the world size, except at the epoch's short tail units. Shards of format 1 (1,024-row chunks)
and NVIDIA's are read too, at the amplification their chunking implies.

Shuffle. A step's samples are G / unit_rows units drawn without replacement from the whole data set, so
every step mixes all shards; inside a unit the rows are consecutive rows of one shard. BERT writers
shuffle instances inside each shard (as NVIDIA's do), so a unit's 64 rows are random instances of one
shard's text; a GPT unit is a single window, so a step's windows are drawn uniformly from the whole
stream. The permutation is a 4-round Feistel network on the unit index (cycle-walking into range), so
it costs O(1) memory however many units there are.

Metadata. Row counts, sizes and settings come from ``manifest.json``: at start-up every rank stats each
listed shard (size against the manifest) and opens only its share of them (shard i on rank
i mod dp_world) to check the schema and the row count, so each shard is opened once per job, not once
per rank. Any shard a reader opens later is checked against its row count again. ``python -m data
verify`` checks the content hashes. A directory without a manifest is refused (an interrupted writer
leaves one) unless ``require_manifest=False`` (shards made elsewhere: every file is opened and checked).

Memory. A reader holds the units its last two micro-batches touched: at most 2 * (micro_batch + 2 *
unit_rows) rows, whatever the shard sizes.

Iteration. ``iter(loader)`` yields micro-batches forever, epoch after epoch, starting at the current
position; ``state_dict()`` is the position after the last micro-batch handed out, so batches that
prefetching workers produced but the trainer never received do not count.

Evaluation. ``EvalSet`` is a fixed held-out set (the first n samples of the eval shards, split over
the ranks), the same at every evaluation and for every world size.

Fields. The datasets, their order in a packed row, their widths and their keys in a micro-batch all
come from ``data.h5format``'s schema.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from common.errors import UserError
from common.log import get_logger
from data import h5format, reads
from data.formats import get_format
from data.reads import ReadRetry, ShardDamaged, ShardReadError

log = get_logger("data.loader")

STATE_FORMAT = "wikipretrain-loader"
STATE_VERSION = 2  # 1: the block/window order of format-1 days (not continued by this loader)
ORDER = "units-feistel"
CHUNK_ROWS = 512  # rows a worker ships per transfer (rounded to whole micro-batches and units)
WORKER_GRACE_S = 60  # how long a DataLoader worker outlives a SIGTERM (the launcher kills at 30 s)
_warned_missing_attrs = False


def _open_shards(
    path: str | Path, kind: str, expect: dict | None, require_manifest: bool, share: tuple[int, int] | None
) -> h5format.ShardList:
    """List and check the shards: the manifest, a stat of every shard, and a full check of this rank's
    ``share`` (rank, world) of them; without a manifest (opt-in) every shard is opened."""
    global _warned_missing_attrs
    get_format(kind)  # one line naming the known formats otherwise
    shards = h5format.list_shards(path, kind, require_manifest=require_manifest)
    h5format.check_expect(shards.attrs, expect, shards.where)
    if shards.manifest is not None:
        h5format.check_listed(shards)
        if share is not None:
            rank, world = share
            for i in range(rank, len(shards.entries), world):
                h5format.check_shard(shards, i)
    elif "format" not in shards.attrs and not _warned_missing_attrs:
        _warned_missing_attrs = True
        log.warning(
            f"{shards.where}: shards carry no attributes (NVIDIA-made?): seq_len/max_pred inferred from "
            "shapes, vocabulary unknown and not checked"
        )
    return shards


def _check_ranks(dp_rank: int, dp_world: int, **positive: int) -> None:
    for name, v in {**positive, "dp_world": dp_world}.items():
        if v < 1:
            raise UserError(f"loader {name}={v}: must be >= 1")
    if not 0 <= dp_rank < dp_world:
        raise UserError(f"loader dp_rank={dp_rank} outside [0, dp_world={dp_world})")


def _widths(kind: str, attrs: dict[str, Any]) -> list[int]:
    """Row width of each dataset, in schema order (the packing order of a micro-batch row)."""
    seq, pred = int(attrs["seq_len"]), int(attrs.get("max_pred", 0))
    return [f.row_width(seq, pred) for f in h5format.SCHEMAS[kind].values()]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (multiplications wrap modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Permutation:
    """A keyed pseudo-random permutation of [0, n), evaluated index by index in O(1) memory: a 4-round
    balanced Feistel network on the smallest even number of bits covering n (a bijection of
    [0, 4**half)), cycle-walked into [0, n) (apply again until the value is in range; fewer than four
    rounds on average)."""

    def __init__(self, n: int, key: list[int]) -> None:
        self.n = n
        half = (max(2, (n - 1).bit_length()) + 1) // 2
        self.half, self.mask = np.uint64(half), np.uint64((1 << half) - 1)
        self.keys = np.random.SeedSequence(key).generate_state(4, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: np.ndarray) -> np.ndarray:
        out = self._rounds(np.asarray(i, dtype=np.uint64))
        todo = out >= np.uint64(self.n)
        while todo.any():
            out[todo] = self._rounds(out[todo])
            todo = out >= np.uint64(self.n)
        return out.astype(np.int64)


class _Order:
    """Shards -> units -> per-epoch global order; pure functions of (counts, unit_rows, seed)."""

    def __init__(self, counts: list[int], unit_rows: int, seed: int) -> None:
        self.unit, self.seed = unit_rows, seed
        c = np.asarray(counts, dtype=np.int64)
        full = c // unit_rows
        self.full_first = np.concatenate([[0], np.cumsum(full)])  # first full-unit id of each shard
        self.num_full = int(self.full_first[-1])
        tails = np.flatnonzero(c % unit_rows)
        self.tail_shard, self.tail_start, self.tail_len = tails, full[tails] * unit_rows, c[tails] % unit_rows
        self.num_samples = int(c.sum())
        self._epoch: tuple[int, _Permutation, np.ndarray, np.ndarray] | None = None

    def _layout(self, epoch: int) -> tuple[_Permutation, np.ndarray, np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            perm = _Permutation(self.num_full, [self.seed, epoch, 0])
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 1])))
            tails = rng.permutation(len(self.tail_shard))
            first = self.num_full * self.unit + np.concatenate([[0], np.cumsum(self.tail_len[tails])])
            self._epoch = (epoch, perm, tails, first)
        return self._epoch[1], self._epoch[2], self._epoch[3]

    def locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Epoch positions -> (shard, row in the shard)."""
        perm, tails, first = self._layout(epoch)
        positions = np.asarray(positions, dtype=np.int64)
        shard, row = np.empty_like(positions), np.empty_like(positions)
        in_full = positions < self.num_full * self.unit
        if in_full.any():
            p = positions[in_full]
            u = perm(p // self.unit)
            s = np.searchsorted(self.full_first, u, side="right") - 1
            shard[in_full], row[in_full] = s, (u - self.full_first[s]) * self.unit + p % self.unit
        if not in_full.all():
            p = positions[~in_full]
            k = np.searchsorted(first, p, side="right") - 1
            t = tails[k]
            shard[~in_full], row[~in_full] = self.tail_shard[t], self.tail_start[t] + (p - first[k])
        return shard, row


@dataclass
class ReadStats:
    """Rows decompressed (every HDF5 chunk a read touches counted whole, per row of all datasets) and
    rows handed out, by one reader."""

    rows_decoded: int = 0
    rows_used: int = 0
    files_opened: int = 0

    @property
    def amplification(self) -> float:
        return self.rows_decoded / self.rows_used if self.rows_used else 0.0


class _Reader:
    """Reads whole units and gathers micro-batches; keeps the units its last two reads touched."""

    def __init__(self, shards: h5format.ShardList, order: _Order, retry: ReadRetry) -> None:
        self.shards, self.kind, self.order, self.retry = shards, shards.kind, order, retry
        self.outage = reads.Outage()  # the retries of one outage share their time, across units
        self.names = list(h5format.SCHEMAS[self.kind])  # packing order of a micro-batch row (see _unpack)
        self.units: dict[tuple[int, int], np.ndarray] = {}
        self.handles: dict[int, tuple[h5py.File, int | None]] = {}
        self.stats = ReadStats()
        self.peak_buffered = 0

    def _file(self, s: int) -> tuple[h5py.File, int | None]:
        got = self.handles.pop(s, None)
        if got is None:
            e = self.shards.entries[s]
            f = h5py.File(e.path, "r")  # an OSError here is classified and retried by _unit
            self.stats.files_opened += 1
            lead = self.names[0]  # the format's first dataset (ShardFormat.lead)
            rows = f[lead].shape[0] if lead in f else -1
            if rows != e.samples:
                f.close()
                raise ShardDamaged(f"{e.path}: {rows} rows but {self.shards.where} records {e.samples}")
            got = (f, h5format.chunk_rows_of(f, self.kind))
            while len(self.handles) >= 64:
                self.handles.pop(next(iter(self.handles)))[0].close()
        self.handles[s] = got  # most recently used last
        return got

    def _drop(self, s: int) -> None:
        """Forget shard ``s``'s handle after a failed read (the next attempt opens the file again)."""
        got = self.handles.pop(s, None)
        if got is not None:
            with contextlib.suppress(Exception):  # closing a handle whose file failed may fail too
                got[0].close()

    def _unit(self, s: int, k: int) -> np.ndarray:
        e = self.shards.entries[s]
        a = k * self.order.unit
        z = min(a + self.order.unit, e.samples)

        def attempt() -> tuple[np.ndarray, int | None]:
            f, chunk = self._file(s)
            return _pack([f[n][a:z] for n in self.names]), chunk

        rows, chunk = reads.read(
            attempt, e.path, (a, z), e.file_bytes, self.retry, on_failure=lambda: self._drop(s), outage=self.outage
        )
        self.stats.rows_decoded += (-(-z // chunk) - a // chunk) * chunk if chunk else z - a
        return rows

    def read(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """One micro-batch packed as a single int32 array [B, sum of field widths] (one transfer)."""
        shard, row = self.order.locate(epoch, positions)
        unit = row // self.order.unit
        keys, inverse = np.unique(np.stack([shard, unit], axis=1), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        keep: dict[tuple[int, int], np.ndarray] = {}
        out: np.ndarray | None = None
        for j, (s, k) in enumerate(keys.tolist()):
            buf = self.units.get((s, k))
            if buf is None:
                buf = self._unit(s, k)
            keep[(s, k)] = buf
            if out is None:
                out = np.empty((len(positions), buf.shape[1]), dtype=np.int32)
            sel = inverse == j
            out[sel] = buf[row[sel] - k * self.order.unit]
        # this read's units stay for the next read (a unit may span micro-batches); older ones go
        held = sum(len(v) for v in keep.values()) + sum(len(v) for k, v in self.units.items() if k not in keep)
        self.peak_buffered = max(self.peak_buffered, held)
        self.units = keep
        self.stats.rows_used += len(positions)
        assert out is not None
        return out

    def close(self) -> None:
        for f, _ in self.handles.values():
            f.close()
        self.handles.clear()
        self.units.clear()


def _pack(fields: list[np.ndarray]) -> np.ndarray:
    """The datasets' rows (schema order) side by side as one int32 array: one transfer, one copy."""
    return np.concatenate([a.reshape(len(a), -1) for a in fields], axis=1).astype(np.int32, copy=False)


def unpadding_index(attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where the real tokens of a padded ``[B, S]`` batch are, for a model that computes only them.

    ``unpad_indices``: flat indices (row-major, into ``B * S``) of the nonzero mask entries, int64 [T];
    ``cu_seqlens``: int32 [B + 1], sequence b's real tokens are ``[cu_seqlens[b], cu_seqlens[b + 1])`` of
    the packed layout; ``max_seqlen``: 0-d int64, the longest sequence. Built on the host by the loader, so
    the device never waits on a ``nonzero`` or ``.item()``; ``model.unpad`` computes the same when absent.
    """
    real = attention_mask != 0
    lengths = real.sum(1)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    return {
        "unpad_indices": real.reshape(-1).nonzero().reshape(-1),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": lengths.max() if len(lengths) else lengths.new_zeros(()),
    }


def _unpack(kind: str, packed: torch.Tensor, widths: list[int], unpad: bool = False) -> dict[str, torch.Tensor]:
    """Packed int32 rows -> the micro-batch dict: long tensors under the schema's batch keys
    (BERT adds float ``masked_lm_weights``, ``min_seqlen`` (0-d int64, its shortest row: a padded model needs no
    attention mask when it is the full width), and with ``unpad`` the keys of :func:`unpadding_index`)."""
    batch = _unpack_rows(kind, packed, widths)
    batch.update(_micro_keys(batch, unpad))
    return batch


def _unpack_rows(kind: str, packed: torch.Tensor, widths: list[int]) -> dict[str, torch.Tensor]:
    """The keys of ``_unpack`` that are one row per sample (any number of micro-batches' rows at once)."""
    schema = h5format.SCHEMAS[kind]
    parts = torch.split(packed.long(), widths, dim=1)
    batch = {
        fld.key(name): (part.reshape(-1) if fld.rank == 1 else part).contiguous()
        for (name, fld), part in zip(schema.items(), parts)
    }
    if "masked_lm_positions" in batch:
        # NVIDIA's reader: predictions run up to the first zero position (position 0 is always [CLS])
        batch["masked_lm_weights"] = torch.cumprod((batch["masked_lm_positions"] != 0).float(), dim=1)
    return batch


def _micro_keys(rows: dict[str, torch.Tensor], unpad: bool) -> dict[str, torch.Tensor]:
    """The keys of ``_unpack`` that describe a whole micro-batch (``rows``: its rows)."""
    if "attention_mask" not in rows:
        return {}
    lengths = (rows["attention_mask"] != 0).sum(1)
    out = {"min_seqlen": lengths.min() if len(lengths) else lengths.new_zeros(())}
    if unpad:
        out.update(unpadding_index(rows["attention_mask"]))
    return out


def _unpack_group(
    kind: str, packed: torch.Tensor, widths: list[int], unpad: bool, micro: int
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """A worker's transfer: the packed rows of consecutive micro-batches of ``micro`` rows -> ``_collate``'s
    form of their ``_unpack`` dicts, the row keys unpacked at once."""
    rows = _unpack_rows(kind, packed, widths)
    n = -(-len(packed) // micro)
    cat, sizes = {}, {}
    for k, v in rows.items():
        cat[k], sizes[k] = v, [len(p) for p in v.split(micro)]
    extra = [
        _micro_keys({k: v.narrow(0, i * micro, min(micro, len(v) - i * micro)) for k, v in rows.items()}, unpad)
        for i in range(n)
    ]
    if extra and extra[0]:
        more, more_sizes = _collate(extra)
        cat.update(more)
        sizes.update(more_sizes)
    return cat, sizes


class _Schedule:
    """The position arithmetic shared by the loader (bookkeeping) and its workers (what to read)."""

    def __init__(self, n: int, micro_batch: int, grad_accum: int, dp_rank: int, dp_world: int, drop_last: bool) -> None:
        self.n, self.mb, self.ga, self.rank, self.world, self.drop_last = (
            n,
            micro_batch,
            grad_accum,
            dp_rank,
            dp_world,
            drop_last,
        )
        self.G = micro_batch * grad_accum * dp_world

    def advance(self, epoch: int, pos: int, micro: int) -> tuple[int, int, int]:
        """The position after one more micro-batch of this rank."""
        micro += 1
        if micro < self.ga:
            return epoch, pos, micro
        pos += self.G
        if (self.drop_last and pos + self.G > self.n) or pos >= self.n:
            return epoch + 1, 0, 0
        return epoch, pos, 0

    def positions(self, pos: int, micro: int) -> np.ndarray:
        """Epoch positions of this rank's micro-batch ``micro`` of the step starting at ``pos``."""
        first = pos + self.rank * self.mb * self.ga + micro * self.mb
        p = first + np.arange(self.mb, dtype=np.int64)
        return p % self.n  # only the last step of an epoch with drop_last=False wraps to its start

    def iterate(self, epoch: int, pos: int, micro: int) -> Iterator[tuple[int, np.ndarray]]:
        while True:
            yield epoch, self.positions(pos, micro)
            epoch, pos, micro = self.advance(epoch, pos, micro)

    def chunks(self, epoch: int, pos: int, micro: int, per_chunk: int) -> Iterator[list[tuple[int, np.ndarray]]]:
        """Groups of ``per_chunk`` consecutive micro-batches (a worker reads and ships one group at a
        time)."""
        it = self.iterate(epoch, pos, micro)
        while True:
            yield [next(it) for _ in range(per_chunk)]


def _outlive_sigterm(signum: int, frame: Any) -> None:  # a signal handler's signature
    signal.alarm(WORKER_GRACE_S)  # SIGALRM's default action ends the process


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_rank(rank_pid: int) -> None:
    """A worker forked by its rank ends when the rank does, however it is stuck: the kernel kills it
    (``PR_SET_PDEATHSIG``) as the thread that forked it ends (the rank's training loop, whose first ``next()``
    on the loader starts the workers). A worker that outlived a rank killed -9 (stuck in a read, stopped,
    deadlocked) held the job's output open and its memory for good. A worker started otherwise (a fork
    server: its parent is not the rank), or whose rank is gone already, keeps the DataLoader's own check."""
    if os.getppid() != rank_pid:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the DataLoader's own check of its parent
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != rank_pid:  # the rank died between the check and the call
        os._exit(0)


def _rank_gone_quietly(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """A worker's ``sys.excepthook``: a lost connection to its rank (killed while it fetched a transfer's
    shared-memory handles, which ``multiprocessing.resource_sharer``'s thread reports through this hook) is
    no error of the worker's: it ends with its rank, without a traceback in the job's output."""
    if not issubclass(kind, (ConnectionError, EOFError)):
        sys.__excepthook__(kind, value, tb)


def _collate(batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Micro-batch dicts -> one tensor per key (concatenated along dim 0; 0-d values stacked) and each
    micro-batch's rows of it (-1: a 0-d value): a worker ships one tensor per key, whatever the number of
    micro-batches (each tensor a transfer costs is a shared-memory file and a connection)."""
    cat, sizes = {}, {}
    for k in batches[0]:
        parts = [b[k] for b in batches]
        cat[k] = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)
        sizes[k] = [-1 if t.dim() == 0 else len(t) for t in parts]
    return cat, sizes


def _uncollate(cat: dict[str, torch.Tensor], sizes: dict[str, list[int]]) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches of ``_collate``, as views of its tensors (pinned where they are)."""
    offsets = dict.fromkeys(cat, 0)
    for i in range(len(next(iter(sizes.values())))):
        batch = {}
        for k, t in cat.items():
            n, at = sizes[k][i], offsets[k]
            batch[k] = t[at] if n < 0 else t.narrow(0, at, n)
            offsets[k] = at + (1 if n < 0 else n)
        yield batch


class _Stream(torch.utils.data.IterableDataset):
    """DataLoader worker side: worker k of K produces groups k, k+K, ... of the schedule's micro-batches,
    unpacked (``unpack``: packed rows -> the micro-batch dict); the DataLoader hands them out round-robin,
    i.e. in schedule order, pinned by its pin-memory thread on accelerators."""

    def __init__(
        self,
        shards: h5format.ShardList,
        order: _Order,
        schedule: _Schedule,
        start: tuple[int, int, int],
        per_chunk: int,
        unpack: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], dict[str, list[int]]]],
        retry: ReadRetry,
    ) -> None:
        super().__init__()
        self.shards, self.order, self.schedule, self.start = shards, order, schedule, start
        self.per_chunk, self.unpack, self.retry = per_chunk, unpack, retry
        self.rank_pid = os.getpid()  # the process whose workers these are

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, list[int]]]]:
        info = torch.utils.data.get_worker_info()
        k, K = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            # A scheduler's SIGTERM reaches the whole process group (scancel, the launcher's tree kill). The
            # worker must outlive it: the rank finishes its step with this worker's data, saves and exits,
            # and the worker is shut down with it. A worker nobody shuts down ends by itself a minute later.
            signal.signal(signal.SIGTERM, _outlive_sigterm)
            sys.excepthook = _rank_gone_quietly
            _die_with_rank(self.rank_pid)
        reader = _Reader(self.shards, self.order, self.retry)
        try:
            for j, chunk in enumerate(self.schedule.chunks(*self.start, self.per_chunk)):
                if j % K == k:
                    yield self.unpack(torch.from_numpy(np.concatenate([reader.read(e, p) for e, p in chunk])))
        finally:
            reader.close()


class PretrainingLoader:
    """Micro-batches of BERT or GPT shards for one data-parallel rank; see the module docstring.

    ``num_workers=0`` reads in the calling process; ``>= 1`` uses that many DataLoader worker processes
    that prefetch. ``unit_rows`` (rows of the unit of order; ``None``: the shards' chunk rows) defines
    the order with ``seed``, so it is part of the resume state. ``require_manifest=False`` reads shards
    without a ``manifest.json`` (made elsewhere), opening every one of them. ``unpad=True`` adds where the
    real tokens are (:func:`unpadding_index`) to BERT micro-batches, for a model that computes only them.
    ``pin_memory=True`` (an accelerator's run) hands out micro-batches in pinned host memory, pinned by the
    DataLoader's thread (or, with ``num_workers=0``, as they are read), so the copy to the device need not wait.
    The workers start at the first ``next()`` and die with the thread that made it (``_die_with_rank``): iterate
    from a thread that lives as long as the iteration (the training loop's).
    """

    def __init__(
        self,
        path: str | Path,
        kind: str,
        *,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_world: int,
        seed: int = 1234,
        num_workers: int = 1,
        expect: dict | None = None,
        drop_last: bool = True,
        unit_rows: int | None = None,
        prefetch_factor: int = 4,
        require_manifest: bool = True,
        unpad: bool = False,
        pin_memory: bool = False,
        read_retry: ReadRetry | None = None,
    ) -> None:
        _check_ranks(dp_rank, dp_world, micro_batch=micro_batch, grad_accum=grad_accum, unit_rows=unit_rows or 1)
        self.pin_memory = pin_memory
        self.read_retry = read_retry or ReadRetry()
        self.kind = kind
        self.shards = _open_shards(path, kind, expect, require_manifest, (dp_rank, dp_world))
        self.files, self.counts, self._attrs = self.shards.files, self.shards.counts, self.shards.attrs
        self._widths = _widths(kind, self._attrs)
        self.unpad = unpad
        self.micro_batch, self.grad_accum, self.dp_rank, self.dp_world = (
            micro_batch,
            grad_accum,
            dp_rank,
            dp_world,
        )
        self.seed, self.num_workers, self.drop_last, self.prefetch_factor = (
            seed,
            num_workers,
            drop_last,
            prefetch_factor,
        )
        self.unit_rows = int(unit_rows or self.shards.chunk_rows or h5format.UNIT_ROWS[kind])
        self.order = _Order(self.counts, self.unit_rows, seed)
        n = self.order.num_samples
        self.schedule = _Schedule(n, micro_batch, grad_accum, dp_rank, dp_world, drop_last)
        if n == 0:
            raise UserError(f"{self.shards.where}: the shards hold no samples")
        if drop_last and n < self.schedule.G:
            raise UserError(
                f"{self.shards.where}: {n} samples, fewer than one global batch of {self.schedule.G}"
                f" (micro_batch {micro_batch} x grad_accum {grad_accum} x dp_world {dp_world})"
            )
        slice_rows = micro_batch * grad_accum
        if slice_rows % self.unit_rows and slice_rows < 16 * self.unit_rows:
            worst = (slice_rows + 2 * self.unit_rows) / slice_rows
            log.info(
                f"loader: a rank's share of a step ({slice_rows} rows) is not whole units of "
                f"{self.unit_rows} rows: it decodes up to {worst:.1f}x the rows it uses"
            )
        self.epoch, self.pos, self.micro = 0, 0, 0
        self.global_samples = 0  # consumed over all epochs (whole steps)
        self._reader: _Reader | None = None

    # ----------------------------------------------------------------- info
    @property
    def samples_per_epoch(self) -> int:
        return self.order.num_samples

    @property
    def steps_per_epoch(self) -> int:
        n, G = self.order.num_samples, self.schedule.G
        return n // G if self.drop_last else -(-n // G)

    @property
    def global_batch(self) -> int:
        return self.schedule.G

    @property
    def attrs(self) -> dict:
        return dict(self._attrs)

    @property
    def buffer_samples(self) -> int:
        """Upper bound on rows a reader holds (the units of two micro-batches), independent of shard sizes."""
        return 2 * (self.micro_batch + 2 * self.unit_rows)

    @property
    def peak_buffered_samples(self) -> int:
        """Rows the in-process reader (``num_workers=0``) held at most so far."""
        return self._reader.peak_buffered if self._reader else 0

    @property
    def read_stats(self) -> ReadStats:
        """Rows decoded and handed out by the in-process reader (``num_workers=0``) so far."""
        return self._reader.stats if self._reader else ReadStats()

    def _per_chunk(self) -> int:
        """Micro-batches a worker ships at once: about CHUNK_ROWS rows, and whole units where a rank's
        share of a step is whole units (two workers never decode the same unit)."""
        per_unit = self.unit_rows // math.gcd(self.unit_rows, self.micro_batch)
        return max(1, CHUNK_ROWS // (self.micro_batch * per_unit)) * per_unit

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start = (self.epoch, self.pos, self.micro)
        if self.num_workers <= 0:
            if self._reader is None:
                self._reader = _Reader(self.shards, self.order, self.read_retry)
            for epoch, positions in self.schedule.iterate(*start):
                batch = self._unpack(torch.from_numpy(self._reader.read(epoch, positions)))
                self._consumed()
                yield batch
        else:
            # workers ship several micro-batches per transfer (the per-transfer cost dominates small batches),
            # unpacked there; the DataLoader's own thread pins them on accelerators (``pin_memory``)
            unpack = functools.partial(
                _unpack_group, self.kind, widths=self._widths, unpad=self.unpad, micro=self.micro_batch
            )
            stream = _Stream(self.shards, self.order, self.schedule, start, self._per_chunk(), unpack, self.read_retry)
            dl = torch.utils.data.DataLoader(
                stream,
                batch_size=None,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                pin_memory=self.pin_memory,
            )
            try:
                for cat, sizes in dl:
                    for batch in _uncollate(cat, sizes):
                        self._consumed()
                        yield batch
            except ShardReadError as e:  # from a worker: torch re-raised it with the worker's traceback as text
                raise type(e)(e.one_line()) from None

    def _unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = _unpack(self.kind, packed, self._widths, self.unpad)
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def _consumed(self) -> None:
        e, p, m = self.schedule.advance(self.epoch, self.pos, self.micro)
        if m == 0:
            self.global_samples += self.schedule.G
        self.epoch, self.pos, self.micro = e, p, m

    # --------------------------------------------------------------- resume
    def _fingerprint(self) -> list[list]:
        return [[f.name, n] for f, n in zip(self.files, self.counts)]

    def state_dict(self) -> dict:
        """The exact resume point in global samples, plus what defines the order."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "kind": self.kind,
            "seed": self.seed,
            "epoch": self.epoch,
            "samples_in_epoch": self.pos,
            "micro_in_step": self.micro,
            "global_samples": self.global_samples,
            "global_batch": self.schedule.G,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "dp_world": self.dp_world,
            "drop_last": self.drop_last,
            "order": ORDER,
            "unit_rows": self.unit_rows,
            "num_samples": self.order.num_samples,
            "data_id": self.shards.data_id,
            "data": self.shards.where,
            "shards": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved sample position; refuses what would change the sample order.

        A different dp_world / micro_batch / grad_accum is fine at a step boundary: the global sequence
        is the same and the run continues at the same global sample. If the global batch changed, the
        step boundaries shift from that sample on (logged).
        """
        if state.get("format") != STATE_FORMAT:
            raise UserError(f"loader state: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        version = int(state.get("version", 0))
        if version > STATE_VERSION:
            raise UserError(f"loader state: version {version} is newer than this code ({STATE_VERSION})")
        if version < STATE_VERSION:
            raise UserError(
                f"loader state: version {version} (the block/window order of shard format 1) cannot be "
                f"continued by this loader (version {STATE_VERSION}, unit order): resume with the release "
                "that wrote the checkpoint, or start a new run"
            )
        if state.get("data_id") != self.shards.data_id:
            raise UserError(
                f"loader state: the checkpoint was taken on another data set ({state.get('data')}, id "
                f"{str(state.get('data_id'))[:12]}) than {self.shards.where} (id "
                f"{self.shards.data_id[:12]}); resume on the same shards and manifest, or start a new run"
            )
        for key, mine in (
            ("kind", self.kind),
            ("seed", self.seed),
            ("order", ORDER),
            ("unit_rows", self.unit_rows),
            ("num_samples", self.order.num_samples),
            ("drop_last", self.drop_last),
        ):
            if state.get(key) != mine:
                raise UserError(
                    f"loader state: {key}={state.get(key)!r} but this "
                    f"loader has {mine!r}; the sample order would differ"
                )
        if [list(x) for x in state.get("shards", [])] != self._fingerprint():
            raise UserError("loader state: the shard files or their sample counts differ from the checkpoint's")
        micro = int(state["micro_in_step"])
        same_layout = (state["micro_batch"], state["grad_accum"], state["dp_world"]) == (
            self.micro_batch,
            self.grad_accum,
            self.dp_world,
        )
        if micro and not same_layout:
            raise UserError(
                f"loader state: saved in the middle of a step (micro-batch {micro}); resuming with a "
                "different micro_batch/grad_accum/dp_world needs a checkpoint taken at a step boundary"
            )
        if state["global_batch"] != self.schedule.G:
            log.warning(
                f"loader: global batch changed from {state['global_batch']} to {self.schedule.G}; continuing "
                f"at sample {state['samples_in_epoch']} of epoch {state['epoch']}, step boundaries shift"
            )
        pos = int(state["samples_in_epoch"])
        epoch = int(state["epoch"])
        if pos and (
            (self.drop_last and pos + self.schedule.G > self.order.num_samples) or pos >= self.order.num_samples
        ):
            epoch, pos = epoch + 1, 0
        self.epoch, self.pos, self.micro = epoch, pos, micro
        self.global_samples = int(state["global_samples"])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class EvalSet:
    """A fixed held-out evaluation set: this rank's share of the first ``n`` samples of the shards.

    The n samples are the first in storage order (shards in manifest or name order, rows in file
    order), so they are the same at every evaluation and for every world size, and evaluating never
    moves the training loader. Rank r of W holds the contiguous samples ``[r*n//W, (r+1)*n//W)``
    (the shares differ by at most one sample) and yields them, once per ``iter()``, as ``len(self)``
    micro-batches of at most ``micro_batch`` rows, dicts like :class:`PretrainingLoader` yields (``unpad``
    as there).

    Every rank yields the same number of micro-batches (ZeRO-3 needs every rank in every forward),
    but micro-batches may hold fewer rows than ``micro_batch`` and differ by one row between ranks.
    So weight by samples, not by batches: sum ``loss * rows`` (or the model's token / prediction
    counts) over the micro-batches, all-reduce the sums and the counts, and divide; the result is the
    mean over exactly the n samples, whatever the world size. Refused (``UserError``) when the shards
    hold fewer than n samples, or when the ranks cannot get equal batch counts (n < dp_world, or
    micro_batch 1 with n not a multiple of dp_world).

    The rank's share is read on the first iteration and kept (packed int32 rows) for the next ones.
    """

    def __init__(
        self,
        path: str | Path,
        kind: str,
        n: int,
        *,
        micro_batch: int,
        dp_rank: int,
        dp_world: int,
        expect: dict | None = None,
        require_manifest: bool = True,
        unpad: bool = False,
        read_retry: ReadRetry | None = None,
    ) -> None:
        _check_ranks(dp_rank, dp_world, micro_batch=micro_batch, n=n)
        self.kind, self.unpad, self.read_retry = kind, unpad, read_retry or ReadRetry()
        self.shards = _open_shards(path, kind, expect, require_manifest, None)
        self.files, self.counts, self._attrs = self.shards.files, self.shards.counts, self.shards.attrs
        self._widths = _widths(kind, self._attrs)
        if n > sum(self.counts):
            raise UserError(
                f"{self.shards.where}: {sum(self.counts)} samples, fewer than the {n} evaluation samples asked for"
            )
        self.n, self.micro_batch, self.dp_rank, self.dp_world = n, micro_batch, dp_rank, dp_world
        self.start, self.stop = dp_rank * n // dp_world, (dp_rank + 1) * n // dp_world
        largest = -(-n // dp_world)
        self.num_batches = -(-largest // micro_batch)
        if n // dp_world < self.num_batches:  # the smallest share cannot fill as many micro-batches
            raise UserError(
                f"{path}: {n} evaluation samples over dp_world={dp_world} in micro-batches of {micro_batch}:"
                f" the ranks would run different numbers of forward passes; use a multiple of {dp_world}"
            )
        self._packed: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        """Samples of this rank's share."""
        return self.stop - self.start

    @property
    def attrs(self) -> dict:
        return dict(self._attrs)

    def __len__(self) -> int:
        return self.num_batches

    def _read(self) -> np.ndarray:
        """This rank's share, packed like the training loader's micro-batches."""
        pieces: list[np.ndarray] = []
        outage = reads.Outage()
        first = 0  # global index of the current shard's first sample
        for i, count in enumerate(self.counts):
            a, z = max(self.start, first) - first, min(self.stop, first + count) - first
            if a < z:
                pieces.append(
                    reads.read(
                        functools.partial(self._rows, i, a, z),
                        self.files[i],
                        (a, z),
                        self.shards.entries[i].file_bytes,
                        self.read_retry,
                        outage=outage,
                    )
                )
            first += count
        return np.concatenate(pieces)

    def _rows(self, i: int, a: int, z: int) -> np.ndarray:
        with h5py.File(self.files[i], "r") as f:  # an OSError is classified and retried by reads.read
            try:
                h5format.check_shard(self.shards, i)  # opens it again: a failure there may be transient too
            except UserError as e:
                entry = self.shards.entries[i]
                if reads.is_transient(e, entry.path, entry.file_bytes):  # errno read from the message
                    raise OSError(str(e)) from None
                raise ShardDamaged(str(e)) from None
            return _pack([f[name][a:z] for name in h5format.SCHEMAS[self.kind]])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._packed is None:
            self._packed = self._read()
        for rows in np.array_split(np.arange(self.num_samples), self.num_batches):
            packed = torch.from_numpy(self._packed[rows[0] : rows[-1] + 1])
            yield _unpack(self.kind, packed, self._widths, self.unpad)


__all__ = ["EvalSet", "PretrainingLoader", "ReadStats", "unpadding_index"]
