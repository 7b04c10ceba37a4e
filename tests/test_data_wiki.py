"""``python -m data wiki``: the real enwiki sample from gensim -> clean sentence-per-line shards."""

from __future__ import annotations

import bz2
import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from common.errors import UserError
from data.textclean import clean_wikitext, split_sentences
from data.wiki import SHARD_PATTERN, extract_dump, iter_pages, process_article
from tests.conftest import REPO, WIKI_FIXTURE_SHARDS, run_env, run_python

# Markup that must never reach the text.
RESIDUE = (
    "{{",
    "}}",
    "[[",
    "]]",
    "|}",
    "{|",
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

# The sample's disambiguation pages: five "(disambiguation)" titles and three tagged with a template.
SAMPLE_DISAMBIGUATION = {
    "Alien",
    "Austin (disambiguation)",
    "Ada",
    "Aberdeen (disambiguation)",
    "Argument (disambiguation)",
    "Animal (disambiguation)",
    "Asia Minor (disambiguation)",
    "Aa River",
}

MW_NS = "http://www.mediawiki.org/xml/export-0.10/"


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def page_xml(title: str, text: str, *, ns: int = 0, redirect: str | None = None, pid: int = 1) -> str:
    red = f'    <redirect title="{escape(redirect)}" />\n' if redirect else ""
    return (
        f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{pid}</id>\n{red}"
        f"    <revision>\n      <id>{pid + 1000}</id>\n      <model>wikitext</model>\n"
        f'      <format>text/x-wiki</format>\n      <text xml:space="preserve">{escape(text)}</text>\n'
        f"    </revision>\n  </page>\n"
    )


def dump_xml(pages: list[str]) -> str:
    return (
        f'<mediawiki xmlns="{MW_NS}" version="0.10" xml:lang="de">\n  <siteinfo>\n'
        "    <sitename>Wikipedia</sitename>\n    <dbname>dewiki</dbname>\n  </siteinfo>\n"
        + "".join(pages)
        + "</mediawiki>\n"
    )


def write_bz2(path: Path, text: str) -> Path:
    path.write_bytes(bz2.compress(text.encode("utf-8")))
    return path


def shard_lines(out_dir: Path) -> list[str]:
    lines: list[str] = []
    for f in sorted(out_dir.glob("wiki_*.txt")):
        lines += f.read_text(encoding="utf-8").splitlines()
    return lines


def articles_of(out_dir: Path) -> list[list[str]]:
    """Articles in shard order: blocks of sentence lines separated by one blank line."""
    arts: list[list[str]] = []
    for f in sorted(out_dir.glob("wiki_*.txt")):
        text = f.read_text(encoding="utf-8")
        assert text.endswith("\n\n") and "\n\n\n" not in text, f"{f.name}: not one blank line per article"
        arts += [block.split("\n") for block in text[:-2].split("\n\n")]
    return arts


def snapshot(d: Path) -> dict[str, bytes] | None:
    if not d.exists():
        return None
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "data", "wiki", *args])


# --------------------------------------------------------------------------------------------------
# the real sample
# --------------------------------------------------------------------------------------------------


