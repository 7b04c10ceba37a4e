"""The loader at many ranks, beside mosaicml-streaming on the same samples, in the same run.

    python benchmarks/bench_loader.py --world-sizes 1,128,1024              # BERT seq 128, batch 65,536
    python benchmarks/bench_loader.py --kind gpt --world-sizes 1,64,512     # GPT seq 2048, batch 1,536
    python benchmarks/bench_loader.py --tiny --world-sizes 2 --steps 1 --seconds 0.5 --startup-shards 8

Per simulated world size W (one data-parallel rank of W, in its own process; the others are not run
because a rank's reads do not depend on them):

- rows decoded per row used: every rank of W runs ``--steps`` steps in-process and counts the HDF5 rows it
  decompresses, each chunk a read touches counted whole (``PretrainingLoader.read_stats``); the worst rank
  is printed. Streaming reads uncompressed MDS samples (its default: no compression), so it decodes only
  what it uses: printed as 1.00.
- samples/s per rank from one worker: the last rank of W, its loader with one DataLoader worker process,
  micro-batches taken for ``--seconds`` after the first.
- start-up: construction to the first micro-batch; peak RSS: the process's plus its worker's (VmHWM).

The peer: ``streaming.StreamingDataset`` over the same samples written with ``MDSWriter`` (local shards,
default shard size, no compression), configured as its documentation recommends: ``local=`` the
directory, ``batch_size=`` the micro-batch, its default shuffle (``py1e``) and canonical nodes, under a
torch DataLoader with one worker. Each simulated rank is one node of W (``WORLD_SIZE``/``RANK``, one rank
per node), which is how streaming partitions samples over nodes; a one-member gloo group stands in for the
other ranks in streaming's one barrier.

``--startup-shards N`` also times loader start-up over N shards (links to one shard, listed in a
manifest) on rank 0 of ``max(world sizes)`` ranks, and counts the files it opens, against reading the
same shards without a manifest (every rank opens every shard, as before format 2).

``--tiny`` (toy size, CI, seconds): BERT global batch 512 at micro-batch 8, GPT seq 256 and global batch 64
(one pass over the sample is enough data).

Needs ``mosaicml-streaming`` (``pip install --no-deps mosaicml-streaming xxhash zstd brotli python-snappy
cramjam catalogue``; its own dependencies would replace torch and transformers), into the venv or apart
(``--target DIR``, then run with ``PYTHONPATH=DIR``: the children keep it); without it, ours is measured alone
(and says so). Its package imports its torchvision datasets at import time; where no torchvision build matches
the installed torch (this CPU machine), the streaming process puts an empty ``torchvision`` module in place
first; streaming's text datasets and MDS reader do not use it. Builds its data from the enwiki sample
(../shared's real vocabulary and tokenizer when present).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.packages import python_path

REPO = Path(__file__).resolve().parents[1]

SHARED = REPO.parent / "shared" / "data"
SETUP = {  # kind -> (seq_len, global batch, micro-batch); gradient accumulation fills the batch at W ranks
    "bert": (128, 65536, 64),  # NVIDIA's phase 1
    "gpt": (2048, 1536, 1),  # GPT-NeoX 20B's batch; one window per micro-batch
}
TINY = {"bert": (128, 512, 8), "gpt": (256, 64, 1)}  # --tiny (CI): seconds, not a measurement


def setup(kind: str, tiny: bool) -> tuple[int, int, int]:
    """(seq_len, global batch, micro-batch) of ``kind``."""
    return (TINY if tiny else SETUP)[kind]


def env() -> dict[str, str]:
    """The children's: this repository first on their path, then the caller's (where streaming may be)."""
    return dict(os.environ, PYTHONPATH=python_path(str(REPO)), OMP_NUM_THREADS="1")


# ------------------------------------------------------------------------------------------------- data
def build(work: Path, kind: str, tiny: bool) -> Path:
    """Format-2 shards from the enwiki sample, with at least two global batches of samples."""
    from data.sample import sample_dump_path
    from data.wiki import extract_dump

    text = work / "text"
    extract_dump([sample_dump_path()], text, workers=2, shards=4)
    seq, G, _ = setup(kind, tiny)
    out = work / kind
    if kind == "bert":
        vocab = SHARED / "bert-base-uncased-vocab.txt"
        if not vocab.exists():
            from data.vocab import train_wordpiece

            vocab = train_wordpiece(text, work / "vocab.txt", 8000)
        # ~5,500 instances per pass over the sample: enough passes for two global batches
        dupe = -(-2 * G // 5000)
        args = [
            "bert",
            "--text",
            str(text),
            "--vocab",
            str(vocab),
            "--dupe-factor",
            str(dupe),
            "--shards",
            "8",
        ]
    else:
        tok = SHARED / "gpt-neox-20b-tokenizer.json"
        if not tok.exists():
            from data.vocab import train_bpe

            tok = train_bpe(text, work / "tokenizer.json", 8000)
        # ~260 windows of 2,048 per copy of the sample text: enough copies for two global batches
        copies = -(-2 * G // 250)
        big = work / "text-x"
        big.mkdir()
        for i in range(copies):
            for f in sorted(text.glob("*.txt")):
                os.link(f, big / f"{i:03d}-{f.name}")
        args = ["gpt", "--text", str(big), "--tokenizer", str(tok), "--seq-len", str(seq), "--shards", "8"]
    subprocess.run(
        [sys.executable, "-m", "data", *args, "--out", str(out), "--workers", "2", "--no-progress"],
        check=True,
        cwd=REPO,
        env=env(),
    )
    return out


def write_mds(shards: Path, kind: str, out: Path) -> None:
    """The same samples, in storage order, as streaming's MDS shards (its defaults: no compression)."""
    import h5py

    from data import h5format

    install_torchvision_placeholder()
    from streaming import MDSWriter

    schema = h5format.SCHEMAS[kind]
    man = json.loads((shards / "manifest.json").read_text())
    with h5py.File(shards / man["shards"][0]["file"]) as f:
        columns = {n: f"ndarray:int32:{f[n].shape[1]}" if f[n].ndim == 2 else "int32" for n in schema}
    with MDSWriter(out=str(out), columns=columns) as w:
        for rec in man["shards"]:
            with h5py.File(shards / rec["file"]) as f:
                arrays = {n: f[n][:].astype(np.int32) for n in schema}
            for i in range(len(arrays["input_ids"])):
                w.write({n: (a[i] if a.ndim == 2 else int(a[i])) for n, a in arrays.items()})


