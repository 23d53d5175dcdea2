#!/usr/bin/env python3
"""The checksum file of a shipped model's folder: results/NAME/SHA256SUMS.

    python scripts/release/checksums.py results/multi30k-de-en           write it
    python scripts/release/checksums.py --check results/multi30k-de-en   exit 1 if stale

One line per file of the folder, in the format of `sha256sum` (so that
`sha256sum -c SHA256SUMS` checks a download too): the model, its tokenizer, its
scores and every run record beside them. The READMEs are left out: they are the
model card, which is written again as the book changes; what it quotes is in the
records. The package pins only the digests of the model, its tokenizer and this
file (chapter 16's PRETRAINED); a record is verified through this file.
ship_pretrained.py and decoding_grid.py write it again after they write the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

NAME = "SHA256SUMS"
UNLISTED = {NAME, "README.md"}  # at any depth


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def listed(folder: Path) -> dict[str, str]:
    """Each file of folder that the checksum file lists -> its SHA-256 digest."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {
        p.relative_to(folder).as_posix(): digest(p)
        for p in files
        if p.name not in UNLISTED
    }


def text(folder: Path) -> str:
    return "".join(f"{d}  {name}\n" for name, d in listed(folder).items())


def read(path: Path) -> dict[str, str]:
    """A SHA256SUMS file: file -> digest."""
    pairs = (line.split("  ", 1) for line in path.read_text().splitlines() if line)
    return {name: d for d, name in pairs}


def write(folder: Path) -> Path:
    path = folder / NAME
    path.write_text(text(folder), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path, metavar="FOLDER")
    p.add_argument("--check", action="store_true", help="only say whether it is stale")
    args = p.parse_args(argv)
    stale = 0
    for folder in args.folders:
        if args.check:
            ok = (folder / NAME).is_file() and read(folder / NAME) == listed(folder)
            stale += not ok
            print(f"{folder / NAME}: {'up to date' if ok else 'STALE'}")
        else:
            print(f"wrote {write(folder)}: {digest(folder / NAME)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
