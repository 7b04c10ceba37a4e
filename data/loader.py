"""Distributed, exactly resumable loaders for the BERT and GPT HDF5 shards.

Order. Per epoch, a deterministic shuffle (from ``seed`` and the epoch) defines one global sequence of
all samples: the shards are cut into blocks of ``block_size`` consecutive rows, the blocks are
permuted, consecutive groups of ``window_blocks`` blocks form windows, and the samples inside each
window are permuted. Optimizer step k consumes global positions [k*G, (k+1)*G) of that sequence,
G = micro_batch * grad_accum * dp_world; rank r takes the contiguous slice
[r*micro_batch*grad_accum, (r+1)*micro_batch*grad_accum) of it, micro-batch m the m-th micro_batch of
that slice. So the samples of a step do not depend on how many ranks share it, and the resume point
(epoch, position in the epoch) is a count of global samples that any world size can continue from.

Memory. Blocks are read with one contiguous HDF5 read each; a reader holds at most two windows
(``buffer_samples`` rows), whatever the shard sizes. The block permutation is metadata (one integer
per block).

Iteration. ``iter(loader)`` yields micro-batches forever, epoch after epoch, starting at the current
position; ``state_dict()`` is the position after the last micro-batch handed out, so batches that
prefetching workers produced but the trainer never received do not count.

Evaluation. ``EvalSet`` is a fixed held-out set (the first n samples of the eval shards, split over
the ranks), the same at every evaluation and for every world size.

Fields. The datasets, their order in a packed row, their widths and their keys in a micro-batch all
come from ``data.h5format``'s schema.
"""

from __future__ import annotations

import signal
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from common.errors import UserError
from common.log import get_logger
from data import h5format

log = get_logger("data.loader")

STATE_FORMAT = "wikipretrain-loader"
STATE_VERSION = 1
TARGET_BLOCK_BYTES = 1 << 20
CHUNK_ROWS = 512  # rows a worker ships per transfer (rounded to whole micro-batches)
WORKER_GRACE_S = 60  # how long a DataLoader worker outlives a SIGTERM (the launcher kills at 30 s)
_CONSISTENT_KEYS = {
    "bert": ("seq_len", "max_pred", "vocab_sha256", "vocab_size", "lowercase", "format_version"),
    "gpt": ("seq_len", "tokenizer_sha256", "vocab_size", "eod_id", "format_version"),
}
_warned_missing_attrs = False


def _open_shards(
    path: str | Path, kind: str, expect: dict | None
) -> tuple[list[Path], list[int], dict[str, Any]]:
    """Resolve and check the shards: (files, samples per file, the attributes they share)."""
    global _warned_missing_attrs
    if kind not in h5format.SCHEMAS:
        raise UserError(f"loader kind {kind!r}: expected 'bert' or 'gpt'")
    files = h5format.resolve_shards(path)
    infos = [h5format.inspect_shard(f, kind) for f in files]
    for info in infos:
        h5format.check_expect(info.attrs, expect, str(info.path))
    missing = [i.path.name for i in infos if not i.has_attrs]
    if missing and not _warned_missing_attrs:
        _warned_missing_attrs = True
        log.warning(
            "%d shard(s) (e.g. %s) carry no attributes (NVIDIA-made?): seq_len/max_pred inferred from "
            "shapes, vocabulary unknown and not checked",
            len(missing),
            missing[0],
        )
    attrs = h5format.check_consistent(infos, _CONSISTENT_KEYS[kind])
    return files, [i.num_samples for i in infos], attrs


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


def _auto_block_size(kind: str, attrs: dict[str, Any]) -> int:
    """About 1 MiB of rows per block (a power of two between 16 and 1024)."""
    fields = h5format.SCHEMAS[kind].values()
    row_bytes = sum(w * np.dtype(f.dtype).itemsize for w, f in zip(_widths(kind, attrs), fields))
    b = 1024
    while b > 16 and b * row_bytes > TARGET_BLOCK_BYTES:
        b //= 2
    return b