def test_sample_counts_and_manifest(wiki_text_dir: Path, sample_dump: Path) -> None:
    m = json.loads((wiki_text_dir / "manifest.json").read_text())
    c = m["counts"]
    assert c["pages"] == 206
    assert c["redirects"] + c["other_namespace"] == 100  # the one non-article page is a redirect too
    assert c["articles"] == 106  # main namespace, not redirects
    assert c["disambiguation"] == len(SAMPLE_DISAMBIGUATION)
    assert c["empty"] == 1  # "List of anthropologists": headings, lists and templates only
    assert c["articles_written"] == 106 - len(SAMPLE_DISAMBIGUATION) - 1

    # what the manifest says is what is on disk
    assert [s["file"] for s in m["shards"]] == [f"wiki_{i:05d}.txt" for i in range(WIKI_FIXTURE_SHARDS)]
    for s in m["shards"]:
        data = (wiki_text_dir / s["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"]
        assert len(data) == s["bytes"]
        lines = [ln for ln in data.decode("utf-8").split("\n") if ln]
        assert len(lines) == s["sentences"]
        assert sum(len(ln) for ln in lines) == s["chars"]
    arts = articles_of(wiki_text_dir)
    assert len(arts) == c["articles_written"] == m["totals"]["articles"]
    assert sum(s["articles"] for s in m["shards"]) == len(arts)
    assert m["inputs"] == [{"path": str(sample_dump.resolve()), "bytes": sample_dump.stat().st_size}]
    assert m["format_version"] == 1 and m["settings"]["shards"] == WIKI_FIXTURE_SHARDS
    assert sorted(p.name for p in wiki_text_dir.iterdir()) == sorted(
        ["manifest.json"] + [s["file"] for s in m["shards"]]
    ), "temporary files left behind"


def test_sample_dropped_pages_are_the_right_ones(sample_dump: Path) -> None:
    """Re-derive the drops page by page: the disambiguation set and the one empty article."""
    dab, empty = set(), set()
    for page in iter_pages(sample_dump):
        if page.ns == 0 and not page.redirect:
            status = process_article(page.title, page.text)[0]
            if status == "disambiguation":
                dab.add(page.title)
            elif status == "empty":
                empty.add(page.title)
    assert dab == SAMPLE_DISAMBIGUATION
    assert empty == {"List of anthropologists"}


def test_no_markup_residue_on_any_line(wiki_text_dir: Path) -> None:
    lines = [ln for ln in shard_lines(wiki_text_dir) if ln]
    assert len(lines) > 10_000
    bad = {r: [ln for ln in lines if r in ln][:2] for r in RESIDUE}
    assert not {r: v for r, v in bad.items() if v}
    assert not [ln for ln in lines if ln != ln.strip() or "  " in ln][:3], "unnormalised whitespace"
    assert not [ln for ln in lines if ln.startswith(("==", "*", "#", "|", "!"))][:3]
    # debris where pronunciation templates were removed: "Andorra (; , )" -> "Andorra"
    assert not [ln for ln in lines if "()" in ln or "(, " in ln or "(; " in ln][:3]


def test_known_sentences_are_split_correctly(wiki_text_dir: Path) -> None:
    arts = articles_of(wiki_text_dir)
    # Anarchism is the sample's first article, so it opens shard 0.
    assert arts[0][:3] == [
        "Anarchism is a political philosophy that advocates self-governed societies based on voluntary institutions.",
        "These are often described as stateless societies, although several authors have defined them more "
        "specifically as institutions based on non-hierarchical free associations.",
        "Anarchism considers the state to be undesirable, unnecessary, and harmful.",
    ]
    # Autism is the second article: round-robin puts it first in shard 1.
    assert (wiki_text_dir / "wiki_00001.txt").read_text(encoding="utf-8").split("\n", 1)[0] == (
        "Autism is a neurodevelopmental disorder characterized by impaired social interaction, verbal and "
        "non-verbal communication, and restricted and repetitive behavior."
    )
    lines = [ln for art in arts for ln in art]
    # abbreviations stay inside their sentence
    eg = [ln for ln in lines if "(e.g. the Nihilist movement)" in ln]
    assert len(eg) == 1 and eg[0].startswith("On a tactical level") and eg[0].endswith("anarchist society.")
    assert not [ln for ln in lines if re.match(r"(?:e\.g|i\.e)\.", ln)]
    terminal = sum(1 for ln in lines if ln[-1] in ".!?\"'”’)»:;")
    assert terminal / len(lines) > 0.97
    assert sum(1 for ln in lines if ln[0].islower()) / len(lines) < 0.01


def test_no_sentence_split_after_an_abbreviation(sample_dump: Path) -> None:
    """Within a paragraph, no sentence but the last may end with a title or Latin abbreviation."""
    abbrev = re.compile(r"(?:^|\s)(?:Mr|Mrs|Dr|Prof|St|e\.g|i\.e|cf|vs|No|pp|[A-Z])\.$")
    bad, n = [], 0
    for page in iter_pages(sample_dump):
        if page.ns == 0 and not page.redirect:
            for para in clean_wikitext(page.text).split("\n\n"):
                sentences = split_sentences(para)
                n += len(sentences)
                bad += [s for s in sentences[:-1] if abbrev.search(s)]
    assert n > 15_000 and not bad


def test_keep_disambiguation_gives_105_articles_with_text(sample_dump: Path, tmp_path: Path) -> None:
    """The issue's count: 106 non-redirect articles, one with an empty body -> 105 with text
    (WikiExtractor's)."""
    s = extract_dump([sample_dump], tmp_path / "all", workers=1, keep_disambiguation=True)
    assert (s["pages"], s["articles"], s["empty"], s["articles_written"]) == (206, 106, 1, 105)
    assert s["disambiguation"] == 0
    assert json.loads((tmp_path / "all" / "manifest.json").read_text())["settings"]["keep_disambiguation"] is True


def test_output_is_identical_for_any_worker_count(wiki_text_dir: Path, sample_dump: Path, tmp_path: Path) -> None:
    handler = signal.getsignal(signal.SIGINT)
    s = extract_dump([sample_dump], tmp_path / "w1", workers=1, shards=WIKI_FIXTURE_SHARDS)
    assert s["workers"] == 1
    assert signal.getsignal(signal.SIGINT) is handler, "in-process run must leave Ctrl-C working"
    names = [f"wiki_{i:05d}.txt" for i in range(WIKI_FIXTURE_SHARDS)]
    for n in names:
        assert (tmp_path / "w1" / n).read_bytes() == (wiki_text_dir / n).read_bytes(), n
    m1 = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    m2 = json.loads((wiki_text_dir / "manifest.json").read_text())
    assert m1["shards"] == m2["shards"] and m1["counts"] == m2["counts"]
    assert m1["run"]["workers"] == 1 and m2["run"]["workers"] == 2


# --------------------------------------------------------------------------------------------------
# cleaner and splitter, unit level
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wikitext", "expected"),
    [
        ("[[Political philosophy|political]] and [[anarchy]]s.", "political and anarchys."),
        ("'''Bold''' and ''italic'' and '''''both'''''.", "Bold and italic and both."),
        ("A{{cite web|url=x|title={{lang|fr|y}}}} b.", "A b."),
        ("Text.<ref name=a>{{cite|x}} [[y]]</ref> More<ref name=a/>.", "Text. More."),
        ("[[File:X.jpg|thumb|A [[caption]] with [x] bracket]]Prose.", "Prose."),
        ("a &amp; b&nbsp;c &lt;d&gt;", "a & b c <d>"),
        ("x<!-- hidden {{ -->y", "xy"),
        ("See [http://example.org the site] or [http://bare.org].", "See the site or."),
        ("One.\n{| class=wikitable\n|-\n| {{x}} || cell\n|}\nTwo.", "One.\n\nTwo."),
        ("Intro.\n== Heading ==\n* item\n# item\n: indent\n; term\nBody.", "Intro.\n\nBody."),
        ("Body.\n[[Category:Foo]]\n[[de:Anarchismus]]\n__NOTOC__", "Body."),
        (
            "It is {{convert|5|km|mi}} long, from {{circa}} 1900{{snd}}now.",
            "It is 5 km long, from c. 1900 – now.",
        ),
        ("A<br/>b <span style=x>c</span> <math>x^2</math>d.", "A b c d."),
        ("Name ({{lang-grc|ἀναρχία}}; born 1900) was.", "Name (ἀναρχία; born 1900) was."),
        ("Andorra ({{IPAc-en|a}}; {{IPA-ca|b}}, {{IPA-ca|c}}), officially.", "Andorra, officially."),
        ("Einstein ({{IPA|x}}; 14 March 1879 – 1955) was.", "Einstein (14 March 1879 – 1955) was."),
        ("Broken {{template without end\n\nNext paragraph.", "Broken\n\nNext paragraph."),
        ("[[:Category:Lists|the list]] and [[wikt:word]].", "the list and word."),
    ],
)
def test_clean_wikitext(wikitext: str, expected: str) -> None:
    assert clean_wikitext(wikitext) == expected


