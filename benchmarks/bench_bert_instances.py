"""BERT instance creation: ``python -m data bert`` vs NVIDIA's ``create_pretraining_data.py``, same text,
vocab, settings and machine, measured in the same run.

    python benchmarks/bench_bert_instances.py [--copies 20] [--peer-dir /tmp/peers/nvidia-bert]
    python benchmarks/bench_bert_instances.py --copies 1 --dupe-factor 1 --skip-peer --vocab V   # toy (CI)

Needs: the real BERT vocab (``../shared/data/bert-base-uncased-vocab.txt`` or ``--vocab``), and the peer
(NVIDIA DeepLearningExamples
``PyTorch/LanguageModeling/BERT/{create_pretraining_data,tokenization,file_utils}.py``) in ``--peer-dir``
with a Python that has h5py/numpy/tqdm/six/boto3/requests (``--peer-python``). The corpus is the enwiki
sample from the gensim wheel, extracted by ``data.wiki`` and repeated ``--copies`` times (20 copies ~ 10.6M
WordPiece tokens). Repetition flatters our chunk cache, so the single-copy corpus is measured too. Wall time
of each whole command (start-up included) and peak RSS of its largest process are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

REPO = Path(__file__).resolve().parents[1]

SETTINGS = {
    "seq_len": 128,
    "max_pred": 20,
    "dupe_factor": 5,
    "masked_lm_prob": 0.15,
    "short_seq_prob": 0.1,
    "seed": 12345,
}


def timed(cmd: list[str], cwd: Path | None = None) -> tuple[float, int, str]:
    """Run a command; (wall seconds, peak RSS MiB of its largest process, stdout)."""
    wrapper = (
        "import resource, subprocess, sys, time; t=time.perf_counter(); p=subprocess.run(sys.argv[1:], "
        "capture_output=True, text=True); sys.stderr.write(p.stderr[-3000:]); print(p.stdout); print('@@', "
        "time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], cwd=cwd, capture_output=True, text=True, env=env)
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")][-1].split()
    secs, rss_kb, rc = float(last[1]), int(last[2]), int(last[3])
    if rc != 0:
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}\n{p.stderr}")
    return secs, rss_kb // 1024, p.stdout


def make_corpus(work: Path, copies: int) -> tuple[Path, Path | None]:
    """One copy of the sample's text (one file), and ``copies`` of it in 4 files (None for one copy)."""
    from data.sample import sample_dump_path
    from data.wiki import extract_dump

    text = work / "wikitext"
    extract_dump([sample_dump_path()], text, workers=1, shards=1)
    src = sorted(text.rglob("*.txt"))
    one = work / "corpus1"
    one.mkdir()
    shutil.copy(src[0], one / "part0.txt")
    if copies == 1:
        return one, None
    many = work / f"corpus{copies}"
    many.mkdir()
    body = "".join(f.read_text(encoding="utf-8").rstrip("\n") + "\n\n" for f in src)
    files = 4
    for i in range(files):
        n = copies // files + (1 if i < copies % files else 0)
        (many / f"part{i}.txt").write_text(body * n, encoding="utf-8")
    return one, many


def ours(corpus: Path, vocab: Path, out: Path, workers: int, shards: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "data",
        "bert",
        "--text",
        str(corpus),
        "--vocab",
        str(vocab),
        "--out",
        str(out),
        "--seq-len",
        str(SETTINGS["seq_len"]),
        "--max-pred",
        str(SETTINGS["max_pred"]),
        "--dupe-factor",
        str(SETTINGS["dupe_factor"]),
        "--masked-lm-prob",
        str(SETTINGS["masked_lm_prob"]),
        "--short-seq-prob",
        str(SETTINGS["short_seq_prob"]),
        "--seed",
        str(SETTINGS["seed"]),
        "--workers",
        str(workers),
        "--shards",
        str(shards),
        "--overwrite",
        "--no-progress",
    ]
    secs, rss, _ = timed(cmd, cwd=REPO)
    man = json.loads((out / "manifest.json").read_text())
    return {
        "seconds": secs,
        "rss_mib": rss,
        "instances": man["totals"]["instances"],
        "tokens": man["totals"]["tokens"],
    }


