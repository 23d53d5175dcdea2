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
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the parts only, never by the driver
    import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
MARK = "SUMMARY|"  # a part's stdout line "SUMMARY|check|status|detail" is a row
STATUSES = ("PASS", "WARN", "FAIL", "INFO", "SKIPPED", "TIMEOUT", "ERROR")
SUMMARY_FILE = "summary.txt"
M30K_METRICS = "m30k_metrics.jsonl"
M30K_EXTRA = 300  # seconds beyond --m30k-seconds: start, save after SIGINT, BLEU
M30K_STOP_WAIT = 120  # seconds a run may take to save after its SIGINT
KILL_GRACE = 10  # seconds between SIGTERM and SIGKILL of a part out of time
MIN_PART = 15  # a part with less time than this left is skipped
COPY_TEXT = "3 1 4 1 5 9 2 6 5 3"
MFU_BATCH, MFU_SEQ_LEN = 512, 128  # 4x the positions of 256 pairs of 32-63 tokens
SDPA_KERNELS = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


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


# ----------------------------------------------------------------------------------
# env


def part_env(ctx: Context) -> None:
    """Versions, the GPU, the attention kernels enabled; what "auto" picks."""
    import torch

    import aiayn
    from aiayn.batching import pick_device
    from aiayn.train import autocast_dtype

    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}")
    print(
        f"python {platform.python_version()} | torch {torch.__version__} | "
        f"cuda {torch.version.cuda} | aiayn {aiayn.__version__} at {aiayn.__file__}"
    )
    if shutil.which("nvidia-smi"):
        query = "name,memory.total,driver_version,clocks.sm,power.limit"
        run_cli(ctx, ["nvidia-smi", f"--query-gpu={query}", "--format=csv"])
    if ctx.cuda and not torch.cuda.is_available():
        report("env.versions", "FAIL", f"--device {ctx.device}: no CUDA GPU visible")
        return
    name = "cpu"
    if ctx.cuda:
        name = describe_gpu(torch.device(ctx.device))
    auto = pick_device("auto")
    ours = Path(aiayn.__file__).resolve().is_relative_to(ROOT / "src")
    detail = (
        f"torch {torch.__version__}, {name}, pick_device('auto')={auto}, "
        f"amp auto -> {autocast_dtype('auto', auto)}"
    )
    if not ours:
        detail += f"; aiayn imported from {aiayn.__file__}, not this checkout"
    report("env.versions", "INFO" if ours else "WARN", detail)
    n = torch.cuda.device_count()
    report(
        "env.ddp",
        "SKIPPED",
        f"one GPU: NCCL refuses two ranks on one device ({n} CUDA device(s) "
        "visible; tests/test_ddp.py trains two processes with gloo on a CPU)",
    )


def describe_gpu(device: torch.device) -> str:
    """Print the GPU's properties and the kernels enabled; its name."""
    import torch

    p = torch.cuda.get_device_properties(device)
    b = torch.backends.cuda
    print(
        f"gpu {p.name} {p.total_memory / 2**30:.1f} GiB capability "
        f"{torch.cuda.get_device_capability(device)} | bf16 supported "
        f"{torch.cuda.is_bf16_supported()}"
    )
    print(
        f"sdpa enabled: flash {b.flash_sdp_enabled()} mem_efficient "
        f"{b.mem_efficient_sdp_enabled()} cudnn "
        f"{getattr(b, 'cudnn_sdp_enabled', lambda: '?')()} math "
        f"{b.math_sdp_enabled()} | matmul tf32 {b.matmul.allow_tf32}"
    )
    return p.name


# ----------------------------------------------------------------------------------
# sync


