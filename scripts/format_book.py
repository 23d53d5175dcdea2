#!/usr/bin/env python3
"""Format the code cells of the book's chapters with ruff, in place.

A chapter's source is `book/NN_name.md`; its paired notebook `book/NN_name.ipynb`
holds the stored outputs. Formatting changes how code looks, never what it prints,
so this script rewrites the code of both files and keeps the outputs: no chapter
needs to be re-executed afterwards. It runs `ruff format` and ruff's import sorting
(`ruff check --fix --select I`) with the settings of pyproject.toml.

    python scripts/format_book.py book/03_multi_head_attention.md ...   format these
    python scripts/format_book.py                                       every chapter
    python scripts/format_book.py --check                               exit 1, naming
                                                                        each cell that
                                                                        would change
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat
from export import ruff

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"


def formatted_sources(sources: list[str]) -> list[str]:
    """The code cells `sources`, formatted by ruff as the cells of one notebook."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        path = Path(tmp) / "cells.ipynb"
        nbformat.write(nb, path)
        settings = ["--config", str(ROOT / "pyproject.toml")]
        for args in (
            ["check", "--fix", "--select", "I", "--quiet", "--exit-zero"],
            ["format", "--quiet"],
        ):
            run = subprocess.run(
                [*ruff(), *args, *settings, str(path)], capture_output=True, text=True
            )
            if run.returncode != 0:
                raise SystemExit(f"ruff {args[0]} failed:\n{run.stdout}{run.stderr}")
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells]


def format_chapter(md: Path, check: bool) -> list[int]:
    """Format a chapter (source and paired notebook); return the changed code cells."""
    source = jupytext.read(md)
    code = [c for c in source.cells if c.cell_type == "code"]
    old = [c.source for c in code]
    new = formatted_sources(old)
    changed = [
        k for k, (a, b) in enumerate(zip(old, new)) if a.strip("\n") != b.strip("\n")
    ]
    if check or not changed:
        return changed
    text = md.read_text(encoding="utf-8")
    cursor = 0
    for k, (a, b) in enumerate(zip(old, new)):
        start = text.index("```{code-cell}", cursor)
        at = text.index(a, start)
        if k in changed:
            text = text[:at] + b.strip("\n") + text[at + len(a) :]
            at_end = at + len(b.strip("\n"))
        else:
            at_end = at + len(a)
        cursor = text.index("\n```", at_end - 1 if at_end else 0) + 4
    md.write_text(text, encoding="utf-8")
    ipynb = md.with_suffix(".ipynb")
    if ipynb.exists():
        stored = nbformat.read(ipynb, as_version=4)
        stored_code = [c for c in stored.cells if c.cell_type == "code"]
        if [c.source.strip("\n") for c in stored_code] == [a.strip("\n") for a in old]:
            for k in changed:
                stored_code[k].source = new[k].strip("\n")
            jupytext.write(stored, ipynb, fmt="ipynb")
        else:
            print(
                f"{ipynb.relative_to(ROOT)}: not the notebook of {md.name}; "
                "re-execute it "
                f"(python scripts/execute.py {md.relative_to(ROOT)})"
            )
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "chapters",
        nargs="*",
        type=Path,
        help="chapter sources (default: every chapter)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only report; exit 1 when a cell would change",
    )
    args = parser.parse_args(argv)
    every = sorted(BOOK.glob("[0-9][0-9]_*.md"))
    chapters = [p.with_suffix(".md") for p in args.chapters] or every
    dirty = 0
    for md in chapters:
        changed = format_chapter(md.resolve(), args.check)
        if changed:
            dirty += 1
            verb = "would reformat" if args.check else "reformatted"
            numbers = ", ".join(str(k + 1) for k in changed)
            print(f"{md}: {verb} {len(changed)} code cell(s) (numbers {numbers})")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
