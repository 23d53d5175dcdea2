#!/usr/bin/env python3
"""Build the whole book as one PDF, `_build/book.pdf`, without a TeX installation.

Jupyter Book writes the book as one HTML page (its `singlehtml` builder, from the
stored notebooks, like the HTML book); headless Chromium, driven by Playwright and
offline, opens that page, waits until MathJax has typeset every formula and every
altair chart has drawn, and prints it:

- a title page, then a table of contents that links to each part and chapter (the PDF
  also carries them as bookmarks);
- each chapter on a new page, numbered pages;
- code and outputs wrapped at the margin, never cut (the book's code fits in 88
  columns, printed at 8.6 points on A4); figures scaled to the page;
- folded cells stay folded as in the HTML (validation code): their outputs print,
  their code does not; the charts print without their controls (menu, sliders);
- the exercises' solutions move to a last appendix, "Solutions to the exercises",
  opened, with a link from each exercise to its solution and back.

Then the PDF is read back (pypdf) and checked: it has at least MIN_PAGES pages, and
every part and chapter title of _toc.yml is a bookmark and in the text of the page
that the bookmark opens. The check
alone runs with --check-only.

    python scripts/build_pdf.py                 build _build/singlehtml, then the PDF
    python scripts/build_pdf.py --no-build      print the existing single page
    python scripts/build_pdf.py --check-only    check an existing _build/book.pdf
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from playwright.sync_api import sync_playwright
from pypdf import PdfReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_html import CHROMIUM_ARGS, serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SINGLE = ROOT / "_build" / "singlehtml"
PDF = ROOT / "_build" / "book.pdf"
SOURCE = "book/intro.html"  # the root document: the whole book on one page
# Its links (_static/, _images/) are relative to the builder's root folder, not to
# book/: the page is printed from a copy there.
PAGE = "book.html"
SOLUTIONS = "Solutions to the exercises"
MIN_PAGES = 300  # the book prints on some 750 A4 pages; fewer means content is missing
BODY_PT = 10.5  # the body text; a page wider than A4 would shrink it all

# What the page gets before printing: the theme's own print styles hide the sidebars
# and buttons; these break chapters onto new pages, keep code inside the margin and
# hide the charts' controls (their menu of actions, their sliders), which paper
# cannot work.
PRINT_CSS = """
@page { size: A4; margin: 16mm 14mm 18mm 14mm; }
html { font-size: BODY_PTpt; }
.bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, .header-article,
.prev-next-area, .bd-footer, .bd-footer-article, footer, .headerlink,
.copybtn, .toggle-details__summary-text { display: none !important; }
.bd-container, .bd-container__inner, .bd-page-width, .bd-main, .bd-main .bd-content,
.bd-article-container, .bd-article { display: block !important; min-width: 0 !important;
  max-width: 100% !important; width: 100% !important; margin-left: 0 !important;
  padding-left: 0 !important; padding-right: 0 !important; }
section.book-chapter { break-before: page; }
#book-title { height: 230mm; display: flex; flex-direction: column;
  justify-content: center; text-align: center; break-after: page; }
#book-title h1 { font-size: 30pt; display: block !important; }
#book-title p { font-size: 14pt; }
#book-contents { break-after: page; }
#book-contents ul { list-style: none; padding-left: 1em; }
pre, .highlight pre, div.cell_output pre { white-space: pre-wrap !important;
  overflow-wrap: anywhere; overflow: visible !important; font-size: 8.6pt; }
