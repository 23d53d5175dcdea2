#!/usr/bin/env python3
"""Execute chapters and store their outputs, deterministically.

For each chapter `book/NN_name.md` (the source you edit) this writes the paired
`book/NN_name.ipynb` with fresh outputs: the package is re-exported first (later
chapters import earlier ones), the notebook is built from the .md, executed top to
bottom in a fresh kernel, and saved without timing metadata, with cell ids and
chart ids derived from content, so that re-running an unchanged chapter rewrites
the same bytes.

    python scripts/execute.py                        every chapter
    python scripts/execute.py book/01_attention.md   some chapters (.md or .ipynb)
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import export  # noqa: E402  (scripts/export.py)
import quoted  # noqa: E402  (scripts/quoted.py)

ROOT = export.ROOT
ALTAIR_ID = re.compile(r"altair-viz-[0-9a-f]{32}")
TIMEOUT_S = 1200  # per cell; the longest cells train small models on a CPU


def cell_ids(nb: nbformat.NotebookNode) -> None:
    """Give every cell an id derived from its content, unique within the notebook."""
    seen: set[str] = set()
    for cell in nb.cells:
        digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()
        i, cid = 8, digest[:8]
        while cid in seen:  # two identical cells: take more of the hash, then a counter
            i += 1
            cid = digest[:i] if i <= len(digest) else f"{digest[:8]}-{i}"
        seen.add(cid)
        cell.id = cid


def stable_outputs(nb: nbformat.NotebookNode) -> None:
    """Drop per-run metadata and replace altair's random chart ids by content hashes."""
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            html = output.get("data", {}).get("text/html")
            if html is None:
                continue
            text = html if isinstance(html, str) else "".join(html)
            ids = sorted(set(ALTAIR_ID.findall(text)))
            for n, old in enumerate(ids):
                body = text.replace(old, "")
                new = (
                    "altair-viz-"
                    + hashlib.sha1(f"{index}/{n}/{body}".encode()).hexdigest()[:32]
                )
                text = text.replace(old, new)
            output["data"]["text/html"] = text


HIDDEN_SOURCE = {"hide-input", "hide-cell"}  # the HTML book folds these cells' code


def fold(nb: nbformat.NotebookNode) -> None:
    """Fold in Jupyter and Colab the code that the HTML book folds.

    JupyterLab and Notebook read jupyter.source_hidden; Colab shows a cell with
    cellView "form" as its output and a "Show code" link.
    """
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        hidden = bool(HIDDEN_SOURCE & set(cell.metadata.get("tags", [])))
        jupyter = cell.metadata.get("jupyter", {})
        jupyter.pop("source_hidden", None)
        cell.metadata.pop("cellView", None)
        if hidden:
            jupyter["source_hidden"] = True
            cell.metadata["cellView"] = "form"
        if jupyter:
            cell.metadata["jupyter"] = jupyter
        else:
            cell.metadata.pop("jupyter", None)


def notebook_from_source(md: Path) -> nbformat.NotebookNode:
    """The chapter as an unexecuted notebook, paired with its .md."""
    nb = jupytext.read(md)
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,md:myst"
    nb.metadata["jupytext"].pop("text_representation", None)
    cell_ids(nb)
    fold(nb)
    return nb


def execute(md: Path) -> float:
    """Execute one chapter and write its .ipynb; return the seconds it took.

    The numbers that the prose quotes with their expression (scripts/quoted.py) are
    recomputed after the cell that precedes them and rewritten in the .md, and in
    the pages that quote this chapter, when they changed.
    """
    source = notebook_from_source(md)
    nb, inserted = quoted.with_checks(source, md.stem)
    start = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        record_timing=False,
        # One output per stream per cell: without this, how a cell's prints are split
        # into pieces depends on timing, and re-runs would not be byte-identical.
        coalesce_streams=True,
        resources={"metadata": {"path": str(md.parent)}},
    )
    client.execute()
    for line in quoted.update_pages(md, nb, inserted):
        print(f"quoted number updated: {line}")
    for index, _ in reversed(inserted):  # the check cells are not the chapter's
        del nb.cells[index]
    fresh = notebook_from_source(md)  # the prose with the updated numbers
    for cell, new in zip(nb.cells, fresh.cells, strict=True):
        if cell.cell_type == "markdown":
            cell.source = new.source
    cell_ids(nb)
    renumber(nb)
    stable_outputs(nb)
    jupytext.write(nb, md.with_suffix(".ipynb"), fmt="ipynb")
    return time.perf_counter() - start


def renumber(nb: nbformat.NotebookNode) -> None:
    """Number the code cells 1, 2, ... as one run from the top gives them."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    for n, cell in enumerate(code, start=1):
        if cell.get("execution_count") is None:
            continue
        cell.execution_count = n
        for output in cell.get("outputs", []):
            if "execution_count" in output:
                output["execution_count"] = n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "chapters", nargs="*", type=Path, help="chapters to run (default: all)"
    )
    args = parser.parse_args(argv)
    if args.chapters:
        sources = [p.resolve().with_suffix(".md") for p in args.chapters]
    else:
        sources = export.chapter_paths()
    for md in sources:
        if not md.exists():
            print(
                f"error: {md} does not exist (chapters are book/NN_name.md)",
                file=sys.stderr,
            )
            return 2
    try:  # the chapters import the package they (and earlier ones) export
        export.write()
    except export.ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for md in sources:
        rel = md.relative_to(ROOT).as_posix()
        try:
            seconds = execute(md)
        except CellExecutionError as err:
            print(
                f"error: {rel} failed; its .ipynb was not written\n{err}",
                file=sys.stderr,
            )
            return 1
        print(f"executed {rel} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
