"""Settings of every test run, the notebooks' included."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n auto`), one CPU thread per worker.

    The workers share the machine's cores: if each worker, and the notebook kernel it
    starts, also used every core, the threads would outnumber the cores and wait on
    one another. The kernels inherit this environment. The heavy chapters set one
    thread themselves; a number the chapters print does not depend on it.
    """
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