@pytest.mark.parametrize(
    ("paragraph", "expected"),
    [
        ("Mr. Smith met Dr. Jones. They talked.", ["Mr. Smith met Dr. Jones.", "They talked."]),
        ("J. R. R. Tolkien wrote it. It sold.", ["J. R. R. Tolkien wrote it.", "It sold."]),
        ("Pi is 3.14 or so. Yes.", ["Pi is 3.14 or so.", "Yes."]),
        ("See e.g. the list, i.e. this. Next.", ["See e.g. the list, i.e. this.", "Next."]),
        ("It was in the U.S. Army. The U.S. The end.", ["It was in the U.S. Army.", "The U.S.", "The end."]),
        ('He said, "Stop." Then he left.', ['He said, "Stop."', "Then he left."]),
        (
            "(It was late.) We slept... And woke? Yes! ok.",
            ["(It was late.)", "We slept...", "And woke?", "Yes! ok."],
        ),
        (
            "See No. 5 and pp. 12-14. In Jan. 1990 snow fell.",
            ["See No. 5 and pp. 12-14.", "In Jan. 1990 snow fell."],
        ),
        ("Apples, pears, etc. were sold. Then rain.", ["Apples, pears, etc. were sold.", "Then rain."]),
        # codespell:ignore-begin (German)
        ("Die Katze schläft z. B. im Haus. Ende.", ["Die Katze schläft z. B. im Haus.", "Ende."]),
        # codespell:ignore-end
        ("東京は日本の首都である。人口は多い。", ["東京は日本の首都である。", "人口は多い。"]),
        ("no terminal punctuation", ["no terminal punctuation"]),
        ("", []),
    ],
)
def test_split_sentences(paragraph: str, expected: list[str]) -> None:
    assert split_sentences(paragraph) == expected


