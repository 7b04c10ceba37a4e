"""Dump extraction: ours (``data.wiki``) vs WikiExtractor, same input, same process counts, one run.

Input: the gensim enwiki sample's 206 pages repeated R times into one valid bz2 dump (built once in
--workdir, streamed), so start-up does not dominate. For each process count we report wall seconds,
articles/s, MB/s of compressed input, and markup residue per 1,000 output lines for both tools; then
our peak RSS (whole process tree, sampled) at two input sizes to show memory does not grow with the
dump.

WikiExtractor is AGPL: it runs as a separate program from its own venv and is never imported::

    python -m venv /tmp/peers/wikiextractor-venv && /tmp/peers/wikiextractor-venv/bin/pip install
    wikiextractor
    python benchmarks/bench_wiki.py --workers 1 2 --repeat 20
    python benchmarks/bench_wiki.py --workers 1 --repeat 1 --rss-repeats 1 1 --workdir DIR   # toy (CI)

Without the peer (or without ``mwparserfromhell``, the cleaner-only peer: the ``bench`` extra) ours is
measured alone, and the output says so.
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from data.sample import sample_dump_path

REPO = Path(__file__).resolve().parents[1]

RESIDUE = (
    "{{",
    "}}",
    "[[",
    "]]",
    "{|",
    "|}",
    "<ref",
    "</",
    "&nbsp;",
    "&amp;",
    "'''",
    "[http",
    "File:",
    "Category:",
    "thumb|",
)

OURS = """
import json, sys
from pathlib import Path
from data.wiki import extract_dump
s = extract_dump([Path(sys.argv[1])], Path(sys.argv[2]), workers=int(sys.argv[3]), shards=4, overwrite=True)
print(json.dumps(s))
"""


def build_dump(repeat: int, workdir: Path) -> Path:
    """Sample pages repeated ``repeat`` times in one valid MediaWiki dump, written as a bz2 stream."""
    out = workdir / f"enwiki-sample-x{repeat}.xml.bz2"
    if out.exists():
        return out
    with bz2.open(sample_dump_path(), "rt", encoding="utf-8") as f:
        text = f.read()
    first, last = text.index("  <page>"), text.rindex("</page>") + len("</page>\n")
    header, pages, footer = text[:first], text[first:last], text[last:]
    tmp = out.with_suffix(".tmp")
    with bz2.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(header)
        for _ in range(repeat):
            f.write(pages)
        f.write(footer)
    tmp.rename(out)
    return out


def _tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants, from /proc (Linux)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int, str]:
    """Run ``cmd``; return (wall seconds, CPU seconds of its process tree, peak tree RSS in MiB, stdout).

    CPU seconds (user + system, all descendants) are the fair figure on a shared machine where wall
    time depends on what else runs.
    """
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_kib(proc.pid))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{err[-2000:]}")
    return wall, cpu, peak // 1024, out


def residue_per_1000(lines: list[str]) -> tuple[float, dict[str, int]]:
    counts = {r: sum(1 for ln in lines if r in ln) for r in RESIDUE}
    bad = sum(1 for ln in lines if any(r in ln for r in RESIDUE))
    return 1000.0 * bad / max(1, len(lines)), counts


def our_lines(out_dir: Path) -> list[str]:
    lines: list[str] = []
    for f in sorted(out_dir.glob("wiki_*.txt")):
        lines += [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines


def peer_lines(out_dir: Path) -> tuple[list[str], int]:
    lines: list[str] = []
    docs = 0
    for f in sorted(out_dir.rglob("wiki_*")):
        for ln in f.read_text(encoding="utf-8").splitlines():
            if ln.startswith("<doc "):
                docs += 1
            elif ln.strip() and ln != "</doc>":
                lines.append(ln)
    return lines, docs


def bench_cleaners() -> None:
    """Cleaner only, in this process: ours vs mwparserfromhell's strip_code on the sample's articles."""
    try:
        import mwparserfromhell
    except ImportError:
        mwparserfromhell = None
    from data.textclean import clean_wikitext, split_sentences
    from data.wiki import iter_pages

    texts = [p.text for p in iter_pages(sample_dump_path()) if p.ns == 0 and not p.redirect]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    t0 = time.process_time()
    ours = [clean_wikitext(t) for t in texts]
    t1 = time.process_time()
    sentences = [s for c in ours for p in c.split("\n\n") for s in split_sentences(p)]
    t2 = time.process_time()
    mwp = [mwparserfromhell.parse(t).strip_code() for t in texts] if mwparserfromhell else []
    t3 = time.process_time()
    ours_lines = [ln for c in ours for ln in c.splitlines() if ln.strip()]
    mwp_lines = [ln for c in mwp for ln in c.splitlines() if ln.strip()]
    print(f"\ncleaner only, {len(texts)} articles, {mb:.1f} MB wikitext, CPU seconds, one process:")
    print("| cleaner | seconds | MB/s | residue lines /1000 |")
    print("|---|---|---|---|")
    print(f"| ours clean_wikitext | {t1 - t0:.2f} | {mb / (t1 - t0):.1f} | {residue_per_1000(ours_lines)[0]:.2f} |")
    print(f"| ours split_sentences ({len(sentences)} sentences) | {t2 - t1:.2f} | {mb / (t2 - t1):.1f} | |")
    if mwparserfromhell is None:
        print("mwparserfromhell is not installed (pip install -e '.[bench]'): its row is left out")
        return
    print(
        f"| mwparserfromhell strip_code | {t3 - t2:.2f} | {mb / (t3 - t2):.1f} | {residue_per_1000(mwp_lines)[0]:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=20, help="copies of the sample's pages in the input")
    ap.add_argument("--rss-repeats", type=int, nargs=2, default=[5, 20], help="input sizes for the RSS check")
    ap.add_argument("--peer", default="/tmp/peers/wikiextractor-venv/bin/wikiextractor")
    ap.add_argument("--peer-mode", default="--no-templates", help="extra WikiExtractor flag ('' = default mode)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_wiki"))
    ap.add_argument("--skip-cleaners", action="store_true", help="skip the cleaner-only comparison")
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    dump = build_dump(args.repeat, args.workdir)
    mb = dump.stat().st_size / 1e6
    have_peer = Path(args.peer).exists()
    print(f"input: {dump} ({mb:.1f} MB bz2, sample x{args.repeat}); CPUs: {os.cpu_count()}")
    if not have_peer:
        print(f"peer not found at {args.peer}: install it as the docstring says; measuring ours only")

    rows = []
    for w in args.workers:
        ours_dir = args.workdir / f"ours-w{w}"
        wall, cpu, rss, out = run_measured([sys.executable, "-c", OURS, str(dump), str(ours_dir), str(w)], env)
        s = json.loads(out.strip().splitlines()[-1])
        res, _ = residue_per_1000(our_lines(ours_dir))
        rows.append(("ours (data.wiki)", w, wall, cpu, s["articles"], rss, res))
        if have_peer:
            peer_dir = args.workdir / f"peer-w{w}"
            shutil.rmtree(peer_dir, ignore_errors=True)
            cmd = [args.peer, "--processes", str(w), "-q", "-o", str(peer_dir), "-b", "100M"]
            cmd += [args.peer_mode] if args.peer_mode else []
            wall, cpu, prss, _ = run_measured([*cmd, str(dump)])
            lines, docs = peer_lines(peer_dir)
            res, _ = residue_per_1000(lines)
            rows.append((f"WikiExtractor {args.peer_mode}".strip(), w, wall, cpu, docs, prss, res))

    print()
    print(
        "| tool | --workers / --processes | wall s | CPU s | articles | articles/s | MB/s (bz2) | "
        "articles per CPU s | peak RSS MiB | residue lines /1000 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, w, wall, cpu, arts, rss, res in rows:
        print(
            f"| {name} | {w} | {wall:.2f} | {cpu:.2f} | {arts} | {arts / wall:.0f} | {mb / wall:.2f} | "
            f"{arts / cpu:.0f} | {rss} | {res:.2f} |"
        )

    # residue detail for the last pair
    print()
    print("residue by pattern (lines containing it):")
    ours_counts = residue_per_1000(our_lines(args.workdir / f"ours-w{args.workers[-1]}"))[1]
    peer_counts = residue_per_1000(peer_lines(args.workdir / f"peer-w{args.workers[-1]}")[0])[1] if have_peer else {}
    for r in RESIDUE:
        print(f"  {r!r:12} ours {ours_counts[r]:6d}   peer {peer_counts.get(r, '-')!s:>6}")

    if len(args.workers) > 1:
        a = [r for r in rows if r[0].startswith("ours")]
        for b in a[1:]:
            print(f"\nours {b[1]} vs {a[0][1]} processes: speed-up {a[0][2] / b[2]:.2f}x")

    print("\nmemory: our peak RSS (process tree) vs input size, workers =", max(args.workers))
    for r in args.rss_repeats:
        d = build_dump(r, args.workdir)
        wall, _, rss, _ = run_measured(
            [sys.executable, "-c", OURS, str(d), str(args.workdir / f"ours-rss{r}"), str(max(args.workers))],
            env,
        )
        print(f"  sample x{r:3d}: {d.stat().st_size / 1e6:6.1f} MB bz2, {wall:6.2f} s, peak RSS {rss} MiB")

    if not args.skip_cleaners:
        bench_cleaners()


if __name__ == "__main__":
    main()
