"""Sphinx extension: each chapter says, at its top, which Colab runtime to choose.

The choice is written once, in the chapter's front matter, which becomes its notebook's
metadata: `accelerator: GPU` with `colab: {gpuType: T4}` makes Colab open the notebook
on a GPU runtime, and `runtime:` says in a sentence what the chapter does there. A
chapter without them runs on Colab's default CPU runtime. This extension turns that
metadata into a note under the chapter's title, so the page and the runtime that Colab
picks cannot disagree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHAPTER = re.compile(r"(^|/)\d\d_[a-z_]+$")  # book/NN_name
CPU_NOTE = (
    "Colab runtime: the default CPU runtime is enough; every cell runs in minutes on a "
    "CPU."
)


def runtime_note(metadata: dict[str, Any]) -> str:
    """The sentence a chapter shows about its runtime, from its notebook metadata."""
    if metadata.get("accelerator") != "GPU":
        return CPU_NOTE
    gpu = (metadata.get("colab") or {}).get("gpuType", "any")
    what = metadata.get("runtime", "")
    return f"Colab runtime: GPU ({gpu}), which the Launch button opens. {what}".strip()


def notebook_metadata(path: Path) -> dict[str, Any]:
    """The metadata of a chapter's notebook, or of its MyST source's front matter."""
    if path.suffix == ".ipynb":
        return json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    import jupytext

    return dict(jupytext.read(path).metadata)


def add_runtime_note(app, doctree) -> None:
    from docutils import nodes

    docname = app.env.docname
    if not CHAPTER.search(docname):
        return
    note = nodes.note()
    path = Path(app.env.doc2path(docname))
    note += nodes.paragraph(text=runtime_note(notebook_metadata(path)))
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    title = next(
        (i for i, n in enumerate(section.children) if isinstance(n, nodes.title)), -1
    )
    section.insert(title + 1, note)


def setup(app):
    app.connect("doctree-read", add_runtime_note)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