def sync_setup(ctx: Context) -> tuple:
    """The sync part's tokenizer, loaders and model size."""
    from aiayn import TransformerConfig
    from aiayn.train import (
        encode_pairs,
        make_loader,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    tok = synthetic_tokenizer(10)
    n_train, n_valid = (1000, 100) if ctx.small else (4000, 300)
    pairs = encode_pairs(tok, synthetic_pairs("copy", n_train, max_len=30, seed=1))
    valid = encode_pairs(tok, synthetic_pairs("copy", n_valid, max_len=30, seed=2))
    loader = make_loader(pairs, tok, max_tokens=2048, pin_memory=ctx.cuda)
    valid_loader = make_loader(valid, tok, max_tokens=2048, shuffle=False)
    size = TransformerConfig.tiny if ctx.small else TransformerConfig.small
    return tok, loader, valid_loader, size(tok.vocab_size, max_len=64)


def sync_trainer(ctx: Context, loader: Any, config: Any, steps: int) -> Any:
    """A new RunTrainer of a fresh model, the same every time."""
    import torch

    from aiayn import Transformer
    from aiayn.engine import RunTrainer
    from aiayn.train import TrainConfig

    torch.manual_seed(0)
    train_config = TrainConfig(
        steps=steps,
        warmup=10,
        log_every=0,
        amp="auto",
        device=ctx.device,
        progress=False,
    )
    return RunTrainer(Transformer(config), train_config, loader, log=None)


def report_syncs(ctx: Context, check: str, status: str, detail: str) -> None:
    """A row of the sync part; off CUDA nothing is counted: SKIPPED, the code ran."""
    if not ctx.cuda:
        status = "SKIPPED"
        detail = f"set_sync_debug_mode needs CUDA (the code ran on {ctx.device})"
    report(check, status, detail)


def check_train_step_syncs(ctx: Context, trainer: Any) -> None:
    """Five updates in "error" mode: any synchronising call raises."""
    import traceback

    import torch

    if not ctx.cuda:
        trainer.train_step()
        report_syncs(ctx, "sync.train_step", "SKIPPED", "")
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            trainer.train_step()
        ok, where = True, "5 Trainer.train_step() calls ran with "
        where += "set_sync_debug_mode('error')"
    except RuntimeError as err:
        ok = False
        tb = traceback.extract_tb(err.__traceback__)
        frames = [f"{short(f.filename)}:{f.lineno} {f.name}" for f in tb]
        frames = [f for f in frames if f.startswith("aiayn/")][-3:]
        where = f"{str(err).splitlines()[0][:90]} at {' <- '.join(reversed(frames))}"
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    report("sync.train_step", "PASS" if ok else "FAIL", where)


def check_decode_syncs(ctx: Context, model: Any, vocab: int) -> None:
    """Synchronisations of greedy, beam and sampling decoding, per call and step."""
    import torch

    from aiayn.decoding import beam_search, greedy_search, sample

    device = torch.device(ctx.device)
    n, m = (8, 8) if ctx.small else (32, 40)  # exactly m tokens each
    lengths = torch.randint(10, 26, (n,))
    src = torch.nn.utils.rnn.pad_sequence(
        [torch.randint(4, vocab, (int(k),)) for k in lengths], batch_first=True
    ).to(device)  # [n, longest]
    gen = torch.Generator(device=device).manual_seed(0)
    searches = {
        "greedy": lambda: greedy_search(model, src, max_len=m, min_len=m),
        "beam4": lambda: beam_search(model, src, beam_size=4, max_len=m, min_len=m),
        "sample": lambda: sample(model, src, max_len=m, min_len=m, generator=gen),
    }
    for name, search in searches.items():
        search()  # warm-up
        synchronize(device)
        with count_syncs(ctx.cuda) as found:
            search()
        total = sum(found.values())
        # about 9 a call: checks, limits, the stop flag every 8 steps, the final cut
        per_step = max(0, total - 9) / m
        report_syncs(
            ctx,
            f"sync.decode_{name}",
            "PASS" if per_step < 0.5 else "WARN",
            f"{total} syncs for {m} steps (~{per_step:.1f} per step beyond the ~9 "
            f"per call): {fmt_counter(found)}",
        )


def part_sync(ctx: Context) -> None:
    """Host synchronisations of training, evaluation and decoding."""
    import torch

    from aiayn.train import evaluate

    tok, loader, valid_loader, config = sync_setup(ctx)
    steps = 12 if ctx.small else 40
    trainer = sync_trainer(ctx, loader, config, steps)
    for _ in range(3):  # lazy initialisations (cuBLAS handles, Adam, the scaler)
        trainer.train_step()
    synchronize(torch.device(ctx.device))
    check_train_step_syncs(ctx, trainer)
    trainer = sync_trainer(ctx, loader, config, steps)
    trainer.train_step()
    with count_syncs(ctx.cuda) as found:
        trainer.fit()
    n = sum(found.values())
    report_syncs(
        ctx,
        "sync.fit",
        "INFO",
        f"{n} syncs in {steps - 1} updates ({n / (steps - 1):.2f}/update; flush "
        f"every 10 expected): {fmt_counter(found)}",
    )
    with count_syncs(ctx.cuda) as found:
        evaluate(trainer.model, valid_loader, trainer.criterion, trainer.config.amp)
    report_syncs(
        ctx,
        "sync.evaluate",
        "INFO",
        f"{sum(found.values())} syncs for {len(list(valid_loader))} batches: "
        f"{fmt_counter(found)}",
    )
    check_decode_syncs(ctx, trainer.model.eval(), tok.vocab_size)


# ----------------------------------------------------------------------------------
# amp


@contextlib.contextmanager
def pretend_t4() -> Iterator[None]:
    """Capability 7.5 for "auto"; attention limited to the kernels a T4 has."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (7, 5)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.cuda.get_device_capability = real


def amp_setup(ctx: Context) -> tuple:
    """The recipe's model config, two batches of 12,000 positions, and their FLOPs."""
    from aiayn.batching import make_batch
    from aiayn.data import GPU_RECIPE

    sys.path.insert(0, str(BENCHMARKS))
    import peers
    import train_mfu

    vocab = 500 if ctx.small else 10_000
    c = GPU_RECIPE.model_config(vocab)
    if ctx.small:
        c = dataclasses.replace(
            c, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64
        )
    # max_tokens 12,000: b * max(src_len, tgt_len + 1) <= 12,000
    shapes = (
        [(40, 10, 9), (20, 20, 19)] if ctx.small else [(400, 30, 29), (190, 63, 62)]
    )
    batches = [
        make_batch(random_pairs(b, s, t, vocab, seed=i), c.pad_id, c.bos_id, c.eos_id)
        for i, (b, s, t) in enumerate(shapes)
    ]
    size = peers.Size(
        "gpu recipe", vocab, c.d_model, c.n_heads, c.n_encoder_layers, c.d_ff,
        0, 0, 0, 0, (0, 0),
    )  # fmt: skip
    return c, batches, [train_mfu.train_flops(size, b) for b in batches]


def amp_steps(ctx: Context, amp: str, config: Any, batches: list) -> tuple:
    """Six updates in one precision: the trainer, step seconds, peak memory."""
    import torch

    from aiayn import Transformer
    from aiayn.engine import RunTrainer, check_finite
    from aiayn.train import TrainConfig

    device = torch.device(ctx.device)
    torch.manual_seed(0)
    train_config = TrainConfig(
        steps=100, warmup=4000, amp=amp, device=ctx.device, log_every=0, progress=False
    )
    trainer = RunTrainer(Transformer(config), train_config, batches * 100, log=None)
    scale0 = float(trainer.scaler.get_scale())
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed(trainer.train_step, device) for _ in range(6)]
    peak = reserved = math.nan
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    check_finite(trainer, weights=True)
    return trainer, scale0, times, peak, reserved


