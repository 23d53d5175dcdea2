#!/usr/bin/env python3
"""Wall time of `python -m aiayn train --task copy` by CPU threads, idle and busy.

Chapter 14's command line trains with one CPU thread unless `--threads` says
otherwise. This script measures why: it runs the copy preset (400 updates of the
tiny model) with each thread count, once with the machine otherwise idle and once
while another process keeps one core busy, and prints the seconds of training that
each run reports ("done in ... s"), repetition by repetition, then the medians.

    python benchmarks/cli_threads.py                     # 1 and 2 threads, 1 repetition
    python benchmarks/cli_threads.py --threads 1 2 4 --reps 3

Run it on a machine with nothing else to do: the "idle" column assumes that.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SPIN = "while True:\n    pass\n"


def train_seconds(threads: int, extra: list[str]) -> float:
    """Run the copy preset in a fresh folder and return the training time it reports."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "aiayn", "train", "--task", "copy"]
        command += ["--threads", str(threads), "--no-progress", *extra]
        command += ["--checkpoint-dir", str(Path(folder) / "run")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    return float(re.search(r"done in ([0-9.]+) s", result.stdout).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="thread counts (default 1 2)",
    )
    parser.add_argument(
        "--reps", type=int, default=1, help="repetitions of the whole grid (default 1)"
    )
    parser.add_argument(
        "--amp", default=None, help="also pass --amp AMP to every run (e.g. bf16)"
    )
    args = parser.parse_args()
    extra = ["--amp", args.amp] if args.amp else []
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for load in ("idle", "one core busy"):
            spinner = (
                subprocess.Popen([sys.executable, "-c", SPIN])
                if load != "idle"
                else None
            )
            try:
                for threads in args.threads:
                    seconds = train_seconds(threads, extra)
                    times.setdefault((load, threads), []).append(seconds)
                    print(
                        f"rep {rep + 1}, {load}, {threads} thread(s): {seconds:.1f} s",
                        flush=True,
                    )
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    cpu = platform.processor() or platform.machine()
    print(
        f"\n{datetime.date.today()}, {cpu}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, commit {commit or 'unknown'}; "
        f"medians of {args.reps} repetition(s)"
        + (f", --amp {args.amp}" if args.amp else "")
    )
    print("| threads | idle | one core busy |\n|---|---|---|")
    for threads in args.threads:
        cells = [
            f"{statistics.median(times[(load, threads)]):.1f} s"
            for load in ("idle", "one core busy")
        ]
        print(f"| {threads} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
