#!/usr/bin/env python3
"""Start a new chapter: `book/NN_name.md` with the front matter and the setup cell.

    python scripts/new_chapter.py 02_self_attention "Self-attention and masks" \\
        --module aiayn.masks

The setup cell (the first code cell of every chapter) installs the package from the
repository when the chapter runs on Colab, and picks the device. Its text lives here
only; tests/test_pipeline.py checks that every chapter starts with it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repository_url() -> str:
    """The repository URL, from pyproject.toml (the one place it is written)."""
    # A regex rather than tomllib, which Python 3.10 lacks.
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^Repository\s*=\s*"([^"]+)"', text, re.M)
    if match is None:
        raise RuntimeError(
            'pyproject.toml has no [project.urls] Repository = "..." line'
        )
    return match.group(1)


def setup_cell() -> str:
    """The source of the first code cell of every chapter."""
    return f"""\
# Setup: on Colab, install this book's package from its repository; elsewhere
# `pip install -e .` (see the README) has installed it already. Then pick a device.
import sys

if "google.colab" in sys.modules:
    import subprocess

    package = "aiayn[book] @ git+{repository_url()}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", package], check=True)

import torch

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")"""


# the book shows the setup cell folded: it is the same on every page
SETUP_TAG = "hide-input"

FRONT_MATTER = """---
jupytext:
  formats: ipynb,md:myst
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
{module}---
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "name", help="file name without extension, e.g. 02_self_attention"
    )
    parser.add_argument("title", help="the chapter's title")
    parser.add_argument(
        "--module", help="the module its export cells become, e.g. aiayn.masks"
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d\d_[a-z0-9_]+", args.name):
        parser.error("name must look like NN_words, e.g. 02_self_attention")
    path = ROOT / "book" / f"{args.name}.md"
    if path.exists():
        parser.error(f"{path} exists already")
    module = f"module: {args.module}\n" if args.module else ""
    cell = f"```{{code-cell}} ipython3\n:tags: [{SETUP_TAG}]\n\n{setup_cell()}\n```\n"
    body = f"\n# {args.title}\n\n{cell}"
    path.write_text(FRONT_MATTER.format(module=module) + body, encoding="utf-8")
    print(f"created {path.relative_to(ROOT)}; add it to _toc.yml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
