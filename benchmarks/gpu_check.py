"""One command that proves the GPU path: train, resume, decode, precision, kernels.

Run from the repository root on a machine with one GPU:

    python benchmarks/gpu_check.py --out results/gpu/DATE-DEVICE   # about 8 minutes

Each part runs in a fresh subprocess under a timeout taken from what is left of
--budget seconds, so that a part that hangs or crashes loses nothing of the
others. At the end the script prints a summary table (check, status, detail) and
writes it to OUT/summary.txt, next to the raw log of every part.

    env      versions, the GPU, its capability, the attention kernels enabled
    sync     RunTrainer.train_step under torch.cuda.set_sync_debug_mode("error");
             the synchronisations of fit(), evaluate() and greedy, beam and
             sampling decoding, counted
    amp      the GPU recipe's model on two batch shapes of 12,000 positions: fp32,
             bf16, fp16 with loss scaling, and the path of a T4 (capability 7.5);
             peak memory against a 16 GB card
    sdpa     the attention kernels that run with the book's boolean masks, their
             error against float64, a fully masked query row, and what the first
             call on a new shape costs each kernel (cuDNN, memory-efficient, math)
    copy     `python -m aiayn train --task copy` with --amp auto and fp16 (exact
             match at least 0.9), then `python -m aiayn translate`, greedy and beam
    resume   chapter 14's bitwise resume: 100 steps against 50 + 50 resumed
    cache    benchmarks/decode_throughput.py: the speed-up of the key-value cache
    compile  a RunTrainer with compile=True over 20 token-bucketed batches, with the
             aot_eager and the inductor backend: graphs and recompile reasons
    mfu      benchmarks/train_mfu.py: the base model in bf16 on batches that fill
             the GPU, eager then compiled, against torch.nn.Transformer
    peers    benchmarks/peers.py on the GPU, short (needs transformers)
    m30k     off unless --m30k-seconds N: the Multi30k GPU recipe for N seconds,
             stopped by one SIGINT, then the test2016 BLEU of what it saved

Statuses: PASS (the claim holds), WARN (it holds with a caveat), FAIL, INFO (a
measurement), SKIPPED, TIMEOUT (the part ran out of time), ERROR (it crashed).
The exit status is 1 if a check FAILed or a part crashed, else 0. --small runs a
tiny version of every part that makes sense on the device (with --device cpu,
about a minute; the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The parts live in gpu_check_parts/, next to this file (one module per log file);
# they import torch inside their functions, so the driver never does.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_parts.amp import part_amp
from gpu_check_parts.command_line import part_cache, part_copy, part_resume
from gpu_check_parts.common import ROOT, Context, last_line, parse_rows
from gpu_check_parts.compiling import part_compile
from gpu_check_parts.env_sync import part_env, part_sync
from gpu_check_parts.m30k import part_m30k
from gpu_check_parts.mfu_peers import part_mfu, part_peers
from gpu_check_parts.sdpa import part_sdpa

SUMMARY_FILE = "summary.txt"
M30K_EXTRA = 300  # seconds beyond --m30k-seconds: start, save after SIGINT, BLEU
KILL_GRACE = 10  # seconds between SIGTERM and SIGKILL of a part out of time
MIN_PART = 15  # a part with less time than this left is skipped


@dataclasses.dataclass(frozen=True)
class Unit:
    """One subprocess of a part: its name (part or part.step), log and time limit."""

    name: str
    log: str
    limit: float  # seconds; m30k's comes from --m30k-seconds

    @property
    def part(self) -> str:
        """The part, as --only names it."""
        return self.name.split(".")[0]


UNITS = (  # in the order they run; at most 8 files in OUT with the summary
    Unit("env", "env_sync.log", 60),
    Unit("sync", "env_sync.log", 100),
    Unit("amp", "amp_sdpa.log", 120),
    Unit("sdpa", "amp_sdpa.log", 90),
    Unit("copy", "copy_resume_cache.log", 200),
    Unit("resume", "copy_resume_cache.log", 120),
    Unit("cache", "copy_resume_cache.log", 60),
    Unit("compile.aot_eager", "compile.log", 100),
    Unit("mfu.eager", "mfu_peers.log", 90),
    Unit("mfu.compiled", "mfu_peers.log", 200),
    Unit("compile.inductor", "compile.log", 150),
    Unit("peers", "mfu_peers.log", 100),
    Unit("m30k", "m30k.log", 0),
)
PARTS = tuple(dict.fromkeys(unit.part for unit in UNITS))  # what --only names


# ----------------------------------------------------------------------------------
# The driver: runs every part in its own subprocess, then prints the summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of the driver, and the hidden one of a part."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="folder for summary.txt and the logs")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cuda)")
    p.add_argument("--small", action="store_true", help="tiny models, few steps")
    p.add_argument(
        "--only", type=part_list, help=f"comma list of parts: {','.join(PARTS)}"
    )
    p.add_argument(
        "--budget", type=float, default=470.0, help="seconds for all parts (470)"
    )
    p.add_argument(
        "--m30k-seconds",
        type=float,
        default=0.0,
        help="run the m30k part: train Multi30k for N seconds (adds N + "
        f"{M30K_EXTRA} s to the budget)",
    )
    hidden = argparse.SUPPRESS
    p.add_argument("--worker", choices=[u.name for u in UNITS], help=hidden)
    p.add_argument("--work", type=Path, help=hidden)
    p.add_argument("--deadline", type=float, help=hidden)
    args = p.parse_args(argv)
    if args.out is None and args.worker is None:
        p.error("--out DIR is required")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    return args


def part_list(text: str) -> list[str]:
    """--only: part names separated by commas."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {unknown}; the parts are {','.join(PARTS)}"
        )
    return names