div.cell_output, .output, .vega-embed, figure, img, svg { max-width: 100% !important; }
img { height: auto !important; }
figure, .cell, table, .admonition { break-inside: avoid; }
h2, h3, h4 { break-after: avoid; }
details.hide > summary { display: none !important; }
#book-solutions > p { break-after: avoid; }
mjx-container[display="true"] { overflow: visible !important; }
.vega-embed details, .vega-bindings { display: none !important; }
""".replace("BODY_PT", str(BODY_PT))

# Waits for MathJax and the charts, marks each chapter's section (to start a page), and
# puts a title page and the table of contents first; returns what it found.
PREPARE = """async (meta) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const charts = [...document.querySelectorAll('div[id^="altair-viz-"]')];
  const drawn = (c) => c.querySelector('svg, canvas') !== null;
  const deadline = Date.now() + 60000;
  const waiting = () => charts.some((c) => !drawn(c) && !c.querySelector('.error'));
  while (waiting() && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 100));
  }
  const math = [...document.querySelectorAll('span.math, div.math')];
  const article = document.querySelector('article.bd-article') || document.body;
  const plain = (t) => t.replace(/[\u2018\u2019]/g, "'").replace(/#$/, '').trim();
  const title = (s) => plain(s.querySelector(':scope > h2').innerText);
  const heading3 = (s) => s.querySelector(':scope > h3');
  let chapters = [];
  const findChapters = () => {
    chapters = [...article.querySelectorAll('section')].filter((s) =>
      s.querySelector(':scope > h2') !== null
      && s.parentElement.closest('section') !== null);
  };
  findChapters();
  // The exercises' solutions move to an appendix, each opened, with a link both ways.
  const solutions = document.createElement('section');
  solutions.innerHTML = '<h2></h2>';
  solutions.id = 'book-solutions';
  solutions.querySelector('h2').textContent = meta.solutions;
  let solved = 0, exercises = 0;
  for (const chapter of chapters) {
    const number = (meta.numbers[title(chapter)] || '') + '';
    const section = [...chapter.querySelectorAll(':scope > section')]
      .find((s) => heading3(s) && plain(heading3(s).innerText) === 'Exercises');
    if (!section || !number) continue;
    const heading = document.createElement('h3');
    heading.textContent = number + '. ' + title(chapter);
    solutions.appendChild(heading);
    let current = null;
    for (const node of [...section.children]) {
      const opening = node.tagName === 'P' && node.querySelector(':scope > strong');
      const m = opening
        && node.querySelector(':scope > strong').innerText.match(/^Exercise (\\d+)/);
      if (m) {
        exercises += 1;
        const id = 'solution-' + number + '-' + m[1];
        node.id = 'exercise-' + number + '-' + m[1];
        current = document.createElement('p');
        current.innerHTML = '<strong></strong> <a>(the exercise)</a>';
        current.id = id;
        current.querySelector('strong').textContent = 'Exercise ' + number + '.' + m[1];
        current.querySelector('a').href = '#' + node.id;
        solutions.appendChild(current);
        const link = document.createElement('a');
        link.href = '#' + id;
        link.textContent = ' (solution: appendix)';
        node.appendChild(link);
      } else if (current && node.matches('div.cell.tag_hide-cell')) {
        node.querySelectorAll('details').forEach((d) => { d.open = true; });
        solutions.appendChild(node);
        solved += 1;
      }
    }
  }
  chapters[chapters.length - 1].parentElement.appendChild(solutions);
  findChapters();
  const byTitle = new Map(chapters.map((s) => [title(s), s]));
  const cover = document.createElement('div');
  cover.id = 'book-title';
  cover.innerHTML = '<h1></h1><p></p>';
  cover.querySelector('h1').textContent = meta.title;
  cover.querySelector('p').textContent = meta.author;
  const nav = document.createElement('nav');
  nav.id = 'book-contents';
  nav.innerHTML = '<h2>Contents</h2>';
  const missing = [];
  for (const part of meta.parts) {
    const title = document.createElement('h3');
    title.textContent = part.caption;
    nav.appendChild(title);
    const list = document.createElement('ul');
    for (const chapter of part.chapters) {
      const section = byTitle.get(chapter.title);
      if (!section) { missing.push(chapter.title); continue; }
      section.classList.add('book-chapter');
      if (!section.id) {
        section.id = 'book-chapter-' + article.querySelectorAll('.book-chapter').length;
      }
      const item = document.createElement('li');
      const link = document.createElement('a');
      link.href = '#' + section.id;
      link.textContent = (chapter.number ? chapter.number + '. ' : '') + chapter.title;
      item.appendChild(link);
      list.appendChild(item);
    }
    nav.appendChild(list);
  }
  article.prepend(cover, nav);
  // The theme's own contents box of the root page lists only the first page's sections.
  const printToc = document.querySelectorAll('#jb-print-toc, .bd-toc, .onlyprint');
  printToc.forEach((e) => e.remove());
  return {
    math: math.length,
    untypeset: math.filter((m) => m.querySelector('mjx-container') === null).length,
    mathErrors: document.querySelectorAll('mjx-merror').length,
    charts: charts.length,
    drawn: charts.filter(drawn).length,
    chapters: article.querySelectorAll('.book-chapter').length,
    exercises,
    solved,
    missing,
  };
}"""

# The charts' controls that would print: menus, sliders, buttons, visible boxes.
VISIBLE_CONTROLS = """() => [...document.querySelectorAll(
  '.vega-embed details, .vega-embed input, .vega-embed select, .vega-embed button'
)].filter((e) => e.getClientRects().length > 0).length"""

FOOTER = (
    '<div style="font-size:8pt;width:100%;text-align:center;color:#555">'
    '<span class="pageNumber"></span> / <span class="totalPages"></span></div>'
)


def book_contents() -> dict:
    """The title, the authors, and the parts with their pages, in _toc.yml's order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    parts = []
    for part in toc.get("parts", []):
        pages = []
        for entry in part.get("chapters", []):
            number = re.match(r"book/(\d+)_", entry["file"])  # numbered chapters
            pages.append(
                {
                    "title": page_title(entry["file"]),
                    "number": int(number.group(1)) if number else None,
                }
            )
        parts.append({"caption": part["caption"], "chapters": pages})
    # The PDF's own last appendix: the solutions, moved out of the chapters.
    parts[-1]["chapters"].append({"title": SOLUTIONS, "number": None})
    numbers = {
        c["title"]: c["number"] for p in parts for c in p["chapters"] if c["number"]
    }
    return {
        "title": config["title"],
        "author": config["author"],
        "parts": parts,
        "solutions": SOLUTIONS,
        "numbers": numbers,
    }


