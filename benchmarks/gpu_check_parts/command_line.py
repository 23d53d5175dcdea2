"""gpu_check's copy, resume and cache parts: the command line and decoding."""

from __future__ import annotations

import re
from pathlib import Path

from .common import Context, aiayn, benchmark, match, report, run_cli

COPY_TEXT = "3 1 4 1 5 9 2 6 5 3"


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