def peer(corpus: Path, vocab: Path, out: Path, peer_dir: Path, peer_python: str) -> dict:
    cmd = [
        peer_python,
        str(peer_dir / "create_pretraining_data.py"),
        "--vocab_file",
        str(vocab),
        "--input_file",
        str(corpus),
        "--output_file",
        str(out),
        "--max_seq_length",
        str(SETTINGS["seq_len"]),
        "--max_predictions_per_seq",
        str(SETTINGS["max_pred"]),
        "--dupe_factor",
        str(SETTINGS["dupe_factor"]),
        "--masked_lm_prob",
        str(SETTINGS["masked_lm_prob"]),
        "--short_seq_prob",
        str(SETTINGS["short_seq_prob"]),
        "--random_seed",
        str(SETTINGS["seed"]),
        "--do_lower_case",
    ]
    secs, rss, _ = timed(cmd, cwd=peer_dir)
    with h5py.File(out) as f:
        n = len(f["input_ids"])
    return {"seconds": secs, "rss_mib": rss, "instances": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--dupe-factor", type=int, default=SETTINGS["dupe_factor"], help="both programs")
    ap.add_argument("--vocab", default=str(REPO.parent / "shared" / "data" / "bert-base-uncased-vocab.txt"))
    ap.add_argument("--peer-dir", default="/tmp/peers/nvidia-bert")
    ap.add_argument(
        "--peer-python",
        default="/tmp/peers/venv/bin/python" if Path("/tmp/peers/venv/bin/python").exists() else sys.executable,
    )
    ap.add_argument("--skip-peer", action="store_true", help="only our figures")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.copies < 1 or args.dupe_factor < 1:
        raise SystemExit(f"error: --copies and --dupe-factor must be >= 1 (got {args.copies}, {args.dupe_factor})")
    SETTINGS["dupe_factor"] = args.dupe_factor
    vocab = Path(args.vocab)
    if not vocab.exists():
        raise SystemExit(f"the real BERT vocab is needed: {vocab} not found (../shared absent? pass --vocab)")
    peer_dir = Path(args.peer_dir)
    if not args.skip_peer and not (peer_dir / "create_pretraining_data.py").exists():
        raise SystemExit(f"peer not found in {peer_dir}; see this script's docstring (or --skip-peer)")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_bert_") as tmp:
        work = Path(tmp)
        one, many = make_corpus(work, args.copies)
        rows = []
        corpora = [("1 copy", one, 1)] + ([(f"{args.copies} copies", many, args.shards)] if many else [])
        for label, corpus, shards in corpora:
            r1 = ours(corpus, vocab, work / "o1", 1, shards)
            r2 = ours(corpus, vocab, work / "o2", 2, shards)
            tokens = r1["tokens"]
            res = {"ours_w1": r1, "ours_w2": r2, "tokens": tokens}
            if not args.skip_peer:
                res["peer"] = peer(corpus, vocab, work / "peer.h5", peer_dir, args.peer_python)
            results[label] = res
            for name in ("peer", "ours_w1", "ours_w2"):
                if name in res:
                    r = res[name]
                    rows.append((label, name, r["instances"], tokens, r["seconds"], r["rss_mib"]))
    print(
        f"\nBERT instances, seq {SETTINGS['seq_len']}, max_pred {SETTINGS['max_pred']}, "
        f"dupe {SETTINGS['dupe_factor']}, "
        f"{os.cpu_count()} CPUs, load avg at end {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'corpus':<12} {'program':<28} {'instances':>10} {'tokens':>10} {'seconds':>8} {'inst/s':>9} "
        f"{'tokens/s':>10} {'x peer':>7} {'peak RSS':>9}"
    )
    names = {
        "peer": "NVIDIA create_pretraining",
        "ours_w1": "data bert --workers 1",
        "ours_w2": "data bert --workers 2",
    }
    for label, name, inst, tok, secs, rss in rows:
        peer_r = results[label].get("peer")
        speed = f"{(inst / secs) / (peer_r['instances'] / peer_r['seconds']):.1f}" if peer_r else "-"
        print(
            f"{label:<12} {names[name]:<28} {inst:>10} {tok:>10} {secs:>8.1f} {inst / secs:>9.0f} "
            f"{tok / secs:>10.0f} {speed:>7} {rss:>8}M"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
