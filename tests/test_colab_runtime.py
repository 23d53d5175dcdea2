"""Each chapter says under its title which Colab runtime to choose, from its metadata.

The choice lives in the chapter's front matter (and so its notebook's metadata), where
Colab reads it too: `accelerator: GPU` opens the notebook on a GPU runtime. The book's
note is generated from the same metadata by `_ext/colab_runtime.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import export
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "_ext"))

import colab_runtime  # noqa: E402

# the chapter that trains the GPU recipe on a GPU runtime
GPU_CHAPTERS = {"16_translation"}


def test_each_chapter_notebook_asks_colab_for_its_runtime() -> None:
    for md in export.chapter_paths():
        notebook = json.loads(md.with_suffix(".ipynb").read_text(encoding="utf-8"))
        metadata = notebook["metadata"]
        gpu = md.stem in GPU_CHAPTERS
        assert (metadata.get("accelerator") == "GPU") == gpu, md.stem
        if gpu:
            assert metadata["colab"]["gpuType"] == "T4" and metadata["runtime"]
        front_matter = colab_runtime.notebook_metadata(md)
        assert front_matter.get("accelerator") == metadata.get("accelerator")


def test_the_note_says_what_the_metadata_asks_for() -> None:
    assert colab_runtime.runtime_note({}) == colab_runtime.CPU_NOTE
    assert "CPU runtime is enough" in colab_runtime.CPU_NOTE
    note = colab_runtime.runtime_note(
        {"accelerator": "GPU", "colab": {"gpuType": "T4"}, "runtime": "It trains more."}
    )
    assert note.startswith("Colab runtime: GPU (T4)") and note.endswith(
        "It trains more."
    )
    assert colab_runtime.CHAPTER.search("book/16_translation")
    assert not colab_runtime.CHAPTER.search(
        "book/intro"
    ) and not colab_runtime.CHAPTER.search("book/tour")


def test_the_book_loads_the_extension() -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]
    assert config["local_extensions"]["colab_runtime"] == "_ext"
