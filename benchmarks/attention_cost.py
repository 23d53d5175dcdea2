#!/usr/bin/env python3
"""Chapter 18's timings, measured as a benchmark: attention against the length.

Chapter 18 counts the FLOPs and bytes of attention exactly, and times three things
on the machine that runs it. This script runs the same three comparisons with the
same sizes, more repetitions and the spread of each, so that the book can quote a
recorded run:

1. length: chapter 1's `scaled_dot_product_attention` on 8 heads (the attention
   products, which form the n x n weights), the package's `MultiHeadAttention`
   (projections included, on its fused path) and `PositionwiseFeedForward`, at
   d_model 512, d_ff 2048, one sequence of n = 128 ... 2048 positions. At
   n = d_ff = 2048 the attention products and the feed-forward network do the
   same FLOPs;
2. lstm: `nn.LSTM` against `MultiHeadAttention` (4 heads), both of width 256, on a
   batch of 8 sequences of n = 32 ... 1024 positions; their FLOPs are equal at
   n = 2 d = 512;
3. backends: `F.scaled_dot_product_attention` restricted to each backend that
   runs on the device (`sdpa_kernel`), on [1, 8, n, 64], n = 256 ... 2048; on a
   GPU also the peak memory of a forward and backward pass of each;
4. query: one query per sequence, as in decoding one token at a time, attending
   over n = 10 ... 80 keys in 4 heads of 64, for 32 and for 128 sequences (32
   sentences, or a beam of 4 for each): PyTorch's fused function against
   chapter 1's `scaled_dot_product_attention` (which `MultiHeadAttention` uses for
   a single query on a CPU).

Every measurement is a forward pass without gradients (the backends' memory on a
GPU excepted) and is interleaved: in every repetition each contender runs once,
in an order that rotates, after an untimed warm-up. The tables give the median,
min and max in milliseconds over the repetitions, the ratio of the medians and the
slope p of a least-squares fit time = c * n^p over the longer lengths.

    python benchmarks/attention_cost.py                    # CPU, 1 thread, 7 reps
    python benchmarks/attention_cost.py --only backends --device cuda
    python benchmarks/attention_cost.py --smoke            # short lengths, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.attention import scaled_dot_product_attention
from aiayn.batching import pick_device
from aiayn.multi_head import MultiHeadAttention
from aiayn.sublayers import PositionwiseFeedForward

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, next to this file
import peers

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
LENGTHS = {  # per measurement: (lengths, how many of the last ones fit the slope)
    "length": ([128, 256, 512, 1024, 2048], 4),
    "lstm": ([32, 64, 128, 256, 512, 1024], 3),
    "backends": ([256, 512, 1024, 2048], 3),
    "query": ([10, 20, 40, 80], 3),
}
SMOKE_LENGTHS = {
    "length": ([16, 32], 2),
    "lstm": ([8, 16], 2),
    "backends": ([16, 32], 2),
    "query": ([4, 8], 2),
}


def interleaved(
    runs: dict[str, Callable[[], Any]], reps: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Wall seconds of each run, {name: [...]}, in peers.py's rotating order.

    Each run is called once untimed first, and the device is synchronised inside
    every timing.
    """

    def synced(run: Callable[[], Any]) -> Callable[[], None]:
        def go() -> None:
            run()
            sync()

        return go

    timed = {name: synced(run) for name, run in runs.items()}
    for run in timed.values():  # warm-up, untimed
        run()
    return {name: s["wall"] for name, s in peers.interleaved(timed, reps).items()}


def slope(lengths: list[int], values: list[float]) -> float:
    """The exponent p of the least-squares fit values = c * lengths**p (log-log)."""
    xs, ys = [math.log(n) for n in lengths], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum(
        (x - mx) ** 2 for x in xs
    )


