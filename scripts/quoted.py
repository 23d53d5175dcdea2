"""Numbers that the prose quotes from the cells: found, recomputed, rewritten.

A number in a page's prose that a cell computes is written with the expression that
computes it, as an HTML comment right after it, which every reader of the page
(the HTML book, the PDF, Jupyter, Colab, GitHub) leaves out:

    the base model has 63,082,496<!--{base.num_parameters():,}--> parameters

The comment holds a replacement field of an f-string, `{expression:format}`: the
number's text is what `format(expression, "format")` gives in the chapter's kernel,
after the code cell that precedes the paragraph. A page that is not a chapter (the
intro, the errata, the model card, the README) names the chapter whose kernel
computes it, and the value is taken at the end of that chapter (as it is for a
chapter's own number that names the chapter, for a value computed further on):

    its greedy search scores 40.5<!--16_translation{greedy_bleu:.1f}--> on test2016

Two programs use the markers:

- `scripts/execute.py` runs, after each code cell followed by markers, a cell that
  prints their values, and rewrites every number whose value changed, in the chapter
  and in the pages that quote it: re-running a chapter updates its sentences.
- the test suite (`conftest.py`) adds the same cells to nbval's run of each notebook,
  with the numbers of the prose as their expected output: a number that no longer
  matches what the cells compute fails the tests (`tests/test_numbers.py` checks the
  numbers that carry no marker).

A number taken from elsewhere says where, with a source comment instead:
`65 million<!--src: paper, Table 3-->`, `21.9<!--src: results/recipe-study/-->`
(`tests/test_numbers.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
# The pages that are not chapters and may quote a chapter's numbers.
QUOTING_PAGES = [
    BOOK / "intro.md",
    BOOK / "errata.md",
    BOOK / "model_card.md",
    ROOT / "README.md",
]
NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?%?"
MARKER = re.compile(
    rf"(?P<number>{NUMBER})<!--(?P<chapter>\d\d_\w+|tour)?\{{(?P<field>.+?)\}}-->"
)
MARK = "# the numbers that the prose quotes after this cell"


@dataclass(frozen=True)
class Quote:
    """One marked number: its text, its expression and format, and where it is."""

    number: str
    expression: str
    spec: str
    chapter: str | None  # None: the page's own chapter, after the preceding cell
    start: int  # of the number in the text it was found in
    end: int  # of the whole marker

    def code(self) -> str:
        """The line that prints the value, as the number's text should read."""
        return f"print(format({self.expression}, {self.spec!r}))"


def split_field(field: str) -> tuple[str, str]:
    """`expression:format` split at the first colon outside brackets and strings."""
    depth, quote = 0, ""
    for i, char in enumerate(field):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == ":" and depth == 0:
            return field[:i].strip(), field[i + 1 :]
    return field.strip(), ""


def quotes(text: str) -> list[Quote]:
    """The marked numbers of a text, in order."""
    found = []
    for m in MARKER.finditer(text):
        expression, spec = split_field(m["field"])
        found.append(
            Quote(m["number"], expression, spec, m["chapter"], m.start(), m.end())
        )
    return found


def rewrite(text: str, values: list[str | None]) -> str:
    """text with each marked number replaced by its value (None: kept)."""
    pieces, last = [], 0
    for quote, value in zip(quotes(text), values, strict=True):
        pieces.append(text[last : quote.start])
        pieces.append(quote.number if value is None else value)
        last = quote.start + len(quote.number)
    return "".join(pieces) + text[last:]


def check_cell(lines: list[str], expected: list[str], ignore: bool):
    """The code cell that prints the quoted values; its output, the prose's numbers."""
    cell = nbformat.v4.new_code_cell("\n".join([MARK, *lines]))
    tags = ["remove-cell", "nbval-ignore-output"] if ignore else ["remove-cell"]
    cell.metadata["tags"] = tags
    text = "".join(f"{number}\n" for number in expected)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    cell.execution_count = 1  # nbval compares the outputs of a cell that ran
    return cell


