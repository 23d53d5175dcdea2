"""Shared helpers of the tests: the scripts on the path, and the local copy of Multi30k."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

MULTI30K_COPY = ROOT.parent / "shared" / "data" / "multi30k"  # ../shared/data/multi30k of the repository
DATA_ENV = "AIAYN_MULTI30K_DIR"  # aiayn.data.DATA_ENV
# The limit of a test's subprocess or wait: only against a hang, never a speed bar. A machine
# busy with other work can be ten times slower than an idle one, and the tests must pass there.
HANG_S = 1800


def local_multi30k() -> Path:
    """The Multi30k files of the tests: $AIAYN_MULTI30K_DIR, else the copy next to the repository.

    Tests never download: without either, the test that asks is skipped, saying what to set.
    """
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    if not MULTI30K_COPY.is_dir():
        pytest.skip(f"no local copy of Multi30k: set {DATA_ENV} or put the files in {MULTI30K_COPY}")
    return MULTI30K_COPY