def time_table(
    names: list[str],
    lengths: list[int],
    fit: int,
    seconds: dict[str, list[list[float]]],
    ratio: tuple[str, str],
) -> dict:
    """Print median [min-max] ms per length and contender, the ratio and the slopes."""
    medians = {name: [statistics.median(s) for s in seconds[name]] for name in names}
    slopes = {name: slope(lengths[-fit:], medians[name][-fit:]) for name in names}
    top, bottom = ratio
    print(
        "| n | "
        + " | ".join(f"{name} (ms)" for name in names)
        + f" | {top} / {bottom} |"
    )
    print("|---:|" + "---:|" * (len(names) + 1))
    for i, n in enumerate(lengths):
        cells = [
            f"{statistics.median(s) * 1e3:,.2f} "
            f"[{min(s) * 1e3:,.2f}-{max(s) * 1e3:,.2f}]"
            for s in (seconds[name][i] for name in names)
        ]
        r = medians[top][i] / medians[bottom][i]
        print(f"| {n:,} | " + " | ".join(cells) + f" | {r:.2f} |")
    fitted = f"n = {lengths[-fit]:,} to {lengths[-1]:,}"
    print(
        f"\nslopes of the medians, {fitted}: "
        + ", ".join(f"{name} {s:.2f}" for name, s in slopes.items())
        + "\n"
    )
    return {
        "lengths": lengths,
        "seconds": seconds,
        "slopes": slopes,
        "ratio": {
            "of": list(ratio),
            "values": [a / b for a, b in zip(medians[top], medians[bottom])],
        },
    }


def measure(
    contenders: Callable[[int], dict[str, Callable[[], Any]]],
    lengths: list[int],
    reps: int,
    sync: Callable[[], None],
) -> dict[str, list[list[float]]]:
    """seconds[name][i]: the repetitions of contender `name` at lengths[i]."""
    seconds: dict[str, list[list[float]]] = {}
    for n in lengths:
        for name, s in interleaved(contenders(n), reps, sync).items():
            seconds.setdefault(name, []).append(s)
    return seconds


def length_runs(
    device: torch.device,
    reps: int,
    sync: Callable[[], None],
    lengths: list[int],
    fit: int,
) -> dict:
    d, heads, d_ff = 512, 8, 2048
    torch.manual_seed(0)
    layer = MultiHeadAttention(d, heads).to(device).eval()
    ffn = PositionwiseFeedForward(d, d_ff).to(device).eval()

    def products(x: Tensor) -> Tensor:  # the 8 heads' softmax(QK^T / sqrt(d_k)) V
        q = x.unflatten(-1, (heads, -1)).transpose(1, 2)  # [1, heads, n, d_k]
        return scaled_dot_product_attention(q, q, q)[0]

    def contenders(n: int) -> dict[str, Callable[[], Any]]:
        x = torch.randn(1, n, d, device=device)  # [batch, n, d_model]
        return {
            "attention products": lambda: products(x),
            "self-attention layer": lambda: layer(x),
            "feed-forward network": lambda: ffn(x),
        }

    print("### length: d_model 512, 8 heads, d_ff 2048, one sequence\n")
    seconds = measure(contenders, lengths, reps, sync)
    return time_table(
        list(seconds),
        lengths,
        fit,
        seconds,
        ("attention products", "feed-forward network"),
    )


def lstm_runs(
    device: torch.device,
    reps: int,
    sync: Callable[[], None],
    lengths: list[int],
    fit: int,
) -> dict:
    d = 256
    torch.manual_seed(0)
    lstm = nn.LSTM(d, d, batch_first=True).to(device).eval()
    attention = MultiHeadAttention(d, 4).to(device).eval()

    def contenders(n: int) -> dict[str, Callable[[], Any]]:
        x = torch.randn(8, n, d, device=device)  # [batch, n, d]
        return {"LSTM": lambda: lstm(x), "self-attention": lambda: attention(x)}

    print(
        f"### lstm: nn.LSTM and self-attention, width {d}, batch 8; "
        f"equal FLOPs at n = {2 * d}\n"
    )
    seconds = measure(contenders, lengths, reps, sync)
    return time_table(list(seconds), lengths, fit, seconds, ("LSTM", "self-attention"))


