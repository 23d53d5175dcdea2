#!/usr/bin/env python3
"""Check the built HTML book in a real browser (headless Chromium), offline.

Serves `_build/html` on 127.0.0.1, opens every page of the table of contents in
Debian's Chromium (driven by Playwright) and fails unless:

- no request leaves the machine (every request is recorded; any to another host fails
  the check);
- no page raises a JavaScript error;
- every formula of every page has been typeset by MathJax (holds an `mjx-container`);
- on the pages that have altair charts, every chart has drawn (holds an SVG or canvas);
- every chapter page has a Colab launch link to its own notebook in the repository,
  and under its title one note saying which Colab runtime to choose: a GPU exactly
  when its notebook's metadata asks Colab for one (_ext/colab_runtime.py);
- every chapter page has at least three exercises, each solution folded (closed) behind
  'Show the solution';
- no page shows more than one search field;
- no token string such as <s> or <pad> (in a caption, say) became an HTML element;
- chapter 1 has both math and at least one chart;
- on a 1366-pixel-wide page (a laptop), no code block, output or chart scrolls
  sideways (its scrollWidth is at most its clientWidth), and every figure has a caption;
- on a 400-pixel-wide phone screen, the pages with the most math and charts
  (PHONE_PAGES) do not scroll sideways as a whole, and each chart fits the page.

    python scripts/check_html.py [--html _build/html] [--chromium /usr/bin/chromium]
        [--screenshots DIR]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
COLAB = "https://colab.research.google.com"
REQUIRED = {"book/01_attention": {"math", "chart"}}  # what these pages must show
PHONE_PAGES = ["book/errata", "book/04_positional_encoding", "book/17_inside_attention"]
WIDE = {"width": 1366, "height": 1600}  # a common laptop screen
PHONE = {"width": 400, "height": 800}
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def repository_path() -> str:
    """'owner/name' of the repository, from _config.yml."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return urlsplit(config["repository"]["url"]).path.strip("/")


def toc_pages() -> list[str]:
    """Every page of the book, as 'book/name', in table-of-contents order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        pages += [entry["file"] for entry in part.get("chapters", [])]
    return pages


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the check's output readable
        pass


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve a folder on a free port of 127.0.0.1; return the server and base URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


CHECK_PAGE = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const charts = [...document.querySelectorAll('div[id^="altair-viz-"]')];
  const deadline = Date.now() + 20000;
  const drawn = (c) => c.querySelector('svg, canvas') !== null;
  const waiting = () => charts.some((c) => !drawn(c) && !c.querySelector('.error'));
  while (waiting() && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 100));
  }
  const math = [...document.querySelectorAll('span.math, div.math')];
  const all = (selector) => [...document.querySelectorAll(selector)];
  const longest = (text) =>
    text.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '');
  const captioned = (img) => img.closest('figure') !== null
    && img.closest('figure').querySelector('figcaption') !== null;
  return {
    math: math.length,
    untypeset: math.filter((m) => m.querySelector('mjx-container') === null).length,
    typeset: document.querySelectorAll('mjx-container').length,
    mathErrors: document.querySelectorAll('mjx-merror').length,
    charts: charts.length,
    drawn: charts.filter(drawn).length,
    chartErrors: charts.map((c) => c.querySelector('.error')).filter((e) => e)
      .map((e) => e.innerText),
    colab: [...new Set(all('a[href^="https://colab.research.google.com/"]')
      .map((a) => a.href))],
    sideways: all('div.cell_input pre, div.cell_output pre, div.highlight pre, '
                  + 'div.cell_output .vega-embed')
      .filter((e) => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
      .map((e) => longest(e.innerText || '').slice(0, 70)),
    uncaptioned: all('div.cell_output img').filter((img) => !captioned(img)).length,
    exercises: all('section#exercises p > strong')
      .filter((s) => /^Exercise \\d+ /.test(s.innerText)).length,
    solutions: all('section#exercises div.cell.tag_hide-cell')
      .map((c) => {
        const d = c.querySelector('details');
        return d !== null && !d.open
          && d.querySelector('summary').innerText.trim() === 'Show the solution';
      }),
    tokenTags: all('article s, article pad, article unk')
      .map((e) => e.tagName.toLowerCase() + ': ' + (e.textContent || '').slice(0, 50)),
    searches: all('input[type="search"], input[name="q"]')
      .filter((e) => e.offsetParent !== null).length,
    runtime: all('div.admonition p').map((e) => e.innerText.trim())
      .filter((t) => t.startsWith('Colab runtime:')),
    altairUncaptioned: charts.filter((c) => {
      const cell = c.closest('div.cell');
      const next = cell && cell.nextElementSibling;
      return !(next && /^Figure\\./.test((next.innerText || '').trim()));
    }).length,
  };
}"""

CHART_WIDTHS = """() => [...document.querySelectorAll('.vega-embed')].map(
    (e) => [e.scrollWidth, e.parentElement.clientWidth])"""
PAGE_WIDTH = (
    "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
)


def runtime_failures(name: str, notes: list[str]) -> list[str]:
    """What is wrong with a chapter's runtime note, given its notebook's metadata."""
    notebook = json.loads((ROOT / f"{name}.ipynb").read_text(encoding="utf-8"))
    if len(notes) != 1:
        return [f"{name}: {len(notes)} 'Colab runtime' notes, expected one"]
    wants_gpu = notebook["metadata"].get("accelerator") == "GPU"
    if notes[0].startswith("Colab runtime: GPU") != wants_gpu:
        return [
            f"{name}: the runtime note {notes[0]!r} disagrees with the notebook's "
            "metadata"
        ]
    return []


