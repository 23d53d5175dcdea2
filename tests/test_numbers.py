"""Every number the book states comes from a cell, from a source, or is a definition.

A number that a cell computes carries its expression (`0.490<!--{sims[50]:.3f}-->`,
scripts/quoted.py): nbval recomputes it after the cell that precedes it (conftest.py)
and scripts/execute.py rewrites it when a re-run changes it. A number taken from
elsewhere is attributed: its sentence cites a source ({cite}, the paper, a document,
a recorded result under results/ or benchmarks/), or the number carries a source
comment (`65 million<!--src: paper, Table 3-->`). Left out as plain definitions:
references (chapter 9, section 3.4, Table 3, step 100, layer 2...), years, whole
numbers up to 12 (six layers, 8 heads), numbers joined to a word (32-bit, 2-core),
formulas and code, and the exercises' statements. Any other number is stale
waiting to happen, and fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import nbformat
import pytest
import quoted

from conftest import HANG_S

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.md"))
PAGES = [
    *CHAPTERS,
    BOOK / "tour.md",
    BOOK / "intro.md",
    BOOK / "errata.md",
    BOOK / "model_card.md",
    ROOT / "README.md",
]

NUMBER = re.compile(
    r"(?<![\w.$/#@-])[-−]?\d(?:[\d,]*\d)?(?:\.\d+)?%?(?![\w/-])(?!\.\d)"
)
REFERENCE = re.compile(
    r"(?:\b(?:[Cc]hapters?|[Ss]ections?|Tables?|Figures?|[Ee]xercises?|"
    r"[Ee]quations?|[Ss]teps?|[Ll]ayers?|[Rr]ows?|[Ll]ines?|[Vv]ersions?|Python|"
    r"PyTorch|[Pp]ositions?|[Hh]eads?|[Cc]ells?|[Pp]ages?|[Ii]ssues?|pass|"
    r"[Ss]plits?|[Cc]olumns?|[Ss]entences?|[Bb]atch|[Bb]locks?|[Tt]okens?|"
    r"[Ii]ndex|[Ii]ds?|[Dd]imensions?|[Pp]airs?|[Ss]nippet)"
    r"(?:\s+\d[\d,.]*(?:,|\s+and|\s+or|\s+to))*\s+$)"
)
ATTRIBUTION = re.compile(
    r"\{cite\}|\bpaper\b|paper's|\bTable \d|\bdocuments?\b|document's|"
    r"\b[Rr]ecord(?:ed|s)?\b|results/|benchmarks/"
)
SOURCE = re.compile(r"<!--src:\s*(?P<what>[^>]+?)\s*-->")


def prose(text: str) -> str:
    """The prose of a page: formulas, code, roles' targets and comments left out.

    A number followed by a quote or source comment is kept with its comment, so
    that the check sees what accounts for it.
    """
    text = re.sub(r"^---\n.*?\n---\n", "", text, flags=re.S)  # front matter
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code, directives
    text = re.sub(r"^## Exercises\n.*?(?=^## )", "", text, flags=re.S | re.M)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"(?<!\\)\$[^$\n]+\$", " ", text)
    text = re.sub(
        r"`(?!results/|benchmarks/)[^`\n]*`", " ", text
    )  # a record's path stays
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    text = re.sub(r"^\(.*\)=$|^#.*$|^%.*$", "", text, flags=re.M)  # labels, headings
    text = re.sub(r"<(?:img|a|span|div)[^>]*>", " ", text)
    return text


def sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?;])\s+(?=[A-Z(*{])|\n\s*\n|\n(?=\s*[-|*] )", text)


def unaccounted(text: str) -> list[str]:
    """The numbers of a page that are neither quoted, attributed nor definitions.

    A paragraph that names a test (tests/test_x.py::test_y) states what that test
    asserts: its numbers are accounted for by the test.
    """
    found = []
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    paragraphs = re.split(r"\n\s*\n", text)
    kept = [p for p in paragraphs if not re.search(r"tests/test_\w+\.py::test_", p)]
    for sentence in sentences(prose("\n\n".join(kept))):
        attributed = ATTRIBUTION.search(re.sub(r"<!--.*?-->", "", sentence))
        comments = [c.span() for c in re.finditer(r"<!--.*?-->", sentence)]
        for m in NUMBER.finditer(sentence):
            number, after = m.group(), sentence[m.end() :]
            if after.startswith("<!--"):  # a quote or a source: checked elsewhere
                continue
            if any(a <= m.start() < b for a, b in comments):  # inside one
                continue
            if REFERENCE.search(sentence[max(0, m.start() - 40) : m.start()]):
                continue
            plain = number.replace(",", "").replace("%", "").lstrip("-−")
            if plain.isdigit() and (int(plain) <= 12 or 1900 <= int(plain) <= 2030):
                if "%" not in number:
                    continue
            if attributed:
                continue
            context = sentence[max(0, m.start() - 50) : m.end() + 20]
            found.append(f"{number}: ...{' '.join(context.split())}...")
    return found


def sources(text: str) -> list[str]:
    return [m["what"] for m in SOURCE.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_is_quoted_attributed_or_a_definition(page: Path) -> None:
    missing = unaccounted(page.read_text(encoding="utf-8"))
    assert not missing, (
        f"{page.name}: {len(missing)} numbers neither quote the cell that computes "
        "them (NUMBER<!--{expression:format}-->, scripts/quoted.py) nor say where "
        "they come from (a citation, or NUMBER<!--src: ...-->):\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_source_comment_names_a_source(page: Path) -> None:
    """src: the paper, a source document, or a file of the repository."""
    for what in sources(page.read_text(encoding="utf-8")):
        first = what.split(",")[0].split()[0]
        if "/" in first:
            assert (ROOT / first).exists(), f"{page.name}: no {first} for {what!r}"
        else:
            assert re.fullmatch(r"paper|doc00\d|definition", first), (page.name, what)


def test_the_check_fails_on_a_planted_stale_number() -> None:
    page = BOOK / "04_positional_encoding.md"
    text = page.read_text(encoding="utf-8")
    assert not unaccounted(text)
    planted = text.replace(
        "\n## Summary\n",
        "\n## Summary\n\nThe encoding's rms is 0.72 at every position.\n",
        1,
    )
    assert unaccounted(planted) == [
        "0.72: ...The encoding's rms is 0.72 at every position...."
    ]


def test_each_quote_is_checked_after_a_cell_of_its_page() -> None:
    """Every quote is planned after a code cell; another page's names a chapter."""
    counts: Counter = Counter()
    for page in CHAPTERS + [BOOK / "tour.md"]:
        nb = quoted.read_notebook(page)
        for _, found in quoted.plan(nb, page.stem):
            counts[page.stem] += len(found)
    for page in quoted.QUOTING_PAGES:
        for quote in quoted.quotes(page.read_text(encoding="utf-8")):
            assert quote.chapter is not None, (page.name, quote)
            assert (BOOK / f"{quote.chapter}.md").exists(), (page.name, quote)
    assert counts["04_positional_encoding"] > 0


def run_nbval(folder: Path, prose: str) -> subprocess.CompletedProcess:
    """nbval, with the book's quote checks (conftest.py), on a two-cell notebook."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    code = nbformat.v4.new_code_cell("share = 0.25")
    code.execution_count = 1
    nb.cells = [code, nbformat.v4.new_markdown_cell(prose)]
    nbformat.write(nb, folder / "page.ipynb")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--nbval",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "page.ipynb",
        ],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


def test_a_quoted_number_that_the_cells_no_longer_compute_fails(tmp_path) -> None:
    """The quote check of conftest.py, on a planted stale number and a true one."""
    stale = run_nbval(tmp_path, "A quarter: 0.26<!--{share:.2f}--> of it.")
    assert stale.returncode == 1 and "quoted numbers" in stale.stdout, stale.stdout
    assert "0.26" in stale.stdout and "0.25" in stale.stdout
    true = run_nbval(tmp_path, "A quarter: 0.25<!--{share:.2f}--> of it.")
    assert true.returncode == 0, true.stdout
    assert "2 passed" in true.stdout
