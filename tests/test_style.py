"""The book reads in explained pieces and nothing in it scrolls sideways.

Each chapter's exported code arrives in cells of at most 100 lines (the median at
most 30), its code and printed outputs fit in 88 columns, its prose is at most about
4,500 words, each chapter reads in one sitting (at most 90 minutes of what the HTML
shows, at most 100 with the folded code too) and the book in at most 20 hours (24 with
the folded code, of which at most 1,500 lines are folded checks), and the package's
bookkeeping (`__all__`) is generated, never
written by hand. The formatter and linter are ruff, configured in pyproject.toml.
"""

from __future__ import annotations

import ast
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import export  # noqa: E402

CHAPTERS = export.chapter_paths()
TOUR = ROOT / "book" / "tour.md"
PAGES = [*CHAPTERS, TOUR]  # every page with code
MAX_TOUR_WORDS = 2000
WIDTH = 88  # pyproject.toml's [tool.ruff] line-length
MAX_EXPORT_LINES = 100
MAX_MEDIAN_EXPORT_LINES = 30
MAX_WORDS = 4500
# Reading time: 200 words of prose and 15 lines of code a minute, counting the code a
# reader sees (folded cells, validation and plotting, are not).
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE = 200, 15
FOLDED = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
MAX_CHAPTER_MINUTES = 90
MAX_BOOK_HOURS = 20
# Counting every line a reader of the notebook meets, folded or not (the exercises'
# solutions apart): a chapter in at most 100 minutes, the book in at most 24 hours,
# and at most 1,500 lines of folded checks that export nothing. A check that the
# prose does not argue from belongs in tests/.
MAX_CHAPTER_MINUTES_ALL_CODE = 100
MAX_BOOK_HOURS_ALL_CODE = 24
MAX_FOLDED_CHECK_LINES = 1500
EXERCISES = re.compile(r"^## Exercises", re.M)
HEADING = re.compile(r"^## ", re.M)


def pages(among: list[Path] = CHAPTERS) -> list:
    """The pages as test parameters, named by their file."""
    return [pytest.param(p, id=p.stem) for p in among]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("ruff")), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def export_cells(chapter: Path) -> list[str]:
    nb = jupytext.read(chapter)
    return [
        c.source.strip("\n")
        for c in nb.cells
        if c.cell_type == "code" and export.EXPORT_TAG in c.metadata.get("tags", [])
    ]


def prose_words(chapter: Path) -> int:
    """Words of prose in a page: its markdown cells without math, labels and roles."""
    nb = jupytext.read(chapter)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)  # display math
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # directives (math, figures)
    text = re.sub(r"\$[^$\n]+\$", " ", text)  # inline math
    text = re.sub(r"\{[a-z]+\}`[^`]*`", " ", text)  # roles: {cite}`...`, {doc}`...`
    text = re.sub(r"^\(.*\)=$", " ", text, flags=re.M)  # labels
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)  # comments: quotes' sources
    return len(re.findall(r"[A-Za-z][A-Za-z'-]*", text))


def visible_code_lines(page: Path) -> int:
    """Non-blank lines of the code cells that the HTML book shows unfolded."""
    return sum(
        1
        for c in jupytext.read(page).cells
        if c.cell_type == "code" and not FOLDED & set(c.metadata.get("tags", []))
        for line in c.source.splitlines()
        if line.strip()
    )


def code_cells_read(page: Path) -> list:
    """The code cells a reader of the notebook meets: all but the exercises' answers.

    An answer is a folded cell (`hide-cell`) of the section "Exercises".
    """
    cells, in_exercises = [], False
    for c in jupytext.read(page).cells:
        if c.cell_type == "markdown":
            for heading in HEADING.finditer(c.source):
                in_exercises = bool(EXERCISES.match(c.source, heading.start()))
        elif c.cell_type == "code":
            if not (in_exercises and "hide-cell" in c.metadata.get("tags", [])):
                cells.append(c)
    return cells


def lines(cell) -> int:
    return sum(1 for line in cell.source.splitlines() if line.strip())