def on_a_t4(reserved: float, flops: list) -> tuple[bool, str]:
    """Whether the recipe fits a 16 GB T4, and how long its 4,000 steps take there."""
    fits = reserved / 2**30 < 14.0  # a T4 has 15 GiB, less the CUDA context
    per_step = statistics.mean(flops)
    return fits, (
        f" ({'fits' if fits else 'does NOT fit'} a 16 GB T4 with margin); GPU "
        f"recipe on a T4: {per_step / 1e12:.2f} TFLOP/step x 4000 = "
        f"{per_step * 4000 / 20e12 / 60:.0f} min at 20 TFLOP/s, "
        f"{per_step * 4000 / 10e12 / 60:.0f} at 10"
    )


def amp_mode(ctx: Context, mode: str, config: Any, batches: list, flops: list) -> float:
    """Train six steps in one precision mode, report it; its first loss."""
    import gc

    import torch

    from aiayn.train import autocast_dtype

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    amp = "auto" if mode == "t4" else mode
    with pretend_t4() if mode == "t4" else contextlib.nullcontext():
        dtype = autocast_dtype(amp, torch.device(ctx.device))
        trainer, scale0, times, peak, reserved = amp_steps(ctx, amp, config, batches)
    h = trainer.history
    losses, norms = h["loss"], h["grad_norm"]
    scale1 = float(trainer.scaler.get_scale())
    skipped = sum(1 for g in norms if not math.isfinite(g))
    # steps 3 to 6 alternate the two shapes: 2 of each
    t_a, t_b = statistics.median(times[2::2]), statistics.median(times[3::2])
    tflops = (flops[0] / t_a + flops[1] / t_b) / 2 / 1e12
    print(
        f"[{mode}] autocast {dtype}, scaler {scale0:g} -> {scale1:g}, losses "
        f"{[round(x, 3) for x in losses]}, grad norms {[round(x, 2) for x in norms]}, "
        f"step s {[round(x, 3) for x in times]}, peak {gib(peak)} GiB allocated, "
        f"{gib(reserved)} GiB reserved, {tflops:.1f} model TFLOP/s",
        flush=True,
    )
    ok = all(math.isfinite(x) for x in losses) and skipped < len(losses)
    detail = (
        f"autocast {str(dtype).replace('torch.', '')}, first loss {losses[0]:.3f}, "
        f"last {losses[-1]:.3f}, skipped {skipped}/6, scale {scale0:g}->{scale1:g}, "
        f"{t_a * 1e3:.0f}/{t_b * 1e3:.0f} ms per step, {tflops:.0f} TFLOP/s, peak "
        f"{gib(peak)} GiB ({gib(reserved)} reserved)"
    )
    if mode == "t4":
        fits, note = on_a_t4(reserved, flops)
        ok = ok and dtype == torch.float16 and scale0 == 65536.0 and fits
        detail += note
    report(f"amp.{mode}", "PASS" if ok else "FAIL", detail)
    return losses[0]


def part_amp(ctx: Context) -> None:
    """The GPU recipe's model in fp32, bf16, fp16 and on a pretended T4."""
    config, batches, flops = amp_setup(ctx)
    modes = ("off", "bf16", "fp16") + (("t4",) if ctx.cuda else ())
    first = {mode: amp_mode(ctx, mode, config, batches, flops) for mode in modes}
    if not ctx.cuda:
        report("amp.t4", "SKIPPED", "the T4 path needs CUDA")
    diffs = {k: abs(v - first["off"]) / first["off"] for k, v in first.items()}
    diffs.pop("off")
    report(
        "amp.first_loss",
        "PASS" if all(d < 0.02 for d in diffs.values()) else "WARN",
        "relative difference of the first loss to fp32: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
    )


# ----------------------------------------------------------------------------------
# sdpa


def book_masks(device: torch.device, batch: int, length: int) -> dict:
    """Chapter 2's padding and target masks for tokens with 7 pads at the end."""
    import torch

    from aiayn.masks import padding_mask, target_mask

    tokens = torch.randint(4, 100, (batch, length), device=device)
    tokens[:, length - 7 :] = 0  # padding at the end
    return {
        "pad[B,1,1,L]": padding_mask(tokens, 0),
        "tgt[B,1,L,L]": target_mask(tokens, 0),
    }


def backend_runs(backend: str, dtype: Any, mask: Any, device: Any) -> bool:
    """Whether one attention kernel runs forward and backward with this mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = mask.size(0), 8, mask.size(-1), 64
    q, k, v = (
        torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    try:
        with warnings.catch_warnings(), sdpa_kernel([getattr(SDPBackend, backend)]):
            warnings.simplefilter("ignore")  # each refusal warns why
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.float().sum().backward()
        synchronize(device)
    except RuntimeError:
        return False
    return True


def check_backends(ctx: Context, masks: dict) -> None:
    """The kernels that run with the book's boolean masks, in each precision."""
    import torch
    from torch.nn.attention import SDPBackend

    kernels = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    kernels = tuple(k for k in kernels if hasattr(SDPBackend, k))
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, mask in masks.items():
            device = mask.device
            runs = [k for k in kernels if backend_runs(k, dtype, mask, device)]
            cells = "+".join(k.split("_")[0].lower() for k in runs) or "none"
            rows.append(f"{str(dtype).replace('torch.', '')} {name}: runs on {cells}")
    print("\n".join(rows))
    report("sdpa.backends", "INFO", "; ".join(rows))


