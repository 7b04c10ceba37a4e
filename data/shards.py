"""The scaffold shared by the shard writers (``data.bert``, ``data.gpt``): output directory, worker
pool, manifest, summary and command line.

A writer turns each input shard into one output file with a job function that depends only on its
arguments, so the output does not depend on the number of workers. ``run_shard_jobs`` runs the jobs
inline (one worker) or in spawned processes, keeping at most ``workers`` jobs queued beyond the
running ones (a job may carry its documents). ``ShardDir`` follows ``common.outdir``'s rule: the new
shards are written into a temporary directory inside ``out`` and moved into place only when the whole
run succeeded, so a failed run (or a refused one) leaves the previous output as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from common.outdir import prepare_out_dir, remove_stale
from data import h5format
from data.formats import LOADED, load_formats


@dataclass(frozen=True)
class ShardJob:
    """One output shard: the job function's arguments and its share of the progress bar."""

    args: tuple[Any, ...]
    weight: int = 1


def _run_job(fn: Callable[..., dict[str, Any]], tok_threads: int, args: tuple[Any, ...]) -> dict[str, Any]:
    """Worker-process entry: share the cores among the workers' Rust tokenizer thread pools."""
    if tok_threads:
        os.environ.setdefault("RAYON_RS_NUM_CPUS", str(tok_threads))
    return fn(*args)


def run_shard_jobs(
    fn: Callable[..., dict[str, Any]],
    jobs: Iterable[ShardJob],
    *,
    workers: int,
    desc: str,
    unit: str = "shard",
    total: int | None = None,
    progress: bool | None = False,
) -> list[dict[str, Any]]:
    """Run ``fn(*job.args)`` for every job; return the results (dicts with an ``index``) sorted by index.

    ``jobs`` may be a generator: it is consumed as workers free up. ``progress``: True shows a bar,
    False hides it, None shows it only on a terminal. Errors propagate (``ShardDir`` cleans up).
    """
    bar = tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=desc,
        disable=None if progress is None else not progress,
    )
    results: list[dict[str, Any]] = []
    try:
        if workers <= 1:
            for job in jobs:
                results.append(fn(*job.args))
                bar.update(job.weight)
        else:
            tok_threads = max(1, (os.cpu_count() or 1) // workers)
            # a spawned worker imports the package afresh: it registers, once, the shard formats from outside the
            # package that this process registered
            spawn, plugins = get_context("spawn"), (list(LOADED),)
            with ProcessPoolExecutor(workers, mp_context=spawn, initializer=load_formats, initargs=plugins) as ex:
                pending: dict[Future, int] = {}

                def collect(futures: Iterable[Future]) -> None:
                    for fut in futures:
                        results.append(fut.result())
                        bar.update(pending.pop(fut))

                for job in jobs:
                    pending[ex.submit(_run_job, fn, tok_threads, job.args)] = job.weight
                    if len(pending) > workers:  # bound the queued jobs' memory
                        collect(wait(pending, return_when=FIRST_COMPLETED).done)
                collect(list(pending))
    finally:
        bar.close()
    return sorted(results, key=lambda r: r["index"])


class ShardDir:
    """The output directory of one shard-writing run, used as ``with ShardDir(out, kind, overwrite)``.

    Entering refuses a non-empty ``out`` unless ``overwrite`` (``common.outdir.prepare_out_dir``);
    shards are written to :meth:`path` in a staging directory; :meth:`commit` moves them into place,
    writes the manifest and removes the previous run's shards that this run did not write. Leaving
    the block without a commit (an error) removes the staging directory, and ``out`` if it was created.
    """

    def __init__(self, out: str | os.PathLike, kind: str, overwrite: bool) -> None:
        self.out, self.kind, self.overwrite = Path(out), kind, overwrite
        self.is_output = re.compile(rf"^{kind}-\d{{5}}\.h5$").match
        self.stage = self.out

    def __enter__(self) -> ShardDir:
        self.created = prepare_out_dir(self.out, self.overwrite)
        # named like common.atomic's temporaries: the next run removes it if this one is killed
        self.stage = Path(tempfile.mkdtemp(prefix=f".{self.kind}-", suffix=".tmp", dir=self.out))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.stage != self.out:
            shutil.rmtree(self.stage, ignore_errors=True)
            self.stage = self.out
            if self.created:
                with contextlib.suppress(OSError):
                    self.out.rmdir()  # only when empty

    def path(self, index: int) -> Path:
        return self.stage / f"{self.kind}-{index:05d}.h5"

    def commit(
        self, results: list[dict[str, Any]], settings: dict[str, Any], t0: float, *, rates: tuple[str, ...]
    ) -> dict[str, Any]:
        """Put the run in place; return its summary: ``out``, ``shards``, the totals of the shard
        records, ``seconds`` since ``t0`` and ``<total>_per_s`` for each name in ``rates``."""
        (self.out / h5format.MANIFEST).unlink(missing_ok=True)  # invalid from here until the new one
        for r in results:
            os.replace(self.stage / r["file"], self.out / r["file"])
        totals = h5format.write_manifest(self.out, self.kind, results, settings)
        remove_stale(self.out, [r["file"] for r in results], self.is_output)
        self.stage.rmdir()
        self.stage = self.out
        secs = max(time.perf_counter() - t0, 1e-9)
        summary: dict[str, Any] = {"out": str(self.out), "shards": len(results), **totals}
        summary["seconds"] = round(secs, 2)
        summary.update({f"{k}_per_s": round(totals[k] / secs, 1) for k in rates})
        return summary


def run_from_args(fn: Callable[..., dict[str, Any]], report: str, args: argparse.Namespace) -> int:
    """A writer's CLI: call ``fn`` with the parsed flags named like its parameters, print
    ``report.format(**summary)``.

    ``--no-progress`` becomes ``progress=False``; without it ``progress=None`` (a bar only on a terminal).
    """
    params = inspect.signature(fn).parameters
    kwargs = {name: getattr(args, name) for name in params if hasattr(args, name)}
    if "progress" in params:
        kwargs["progress"] = False if getattr(args, "no_progress", False) else None
    print(report.format(**fn(**kwargs)), flush=True)
    return 0
