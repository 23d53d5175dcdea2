#!/usr/bin/env python3
"""What bounds aiayn's decoding speed against Marian's: the time in the linear layers.

aiayn and Marian (built as in peers.py, the same size and the same weights' shapes)
decode with the same linear layers: the same matrix products, one per projection,
feed-forward layer and output layer, on the same batch. This script runs peers.py's
decoding workload (greedy and beam-4 search that write exactly `--gen-len` tokens
per sentence) with every call of `torch.nn.functional.linear`, through which both
models' linear layers go, timed as well. For each model it prints the search's wall
time, the time inside those calls, and the rest (attention, the cache, the search's
bookkeeping, Python).

The linear time is work that aiayn cannot skip without computing less. So even if
everything else of aiayn took no time at all, its speed could be at most
Marian's total over aiayn's linear time: the "bound" column. A target above that
bound cannot be met by removing overhead. Repetitions are interleaved as in
peers.py, one thread, medians with min and max.

`--train` does the same for peers.py's training step (forward, loss, backward and
Adam on a batch of the size's training shape), where the backward pass's matrix
products do not go through F.linear: there the linear time is the self time of
`aten::mm` and `aten::addmm` in PyTorch's profiler, forward and backward, and the
total is the step's wall time under the profiler (which adds a little to every
operation; so both are a little higher than without it).

    python benchmarks/linear_share.py                       # book and base sizes
    python benchmarks/linear_share.py --size book --reps 3
    python benchmarks/linear_share.py --train --size base
    python benchmarks/linear_share.py --smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, next to this file
import peers

_linear = F.linear


class LinearTimer:
    """While active, F.linear adds the wall seconds of each call to `seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def linear(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = _linear(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def __enter__(self) -> LinearTimer:
        F.linear = self.linear
        return self

    def __exit__(self, *exc: object) -> None:
        F.linear = _linear


def timed_search(search: Callable[[int], torch.Tensor], m: int) -> dict[str, float]:
    """One search of m tokens: its wall seconds and the seconds inside F.linear."""
    with LinearTimer() as timer:
        start = time.perf_counter()
        search(m)
        total = time.perf_counter() - start
    return {"total": total, "linear": timer.seconds, "calls": timer.calls}


def measure(size: peers.Size, args: argparse.Namespace) -> dict[str, Any]:
    names = ["aiayn", peers.MARIAN]
    models = {name: peers.build_model(name, size, 0.0).eval() for name in names}
    src = peers.decode_source(size, size.decode_batch)
    out: dict[str, Any] = {}
    for label, beams in (("greedy", 1), ("beam 4", 4)):
        search = {n: peers.decoders(n, models[n], src, beams) for n in names}
        with torch.inference_mode():
            for name in names:  # warm-up, shorter
                search[name](min(args.gen_len, 8))
            out[label] = sampled(
                {n: lambda n=n: timed_search(search[n], args.gen_len) for n in names},
                args.reps,
            )
    return out


def sampled(
    runs: dict[str, Callable[[], dict[str, float]]], reps: int
) -> dict[str, list[dict[str, float]]]:
    """What each run returns, repetition by repetition, in peers.py's rotating order."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    peers.interleaved(runs, reps, lambda name, out: samples[name].append(out))
    return samples


MATMULS = ("aten::mm", "aten::addmm")  # what the linear layers call, both passes


def profiled_step(step: Callable[[], None]) -> dict[str, float]:
    """One training step under the profiler: its wall seconds and mm + addmm's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
    ops = [e for e in prof.key_averages() if e.key in MATMULS]
    return {
        "total": total,
        "linear": sum(e.self_cpu_time_total for e in ops) / 1e6,
        "calls": sum(e.count for e in ops),
    }


def measure_train(size: peers.Size, args: argparse.Namespace) -> dict[str, Any]:
    names = ["aiayn", peers.MARIAN]
    models = {name: peers.build_model(name, size, 0.0).train() for name in names}
    optimizers = {name: peers.new_optimizer(m) for name, m in models.items()}
    batch = peers.train_batches(size, 1)[0]

    def step(name: str) -> Callable[[], None]:
        return lambda: peers.train_step(name, models[name], optimizers[name], batch)

    for name in names:  # warm-up: Adam's state, the allocator
        for _ in range(2):
            step(name)()
    runs = {name: lambda name=name: profiled_step(step(name)) for name in names}
    return {"training step": sampled(runs, args.reps)}


def med(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def table(label: str, samples: dict[str, list[dict[str, float]]]) -> list[str]:
    """Milliseconds per search: total, linear, rest; the share and the bound."""
    calls = "mm + addmm calls" if label == "training step" else "F.linear calls"
    lines = [
        "| model | total ms (median [min-max]) | linear ms | rest ms "
        f"| linear share | {calls} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ss in samples.items():
        totals = [1e3 * s["total"] for s in ss]
        total, linear = 1e3 * med(ss, "total"), 1e3 * med(ss, "linear")
        rest = 1e3 * statistics.median(s["total"] - s["linear"] for s in ss)
        lines.append(
            f"| {name} | {total:,.1f} [{min(totals):,.1f}-{max(totals):,.1f}] "
            f"| {linear:,.1f} | {rest:,.1f} | {linear / total:.0%} "
            f"| {int(med(ss, 'calls'))} |"
        )
    ours, theirs = samples["aiayn"], samples[peers.MARIAN]
    now = med(theirs, "total") / med(ours, "total")
    bound = med(theirs, "total") / med(ours, "linear")
    lines.append("")
    lines.append(
        f"{label}: aiayn/Marian now {now:.2f}x; at most {bound:.2f}x if "
        "aiayn's rest took no time"
    )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size",
        action="append",
        choices=["book", "base"],
        help="model size, repeatable (default: book and base)",
    )
    p.add_argument("--smoke", action="store_true", help="a tiny model, in seconds")
    p.add_argument(
        "--train", action="store_true", help="the training step instead of decoding"
    )
    p.add_argument("--gen-len", type=int, default=40, help="tokens per sentence (40)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (7)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    p.add_argument("--json", type=Path, default=None, help="write every sample")
    args = p.parse_args(argv)
    if args.smoke:
        args.gen_len, args.reps = min(args.gen_len, 5), min(args.reps, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not peers.have_transformers():
        print("Marian is needed here: pip install -r benchmarks/requirements.txt")
        return 2
    torch.set_num_threads(args.threads)
    names = ["smoke"] if args.smoke else dict.fromkeys(args.size or ["book", "base"])
    print(
        f"CPU ({platform.machine()}), float32, {args.threads} thread(s), torch "
        f"{torch.__version__}, transformers {peers.transformers_version()}; "
        f"{args.reps} repetitions"
        + ("" if args.train else f", exactly {args.gen_len} tokens per sentence")
    )
    results: dict[str, Any] = {"meta": vars(args) | {"json": None}}
    for name in names:
        size = peers.SIZES[name]
        results[name] = (measure_train if args.train else measure)(size, args)
        for label, samples in results[name].items():
            work = (
                f"{label}, a batch of {size.batch_size} pairs"
                if args.train
                else f"{label} search of {size.decode_batch} sentences"
            )
            print(f"\n### {name}: {work}\n")
            print("\n".join(table(label, samples)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