def runnable_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA backends that run a [1, 8, 64, 64] attention on this device."""
    q = torch.randn(1, 8, 64, 64, device=device)
    found = []
    for backend in (
        SDPBackend.MATH,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q)
            found.append(backend)
        except RuntimeError:  # this backend does not run here
            pass
    return found


def peak_mib(backend: SDPBackend, n: int, device: torch.device) -> float:
    """Peak CUDA memory of one forward and backward pass, beyond q, k and v."""
    qkv = torch.randn(3, 1, 8, n, 64, device=device, requires_grad=True)
    q, k, v = qkv.unbind(0)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.enable_grad(), sdpa_kernel(backend):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def backend_runs(
    device: torch.device,
    reps: int,
    sync: Callable[[], None],
    lengths: list[int],
    fit: int,
) -> dict:
    backends = runnable_backends(device)
    names = [b.name for b in backends]

    def contenders(n: int) -> dict[str, Callable[[], Any]]:
        q, k, v = torch.randn(3, 1, 8, n, 64, device=device).unbind(0)

        def run(backend: SDPBackend) -> Callable[[], Tensor]:
            def attend() -> Tensor:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v)

            return attend

        return {b.name: run(b) for b in backends}

    print(
        f"### backends: scaled_dot_product_attention on [1, 8, n, 64], "
        f"the backends that run on {device.type}: {', '.join(names)}\n"
    )
    seconds = measure(contenders, lengths, reps, sync)
    result = time_table(
        names,
        lengths,
        fit,
        seconds,
        (names[0], names[1] if len(names) > 1 else names[0]),
    )
    if device.type == "cuda":
        peaks = {b.name: [peak_mib(b, n, device) for n in lengths] for b in backends}
        print("peak MiB of a forward and backward pass:\n")
        print("| n | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for i, n in enumerate(lengths):
            row = " | ".join(f"{peaks[b][i]:,.1f}" for b in names)
            print(f"| {n:,} | {row} |")
        print()
        result["peak_mib"] = peaks
    return result


def query_runs(
    device: torch.device,
    reps: int,
    sync: Callable[[], None],
    lengths: list[int],
    fit: int,
) -> dict:
    heads, d_k, result = 4, 64, {}
    for batch in (32, 128):

        def contenders(n: int, batch: int = batch) -> dict[str, Callable[[], Any]]:
            q = torch.randn(batch, heads, 1, d_k, device=device)  # one query each
            k, v = torch.randn(2, batch, heads, n, d_k, device=device).unbind(0)
            return {
                "fused": lambda: F.scaled_dot_product_attention(q, k, v),
                "chapter 1": lambda: scaled_dot_product_attention(q, k, v),
            }

        print(
            f"### query: one query, {heads} heads of {d_k}, {batch} sequences, "
            "against the keys n\n"
        )
        seconds = measure(contenders, lengths, reps, sync)
        result[str(batch)] = time_table(
            list(seconds), lengths, fit, seconds, ("fused", "chapter 1")
        )
    return result


MEASUREMENTS = {
    "length": length_runs,
    "lstm": lstm_runs,
    "backends": backend_runs,
    "query": query_runs,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only",
        action="append",
        choices=list(MEASUREMENTS),
        help="run only this measurement (repeatable); default all four",
    )
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (7)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--json", help="also write every repetition's seconds to this file")
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="tensors' dtype; auto: float32 on a CPU, bfloat16 on a GPU, where "
        "only half precision reaches the flash and cuDNN kernels",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="short lengths and 2 repetitions, to check that it runs",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = (
        args.dtype
        if args.dtype != "auto"
        else "float32"
        if device.type == "cpu"
        else "bfloat16"
    )
    torch.set_default_dtype(DTYPES[dtype])  # every tensor the measurements draw

    def sync() -> None:
        peers.synchronize(device)

    reps = 2 if args.smoke else args.reps
    print(
        f"attention cost: {device.type} ({platform.machine()}), {dtype}, "
        f"{args.threads} thread(s), torch {torch.__version__}, {reps} repetitions, "
        "milliseconds: median [min-max]\n"
    )
    results = {}
    with torch.no_grad():
        for name in args.only or list(MEASUREMENTS):
            lengths, fit = (SMOKE_LENGTHS if args.smoke else LENGTHS)[name]
            results[name] = MEASUREMENTS[name](device, reps, sync, lengths, fit)
    if args.json:
        meta = {
            "device": device.type,
            "machine": platform.machine(),
            "dtype": dtype,
            "threads": args.threads,
            "torch": torch.__version__,
            "reps": reps,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