# --------------------------------------------------------------------------------------------------
# small dumps written here
# --------------------------------------------------------------------------------------------------

# codespell:ignore-begin (German)
GERMAN = (
    "Die '''Österreichische Nationalbibliothek''' ist die größte Bibliothek [[Österreich]]s. "
    "Sie wurde z. B. von [[Karl VI.|Kaiser Karl]] erweitert.<ref>Quelle, S. 12.</ref> "
    "Der Prunksaal gilt als einer der schönsten Bibliothekssäle der Welt."
)
# codespell:ignore-end
JAPANESE = "'''東京都'''は[[日本]]の[[首都]]である。人口は約1400万人である。{{要出典}}"


def small_dump(tmp_path: Path, name: str = "dewiki.xml.bz2") -> Path:
    pages = [
        page_xml("Österreichische Nationalbibliothek", GERMAN, pid=1),
        page_xml("ÖNB", "#WEITERLEITUNG [[Österreichische Nationalbibliothek]]", redirect="ÖNB", pid=2),
        page_xml("Diskussion:Wien", "Ein Kommentar.", ns=1, pid=3),
        page_xml("Leer", "{{Infobox|a=b}}\n== Nur Überschrift ==\n* Liste", pid=5),
        page_xml("東京都", JAPANESE, pid=6),
    ]
    return write_bz2(tmp_path / name, dump_xml(pages))


def test_non_english_text_survives(tmp_path: Path) -> None:
    dump = small_dump(tmp_path)
    s = extract_dump([dump], tmp_path / "out")
    assert (s["pages"], s["articles"], s["redirects"], s["other_namespace"]) == (5, 3, 1, 1)
    assert s["empty"] == 1  # "Leer" has no prose at all
    assert s["articles_written"] == 2
    arts = articles_of(tmp_path / "out")
    # codespell:ignore-begin (German)
    assert arts[0] == [
        "Die Österreichische Nationalbibliothek ist die größte Bibliothek Österreichs.",
        "Sie wurde z. B. von Kaiser Karl erweitert.",
        "Der Prunksaal gilt als einer der schönsten Bibliothekssäle der Welt.",
    ]
    # codespell:ignore-end
    assert arts[-1] == ["東京都は日本の首都である。", "人口は約1400万人である。"]
    raw = (tmp_path / "out" / "wiki_00000.txt").read_bytes()
    assert "Österreichs".encode() in raw and "首都".encode() in raw  # UTF-8, no escaping, no NFKD