def page_title(name: str) -> str:
    """A page's title: the first `# ` heading of its source."""
    m = re.search(r"^# (.+?)\s*$", (ROOT / f"{name}.md").read_text("utf-8"), re.M)
    if m is None:
        raise SystemExit(f"no title found for {name} (a '# ' heading in {name}.md)")
    return m.group(1).strip()


def build_single_page() -> None:
    command = [str(Path(sys.executable).with_name("jupyter-book")), "build"]
    command += ["--builder", "singlehtml", "-W", "-n", "--keep-going", "."]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def print_pdf(chromium: str | None, contents: dict) -> dict:
    """Print the single page to PDF; return what the page reported before printing."""
    shutil.copyfile(SINGLE / SOURCE, SINGLE / PAGE)
    server, base = serve(SINGLE)
    host = urlsplit(base).netloc
    outside: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 1500})

            def route(r) -> None:  # offline: nothing may leave the machine
                if urlsplit(r.request.url).netloc in (host, ""):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.goto(f"{base}/{PAGE}", wait_until="load", timeout=180_000)
            found = page.evaluate(PREPARE, contents)
            page.add_style_tag(content=PRINT_CSS)
            page.emulate_media(media="print")
            found["controls"] = page.evaluate(VISIBLE_CONTROLS)
            page.pdf(
                path=str(PDF),
                format="A4",
                print_background=True,
                display_header_footer=True,
                header_template="<span></span>",
                footer_template=FOOTER,
                outline=True,
                tagged=True,
                prefer_css_page_size=True,
            )
            browser.close()
    finally:
        server.shutdown()
    found["outside"] = outside
    return found


def normalized(text: str) -> str:
    """Text with each run of whitespace (line, page breaks) one space, quotes plain."""
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u00ad", "")
    return re.sub(r"\s+", " ", text)


def bookmarks(reader: PdfReader) -> dict[str, int]:
    """Each bookmark's title, and the page it opens (the first such bookmark).

    Titles are keyed without spaces, since Chromium joins a heading's wrapped lines
    without one.
    """
    found: dict[str, int] = {}
    stack = list(reader.outline)
    while stack:
        item = stack.pop(0)
        if isinstance(item, list):
            stack[:0] = item
            continue
        key = re.sub(r"\s+", "", normalized(item.title))
        found.setdefault(key, reader.get_destination_page_number(item))
    return found