def folded_check_lines(page: Path) -> int:
    """Lines of folded code cells that export nothing (answers to exercises apart)."""
    return sum(
        lines(c)
        for c in code_cells_read(page)
        if FOLDED & set(tags := c.metadata.get("tags", [])) and "export" not in tags
    )


def minutes_with_all_code(page: Path) -> float:
    """Reading time counting folded code too (the exercises' answers apart)."""
    code = sum(map(lines, code_cells_read(page)))
    return prose_words(page) / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE


def reading_minutes(page: Path) -> float:
    return (
        prose_words(page) / WORDS_PER_MINUTE
        + visible_code_lines(page) / CODE_LINES_PER_MINUTE
    )


def test_the_package_and_the_notebooks_are_formatted() -> None:
    result = ruff("format", "--check", "src", "book")
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\n"
        "run python scripts/format_book.py (chapters) or scripts/export.py (package)"
    )


def test_the_linter_passes_apart_from_line_length() -> None:
    result = ruff("check", "--ignore", "E501", "src", "book")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_whole_repository_is_in_the_house_style() -> None:
    """Tests, scripts, benchmarks and extensions too: formatted, linted, 88 columns."""
    formatted = ruff("format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    linted = ruff("check", ".")
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_no_file_of_the_tools_is_over_1000_lines() -> None:
    """A file past a thousand lines is one that nobody reads whole: split it by part."""
    tools = [ROOT / name for name in ("scripts", "benchmarks", "tests")]
    long = {
        str(path.relative_to(ROOT)): n
        for folder in tools
        for path in folder.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 1000
    }
    assert not long, long


def test_the_generated_entry_points_fit_in_88_columns() -> None:
    result = ruff(
        "check", "--select", "E501", "src/aiayn/__init__.py", "src/aiayn/__main__.py"
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("chapter", pages(PAGES))
def test_chapter_code_and_its_module_fit_in_88_columns(chapter: Path) -> None:
    paths = [str(chapter.with_suffix(".ipynb"))]
    module = export.read_chapter(chapter).module if chapter in CHAPTERS else None
    if module:
        paths.append(f"src/aiayn/{module.split('.', 1)[1]}.py")
    result = ruff("check", "--select", "E501", *paths)
    assert result.returncode == 0, result.stdout
    # ruff does not count a trailing noqa pragma; the page shows it all the same
    nb = jupytext.read(chapter)
    long = [
        line
        for c in nb.cells
        if c.cell_type == "code"
        for line in c.source.splitlines()
        if len(line) > WIDTH
    ]
    assert not long, f"code lines over {WIDTH} columns: {long[:3]}"
    # the source too, with each cell's options (captions) as written
    fenced = re.findall(
        r"^```\{code-cell\}.*?\n(.*?)^```",
        chapter.read_text(encoding="utf-8"),
        re.M | re.S,
    )
    long = [line for cell in fenced for line in cell.splitlines() if len(line) > WIDTH]
    assert not long, f"source lines over {WIDTH} columns: {long[:3]}"


@pytest.mark.parametrize("chapter", pages(PAGES))
def test_chapter_outputs_fit_in_88_columns(chapter: Path) -> None:
    nb = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4)
    wide = []
    for k, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get(
                "text/plain", ""
            )
            text = "".join(text) if isinstance(text, list) else text
            wide += [(k, line) for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} printed lines over {WIDTH} columns, e.g. {wide[:3]}"


@pytest.mark.parametrize("chapter", pages())
def test_chapter_exports_code_in_cells_of_at_most_100_lines(chapter: Path) -> None:
    long = [
        (len(c.splitlines()), c.splitlines()[0])
        for c in export_cells(chapter)
        if len(c.splitlines()) > MAX_EXPORT_LINES
    ]
    assert not long, f"export cells over {MAX_EXPORT_LINES} lines: {long}"


def test_the_median_export_cell_is_at_most_30_lines() -> None:
    sizes = [len(c.splitlines()) for p in CHAPTERS for c in export_cells(p)]
    median = statistics.median(sizes)
    assert median <= MAX_MEDIAN_EXPORT_LINES, f"median export cell: {median} lines"


@pytest.mark.parametrize("chapter", pages())
def test_chapter_prose_is_at_most_4500_words(chapter: Path) -> None:
    assert prose_words(chapter) <= MAX_WORDS, f"{prose_words(chapter)} words"


@pytest.mark.parametrize("chapter", pages())
def test_chapter_reads_in_one_sitting(chapter: Path) -> None:
    minutes = reading_minutes(chapter)
    assert minutes <= MAX_CHAPTER_MINUTES, (
        f"{minutes:.0f} minutes to read ({prose_words(chapter)} words, "
        f"{visible_code_lines(chapter)} lines of code shown): move code that is not "
        "what the chapter teaches to where it belongs, or fold validation and plots"
    )


def test_the_book_reads_in_at_most_20_hours() -> None:
    hours = sum(map(reading_minutes, PAGES)) / 60
    assert hours <= MAX_BOOK_HOURS, f"{hours:.1f} hours"


@pytest.mark.parametrize("chapter", pages(PAGES))
def test_chapter_reads_in_100_minutes_with_its_folded_code(chapter: Path) -> None:
    minutes = minutes_with_all_code(chapter)
    assert minutes <= MAX_CHAPTER_MINUTES_ALL_CODE, (
        f"{minutes:.0f} minutes with the folded code ({folded_check_lines(chapter)} "
        "lines of folded checks): move the checks the prose does not argue from to "
        "tests/"
    )


def test_the_book_reads_in_24_hours_with_its_folded_code() -> None:
    hours = sum(map(minutes_with_all_code, PAGES)) / 60
    assert hours <= MAX_BOOK_HOURS_ALL_CODE, f"{hours:.1f} hours"


def test_the_book_folds_at_most_1500_lines_of_checks() -> None:
    folded = {p.stem: folded_check_lines(p) for p in PAGES}
    total = sum(folded.values())
    assert total <= MAX_FOLDED_CHECK_LINES, (
        f"{total} lines of folded checks; the most: "
        f"{sorted(folded.items(), key=lambda kv: -kv[1])[:4]}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_writes_all_by_hand(chapter: Path) -> None:
    # scripts/export.py refuses such a chapter too; this names it without exporting.
    for source in export_cells(chapter):
        assert not re.search(r"^__all__\s*[:=]", source, re.M), (
            "__all__ is generated by scripts/export.py: remove it from the chapter"
        )


def test_the_tour_is_short_and_defines_nothing_the_chapters_export() -> None:
    assert prose_words(TOUR) <= MAX_TOUR_WORDS, f"{prose_words(TOUR)} words"
    exported = {
        name
        for p in CHAPTERS
        for source in export_cells(p)
        for node in ast.parse(source).body
        for name in export.assigned_names(node)
    }
    nb = jupytext.read(TOUR)
    defined = {
        name
        for c in nb.cells
        if c.cell_type == "code"
        for node in ast.parse(c.source).body
        for name in export.assigned_names(node)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    assert not defined & exported, f"the tour redefines {sorted(defined & exported)}"
    imports = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "from aiayn" in imports


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_ends_with_its_summary_and_what_the_documents_say(
    chapter: Path,
) -> None:
    headings = re.findall(r"^## (.+?)\s*$", chapter.read_text(encoding="utf-8"), re.M)
    assert headings[-2:] == ["Summary", "What the documents say"], headings[-3:]


MAX_SHOWN_IMPORT_LINES = 12


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_does_not_open_with_a_long_import_cell(chapter: Path) -> None:
    """The module's imports are folded when they are longer than a few lines."""
    for c in jupytext.read(chapter).cells:
        if c.cell_type == "code" and c.source.startswith("from __future__ import"):
            lines = len([line for line in c.source.splitlines() if line.strip()])
            folded = FOLDED & set(c.metadata.get("tags", []))
            assert lines <= MAX_SHOWN_IMPORT_LINES or folded, f"{lines} lines shown"