def child_env(work: Path) -> dict[str, str]:
    """The environment of the parts: this checkout's package, fresh compile caches."""
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
        "TRITON_CACHE_DIR": str(work / "triton"),
    }


def skip_reason(unit: Unit, args: argparse.Namespace) -> str | None:
    """Why a selected unit does not run here, or None."""
    if args.small and unit.name in ("compile.inductor", "mfu.compiled"):
        return "--small: inductor compiles for minutes; aot_eager checks the graphs"
    if unit.part == "peers" and importlib.util.find_spec("transformers") is None:
        return (
            "transformers is not installed (pip install -r benchmarks/requirements.txt)"
        )
    if unit.part == "m30k" and args.m30k_seconds <= 0:
        return "off: pass --m30k-seconds N to train the Multi30k recipe for N seconds"
    return None


def stop_group(proc: subprocess.Popen) -> None:
    """End a part and everything it started: SIGTERM, then SIGKILL, to its group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_logged(cmd: list[str], log: Path, seconds: float, env: dict) -> int | None:
    """Run cmd in a process group of its own, output into log; None if it timed out."""
    with log.open("a", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return None
        except BaseException:  # Ctrl-C: the part's group is not in our terminal's
            stop_group(proc)
            raise


def worker_command(unit: Unit, args: argparse.Namespace, work: Path, t: float) -> list:
    """The command line that runs one unit in a subprocess."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", unit.name]
    cmd += ["--device", args.device, "--out", str(args.out), "--work", str(work)]
    cmd += ["--deadline", f"{time.time() + t - 5:.1f}"]
    cmd += ["--m30k-seconds", str(args.m30k_seconds)]
    return cmd + (["--small"] if args.small else [])


class Stopped(Exception):
    """The driver was stopped (Ctrl-C, SIGTERM) during a part; that part's rows."""

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        super().__init__("stopped")
        self.rows = rows


def run_unit(
    unit: Unit, args: argparse.Namespace, work: Path, left: float
) -> list[tuple[str, str, str]]:
    """Run one unit under its timeout; its rows, with TIMEOUT or ERROR if need be."""
    reason = skip_reason(unit, args)
    if reason is not None:
        return [(unit.name, "SKIPPED", reason)]
    limit = args.m30k_seconds + M30K_EXTRA if unit.part == "m30k" else unit.limit
    t = min(limit, left - 10)
    if t < MIN_PART:
        return [(unit.name, "SKIPPED", f"no time left (budget {args.budget:.0f}s)")]
    log = args.out / unit.log
    cmd = worker_command(unit, args, work, t)
    with log.open("a", encoding="utf-8") as f:
        f.write(f"== {unit.name} (limit {t:.0f}s): {shlex.join(cmd[1:4])}\n")
    offset, start = log.stat().st_size, time.time()
    try:
        rc = run_logged(cmd, log, t, child_env(work))
    except KeyboardInterrupt:
        rows = parse_rows(log.read_bytes()[offset:].decode("utf-8", "replace"))
        note = f"stopped by a signal after {time.time() - start:.0f}s"
        raise Stopped([*rows, (unit.name, "ERROR", note)]) from None
    text = log.read_bytes()[offset:].decode("utf-8", "replace")
    rows = parse_rows(text)
    if rc is None:
        rows.append((unit.name, "TIMEOUT", f"killed after {t:.0f}s"))
    elif rc != 0:
        rows.append((unit.name, "ERROR", f"exit {rc}: {last_line(text)}"))
    ending = f"== {unit.name}: exit {rc} in {time.time() - start:.0f}s"
    with log.open("a", encoding="utf-8") as f:
        f.write(ending + "\n")
    print(ending, flush=True)
    return rows