def test_multistream_dump_reads_every_stream(tmp_path: Path) -> None:
    """pages-articles-multistream files are many bz2 streams back to back."""
    xml = dump_xml([page_xml(f"Seite {i}", f"Satz Nummer {i}. Noch einer.", pid=i) for i in range(1, 40)])
    cut = xml.index("  <page>", len(xml) // 2)
    (tmp_path / "m.xml.bz2").write_bytes(bz2.compress(xml[:cut].encode()) + bz2.compress(xml[cut:].encode()))
    s = extract_dump([tmp_path / "m.xml.bz2"], tmp_path / "out", shards=3)
    assert s["articles_written"] == 39 and s["sentences"] == 78
    assert len(articles_of(tmp_path / "out")) == 39


def test_two_dumps_and_overwrite_with_fewer_shards(tmp_path: Path) -> None:
    a = small_dump(tmp_path, "a.xml.bz2")
    # codespell:ignore-begin (German)
    b = write_bz2(tmp_path / "b.xml.bz2", dump_xml([page_xml("Zwei", "Zweiter Text. Ende.", pid=9)]))
    # codespell:ignore-end
    out = tmp_path / "out"
    s = extract_dump([a, b], out, shards=5)
    assert s["articles_written"] == 3 and s["pages"] == 6
    assert sorted(p.name for p in out.glob("wiki_*.txt")) == [f"wiki_{i:05d}.txt" for i in range(5)]
    with pytest.raises(UserError, match="not empty"):
        extract_dump([a], out, shards=2)
    s = extract_dump([a], out, shards=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "wiki_00000.txt", "wiki_00001.txt"]
    assert json.loads((out / "manifest.json").read_text())["totals"]["articles"] == 2


def test_leftover_temp_files_are_removed_on_rerun(tmp_path: Path) -> None:
    dump = small_dump(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".wiki_00000.txt.k3j2.tmp").write_text("half a shard")
    (out / ".manifest.json.zz.tmp").write_text("{")
    extract_dump([dump], out)  # no --overwrite needed: only our temporaries were there
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "wiki_00000.txt"]


def test_interrupted_run_leaves_nothing_and_rerun_succeeds(tmp_path: Path, sample_dump: Path) -> None:
    # a bigger input (sample x3) so the run is still going when interrupted
    text = bz2.decompress(sample_dump.read_bytes()).decode()
    first, last = text.index("  <page>"), text.rindex("</page>") + len("</page>\n")
    big = tmp_path / "big.xml.bz2"
    big.write_bytes(bz2.compress((text[:first] + text[first:last] * 3 + text[last:]).encode(), 1))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "data", "wiki", str(big), "--out", str(out), "--workers", "2"],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job starts with SIGINT ignored, and Python then installs no KeyboardInterrupt
        # handler: give the child the default, as a terminal's Ctrl-C finds it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.exists() and any(out.glob(".wiki_*.tmp"))):
        time.sleep(0.005)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir()), "partial output left behind"
    res = cli(str(big), "--out", str(out), "--workers", "2", "--shards", "2")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["counts"]["articles_written"] == 97 * 3


# --------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written
# --------------------------------------------------------------------------------------------------