class _Index:
    """Shards -> blocks -> per-epoch global order; pure functions of (shards, seed, block size, window)."""

    def __init__(self, counts: list[int], block_size: int, window_blocks: int, seed: int) -> None:
        self.block_size, self.window_blocks, self.seed = block_size, window_blocks, seed
        shard, start, length = [], [], []
        for s, n in enumerate(counts):
            for b in range(0, n, block_size):
                shard.append(s)
                start.append(b)
                length.append(min(block_size, n - b))
        self.block_shard = np.asarray(shard, dtype=np.int64)
        self.block_start = np.asarray(start, dtype=np.int64)
        self.block_len = np.asarray(length, dtype=np.int64)
        self.num_samples = int(sum(counts))
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._window_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order, window start positions with a final total) for an epoch."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 0])))
            order = rng.permutation(len(self.block_len))
            lens = self.block_len[order]
            starts = np.concatenate([[0], np.cumsum(lens)])[:: self.window_blocks]
            win_start = (
                np.concatenate([starts, [self.num_samples]]) if starts[-1] != self.num_samples else starts
            )
            self._epoch_cache = (epoch, order, win_start)
        return self._epoch_cache[1], self._epoch_cache[2]

    def window_perm(self, epoch: int, w: int, size: int) -> np.ndarray:
        key = (epoch, w)
        perm = self._window_cache.get(key)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 1, w])))
            perm = rng.permutation(size)
            self._window_cache[key] = perm
            while len(self._window_cache) > 2:
                self._window_cache.popitem(last=False)
        return perm

    def locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Epoch positions -> (window index, row inside the window's concatenated blocks)."""
        _, win_start = self.epoch_layout(epoch)
        w = np.searchsorted(win_start, positions, side="right") - 1
        rows = np.empty(len(positions), dtype=np.int64)
        for wi in np.unique(w):
            sel = w == wi
            size = int(win_start[wi + 1] - win_start[wi])
            rows[sel] = self.window_perm(epoch, int(wi), size)[positions[sel] - win_start[wi]]
        return w, rows

    def window_blocks_of(self, epoch: int, w: int) -> np.ndarray:
        order, _ = self.epoch_layout(epoch)
        return order[w * self.window_blocks : (w + 1) * self.window_blocks]


class _Reader:
    """Reads whole windows (contiguous block reads) and gathers micro-batches; holds at most two windows."""

    def __init__(self, files: list[Path], kind: str, index: _Index) -> None:
        self.files, self.kind, self.index = files, kind, index
        self.names = list(h5format.SCHEMAS[kind])  # packing order of a micro-batch row (see _unpack)
        self.windows: OrderedDict[tuple[int, int], dict[str, np.ndarray]] = OrderedDict()
        self.handles: OrderedDict[int, h5py.File] = OrderedDict()
        self.peak_buffered = 0

    def _file(self, s: int) -> h5py.File:
        f = self.handles.get(s)
        if f is None:
            f = h5py.File(self.files[s], "r")
            self.handles[s] = f
            while len(self.handles) > 64:
                self.handles.popitem(last=False)[1].close()
        else:
            self.handles.move_to_end(s)
        return f

    def _window(self, epoch: int, w: int) -> dict[str, np.ndarray]:
        key = (epoch, w)
        buf = self.windows.get(key)
        if buf is not None:
            return buf
        idx = self.index
        parts: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
        for b in idx.window_blocks_of(epoch, w):
            f = self._file(int(idx.block_shard[b]))
            a, z = int(idx.block_start[b]), int(idx.block_start[b] + idx.block_len[b])
            for n in self.names:
                parts[n].append(f[n][a:z])
        buf = {n: np.concatenate(v) for n, v in parts.items()}
        self.windows[key] = buf
        while len(self.windows) > 2:
            self.windows.popitem(last=False)
        self.peak_buffered = max(self.peak_buffered, sum(len(v["input_ids"]) for v in self.windows.values()))
        return buf

    def read(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """One micro-batch packed as a single int32 array [B, sum of field widths] (one transfer, one
        copy)."""
        w, rows = self.index.locate(epoch, positions)
        out: np.ndarray | None = None
        for wi in np.unique(w):
            buf = self._window(epoch, int(wi))
            sel = w == wi
            part = _pack([buf[n][rows[sel]] for n in self.names])
            if out is None:
                out = np.empty((len(positions), part.shape[1]), dtype=np.int32)
            out[sel] = part
        assert out is not None
        return out

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()
        self.windows.clear()


def _pack(fields: list[np.ndarray]) -> np.ndarray:
    """The datasets' rows (schema order) side by side as one int32 array: one transfer, one copy."""
    return np.concatenate([a.reshape(len(a), -1) for a in fields], axis=1).astype(np.int32, copy=False)


def _unpack(kind: str, packed: torch.Tensor, widths: list[int]) -> dict[str, torch.Tensor]:
    """Packed int32 rows -> the micro-batch dict: long tensors under the schema's batch keys
    (BERT adds float ``masked_lm_weights``)."""
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


class _Schedule:
    """The position arithmetic shared by the loader (bookkeeping) and its workers (what to read)."""

    def __init__(
        self, n: int, micro_batch: int, grad_accum: int, dp_rank: int, dp_world: int, drop_last: bool
    ) -> None:
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

    def chunks(
        self, epoch: int, pos: int, micro: int, per_chunk: int
    ) -> Iterator[list[tuple[int, np.ndarray]]]:
        """Groups of ``per_chunk`` consecutive micro-batches (a worker reads and ships one group at a
        time)."""
        it = self.iterate(epoch, pos, micro)
        while True:
            yield [next(it) for _ in range(per_chunk)]


def _outlive_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001
    signal.alarm(WORKER_GRACE_S)  # SIGALRM's default action ends the process


class _Stream(torch.utils.data.IterableDataset):
    """DataLoader worker side: worker k of K produces micro-batches k, k+K, ... of the schedule; the
    DataLoader hands them out round-robin, i.e. in schedule order."""

    def __init__(
        self,
        files: list[Path],
        kind: str,
        index: _Index,
        schedule: _Schedule,
        start: tuple[int, int, int],
        per_chunk: int,
    ) -> None:
        super().__init__()
        self.files, self.kind, self.index, self.schedule, self.start = files, kind, index, schedule, start
        self.per_chunk = per_chunk

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        k, K = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            # A scheduler's SIGTERM reaches the whole process group (scancel, the launcher's tree kill). The
            # worker must outlive it: the rank finishes its step with this worker's data, saves and exits,
            # and the worker is shut down with it. A worker nobody shuts down ends by itself a minute later.
            signal.signal(signal.SIGTERM, _outlive_sigterm)
        reader = _Reader(self.files, self.kind, self.index)
        try:
            for j, chunk in enumerate(self.schedule.chunks(*self.start, self.per_chunk)):
                if j % K == k:
                    yield torch.from_numpy(np.concatenate([reader.read(e, p) for e, p in chunk]))
        finally:
            reader.close()


class PretrainingLoader:
    """Micro-batches of BERT or GPT shards for one data-parallel rank; see the module docstring.

    ``num_workers=0`` reads in the calling process; ``>= 1`` uses that many DataLoader worker processes
    that prefetch. ``block_size`` (rows per contiguous read; ``None``: about 1 MiB) and ``window_blocks``
    (blocks shuffled together) define the order, so they are part of the resume state.
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
        block_size: int | None = None,
        window_blocks: int = 16,
        prefetch_factor: int = 4,
    ) -> None:
        _check_ranks(
            dp_rank, dp_world, micro_batch=micro_batch, grad_accum=grad_accum, window_blocks=window_blocks
        )
        self.kind = kind
        self.files, self.counts, self._attrs = _open_shards(path, kind, expect)
        self._widths = _widths(kind, self._attrs)
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
        self.block_size = int(block_size or _auto_block_size(kind, self._attrs))
        self.window_blocks = window_blocks
        self.index = _Index(self.counts, self.block_size, window_blocks, seed)
        self.schedule = _Schedule(
            self.index.num_samples, micro_batch, grad_accum, dp_rank, dp_world, drop_last
        )
        if self.index.num_samples == 0:
            raise UserError(f"{path}: the shards hold no samples")
        if drop_last and self.index.num_samples < self.schedule.G:
            raise UserError(
                f"{path}: {self.index.num_samples} samples, fewer than one global batch of {self.schedule.G}"
                f" (micro_batch {micro_batch} x grad_accum {grad_accum} x dp_world {dp_world})"
            )
        self.epoch, self.pos, self.micro = 0, 0, 0
        self.global_samples = 0  # consumed over all epochs (whole steps)
        self._reader: _Reader | None = None

    # ----------------------------------------------------------------- info
    @property
    def samples_per_epoch(self) -> int:
        return self.index.num_samples

    @property
    def steps_per_epoch(self) -> int:
        n, G = self.index.num_samples, self.schedule.G
        return n // G if self.drop_last else -(-n // G)

    @property
    def global_batch(self) -> int:
        return self.schedule.G

    @property
    def attrs(self) -> dict:
        return dict(self._attrs)

    @property
    def buffer_samples(self) -> int:
        """Upper bound on rows a reader holds (two windows), independent of shard sizes."""
        return 2 * self.window_blocks * self.block_size

    @property
    def peak_buffered_samples(self) -> int:
        """Rows the in-process reader (``num_workers=0``) held at most so far."""
        return self._reader.peak_buffered if self._reader else 0

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start = (self.epoch, self.pos, self.micro)
        if self.num_workers <= 0:
            if self._reader is None:
                self._reader = _Reader(self.files, self.kind, self.index)
            for epoch, positions in self.schedule.iterate(*start):
                batch = self._unpack(torch.from_numpy(self._reader.read(epoch, positions)))
                self._consumed()
                yield batch
        else:
            # workers ship several micro-batches per transfer: the per-transfer cost dominates small batches
            per_chunk = max(1, CHUNK_ROWS // self.micro_batch)
            dl = torch.utils.data.DataLoader(
                _Stream(self.files, self.kind, self.index, self.schedule, start, per_chunk),
                batch_size=None,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
            )
            for packed in dl:
                for micro in torch.split(packed, self.micro_batch):
                    batch = self._unpack(micro)
                    self._consumed()
                    yield batch

    def _unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        return _unpack(self.kind, packed, self._widths)

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
            "block_size": self.block_size,
            "window_blocks": self.window_blocks,
            "num_samples": self.index.num_samples,
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
        if int(state.get("version", 0)) > STATE_VERSION:
            raise UserError(
                f"loader state: version {state['version']} is newer than this code ({STATE_VERSION})"
            )
        for key, mine in (
            ("kind", self.kind),
            ("seed", self.seed),
            ("block_size", self.block_size),
            ("window_blocks", self.window_blocks),
            ("num_samples", self.index.num_samples),
            ("drop_last", self.drop_last),
        ):
            if state.get(key) != mine:
                raise UserError(
                    f"loader state: {key}={state.get(key)!r} but this "
                    f"loader has {mine!r}; the sample order would differ"
                )
        if [list(x) for x in state.get("shards", [])] != self._fingerprint():
            raise UserError(
                "loader state: the shard files or their sample counts differ from the checkpoint's"
            )
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
                "loader: global batch changed from %d to %d; continuing "
                "at sample %d of epoch %d, step boundaries shift",
                state["global_batch"],
                self.schedule.G,
                state["samples_in_epoch"],
                state["epoch"],
            )
        pos = int(state["samples_in_epoch"])
        epoch = int(state["epoch"])
        if pos and (
            (self.drop_last and pos + self.schedule.G > self.index.num_samples)
            or pos >= self.index.num_samples
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
    micro-batches of at most ``micro_batch`` rows, dicts like :class:`PretrainingLoader` yields.

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
    ) -> None:
        _check_ranks(dp_rank, dp_world, micro_batch=micro_batch, n=n)
        self.kind = kind
        self.files, self.counts, self._attrs = _open_shards(path, kind, expect)
        self._widths = _widths(kind, self._attrs)
        if n > sum(self.counts):
            raise UserError(
                f"{path}: {sum(self.counts)} samples, fewer than the {n} evaluation samples asked for"
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
        names = list(h5format.SCHEMAS[self.kind])
        pieces: list[np.ndarray] = []
        first = 0  # global index of the current shard's first sample
        for file, count in zip(self.files, self.counts):
            a, z = max(self.start, first) - first, min(self.stop, first + count) - first
            if a < z:
                with h5py.File(file, "r") as f:
                    pieces.append(_pack([f[name][a:z] for name in names]))
            first += count
        return np.concatenate(pieces)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._packed is None:
            self._packed = self._read()
        for rows in np.array_split(np.arange(self.num_samples), self.num_batches):
            yield _unpack(self.kind, torch.from_numpy(self._packed[rows[0] : rows[-1] + 1]), self._widths)


def make_loader(path: str | Path, kind: str, **kwargs: Any) -> PretrainingLoader:
    """Convenience: ``kind`` may also be inferred from the shards' ``format`` attribute (``kind="auto"``)."""
    if kind == "auto":
        first = h5format.resolve_shards(path)[0]
        with h5py.File(first, "r") as f:
            fmt = f.attrs.get("format", "")
            fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
            kind = "gpt" if fmt == h5format.GPT_FORMAT or "masked_lm_positions" not in f else "bert"
    return PretrainingLoader(path, kind, **kwargs)


__all__ = ["EvalSet", "PretrainingLoader", "make_loader"]
