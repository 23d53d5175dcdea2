"""gpu_check's mfu and peers parts: the benchmarks' scripts, from their --json."""

from __future__ import annotations

import json
import os

from .common import Context, benchmark, report, run_cli

MFU_BATCH, MFU_SEQ_LEN = 512, 128  # 4x the positions of 256 pairs of 32-63 tokens


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