def _bad_inputs(tmp_path: Path, sample_dump: Path) -> dict[str, tuple[Path, str]]:
    sample = sample_dump.read_bytes()
    cases = {
        "missing": (tmp_path / "nope.xml.bz2", "no such file"),
        "not_bz2": (tmp_path / "plain.xml.bz2", "not a bz2 file"),
        "truncated": (tmp_path / "truncated.xml.bz2", "truncated bz2"),
        "other_xml": (tmp_path / "feed.xml.bz2", "not a MediaWiki XML dump"),
        "not_xml": (tmp_path / "notes.txt.bz2", "not a MediaWiki XML dump"),
        "incomplete_xml": (tmp_path / "cut.xml.bz2", "incomplete MediaWiki XML"),
        "empty_corpus": (tmp_path / "redirects.xml.bz2", "empty corpus"),
    }
    cases["not_bz2"][0].write_text(dump_xml([page_xml("A", "Text.")]))
    cases["truncated"][0].write_bytes(sample[: len(sample) * 2 // 3])
    write_bz2(cases["other_xml"][0], "<rss><channel><title>News</title></channel></rss>")
    write_bz2(cases["not_xml"][0], "just some notes\n" * 100)
    write_bz2(cases["incomplete_xml"][0], dump_xml([page_xml("A", "Text. More.")])[:-40])
    write_bz2(
        cases["empty_corpus"][0],
        dump_xml([page_xml("R", "#REDIRECT [[X]]", redirect="X"), page_xml("Talk:X", "Hi.", ns=1, pid=2)]),
    )
    return cases


@pytest.mark.parametrize(
    "case", ["missing", "not_bz2", "truncated", "other_xml", "not_xml", "incomplete_xml", "empty_corpus"]
)
def test_bad_dump_is_one_line_error(case: str, tmp_path: Path, sample_dump: Path) -> None:
    path, problem = _bad_inputs(tmp_path, sample_dump)[case]
    good = small_dump(tmp_path, "good.xml.bz2")
    out = tmp_path / "out"
    # the good dump first: shards are already being written when the bad one fails
    dumps = [str(path)] if case == "empty_corpus" else [str(good), str(path)]
    res = cli(*dumps, "--out", str(out), "--workers", "2", "--shards", "2")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"error: {path}") and problem in lines[0], lines[0]
    assert not out.exists(), f"output left behind: {snapshot(out)}"


def test_bad_input_keeps_existing_output_untouched(tmp_path: Path, sample_dump: Path) -> None:
    good = small_dump(tmp_path, "good.xml.bz2")
    out = tmp_path / "out"
    assert cli(str(good), "--out", str(out)).returncode == 0
    before = snapshot(out)
    # a non-empty output directory without --overwrite
    res = cli(str(good), "--out", str(out))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith(f"error: {out}: output directory is not empty") and "--overwrite" in res.stderr
    assert snapshot(out) == before
    # --overwrite with a truncated dump: the previous shards and manifest survive
    path, _ = _bad_inputs(tmp_path, sample_dump)["truncated"]
    res = cli(str(path), "--out", str(out), "--overwrite", "--workers", "2")
    assert res.returncode == 2 and res.stderr.startswith(f"error: {path}: truncated bz2")
    assert snapshot(out) == before


def test_output_path_that_is_a_file(tmp_path: Path) -> None:
    good = small_dump(tmp_path)
    (tmp_path / "a_file").write_text("x")
    res = cli(str(good), "--out", str(tmp_path / "a_file"))
    assert (
        res.returncode == 2
        and res.stderr.strip() == f"error: {tmp_path / 'a_file'}: output path exists and is not a directory"
    )


def test_shard_names_match_pattern() -> None:
    assert SHARD_PATTERN.match("wiki_00000.txt") and not SHARD_PATTERN.match(".wiki_00000.txt.x.tmp")


def test_sample_dump_path_without_gensim(tmp_path: Path) -> None:
    """With gensim not importable, the error says how to get it (run with site-packages hidden)."""
    code = (
        "import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "from common.errors import run_cli; from data.sample import sample_dump_path; "
        "sys.exit(run_cli(lambda argv: print(sample_dump_path())))"
    )
    res = run_python(["-S", "-c", code], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().startswith("error: gensim is not installed")
    assert "pip install gensim" in res.stderr and "Traceback" not in res.stderr
