"""Every numbered chapter ends its teaching with exercises, their solutions checked.

The section "Exercises" comes just before the chapter's "Summary". It holds three to
six exercises, each opened by a paragraph that starts

    **Exercise N (kind).**

numbered from 1, where the kind says what the reader does: *predict* an effect and
check it, *derive* a number, *debug* a planted fault, *extend* a component, or
*explain* a measured result. At least one exercise per chapter is a *debug* or an
*extend*: it asks for code. Each exercise is followed by its worked solution, one or
more code cells folded in the HTML (`hide-cell`, behind a button that says "Show the
solution") that nbval executes like every other cell; every solution asserts what it
claims, and exports nothing. The solutions do not count as reading time
(tests/test_style.py); the exercises' prose does.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import export  # noqa: E402

CHAPTERS = export.chapter_paths()
KINDS = {"predict", "derive", "debug", "extend", "explain"}
CODE_KINDS = {"debug", "extend"}
MIN_EXERCISES, MAX_EXERCISES = 3, 6
OPENING = re.compile(r"^\*\*Exercise (\d+) \(([a-z]+)\)\.\*\*", re.M)
PROMPT = "Show the solution"
HEADING = re.compile(r"^## (.+?)\s*$", re.M)


@dataclass
class Exercise:
    number: int
    kind: str
    prompt: str
    solutions: list[str] = field(default_factory=list)  # the folded code cells
    prompts: list[str | None] = field(default_factory=list)  # their "show" buttons
    shown: list[str] = field(default_factory=list)  # code cells left unfolded


@dataclass
class Section:
    next_heading: str | None
    exercises: list[Exercise]
    exported: int  # code cells of the section tagged export


def exercises_section(chapter: Path) -> Section | None:
    """The chapter's "Exercises" section, or None when it has none."""
    inside, found, next_heading = False, False, None
    items: list[Exercise] = []
    exported = 0
    for cell in jupytext.read(chapter).cells:
        tags = set(cell.metadata.get("tags", []))
        if cell.cell_type == "markdown":
            # A markdown cell may hold a heading and text around it: split it there.
            pieces = HEADING.split(cell.source)
            text_pieces = [(None, pieces[0])] + list(zip(pieces[1::2], pieces[2::2]))
            for heading, text in text_pieces:
                if heading is not None:
                    if inside:
                        next_heading, inside = heading, False
                        break
                    if heading == "Exercises":
                        inside = found = True
                if inside:
                    starts = list(OPENING.finditer(text))
                    for m, after in zip(starts, [*starts[1:], None]):
                        end = after.start() if after else len(text)
                        items.append(
                            Exercise(int(m.group(1)), m.group(2), text[m.start() : end])
                        )
            if found and not inside:
                break
        elif inside:
            exported += "export" in tags
            if items and "hide-cell" in tags:
                items[-1].solutions.append(cell.source)
                prompt = cell.metadata.get("mystnb", {}).get("code_prompt_show")
                items[-1].prompts.append(prompt)
            elif items:
                items[-1].shown.append(cell.source)
    return Section(next_heading, items, exported) if found else None


def params() -> list:
    return [pytest.param(p, id=p.stem) for p in CHAPTERS]


@pytest.mark.parametrize("chapter", params())
def test_the_exercises_come_just_before_the_summary(chapter: Path) -> None:
    section = exercises_section(chapter)
    assert section is not None, 'no "## Exercises" section'
    assert section.next_heading == "Summary", (
        f'"## Exercises" is followed by "## {section.next_heading}", not "## Summary"'
    )


@pytest.mark.parametrize("chapter", params())
def test_three_to_six_exercises_numbered_from_one_of_known_kinds(chapter: Path) -> None:
    section = exercises_section(chapter)
    assert section is not None, 'no "## Exercises" section'
    numbers = [e.number for e in section.exercises]
    assert numbers == list(range(1, len(numbers) + 1)), f"numbered {numbers}"
    assert MIN_EXERCISES <= len(numbers) <= MAX_EXERCISES, f"{len(numbers)} exercises"
    kinds = [e.kind for e in section.exercises]
    assert set(kinds) <= KINDS, f"unknown kinds {set(kinds) - KINDS}; use {KINDS}"
    assert CODE_KINDS & set(kinds), f"no exercise asks for code ({CODE_KINDS}): {kinds}"
    for e in section.exercises:
        words = len(re.findall(r"[A-Za-z]+", OPENING.sub("", e.prompt)))
        assert words >= 15, f"exercise {e.number} says too little ({words} words)"


@pytest.mark.parametrize("chapter", params())
def test_every_exercise_has_a_folded_solution_that_asserts(chapter: Path) -> None:
    section = exercises_section(chapter)
    assert section is not None, 'no "## Exercises" section'
    assert section.exported == 0, (
        "a solution is tagged export: solutions export nothing"
    )
    for e in section.exercises:
        assert e.solutions, f"exercise {e.number} has no folded (hide-cell) solution"
        code = "\n".join(e.solutions)
        assert re.search(r"^\s*assert\b", code, re.M), (
            f"the solution of exercise {e.number} asserts nothing"
        )
        assert not re.search(r"^\s*(from|import) \.", code, re.M)
        assert set(e.prompts) == {PROMPT}, (
            f"exercise {e.number}: a solution's button says {e.prompts}, "
            f"not {PROMPT!r} "
            "(the cell's metadata mystnb: code_prompt_show)"
        )


def test_the_parser_reads_a_planted_section(tmp_path: Path) -> None:
    # The checks above must be able to fail: a section with two exercises, one of them
    # unsolved, placed after the Summary, is read as such.
    page = tmp_path / "99_planted.md"
    page.write_text(
        "# Planted\n\n## Summary\n\nText.\n\n## Exercises\n\n"
        "**Exercise 1 (derive).** Derive it.\n\n"
        "```{code-cell} ipython3\n:tags: [hide-cell]\n\nassert 1 + 1 == 2\n```\n\n"
        "**Exercise 2 (predict).** Predict it.\n\n"
        "```{code-cell} ipython3\nprint(2)\n```\n\n## What the documents say\n",
        encoding="utf-8",
    )
    section = exercises_section(page)
    assert section is not None and section.next_heading == "What the documents say"
    assert [(e.number, e.kind) for e in section.exercises] == [
        (1, "derive"),
        (2, "predict"),
    ]
    assert [len(e.solutions) for e in section.exercises] == [1, 0]
    assert section.exercises[1].shown == ["print(2)"]
