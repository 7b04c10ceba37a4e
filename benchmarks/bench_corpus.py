"""Any corpus in: a dataset's path against the text path, per CPU-second of the whole process tree.

BERT: ``data bert --dataset wiki.parquet`` (Hugging Face's ``wikimedia/wikipedia`` layout) against NVIDIA's
two stages, ``data wiki DUMP`` then ``data bert --text``, on the same articles, reading included. GPT-NeoX:
``data gpt --dataset docs.jsonl`` against ``data gpt --text`` on the same documents (the text layout's
documents, sentences joined by spaces: the same tokens). Each at ``--workers`` 1 and 2.

Input: the gensim enwiki sample's pages repeated ``--copies`` times (a dump as ``bench_wiki.build_dump``
writes it; the parquet and JSONL rows repeated alike). The parquet's text is each article's wikitext cleaned by
``data.textclean`` (paragraphs separated by blank lines), as Hugging Face's files hold it. On a shared machine
CPU seconds (user + system of every process of a command) are the stable figure; the ratios are the result.

    python benchmarks/bench_corpus.py --copies 10 --workers 1 2
    python benchmarks/bench_corpus.py --copies 1 --workers 1 --dupe-factor 1 --vocab V --work DIR   # toy (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_wiki import build_dump, run_measured  # noqa: E402
from data.textclean import clean_wikitext, is_disambiguation  # noqa: E402
from data.wiki import iter_pages  # noqa: E402

SHARED = REPO.parent / "shared" / "data"


def write_inputs(dump: Path, work: Path) -> tuple[Path, Path]:
    """The dump's articles as ``wikimedia/wikipedia`` parquet rows and as JSONL documents in the text layout's
    form (sentences joined by spaces)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.documents import Document, document_sentences

    rows, docs = [], []
    for page in iter_pages(dump):
        if page.ns != 0 or page.redirect or is_disambiguation(page.title, page.text):
            continue
        text = clean_wikitext(page.text)
        sentences = document_sentences(Document(page.text, "wikitext", None, page.title))
        if text and sentences:
            rows.append({"id": str(len(rows)), "url": "", "title": page.title, "text": text})
            docs.append(" ".join(sentences))
    parquet, jsonl = work / "wiki.parquet", work / "docs.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return parquet, jsonl


def data(*args: str) -> list[str]:
    return [sys.executable, "-m", "data", *args]


def measure(cmds: list[list[str]], out: Path, key: str) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, the manifest's ``key`` total) of commands run one after another."""
    cpu = wall = 0.0
    for cmd in cmds:
        w, c, _, _ = run_measured(cmd, env={**os.environ, "PYTHONPATH": str(REPO)})
        cpu, wall = cpu + c, wall + w
    return cpu, wall, int(json.loads((out / "manifest.json").read_text())["totals"][key])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=10, help="copies of the sample's pages in the input")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dupe-factor", type=int, default=5)
    ap.add_argument("--vocab", default=str(SHARED / "bert-base-uncased-vocab.txt"), help="BERT vocab.txt")
    ap.add_argument("--tokenizer", default=str(SHARED / "gpt-neox-20b-tokenizer.json"), help="GPT tokenizer.json")
    ap.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    dump = build_dump(args.copies, work)
    parquet, jsonl = write_inputs(dump, work)
    tokenizer = Path(args.tokenizer)
    if not tokenizer.exists():  # a byte-level BPE of the sample (a user's clone has no ../shared)
        tokenizer = work / "bpe.json"
        from data.vocab import train_bpe

        extract = work / "bpe-text"
        run_measured(data("wiki", str(dump), "--out", str(extract), "--workers", "1", "--overwrite"))
        train_bpe(extract, tokenizer, 2000)
    print(f"input: sample x{args.copies} ({len(parquet.read_bytes()) / 1e6:.1f} MB parquet); CPUs: {os.cpu_count()}")
    bert = ("--vocab", args.vocab, "--seq-len", "128", "--max-pred", "20", "--dupe-factor", str(args.dupe_factor))
    print("| path | workers | units | CPU s | wall s | units per CPU-s | x text path |")
    print("|---|---|---|---|---|---|---|")
    for w in args.workers:
        wf = ("--workers", str(w), "--overwrite", "--no-progress")
        text, h5 = work / f"text-{w}", work / f"bert-text-{w}"
        wiki = data("wiki", str(dump), "--out", str(text), "--workers", str(w), "--overwrite")
        base = measure([wiki, data("bert", "--text", str(text), "--out", str(h5), *bert, *wf)], h5, "instances")
        h5d = work / f"bert-parquet-{w}"
        ours = measure([data("bert", "--dataset", str(parquet), "--out", str(h5d), *bert, *wf)], h5d, "instances")
        gpt = ("--tokenizer", str(tokenizer), "--seq-len", "2048", "--shards", str(2 * w), *wf)
        g_text, g_ds = work / f"gpt-text-{w}", work / f"gpt-jsonl-{w}"
        gbase = measure([data("gpt", "--text", str(text), "--out", str(g_text), *gpt)], g_text, "tokens")
        gours = measure([data("gpt", "--dataset", str(jsonl), "--out", str(g_ds), *gpt)], g_ds, "tokens")
        for name, (cpu, wall, n), ref, unit in (
            ("BERT: data wiki + data bert --text", base, base, "instances"),
            ("BERT: data bert --dataset parquet", ours, base, "instances"),
            ("GPT: data gpt --text", gbase, gbase, "tokens"),
            ("GPT: data gpt --dataset jsonl", gours, gbase, "tokens"),
        ):
            rate, ref_rate = n / cpu, ref[2] / ref[0]
            print(f"| {name} | {w} | {n} {unit} | {cpu:.2f} | {wall:.2f} | {rate:,.0f} | {rate / ref_rate:.2f} |")


if __name__ == "__main__":
    main()