def foreign_quotes(chapter: str) -> list[tuple[Path, Quote]]:
    """The numbers that the other pages quote from chapter (its stem), in order."""
    return [
        (page, quote)
        for page in QUOTING_PAGES
        if page.exists()
        for quote in quotes(page.read_text(encoding="utf-8"))
        if quote.chapter == chapter
    ]


def plan(nb: nbformat.NotebookNode, chapter: str) -> list[tuple[int, list[Quote]]]:
    """(index of a code cell, the quotes to check after it), in the notebook's order.

    The quotes of the prose after a code cell (up to the next code cell) are checked
    after it; the quotes of other pages, after the last cell. A quote before the
    first code cell, or one that names another chapter inside a chapter, is an error.
    """
    checks: list[tuple[int, list[Quote]]] = []
    at_end: list[Quote] = []  # quotes that name this chapter: after its last cell
    last_code = None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            last_code = i
            continue
        if cell.cell_type != "markdown":
            continue
        found = [q for q in quotes(cell.source) if q.chapter is None]
        at_end += [q for q in quotes(cell.source) if q.chapter == chapter]
        for quote in quotes(cell.source):
            if quote.chapter not in (None, chapter) or (last_code is None and found):
                raise ValueError(
                    f"{chapter}: the number {quote.number} quotes "
                    f"{{{quote.expression}}} before any code cell computes it, or "
                    "names another chapter: a chapter quotes its own cells, after "
                    f"the cell that computes the value (or, as {chapter}{{...}}, "
                    "at its end)"
                )
        if found:
            if checks and checks[-1][0] == last_code:
                checks[-1][1].extend(found)
            else:
                checks.append((last_code, list(found)))
    foreign = at_end + [quote for _, quote in foreign_quotes(chapter)]
    if foreign:
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        if checks and checks[-1][0] == code[-1]:
            checks[-1][1].extend(foreign)
        else:
            checks.append((code[-1], foreign))
    return checks


def with_checks(
    nb: nbformat.NotebookNode, chapter: str
) -> tuple[nbformat.NotebookNode, list[tuple[int, list[Quote]]]]:
    """A copy of nb with a check cell after each code cell that is quoted.

    Returns the copy and, for each check cell, its index in the copy and its quotes.
    """
    checks = plan(nb, chapter)
    out = nbformat.from_dict(nb)
    inserted = []
    for offset, (index, found) in enumerate(checks):
        after = out.cells[index + offset]
        ignore = "nbval-ignore-output" in after.metadata.get("tags", [])
        cell = check_cell([q.code() for q in found], [q.number for q in found], ignore)
        out.cells.insert(index + offset + 1, cell)
        inserted.append((index + offset + 1, found))
    return out, inserted


def printed(cell: nbformat.NotebookNode) -> list[str]:
    """The lines a check cell printed."""
    text = "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream"
    )
    return text.splitlines()


def update_pages(
    md: Path, executed: nbformat.NotebookNode, inserted: list[tuple[int, list[Quote]]]
) -> list[str]:
    """Rewrite the chapter's and the other pages' numbers to the computed values.

    Returns a line for each number that changed.
    """
    chapter = md.stem
    values: dict[tuple[str | None, str], list[str]] = {}
    for index, found in inserted:
        lines = printed(executed.cells[index])
        if len(lines) != len(found):
            raise ValueError(f"{chapter}: a check cell printed {lines}")
        for quote, line in zip(found, lines):
            key = (quote.chapter, quote.expression + quote.spec)
            values.setdefault(key, []).append(line)
    changed = []
    for page in [md, *QUOTING_PAGES]:
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        new_values: list[str | None] = []
        taken: dict[tuple[str | None, str], int] = {}
        for quote in quotes(text):
            if quote.chapter != chapter and (page != md or quote.chapter is not None):
                new_values.append(None)  # another chapter's number
                continue
            key = (quote.chapter, quote.expression + quote.spec)
            k = taken.get(key, 0)
            taken[key] = k + 1
            value = values[key][k]
            if value != quote.number:
                changed.append(f"{page.name}: {quote.number} -> {value}")
            new_values.append(value)
        new = rewrite(text, new_values)
        if new != text:
            page.write_text(new, encoding="utf-8")
    return changed


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """A chapter as a notebook, from its .md or .ipynb."""
    return jupytext.read(path)