def body_size(reader: PdfReader, pages: range = range(30, 60)) -> float:
    """The font size, in points, of most of the text on a run of pages."""
    sizes: Counter = Counter()

    def visit(text: str, cm: list, tm: list, font: Any, size: float) -> None:
        if text.strip():  # the size as printed: the font's, scaled by both matrices
            sizes[round(abs(size * tm[3] * cm[3]), 1)] += len(text)

    for n in pages:
        if n < len(reader.pages):
            reader.pages[n].extract_text(visitor_text=visit)
    return sizes.most_common(1)[0][0] if sizes else 0.0


def check_pdf(contents: dict, path: Path = PDF) -> list[str]:
    """What is wrong with the book's PDF (empty when it is fine).

    Every part and chapter title must be a bookmark, and in the text of the page that
    the bookmark opens (pages are read one by one: only those, for speed).
    """
    if not path.exists():
        return [f"{path} does not exist: run scripts/build_pdf.py"]
    reader = PdfReader(path)
    failures = []
    if len(reader.pages) < MIN_PAGES:
        failures.append(f"{len(reader.pages)} pages, expected at least {MIN_PAGES}")
    body = body_size(reader)
    if abs(body - BODY_PT) > 0.5:
        failures.append(
            f"the body text prints at {body:.1f} pt, not {BODY_PT}: something wider "
            "than the page (a long line, a wide table) made Chromium shrink every page"
        )
    marks = bookmarks(reader)
    if not marks:
        failures.append("the PDF has no outline (bookmarks)")
    texts: dict[int, str] = {}
    for part in contents["parts"]:
        for title in [part["caption"], *(c["title"] for c in part["chapters"])]:
            page = marks.get(re.sub(r"\s+", "", normalized(title)))
            if page is None:
                failures.append(f"title not among the PDF's bookmarks: {title!r}")
                continue
            if page not in texts:
                texts[page] = normalized(reader.pages[page].extract_text() or "")
            if normalized(title) not in texts[page]:
                failures.append(f"title not in the text of page {page + 1}: {title!r}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-build", action="store_true", help="reuse _build/singlehtml"
    )
    parser.add_argument(
        "--check-only", action="store_true", help="check _build/book.pdf"
    )
    parser.add_argument(
        "--chromium",
        default=shutil.which("chromium") or shutil.which("chromium-browser"),
        help="the browser to print with (default: the system's Chromium, else the one "
        "that `playwright install chromium` downloads)",
    )
    args = parser.parse_args()
    contents = book_contents()
    start = time.perf_counter()
    if not args.check_only:
        if not args.no_build:
            build_single_page()
        if not (SINGLE / SOURCE).exists():
            raise SystemExit(
                f"{SINGLE / SOURCE} is missing: build it (drop --no-build)"
            )
        found = print_pdf(args.chromium, contents)
        problems = []
        if found["untypeset"] or found["mathErrors"]:
            problems.append(
                f"{found['untypeset']} of {found['math']} formulas not typeset, "
                f"{found['mathErrors']} MathJax errors"
            )
        if found["drawn"] < found["charts"]:
            problems.append(f"{found['drawn']} of {found['charts']} charts drawn")
        if found["solved"] < found["exercises"]:
            problems.append(
                f"{found['solved']} solutions for {found['exercises']} exercises"
            )
        if found["missing"]:
            problems.append(f"chapters not found on the page: {found['missing']}")
        if found["outside"]:
            problems.append(f"requests off the machine: {found['outside'][:3]}")
        if found["controls"]:
            problems.append(f"{found['controls']} chart controls would print")
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        print(
            f"printed {found['chapters']} chapters, {found['math']} formulas, "
            f"{found['charts']} charts, {found['exercises']} exercises with "
            f"{found['solved']} solution cells"
        )
    failures = check_pdf(contents)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        return 1
    pages = len(PdfReader(PDF).pages)
    size = PDF.stat().st_size / 2**20
    seconds = time.perf_counter() - start
    print(f"{PDF.relative_to(ROOT)}: {pages} pages, {size:.1f} MiB, {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