def check_default_kernel(ctx: Context, masks: dict) -> None:
    """The kernels the default choice runs in bf16 with a [B,1,L,L] mask (CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from aiayn.multi_head import MultiHeadAttention

    if not ctx.cuda:
        report("sdpa.default", "SKIPPED", "kernel names come from the CUDA profiler")
        return
    device = torch.device(ctx.device)
    mask = masks["tgt[B,1,L,L]"]
    mha = MultiHeadAttention(512, 8).to(device)
    x = torch.randn(mask.size(0), mask.size(-1), 512, device=device, requires_grad=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = mha(x, mask=mask)
        y.float().sum().backward()
        synchronize(device)
    keys = ("fmha", "flash", "attention", "cudnn", "softmax", "efficient")
    names = sorted(
        {e.key for e in prof.key_averages() if any(s in e.key.lower() for s in keys)}
    )
    report("sdpa.default", "INFO", "kernels: " + ", ".join(n[:60] for n in names[:5]))


def check_accuracy(ctx: Context, masks: dict) -> None:
    """The default kernel against the math kernel in float64, for both masks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, mask in masks.items():
            b, n = mask.size(0), mask.size(-1)
            q, k, v = (torch.randn(b, 8, n, 64, device=mask.device) for _ in range(3))
            with sdpa_kernel([SDPBackend.MATH]):
                ref = F.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), attn_mask=mask
                )
            out = F.scaled_dot_product_attention(
                q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask
            )
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            label = f"{str(dtype).replace('torch.', '')} {name.split('[')[0]}"
            errors.append((label, rel))
    tol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}  # float32 may use tf32
    bad = [e for e in errors if not e[1] < tol[e[0].split()[0]]]
    report(
        "sdpa.accuracy",
        "PASS" if not bad else "FAIL",
        "default kernel vs float64 math, relative error: "
        + ", ".join(f"{n} {e:.1e}" for n, e in errors),
    )


def masked_row(mha: Any, mask: Any, dtype: Any, kernel: str | None) -> tuple | None:
    """(row 2 of batch 0 is the bias and grads are finite, note); None: no kernel."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = mask.device
    x = torch.randn(2, 5, 64, device=device, requires_grad=True)
    chosen = sdpa_kernel([getattr(SDPBackend, kernel)]) if kernel else None
    autocast = torch.autocast(
        device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    )
    try:
        with chosen or contextlib.nullcontext(), autocast:
            out, _ = mha(x, mask=mask)
        out.float().sum().backward()
    except RuntimeError as err:
        if "No viable backend" in str(err) or "No available kernel" in str(err):
            return None  # the kernel does not exist on this device
        return False, str(err)[:40]
    finite = bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all())
    is_bias = torch.allclose(out[0, 2].float(), mha.out_proj.bias.float(), atol=1e-2)
    return finite and is_bias, finite


def check_fully_masked_row(ctx: Context) -> None:
    """A query with nothing to attend to: output = out_proj's bias, finite grads."""
    import torch

    from aiayn.multi_head import MultiHeadAttention

    device = torch.device(ctx.device)
    mha = MultiHeadAttention(64, 4).to(device)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool, device=device)
    mask[0, :, 2, :] = False
    results, absent = [], []
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    for label, dtype in dtypes.items():
        for kernel in (None, "EFFICIENT_ATTENTION", "MATH"):
            name = f"{label}/{(kernel or 'default').split('_')[0].lower()}"
            result = masked_row(mha, mask, dtype, kernel)
            if result is None:
                absent.append(name)
            else:
                results.append((name, *result))
    bad = [r for r in results if not r[1]]
    report(
        "sdpa.fully_masked_row",
        "PASS" if not bad else "WARN",
        f"output = bias, finite grads in {len(results) - len(bad)}/{len(results)}"
        + (f"; not in: {[(r[0], r[2]) for r in bad]}" if bad else "")
        + (f"; no such kernel on {device.type}: {', '.join(absent)}" if absent else ""),
    )


def first_calls(fn: Callable[[], Any], device: Any) -> tuple[float, float]:
    """Seconds of fn's first call, and the median of three repeats."""
    first = timed(fn, device)
    return first, statistics.median(timed(fn, device) for _ in range(3))


def kernel_call(kernel: str, b: int, n: int, dtype: Any, device: Any) -> Callable:
    """One attention call, forward and backward, on new [b, 8, n, 64] inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = book_masks(device, b, n)["tgt[B,1,L,L]"]
    q, k, v = (
        torch.randn(b, 8, n, 64, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(b, 8, n, 64, device=device, dtype=dtype)

    def call() -> None:
        """Forward and backward on the one kernel."""
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(grad)

    return call


def kernel_error(err: RuntimeError, caught: list) -> str:
    """Why a kernel did not run, from the error and the warnings that came with it."""
    reasons = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally.*", "", str(w.message)).strip()
        if text and not text.endswith(":") and text not in reasons:
            reasons.append(text[:80])
    if "No viable backend" in str(err) or "No available kernel" in str(err):
        return "not available" + (f": {'; '.join(reasons[:2])}" if reasons else " here")
    return f"does not run: {str(err).splitlines()[0][:80]}"


def attempt(make_call: Callable, kernel: str, b: int, n: int, device: Any) -> Any:
    """First-call and repeat seconds of a kernel on a new shape, or why it fails."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return first_calls(make_call(kernel, b, n), device)
        except RuntimeError as err:
            return kernel_error(err, caught)


def new_shape_costs(
    make_call: Callable[[str, int, int], Callable], shapes: list, device: Any
) -> dict[str, tuple[list[float], list[float]] | str]:
    """For each kernel: first-call and repeat seconds over new shapes, or why not.

    Each kernel first runs on a shape of its own (its one-time setup); then
    kernel j gets batch b + j, so that every shape is new to every kernel, and
    the order of the kernels rotates from one shape to the next.
    """
    from torch.nn.attention import SDPBackend

    kernels = [k for k in SDPA_KERNELS if hasattr(SDPBackend, k)]
    found: dict[str, Any] = {}
    for j, kernel in enumerate(kernels):
        warm = attempt(make_call, kernel, 2 + j, 8, device)
        found[kernel] = warm if isinstance(warm, str) else ([], [])
    for i, (b, n) in enumerate(shapes):
        for j in range(len(kernels)):
            kernel = kernels[(i + j) % len(kernels)]
            if isinstance(found[kernel], str):
                continue
            costs = attempt(make_call, kernel, b + kernels.index(kernel), n, device)
            if isinstance(costs, str):
                found[kernel] = costs
                continue
            found[kernel][0].append(costs[0])
            found[kernel][1].append(costs[1])
    return found