def check(html: Path, chromium: str, screenshots: Path | None) -> list[str]:
    """Open every page; return the list of failures (empty when the book is fine)."""
    failures: list[str] = []
    server, base = serve(html)
    local_host = urlsplit(base).netloc
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport=WIDE)
        outside: list[str] = []

        # let local requests through, record and refuse every other
        def route(r) -> None:
            url = urlsplit(r.request.url)
            if url.scheme in ("data", "blob") or url.netloc == local_host:
                r.continue_()
            else:
                outside.append(r.request.url)
                r.abort()

        context.route("**/*", route)
        for name in toc_pages():
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            # errors the page logs (a missing file, the theme's complaints) too
            page.on(
                "console",
                lambda m, errors=errors: (
                    errors.append(f"{m.text} {m.location.get('url', '')}".strip())
                    if m.type == "error"
                    else None
                ),
            )
            response = page.goto(f"{base}/{name}.html", wait_until="load")
            if response is None or response.status != 200:
                failures.append(f"{name}: page not found in {html}")
                continue
            result = page.evaluate(CHECK_PAGE)
            needs = REQUIRED.get(name, set())
            if "math" in needs and result["math"] == 0:
                failures.append(f"{name}: no math on the page")
            if result["untypeset"]:
                failures.append(
                    f"{name}: {result['untypeset']} of {result['math']} formulas "
                    "not typeset by MathJax"
                )
            if result["mathErrors"]:
                failures.append(f"{name}: {result['mathErrors']} MathJax errors")
            if "chart" in needs and result["charts"] == 0:
                failures.append(f"{name}: no altair chart on the page")
            if result["drawn"] < result["charts"]:
                failures.append(
                    f"{name}: {result['charts'] - result['drawn']} of "
                    f"{result['charts']} charts did not draw "
                    f"{result['chartErrors']}"
                )
            # a chapter: it opens in Colab from its notebook
            if re.fullmatch(r"book/\d\d_\w+", name):
                colab = f"{COLAB}/github/{repository_path()}/blob/main/{name}.ipynb"
                if result["colab"] != [colab]:
                    failures.append(
                        f"{name}: Colab launch link {result['colab']}, "
                        f"expected [{colab}]"
                    )
                elif not (ROOT / f"{name}.ipynb").exists():
                    failures.append(
                        f"{name}: the Colab link points to {name}.ipynb, "
                        "which does not exist"
                    )
                else:
                    failures += runtime_failures(name, result["runtime"])
                if (
                    result["exercises"] < 3
                    or len(result["solutions"]) < result["exercises"]
                ):
                    failures.append(
                        f"{name}: {result['exercises']} exercises, "
                        f"{len(result['solutions'])} solutions"
                    )
                if not all(result["solutions"]):
                    failures.append(
                        f"{name}: a solution is not folded behind 'Show the solution'"
                    )
            if result["searches"] > 1:
                failures.append(f"{name}: {result['searches']} search fields")
            failures += [
                f"{name}: scrolls sideways at {WIDE['width']} px: {line!r}"
                for line in result["sideways"]
            ]
            if result["tokenTags"]:
                failures.append(
                    f"{name}: token strings read as HTML tags (write them as code): "
                    f"{result['tokenTags'][:2]}"
                )
            if result["uncaptioned"]:
                failures.append(
                    f"{name}: {result['uncaptioned']} figures without a caption"
                )
            if result["altairUncaptioned"]:
                failures.append(
                    f"{name}: {result['altairUncaptioned']} charts not followed "
                    "by a 'Figure.' caption"
                )
            failures += [f"{name}: JavaScript error: {e}" for e in errors]
            print(
                f"{name}: {result['typeset']} formulas typeset, "
                f"{result['drawn']}/{result['charts']} charts drawn, "
                f"{len(errors)} script errors"
            )
            if screenshots is not None:
                screenshots.mkdir(parents=True, exist_ok=True)
                page.screenshot(
                    path=str(screenshots / f"{Path(name).name}.png"), full_page=False
                )
            page.close()
        phone = browser.new_context(viewport=PHONE)
        phone.route("**/*", route)
        for name in PHONE_PAGES:
            page = phone.new_page()
            page.goto(f"{base}/{name}.html", wait_until="load")
            page.evaluate(CHECK_PAGE)  # waits for MathJax
            overflow = page.evaluate(PAGE_WIDTH)
            if overflow > 1:
                failures.append(
                    f"{name}: scrolls sideways by {overflow} px "
                    f"on a {PHONE['width']} px phone"
                )
            failures += [
                f"{name}: chart {i + 1} is {width} px wide in {room} px on a "
                f"{PHONE['width']} px phone"
                for i, (width, room) in enumerate(page.evaluate(CHART_WIDTHS))
                if width > room + 1
            ]
            page.close()
        browser.close()
    server.shutdown()
    failures += [f"request left the machine: {url}" for url in sorted(set(outside))]
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    parser.add_argument(
        "--chromium", default=shutil.which("chromium") or "/usr/bin/chromium"
    )
    parser.add_argument(
        "--screenshots", type=Path, help="save a screenshot of each page here"
    )
    args = parser.parse_args(argv)
    if not (args.html / "index.html").exists():
        print(
            f"error: no built book in {args.html}: run jupyter-book build . first",
            file=sys.stderr,
        )
        return 2
    if not Path(args.chromium).exists():
        print(
            f"error: no Chromium at {args.chromium}: apt-get install chromium",
            file=sys.stderr,
        )
        return 2
    failures = check(args.html, args.chromium, args.screenshots)
    for f in failures:
        print(f"FAIL {f}")
    print(
        "browser check passed"
        if not failures
        else f"browser check failed ({len(failures)} problems)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
