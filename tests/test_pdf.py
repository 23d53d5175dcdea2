"""The PDF check of scripts/build_pdf.py (CI builds the PDF itself, after the HTML).

Building the PDF needs the built book and Chromium, so the tests do not; they check
that its reading of the table of contents is the book's, and that its check of a PDF
can fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pypdf import PdfWriter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build_pdf  # noqa: E402
import export  # noqa: E402


def test_the_contents_list_every_page_of_the_toc_with_chapter_numbers() -> None:
    contents = build_pdf.book_contents()
    pages = [c for part in contents["parts"] for c in part["chapters"]]
    numbered = [c["number"] for c in pages if c["number"] is not None]
    assert numbered == list(range(1, len(export.chapter_paths()) + 1))
    assert pages[0]["title"] == "A tour in one hour" and pages[0]["number"] is None
    assert {"The encoder", "The command line", "Errata of the source documents"} <= {
        c["title"] for c in pages
    }


def test_a_pdf_without_the_book_fails_the_check(tmp_path: Path) -> None:
    blank = tmp_path / "blank.pdf"
    writer = PdfWriter()
    for _ in range(3):
        writer.add_blank_page(width=595, height=842)
    writer.write(blank)
    failures = build_pdf.check_pdf(build_pdf.book_contents(), blank)
    assert failures[0] == f"3 pages, expected at least {build_pdf.MIN_PAGES}"
    assert failures[1].startswith("the body text prints at 0.0 pt, not 10.5")
    assert failures[2] == "the PDF has no outline (bookmarks)"
    assert "title not among the PDF's bookmarks: 'The decoder'" in failures
    missing = build_pdf.check_pdf(build_pdf.book_contents(), tmp_path / "none.pdf")
    assert missing == [
        f"{tmp_path / 'none.pdf'} does not exist: run scripts/build_pdf.py"
    ]