def fmt_costs(found: dict) -> str:
    """Median first-call and repeat milliseconds of each kernel."""
    parts = []
    for kernel, costs in found.items():
        name = kernel.split("_")[0].lower()
        if isinstance(costs, str):
            parts.append(f"{name} {costs}")
            continue
        first, again = statistics.median(costs[0]), statistics.median(costs[1])
        parts.append(
            f"{name} first {first * 1e3:.1f} ms vs repeat {again * 1e3:.1f} ms "
            f"({(first - again) * 1e3:+.1f}, max first {max(costs[0]) * 1e3:.0f})"
        )
    return "; ".join(parts)


def check_first_call(ctx: Context) -> None:
    """What the first call on a new (batch, length) costs each attention kernel."""
    import torch

    device = torch.device(ctx.device)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    shapes = [(12, 24), (20, 31), (28, 18), (36, 45), (44, 27), (52, 38), (60, 21)]
    shapes += [(68, 52), (76, 33), (84, 15)]
    shapes = shapes[:4] if ctx.small else shapes

    def make_call(kernel: str, b: int, n: int) -> Callable:
        """One attention call on new inputs of shape [b, 8, n, 64]."""
        return kernel_call(kernel, b, n, dtype, device)

    found = new_shape_costs(make_call, shapes, device)
    dtype_name = str(dtype).replace("torch.", "")
    report(
        "sdpa.first_call",
        "INFO",
        f"{dtype_name} [B,8,L,64], [B,1,L,L] mask, forward + backward, "
        f"{len(shapes)} new shapes each, medians: {fmt_costs(found)}",
    )


def check_first_step(ctx: Context) -> None:
    """What a tiny model's forward and backward on a new shape costs, by kernel."""
    import torch
    import torch.nn.functional as F

    from aiayn import Transformer, TransformerConfig
    from aiayn.batching import make_batch
    from aiayn.train import autocast

    device = torch.device(ctx.device)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(50, max_len=128)).to(device).train()
    c = model.config
    shapes = [(70, 23), (90, 17), (40, 41), (120, 12), (55, 30), (35, 50), (80, 26)]
    shapes = shapes[:3] if ctx.small else shapes

    def make_call(kernel: str, b: int, n: int) -> Callable:
        """A forward and backward pass on a new batch of b pairs of n tokens."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pairs = random_pairs(b, n, n - 1, 50, seed=b * 1000 + n, full=True)
        batch = make_batch(pairs, c.pad_id, c.bos_id, c.eos_id).to(device)

        def step() -> None:
            """The pass, every attention call on one kernel."""
            with sdpa_kernel([getattr(SDPBackend, kernel)]):
                with autocast("auto", device):
                    logits = model(batch.src, batch.tgt_in)  # [b, n, V]
                loss = F.cross_entropy(
                    logits.float().flatten(0, 1), batch.tgt_out.flatten()
                )
                loss.backward()

        return step

    found = new_shape_costs(make_call, shapes, device)
    report(
        "sdpa.first_step",
        "INFO",
        f"tiny Transformer, forward + backward under amp auto, {len(shapes)} new "
        f"(batch, length) each, medians: {fmt_costs(found)}",
    )


def part_sdpa(ctx: Context) -> None:
    """Attention kernels: which run, how exact, masked rows, new shapes' cost."""
    import torch

    masks = book_masks(torch.device(ctx.device), 8, 40)
    check_backends(ctx, masks)
    check_default_kernel(ctx, masks)
    check_accuracy(ctx, masks)
    check_fully_masked_row(ctx)
    check_first_call(ctx)
    check_first_step(ctx)


# ----------------------------------------------------------------------------------
# copy, resume, cache: the command line and the decoding benchmark


def copy_run(ctx: Context, amp: str) -> Path | None:
    """Train the copy task with the command line; the run's folder if it passed."""
    folder = ctx.work / f"copy_{amp}"
    steps = 5 if ctx.small else 400
    extra = ["--train-size", 1000, "--valid-size", 100] if ctx.small else []
    ran = run_cli(
        ctx,
        aiayn(
            "train", "--task", "copy", "--device", ctx.device, "--amp", amp,
            "--steps", steps, "--checkpoint-dir", folder, "--no-progress",
            "--overwrite", *extra,
        ),
    )  # fmt: skip
    em = match(r"^done in .*exact match ([0-9.]+)", ran.stdout)
    averaged = match(r"^average of .*exact match ([0-9.]+)", ran.stdout) or "?"
    seconds = match(r"^done in ([0-9.]+) s", ran.stdout) or "?"
    need = 0.0 if ctx.small else 0.9
    if ran.rc is None:
        report(f"copy.{amp}", "TIMEOUT", f"{steps} steps did not end in time")
    elif ran.rc == 0 and em is not None and float(em) >= need:
        report(
            f"copy.{amp}",
            "PASS",
            f"exact match {em} (averaged snapshots {averaged}), {steps} steps in "
            f"{seconds} s" + (" (--small: no threshold)" if ctx.small else ""),
        )
        return folder
    else:
        report(
            f"copy.{amp}",
            "FAIL",
            f"exit {ran.rc}, exact match {em or 'none'} (need >= {need}): {ran.last}",
        )
    return None


