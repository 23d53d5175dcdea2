"""Shared helpers of the tests: the scripts on sys.path, the local copy of Multi30k."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The book's tooling (scripts/) and the release experiments (scripts/release/), which
# import each other by their bare names as they do when run as scripts.
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "release"))

# ../shared/data/multi30k of the repository
MULTI30K_COPY = ROOT.parent / "shared" / "data" / "multi30k"
DATA_ENV = "AIAYN_MULTI30K_DIR"  # aiayn.multi30k.DATA_ENV
# The limit of a test's subprocess or wait: only against a hang, never a speed bar.
# A machine busy with other work can be ten times slower than an idle one, and the
# tests must pass there.
HANG_S = 1800


def local_multi30k() -> Path:
    """The tests' Multi30k: $AIAYN_MULTI30K_DIR, else the copy beside the repository.

    Tests never download: without either, the test is skipped, saying what to set.
    """
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    if not MULTI30K_COPY.is_dir():
        pytest.skip(
            f"no local copy of Multi30k: set {DATA_ENV} "
            f"or put the files in {MULTI30K_COPY}"
        )
    return MULTI30K_COPY