def git_commit() -> str:
    """The checkout's commit, and whether src/ or benchmarks/ differ from it."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # reads, never writes the index
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "src", "benchmarks"],
            cwd=ROOT,
            env=env,
            capture_output=True,
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in src/ or benchmarks/" if changed else "")


def summary_text(rows: list, args: argparse.Namespace, seconds: float) -> str:
    """The summary table, with the run's command, commit, date and device."""
    width = max([22] + [len(check) + 1 for check, _, _ in rows])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        "",
        f"=== GPU readiness summary ({seconds:.0f}s of {args.budget:.0f}s; "
        f"device {args.device}{'; --small' if args.small else ''}) ===",
        f"command: python benchmarks/gpu_check.py {shlex.join(sys.argv[1:])}",
        f"commit: {git_commit()}; finished {now:%Y-%m-%d %H:%M} UTC",
        f"{'check':<{width}} {'status':<8} detail",
    ]
    lines += [f"{c:<{width}} {s:<8} {d}" for c, s, d in rows]
    return "\n".join(lines) + "\n"


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM to the driver: stop like Ctrl-C, ending the running part."""
    raise KeyboardInterrupt


def run_all(args: argparse.Namespace) -> int:
    """Run the selected parts in order, then print and write the summary table."""
    args.out = args.out.resolve()  # the parts run in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, interrupt)  # a stopped run still writes its summary
    only = set(args.only or PARTS)
    wants_m30k = "m30k" in only and args.m30k_seconds > 0
    reserve = args.m30k_seconds + M30K_EXTRA if wants_m30k else 0.0
    running = [u for u in UNITS if u.part in only and skip_reason(u, args) is None]
    for log in {unit.log for unit in running}:  # this run's logs start empty
        (args.out / log).write_text("", encoding="utf-8")
    work = Path(tempfile.mkdtemp(prefix="gpu_check."))
    start = time.time()
    rows: list[tuple[str, str, str]] = []
    try:
        for unit in UNITS:
            if unit.part not in only:
                if not any(row[0] == unit.part for row in rows):
                    rows.append((unit.part, "SKIPPED", "not in --only"))
                continue
            held = 0.0 if unit.part == "m30k" else reserve
            left = start + args.budget + reserve - held - time.time()
            rows += run_unit(unit, args, work, left)
    except Stopped as stop:
        rows += stop.rows + [("stopped", "ERROR", "the parts after it did not run")]
    except KeyboardInterrupt:
        rows.append(("stopped", "ERROR", "the parts after it did not run"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = summary_text(rows, args, time.time() - start)
    print(text, end="")
    (args.out / SUMMARY_FILE).write_text(text, encoding="utf-8")
    return 1 if any(status in ("FAIL", "ERROR") for _, status, _ in rows) else 0


# ----------------------------------------------------------------------------------
# Entry points

WORKERS: dict[str, Callable[[Context], None]] = {
    "env": part_env,
    "sync": part_sync,
    "amp": part_amp,
    "sdpa": part_sdpa,
    "copy": part_copy,
    "resume": part_resume,
    "cache": part_cache,
    "compile.aot_eager": functools.partial(part_compile, backend="aot_eager"),
    "compile.inductor": functools.partial(part_compile, backend="inductor"),
    "mfu.eager": functools.partial(part_mfu, compiled=False),
    "mfu.compiled": functools.partial(part_mfu, compiled=True),
    "peers": part_peers,
    "m30k": part_m30k,
}


def run_worker(args: argparse.Namespace) -> int:
    """Run one unit in this process (the driver started it)."""
    ctx = Context(
        device=args.device,
        small=args.small,
        out=args.out,
        work=args.work,
        deadline=args.deadline,
        m30k_seconds=args.m30k_seconds,
    )
    WORKERS[args.worker](ctx)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Drive every part, or (with the hidden --worker) run one of them."""
    args = parse_args(argv)
    return run_worker(args) if args.worker else run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
