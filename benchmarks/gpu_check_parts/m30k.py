"""gpu_check's m30k part: the Multi30k recipe for N seconds, one SIGINT, BLEU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from .common import ROOT, Context, aiayn, last_line, match, report, run_cli

M30K_METRICS = "m30k_metrics.jsonl"
M30K_STOP_WAIT = 120  # seconds a run may take to save after its SIGINT


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
    from aiayn.model import read_checkpoint
    from aiayn.multi30k import DATA_ENV

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