def check_translate(ctx: Context, folder: Path) -> None:
    """Greedy and beam search of `python -m aiayn translate` copy a string."""
    said = {}
    for how in ("greedy", "beam"):
        flags = ["--greedy"] if how == "greedy" else []
        ran = run_cli(
            ctx,
            aiayn(
                "translate", "--checkpoint", folder, "--device", ctx.device,
                *flags, COPY_TEXT,
            ),
        )  # fmt: skip
        lines = ran.stdout.strip("\n").splitlines() or [""]
        said[how] = lines[-1].strip() if ran.rc == 0 else f"exit {ran.rc}"
    if said["greedy"] == COPY_TEXT and said["beam"] == COPY_TEXT:
        report(
            "copy.translate",
            "PASS",
            f"greedy and beam copy '{COPY_TEXT}' on {ctx.device}",
        )
    else:
        report(
            "copy.translate",
            "INFO" if ctx.small else "FAIL",
            f"greedy '{said['greedy']}', beam '{said['beam']}' for '{COPY_TEXT}'",
        )


def part_copy(ctx: Context) -> None:
    """The copy task through the command line, bf16 (auto) and fp16; translate."""
    folder = copy_run(ctx, "auto")
    if folder is not None:
        check_translate(ctx, folder)
    else:
        report("copy.translate", "SKIPPED", "no checkpoint: the training failed")
    copy_run(ctx, "fp16")


def compare_checkpoints(fresh: Path, resumed: Path) -> None:
    """Chapter 14's claim: the resumed run ends bit for bit where the fresh one ends."""
    import torch

    from aiayn.model import read_checkpoint

    a, b = read_checkpoint(fresh), read_checkpoint(resumed)
    sa, sb = a["state_dict"], b["state_dict"]
    same = [torch.equal(sa[k], sb[k]) for k in sa]
    diff = max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
    losses = a["training"]["history"]["loss"] == b["training"]["history"]["loss"]
    report(
        "resume.bitwise",
        "PASS" if all(same) and losses else "FAIL",
        f"chapter 14's check: {sum(same)}/{len(same)} tensors equal, max |diff| "
        f"{diff:.2e}, loss histories equal: {losses}",
    )


def part_resume(ctx: Context) -> None:
    """Train n steps; train n/2 and resume to n; compare every tensor."""
    n, half = (10, 5) if ctx.small else (100, 50)
    extra = ["--train-size", 1000, "--valid-size", 100] if ctx.small else []
    common = ["--task", "reverse", "--device", ctx.device, "--no-progress"]
    common += ["--log-every", 10, "--checkpoint-every", half, *extra]
    fresh, pieces = ctx.work / "fresh", ctx.work / "pieces"
    runs = (
        aiayn("train", *common, "--steps", n, "--checkpoint-dir", fresh, "--overwrite"),
        aiayn("train", *common, "--steps", half, "--checkpoint-dir", pieces,
              "--overwrite"),
        aiayn("train", "--resume", pieces, "--steps", n, "--device", ctx.device,
              "--no-progress"),
    )  # fmt: skip
    for command in runs:
        ran = run_cli(ctx, command)
        if ran.rc != 0:
            status = "TIMEOUT" if ran.rc is None else "FAIL"
            report("resume.bitwise", status, f"a run exited with {ran.rc}: {ran.last}")
            return
    compare_checkpoints(fresh / "last.pt", pieces / "last.pt")


def part_cache(ctx: Context) -> None:
    """Chapter 15's claim: the key-value cache decodes faster than recomputing."""
    if ctx.small:
        args = ["--lengths", 32, "--reps", 1, "--threads", 1]
    else:
        args = ["--lengths", 128, "--reps", 3]
    ran = run_cli(
        ctx,
        benchmark("decode_throughput", "--device", ctx.device, "--vocab", 64, *args),
    )
    line = match(r"^(speedup of the cache.*)$", ran.stdout)
    ratios = [float(x) for x in re.findall(r"([0-9.]+)x", line or "")]
    if line and ratios and min(ratios) > 1.0:
        report("cache.speedup", "INFO", line)
    elif ran.rc is None:
        report("cache.speedup", "TIMEOUT", "decode_throughput.py did not end in time")
    elif line is None:
        report("cache.speedup", "ERROR", f"exit {ran.rc}: {ran.last}")
    else:
        report(
            "cache.speedup",
            "WARN",
            f"{line}: chapter 15 asserts > 1 from a single timing",
        )


# ----------------------------------------------------------------------------------
# compile


class DynamoNotes(logging.Handler):
    """What torch._dynamo logs about recompiling: the reasons, the limit reached."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the guard failures of a recompile, and any recompile-limit message."""
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_hits.append(message.splitlines()[0])
        if "Recompiling function" in message:
            for line in message.splitlines():
                if line.strip().startswith("- "):
                    self.reasons.append(line.strip()[2:])


class Recording:
    """A loader that notes the shape (batch, source, target) of each batch it yields."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.batch_sampler = loader, loader.batch_sampler
        self.shapes: list[tuple[int, int, int]] = []

    def __iter__(self) -> Iterator[Any]:
        """The loader's batches, noting each one's shape."""
        for batch in self.loader:
            self.shapes.append((*batch.src.shape, batch.tgt_in.size(1)))
            yield batch


def compile_trainer(ctx: Context, steps: int) -> tuple:
    """A RunTrainer with compile=True on the copy task's token-bucketed batches."""
    import torch

    from aiayn import Transformer, TransformerConfig
    from aiayn.engine import RunTrainer
    from aiayn.train import (
        TrainConfig,
        encode_pairs,
        make_loader,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    tok = synthetic_tokenizer(10)
    n, max_tokens = (2000, 1024) if ctx.small else (20_000, 4096)
    pairs = encode_pairs(tok, synthetic_pairs("copy", n, max_len=40, seed=1))
    # sorted buckets, batches in shuffled order: the Multi30k presets' loader
    loader = Recording(make_loader(pairs, tok, max_tokens, pin_memory=ctx.cuda))
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(tok.vocab_size, max_len=64))
    config = TrainConfig(
        steps=steps,
        warmup=10,
        log_every=0,
        compile=True,
        amp="auto",
        device=ctx.device,
        progress=False,
    )
    return RunTrainer(model, config, loader, log=None), loader


