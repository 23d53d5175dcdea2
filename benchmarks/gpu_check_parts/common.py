"""What gpu_check.py and its parts share: the context, the rows, the helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported inside the helpers, never by the driver
    import torch

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARKS = ROOT / "benchmarks"
MARK = "SUMMARY|"  # a part's stdout line "SUMMARY|check|status|detail" is a row
STATUSES = ("PASS", "WARN", "FAIL", "INFO", "SKIPPED", "TIMEOUT", "ERROR")


@dataclasses.dataclass
class Context:
    """What a part needs: the device, the size of the run, its folders, its deadline."""

    device: str
    small: bool
    out: Path
    work: Path  # scratch space shared by the parts, removed at the end
    deadline: float  # time.time() by which the part must have reported
    m30k_seconds: float

    @property
    def cuda(self) -> bool:
        """Whether the parts run on a CUDA device."""
        return self.device.startswith("cuda")

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.time()


# ----------------------------------------------------------------------------------
# Rows of the summary


def report(check: str, status: str, detail: str) -> None:
    """Print one row of the summary table, for the driver to collect."""
    detail = " ".join(str(detail).split())  # one line
    print(f"{MARK}{check}|{status}|{detail}", flush=True)


def parse_rows(text: str) -> list[tuple[str, str, str]]:
    """The rows that a part printed, in order."""
    rows = []
    for line in text.splitlines():
        if line.startswith(MARK):
            check, status, detail = (line[len(MARK) :].split("|", 2) + ["", ""])[:3]
            rows.append((check, status, detail))
    return rows


def last_line(text: str) -> str:
    """The last non-empty line of text, cut to 160 characters."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:160] if lines else "no output"


# ----------------------------------------------------------------------------------
# Helpers of the parts


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer sees all of it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds that fn takes on the device, synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def short(path: str) -> str:
    """A source path shortened to package/file, for the summary."""
    for key in ("/src/aiayn/", "/torch/"):
        if key in path:
            return key.strip("/").split("/")[-1] + "/" + path.split(key, 1)[1]
    return os.path.basename(path)


@contextlib.contextmanager
def count_syncs(cuda: bool) -> Iterator[Counter]:
    """Count the synchronising CUDA calls inside, by Python location ("warn" mode)."""
    import torch

    found: Counter = Counter()
    if not cuda:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchronizing" in str(w.message):
            found[f"{short(w.filename)}:{w.lineno}"] += 1


def fmt_counter(c: Counter) -> str:
    """The six most frequent places of a counter, or "none"."""
    return ", ".join(f"{k} x{v}" for k, v in c.most_common(6)) or "none"


def random_pairs(
    n: int, s: int, t: int, vocab: int, seed: int, full: bool = False
) -> list[tuple[list[int], list[int]]]:
    """n (source, target) id lists of lengths up to s and t (the first pair exactly)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def length(most: int, exact: bool) -> int:
        """most, or a length drawn from [most / 2, most]."""
        low = max(1, most // 2)
        return most if exact else int(torch.randint(low, most + 1, (1,), generator=g))

    pairs = []
    for i in range(n):
        ls, lt = length(s, full or i == 0), length(t, full or i == 0)
        source = torch.randint(4, vocab, (ls,), generator=g).tolist()
        pairs.append((source, torch.randint(4, vocab, (lt,), generator=g).tolist()))
    return pairs


def gib(n_bytes: float) -> str:
    """Bytes as GiB with one decimal, or n/a off a GPU."""
    return "n/a" if math.isnan(n_bytes) else f"{n_bytes / 2**30:.1f}"


@dataclasses.dataclass
class Ran:
    """A finished command: its exit status (None: out of time), stdout and stderr."""

    rc: int | None
    stdout: str
    stderr: str

    @property
    def last(self) -> str:
        """The last line it wrote, stderr first."""
        return last_line(self.stderr if self.stderr.strip() else self.stdout)


def as_text(data: str | bytes | None) -> str:
    """What a timed-out subprocess had written, as text."""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data or ""


def run_cli(
    ctx: Context, args: Sequence[str], env: dict | None = None, margin: float = 5.0
) -> Ran:
    """Run a command in what is left of the part's time; copy its output to the log."""
    print(f"$ {shlex.join(str(a) for a in args)}", flush=True)
    try:
        done = subprocess.run(
            [str(a) for a in args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(1.0, ctx.left() - margin),
            stdin=subprocess.DEVNULL,
        )
        ran = Ran(done.returncode, done.stdout, done.stderr)
    except subprocess.TimeoutExpired as err:
        ran = Ran(None, as_text(err.stdout), as_text(err.stderr))
    print(ran.stdout + ran.stderr + ("(out of time)\n" if ran.rc is None else ""))
    return ran


def aiayn(*args: Any) -> list[str]:
    """The command line `python -m aiayn ARGS`."""
    return [sys.executable, "-m", "aiayn", *map(str, args)]


def benchmark(name: str, *args: Any) -> list[str]:
    """The command line `python benchmarks/NAME.py ARGS`."""
    return [sys.executable, str(BENCHMARKS / f"{name}.py"), *map(str, args)]


def match(pattern: str, text: str) -> str | None:
    """The first group of the first line that matches pattern, or None."""
    found = re.search(pattern, text, re.MULTILINE)
    return found.group(1) if found else None