def install_torchvision_placeholder() -> None:
    """streaming imports torchvision's VisionDataset at package import; without a torchvision that loads
    against this torch, give it an empty module (its vision datasets are not used here)."""
    import importlib.machinery
    import types

    try:
        import torchvision.datasets  # noqa: F401

        return
    except Exception:  # missing, or built for another torch
        pass
    mods = {
        n: types.ModuleType(n)
        for n in (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        )
    }
    for m in mods.values():
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    mods["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
    mods["torchvision.datasets"].CIFAR10 = None  # type: ignore[attr-defined]
    mods["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]
    sys.modules.update(mods)


# ----------------------------------------------------------------------------------- child processes
def _hwm_kib(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def peak_rss_mib() -> float:
    """Peak resident memory of this process plus its live children (the DataLoader worker), from
    /proc (ru_maxrss would miss a worker that has not exited)."""
    kids = []
    for task in Path("/proc/self/task").iterdir():
        kids += (task / "children").read_text().split()
    return (_hwm_kib("self") + sum(_hwm_kib(k) for k in kids)) / 1024


def child_amplification(a: argparse.Namespace) -> dict:
    """Every rank of W, in-process: the worst and mean rows decoded per row used over ``steps`` steps."""
    from data.loader import PretrainingLoader

    seq, G, mb = setup(a.kind, a.tiny)
    ga = G // (mb * a.world)
    amps = []
    t0 = time.perf_counter()
    for rank in range(a.world):
        ld = PretrainingLoader(
            a.data, a.kind, micro_batch=mb, grad_accum=ga, dp_rank=rank, dp_world=a.world, num_workers=0
        )
        it = iter(ld)
        for _ in range(a.steps * ga):
            next(it)
        amps.append(ld.read_stats.amplification)
        ld.close()
    return {"worst": max(amps), "mean": float(np.mean(amps)), "seconds": time.perf_counter() - t0}


def child_rate(a: argparse.Namespace) -> dict:
    """The last rank of W with one DataLoader worker: start-up, samples/s, peak RSS."""
    import torch  # noqa: F401

    t0 = time.perf_counter()
    if a.loader == "ours":
        return _rate(a, t0)
    import torch.distributed as dist

    from common.net import free_port
    from common.process import end_process_group

    # streaming's only collective is a barrier at construction; a one-member group stands in for the W - 1
    # ranks not run, and the environment tells streaming which rank of W this is
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return _rate(a, t0)
    finally:
        end_process_group()


def _rate(a: argparse.Namespace, t0: float) -> dict:
    seq, G, mb = setup(a.kind, a.tiny)
    ga = G // (mb * a.world)
    rank = a.world - 1
    if a.loader == "ours":
        from data.loader import PretrainingLoader

        ld = PretrainingLoader(
            a.data, a.kind, micro_batch=mb, grad_accum=ga, dp_rank=rank, dp_world=a.world, num_workers=1
        )
        it = iter(ld)
    else:
        os.environ.update(WORLD_SIZE=str(a.world), RANK=str(rank), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        install_torchvision_placeholder()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        ds = StreamingDataset(local=a.data, batch_size=mb, shuffle=True)
        it = iter(DataLoader(ds, batch_size=mb, num_workers=1, persistent_workers=True))
    first = next(it)
    startup = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < a.seconds:
        try:
            b = next(it)
        except StopIteration:  # streaming: one epoch per iterator
            it = iter(DataLoader(ds, batch_size=mb, num_workers=1, persistent_workers=True))
            continue
        n += len(b["input_ids"])
    del first
    return {
        "samples_per_s": n / (time.perf_counter() - t1),
        "startup_s": startup,
        "peak_rss_mib": peak_rss_mib(),
    }


def child_startup(a: argparse.Namespace) -> dict:
    """Loader start-up over many shards on rank 0 of W: seconds and HDF5 files opened (the real h5py.File,
    counted)."""
    import h5py

    from data.loader import PretrainingLoader

    real, opened = h5py.File, [0]

    def counting(*args, **kw):
        opened[0] += 1
        return real(*args, **kw)

    h5py.File = counting  # type: ignore[misc]
    t0 = time.perf_counter()
    PretrainingLoader(
        a.data,
        a.kind,
        micro_batch=1,
        grad_accum=1,
        dp_rank=0,
        dp_world=a.world,
        num_workers=0,
        require_manifest=a.loader == "ours",
    )
    return {"startup_s": time.perf_counter() - t0, "files_opened": opened[0]}


def run_child(what: str, tiny: bool, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", what] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    cmd += ["--tiny"] if tiny else []
    p = subprocess.run(cmd, capture_output=True, text=True, env=env())
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if p.returncode or not line:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(line[-1][2:])


def many_shards(shards: Path, n: int, out: Path) -> Path:
    """``n`` hard links to one shard and a manifest listing them (start-up cost only)."""
    man = json.loads((shards / "manifest.json").read_text())
    rec = man["shards"][0]
    out.mkdir()
    recs = []
    for i in range(n):
        name = f"{shards.name}-{i:05d}.h5"
        os.link(shards / rec["file"], out / name)
        recs.append({**rec, "file": name, "index": i})
    (out / "manifest.json").write_text(json.dumps({**man, "shards": recs}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("bert", "gpt"), default="bert")
    ap.add_argument("--world-sizes", default="1,128,1024")
    ap.add_argument("--steps", type=int, default=2, help="steps per rank for the amplification count")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--startup-shards", type=int, default=1000)
    ap.add_argument("--tiny", action="store_true", help="toy batch sizes (CI: seconds, not a measurement)")
    ap.add_argument("--child")
    ap.add_argument("--data")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--loader", default="ours")
    a = ap.parse_args()
    if a.child:
        fn = {"amp": child_amplification, "rate": child_rate, "startup": child_startup}[a.child]
        print("@@" + json.dumps(fn(a)), flush=True)
        return 0
    worlds = [int(w) for w in a.world_sizes.split(",")]
    seq, G, mb = setup(a.kind, a.tiny)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        work = Path(tmp)
        data = build(work, a.kind, a.tiny)
        have_peer = importlib.util.find_spec("streaming") is not None
        if not have_peer:
            print("mosaicml-streaming is not installed (see this script's docstring): measuring ours only")
        mds = work / "mds"
        if have_peer:
            write_mds(data, a.kind, mds)
        n = sum(
            r.get("instances", r.get("samples", 0)) for r in json.loads((data / "manifest.json").read_text())["shards"]
        )
        for w in worlds:
            amp = run_child("amp", a.tiny, kind=a.kind, data=data, world=w, steps=a.steps)
            ours = run_child("rate", a.tiny, kind=a.kind, data=data, world=w, seconds=a.seconds, loader="ours")
            peer = None
            if have_peer:
                peer = run_child("rate", a.tiny, kind=a.kind, data=mds, world=w, seconds=a.seconds, loader="streaming")
            rows.append((w, amp, ours, peer))
        startup = []
        if a.startup_shards:
            many = many_shards(data, a.startup_shards, work / "many")
            bare = work / "bare"  # the same links without the manifest
            bare.mkdir()
            for f in many.glob("*.h5"):
                os.link(f, bare / f.name)
            for loader, where in (("ours", many), ("no-manifest", bare)):
                startup.append(
                    (
                        loader,
                        run_child("startup", a.tiny, kind=a.kind, data=where, world=max(worlds), loader=loader),
                    )
                )
    print(
        f"\n{a.kind.upper()} seq {seq}, global batch {G}, micro-batch {mb}, {n} samples; "
        f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'ranks':>6} {'accum':>6} {'loader':<10} {'decoded/used (worst, mean)':>27} {'samples/s/rank':>15} "
        f"{'start-up s':>11} {'peak RSS MiB':>13} {'ours/streaming':>15}"
    )
    for w, amp, ours, peer in rows:
        ga = G // (mb * w)
        ratio = f"{ours['samples_per_s'] / peer['samples_per_s']:.2f}x" if peer else "-"
        print(
            f"{w:>6} {ga:>6} {'ours':<10} {amp['worst']:>14.2f} {amp['mean']:>12.2f} "
            f"{ours['samples_per_s']:>15.0f} {ours['startup_s']:>11.2f} {ours['peak_rss_mib']:>13.0f} "
            f"{ratio:>15}"
        )
        if peer is None:
            continue
        print(
            f"{'':>6} {'':>6} {'streaming':<10} {'1.00 (no compression)':>27} {peer['samples_per_s']:>15.0f} "
            f"{peer['startup_s']:>11.2f} {peer['peak_rss_mib']:>13.0f}"
        )
    for loader, r in startup:
        label = "manifest (format 2)" if loader == "ours" else "no manifest (every shard opened)"
        print(
            f"start-up over {a.startup_shards} shards, rank 0 of {max(worlds)}, {label}: "
            f"{r['startup_s']:.2f} s, {r['files_opened']} HDF5 files opened"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