def compile_steps(ctx: Context, trainer: Any, loader: Recording, steps: int) -> list:
    """Step seconds, printed with the graphs so far; stops short of the deadline."""
    import torch
    from torch._dynamo.utils import counters

    device, times = torch.device(ctx.device), []
    for i in range(steps):
        times.append(timed(trainer.train_step, device))
        graphs = counters["stats"].get("unique_graphs", 0)
        print(
            f"step {i + 1}: shape {loader.shapes[-1]}, {times[-1]:.2f}s, graphs so "
            f"far {graphs}",
            flush=True,
        )
        if ctx.left() < (5 if ctx.small else 30):  # a recompile: 25 s on a GPU
            print(f"stopping after {i + 1} steps: the part's time is nearly up")
            break
    return times


def part_compile(ctx: Context, backend: str) -> None:
    """Recompiles of the package's model over token-bucketed batch shapes."""
    import torch
    from torch._dynamo.utils import counters

    if backend != "inductor":  # the Trainer calls torch.compile(module)
        torch.compile = functools.partial(torch.compile, backend=backend)
    torch._logging.set_logs(recompiles=True)
    notes = DynamoNotes()
    logging.getLogger("torch._dynamo").addHandler(notes)
    steps = 6 if ctx.small else 20
    trainer, loader = compile_trainer(ctx, steps)
    times = compile_steps(ctx, trainer, loader, steps)
    losses = trainer.history["loss"]
    graphs = counters["stats"].get("unique_graphs", 0)
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8))
    hit = bool(notes.limit_hits) or graphs >= limit
    breaks = sum(counters["graph_break"].values())
    print("shapes (b, s, t):", loader.shapes)
    print("step seconds:", [round(t, 3) for t in times])
    print("loss:", [round(x, 3) for x in losses])
    ok = graphs <= 2 and not hit
    detail = (
        f"backend {backend}: {graphs} graphs for {len(set(loader.shapes))} distinct "
        f"shapes in {len(times)} steps, {breaks} graph breaks, recompile limit "
        f"({limit}) hit: {hit}; first step {times[0]:.1f}s, steady "
        f"{statistics.median(times[-5:]) * 1e3:.0f} ms, total {sum(times):.0f}s, "
        f"last loss {losses[-1]:.3f}"
    )
    if not ok:
        reasons = list(dict.fromkeys(r[:160] for r in notes.reasons))
        detail += "; recompiles: " + " | ".join(reasons[:6])
    report(f"compile.{backend}", "PASS" if ok else "FAIL", detail)


# ----------------------------------------------------------------------------------
# mfu and peers: the benchmarks' scripts, summarised from their --json


