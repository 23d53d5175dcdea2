"""Settings of every test run, the notebooks' included."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n auto`), one CPU thread per worker.

    The workers share the machine's cores: if each worker, and the notebook kernel it
    starts, also used every core, the threads would outnumber the cores and wait on
    one another. The kernels inherit this environment. The heavy chapters set one
    thread themselves; a number the chapters print does not depend on it.
    """
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(session, config, items) -> None:
    """After each notebook cell whose results the prose quotes, check the quotes.

    The numbers that a page writes with their expression (scripts/quoted.py) are
    recomputed in the notebook's kernel, right after the code cell that precedes
    them, by a cell that nbval compares with the numbers of the prose: a number that
    no longer matches what the cells compute fails, as a changed output does.
    """
    try:
        from nbval.plugin import IPyNbCell, find_metadata_tags
    except ImportError:  # without nbval there are no notebook items
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    import quoted

    checks: dict[object, dict[int, list]] = {}  # notebook -> code cell -> its quotes
    out = []
    for item in items:
        out.append(item)
        if not isinstance(item, IPyNbCell) or item.name.endswith("quoted numbers"):
            continue
        notebook = item.parent
        if notebook not in checks:
            nb = notebook.nb
            code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
            number = {index: n for n, index in enumerate(code)}  # nb index -> Cell N
            planned = quoted.plan(nb, Path(str(notebook.fspath)).stem)
            checks[notebook] = {number[i]: found for i, found in planned}
        found = checks[notebook].get(item.cell_num)
        if not found:
            continue
        ignore = "nbval-ignore-output" in item.cell.metadata.get("tags", [])
        cell = quoted.check_cell(
            [q.code() for q in found], [q.number for q in found], ignore
        )
        options = defaultdict(bool, find_metadata_tags(cell.metadata))
        options.setdefault("check", notebook.compare_outputs)
        out.append(
            IPyNbCell.from_parent(
                notebook,
                name=f"Cell {item.cell_num}: quoted numbers",
                cell_num=item.cell_num,
                cell=cell,
                options=options,
            )
        )
    items[:] = out