def without_transformers(ctx: Context) -> dict[str, str]:
    """The environment, with an import of transformers that fails: no Marian."""
    shim = ctx.work / "no_transformers"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "transformers.py").write_text(
        'raise ImportError("hidden: the mfu part compares with torch.nn only")\n'
    )
    paths = [str(shim), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def mfu_rows(check: str, result: dict) -> None:
    """One row per contender of a train_mfu.py --json: tokens/s, TFLOP/s, MFU."""
    rows = result["rows"]
    reference = rows.get("torch.nn", {}).get("wall", {}).get("median")
    for label, x in result["extra"].items():
        tok = rows[label]["wall"]["median"]
        mfu = "n/a" if x["mfu"] is None else f"{x['mfu']:.1%}"
        mib = "n/a" if x["step_mib"] is None else f"{x['step_mib']:,.0f} MiB"
        ratio = f", {tok / reference:.2f}x torch.nn" if reference else ""
        base = result["size"]["name"] == "base" and label == "aiayn"
        goal = " (goal: 40% for the base model in bf16)" if base else ""
        report(
            check,
            "INFO",
            f"{label}: {tok:,.0f} tok/s{ratio}, {x['tflops']:.1f} TFLOP/s, MFU {mfu}"
            f"{goal}, step {mib}",
        )


def part_mfu(ctx: Context, compiled: bool) -> None:
    """benchmarks/train_mfu.py, base size, bf16, aiayn and torch.nn only."""
    kind = "compiled" if compiled else "eager"
    path = ctx.work / f"mfu_{kind}.json"
    if ctx.small:
        size = ["--smoke"]
    else:
        size = ["--size", "base", "--device", ctx.device, "--dtype", "bf16"]
        size += ["--batch-size", MFU_BATCH, "--seq-len", MFU_SEQ_LEN]
        # one batch: one shape to compile; eager steps are cheap, more repetitions
        size += ["--reps", 3 if compiled else 5, "--warmup", 1]
    ran = run_cli(
        ctx,
        benchmark(
            "train_mfu", *size, "--compile", "yes" if compiled else "no",
            "--steps", 1, "--json", path,
        ),
        env=without_transformers(ctx),
    )  # fmt: skip
    if ran.rc == 0 and path.exists():
        result = json.loads(path.read_text())
        print("raw json:", json.dumps(result["seconds"]))
        mfu_rows(f"mfu.{kind}", result)
    else:
        status = "TIMEOUT" if ran.rc is None else "ERROR"
        report(f"mfu.{kind}", status, f"exit {ran.rc}: {ran.last}")


def peers_rows(result: dict) -> None:
    """Rows of a peers.py --json: training, memory and decoding, per size."""
    for size, r in result.items():
        if size == "meta":
            continue
        rows = (r.get("train") or {}).get("rows") or {}
        if rows:
            ref = rows["aiayn"]["wall"]["median"]
            speeds = ", ".join(
                f"{n} {v['wall']['median']:,.0f}" for n, v in rows.items()
            )
            ratios = ", ".join(
                f"{ref / v['wall']['median']:.2f}"
                for n, v in rows.items()
                if n != "aiayn"
            )
            report(
                "peers", "INFO", f"{size} train tok/s: {speeds} (aiayn/peer: {ratios})"
            )
        step = (r.get("memory") or {}).get("step") or {}
        if step:
            mib = ", ".join(f"{n} {v['median']:,.1f}" for n, v in step.items())
            report("peers", "INFO", f"{size} step memory MiB: {mib}")
        for label, x in (r.get("decode") or {}).items():
            rows = x.get("rows") or {}
            speeds = ", ".join(
                f"{n} {v['wall']['median']:,.0f}" for n, v in rows.items()
            )
            report("peers", "INFO", f"{size} {label} tok/s: {speeds}")


def part_peers(ctx: Context) -> None:
    """benchmarks/peers.py on the device: aiayn against Marian and torch.nn."""
    path = ctx.work / "peers.json"
    if ctx.small:  # memory measures in fresh processes: seconds each
        size = ["--smoke", "--only", "train", "--only", "decode"]
    else:
        size = ["--size", "base", "--reps", 2, "--warmup", 1, "--gen-len", 20]
    ran = run_cli(
        ctx, benchmark("peers", *size, "--device", ctx.device, "--json", path)
    )
    if ran.rc == 0 and path.exists():
        peers_rows(json.loads(path.read_text()))
    else:
        status = "TIMEOUT" if ran.rc is None else "ERROR"
        report("peers", status, f"exit {ran.rc}: {ran.last}")


# ----------------------------------------------------------------------------------
# m30k: the Multi30k recipe for N seconds, one SIGINT, BLEU


def echo(stream: IO[str], lines: list[str]) -> None:
    """Copy a child's output lines to ours as they come, and keep them."""
    for line in stream:
        lines.append(line)
        print(line, end="", flush=True)


def m30k_train(ctx: Context, folder: Path) -> tuple[int | None, str, float]:
    """Train for --m30k-seconds, then send one SIGINT to the process (not its group).

    Returns the exit status (None: it did not stop), its output, and the seconds
    it trained.
    """
    args = ["train", "--preset", "multi30k-de-en", "--device", ctx.device]
    args += ["--checkpoint-dir", folder, "--no-progress", "--overwrite"]
    args += ["--eval-every", 0, "--log-every", 5 if ctx.small else 100]
    if ctx.small:
        args += ["--model", "tiny", "--train-size", 2000, "--steps", 100_000]
    command = aiayn(*args)
    print(f"$ {shlex.join(command)}", flush=True)
    lines: list[str] = []
    start = time.time()
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    reader = threading.Thread(target=echo, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=ctx.m30k_seconds)
    except subprocess.TimeoutExpired:
        print(f"== one SIGINT to process {proc.pid} after {ctx.m30k_seconds:.0f}s")
        proc.send_signal(signal.SIGINT)  # this process only: one request to stop
    trained = time.time() - start
    try:
        rc = proc.wait(timeout=M30K_STOP_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    reader.join(timeout=5)
    return rc, "".join(lines), trained


def m30k_metrics(ctx: Context, folder: Path) -> tuple[int, list[float]]:
    """Copy the run's metrics.jsonl to OUT; the last step and the tokens/s logged."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0, []
    shutil.copyfile(path, ctx.out / M30K_METRICS)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = max((r["step"] for r in rows if "loss" in r), default=0)
    return steps, [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]


def m30k_bleu(ctx: Context, folder: Path) -> None:
    """`python -m aiayn bleu` on test2016 with the checkpoint the run saved."""
    extra = ["--greedy", "--limit", 100] if ctx.small else []
    ran = run_cli(
        ctx,
        aiayn(
            "bleu", "--checkpoint", folder, "--split", "test2016",
            "--device", ctx.device, *extra,
        ),
        margin=2.0,
    )  # fmt: skip
    bleu = match(r"BLEU ([0-9.]+)", ran.stdout)
    if ran.rc == 0 and bleu is not None:
        report(
            "m30k.bleu",
            "INFO",
            f"{last_line(ran.stdout.split('signature')[0])} (goal: 40 from a single "
            "run of at most 10 minutes)",
        )
    else:
        status = "TIMEOUT" if ran.rc is None else "FAIL"
        report("m30k.bleu", status, f"exit {ran.rc}: {ran.last}")


def part_m30k(ctx: Context) -> None:
    """The Multi30k GPU recipe for N seconds, stopped by one SIGINT; its BLEU."""
    from aiayn.data import DATA_ENV
    from aiayn.model import read_checkpoint

    print(f"{DATA_ENV}={os.environ.get(DATA_ENV, '(not set: the package downloads)')}")
    folder = ctx.work / "m30k"
    rc, output, trained = m30k_train(ctx, folder)
    steps, speeds = m30k_metrics(ctx, folder)
    last = folder / "last.pt"
    saved = read_checkpoint(last)["training"]["step"] if last.exists() else None
    speed = (
        f"{statistics.median(speeds):,.0f} tok/s (median of {len(speeds)} log "
        f"lines; last {speeds[-1]:,.0f})"
        if speeds
        else "no tok/s logged"
    )
    detail = f"{steps} steps in {trained:.0f}s, {speed}"
    if rc == 130 and saved is not None and saved == steps and "--resume" in output:
        report(
            "m30k.train",
            "PASS",
            f"{detail}; one SIGINT after {ctx.m30k_seconds:.0f}s saved step {saved}",
        )
    elif rc == 0:
        report("m30k.train", "INFO", f"{detail}; finished before the SIGINT")
    else:
        report(
            "m30k.train",
            "FAIL",
            f"{detail}; after one SIGINT: exit {rc}, checkpoint at step {saved}: "
            f"{last_line(output)}",
        )
    if saved is not None:
        m30k_bleu(ctx, folder)
    else:
        report("m30k.bleu", "SKIPPED", "no checkpoint")


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
