#!/usr/bin/env python3
"""Training throughput and model FLOPs utilisation (MFU) of aiayn and its peers.

The same three models as peers.py (aiayn, `torch.nn.Transformer` between the
book's embeddings and tied head, Hugging Face's MarianMTModel), on any device, in
float32 or under bfloat16 / float16 autocast, each eager and, with `--compile
both`, also compiled with `torch.compile`. Every contender trains on the same
batches with the same loss and the same Adam update; the contenders alternate
repetition by repetition, after untimed warm-up steps (where compilation happens).

MFU is the model's FLOPs per second over the device's peak. The FLOPs of a step
are those of the architecture, not of any implementation: 3 times the matrix
products of the forward pass on the padded batch (the backward pass costs twice
the forward), counted by `train_flops` from the shapes, and the same for all
three models:

    encoder layer   8 S d^2 + 4 S^2 d + 4 S d d_ff
    decoder layer   8 T d^2 + 4 T^2 d  +  4 T d^2 + 4 S d^2 + 4 T S d  +  4 T d d_ff
    output layer    2 T d V

per sentence, for source and target lengths S and T (tests/test_benchmarks.py
checks the formula against PyTorch's FLOP counter). The peak is `--peak-tflops`,
or for bfloat16 and float16 on a known NVIDIA GPU its dense tensor-core peak
(H100 SXM and H200 989 TFLOP/s, H100 PCIe 756, A100 312, L4 121, T4 65); without
one, MFU is not printed. On a CUDA device the script also prints the peak memory
that one training step allocates beyond the weights and Adam's state.

    python benchmarks/train_mfu.py --size base --device cuda --dtype bf16 --compile both
    python benchmarks/train_mfu.py --size base --device cuda --dtype bf16 \\
        --batch-size 256 --seq-len 64 --compile both
    python benchmarks/train_mfu.py --smoke                       # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.batching import Batch, pick_device

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, next to this file
import peers

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PEAK_TFLOPS = [  # dense bf16 / fp16 tensor-core peaks; the first name found wins
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
    ("L4", 121.0),
    ("T4", 65.0),
]


def train_flops(size: peers.Size, batch: Batch) -> int:
    """FLOPs of one training step on `batch`: 3 x the forward's matrix products."""
    b, s = batch.src.shape
    t = batch.tgt_in.size(1)
    d, d_ff, n, v = size.d_model, size.d_ff, size.layers, size.vocab
    encoder = 8 * s * d * d + 4 * s * s * d + 4 * s * d * d_ff
    self_attention = 8 * t * d * d + 4 * t * t * d
    cross_attention = 4 * t * d * d + 4 * s * d * d + 4 * t * s * d
    decoder = self_attention + cross_attention + 4 * t * d * d_ff
    return 3 * b * (n * encoder + n * decoder + 2 * t * d * v)


def peak_flops(device: torch.device, dtype: str, given: float | None) -> float | None:
    """The device's peak FLOP/s for this precision, if given or known."""
    if given is not None:
        return given * 1e12
    if device.type != "cuda" or dtype == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS if key in name), None)


def step_fn(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dtype: torch.dtype | None,
    device: torch.device,
) -> Callable[[Batch], None]:
    """One full update under autocast (if dtype), with the same loss for all."""

    def step(batch: Batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = peers.logits_of(name, model, batch)  # [b, t, V]
        loss = F.cross_entropy(
            logits.float().flatten(0, 1),
            batch.tgt_out.flatten(),
            ignore_index=peers.PAD,
            label_smoothing=0.1,
        )
        loss.backward()
        optimizer.step()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=["book", "base"], default="base")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bf16",
        help="autocast precision (fp32: none); default bf16",
    )
    p.add_argument(
        "--compile",
        choices=["no", "yes", "both"],
        default="no",
        help="torch.compile the models: no, yes, or both eager and compiled",
    )
    p.add_argument(
        "--batch-size", type=int, help="pairs per batch (the size's; on a GPU 512)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="pairs of seq_len/2 .. seq_len-1 tokens (on a GPU 128)",
    )
    p.add_argument("--steps", type=int, default=None, help="batches per repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed passes over the batches per contender (compilation)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak TFLOP/s for this precision (for the MFU)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1)")
    p.add_argument("--dropout", type=float, default=0.1, help="every dropout (0.1)")
    p.add_argument("--json", type=Path, help="write every raw number")
    args = p.parse_args(argv)
    device = pick_device("cpu" if args.smoke else args.device)
    size = peers.SIZES["smoke" if args.smoke else args.size]
    if device.type == "cuda":  # the CPU's small batches would time kernel launches
        size = dataclasses.replace(size, batch_size=512, seq_len=128)
    size = dataclasses.replace(
        size,
        batch_size=args.batch_size or size.batch_size,
        seq_len=args.seq_len or size.seq_len,
        steps=args.steps or size.steps,
    )
    reps = args.reps or (1 if args.smoke else 5)
    if reps < 1 or size.batch_size < 1 or not 2 <= size.seq_len < peers.MAX_LEN:
        p.error(
            f"--reps and --batch-size must be at least 1 and --seq-len in "
            f"[2, {peers.MAX_LEN - 1}]"
        )
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    def sync() -> None:
        peers.synchronize(device)

    names = ["aiayn", peers.TORCH]
    if peers.have_transformers():
        names.append(peers.MARIAN)
    else:
        print(
            "Marian skipped: transformers is not installed "
            "(pip install -r benchmarks/requirements.txt)"
        )
    variants = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    batches = [b.to(device) for b in peers.train_batches(size, size.steps)]
    tokens = sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
    flops = sum(train_flops(size, b) for b in batches)
    peak = peak_flops(device, args.dtype, args.peak_tflops)
    steps: dict[str, Callable[[Batch], None]] = {}
    memory: dict[str, float] = {}
    counts: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors.*")
        for name in names:
            for compiled in variants:
                label = name + (" compiled" if compiled else "")
                model = peers.build_model(name, size, args.dropout).to(device).train()
                counts[label] = peers.count_parameters(model)
                optimizer = peers.new_optimizer(model)
                run = torch.compile(model) if compiled else model
                step = steps[label] = step_fn(name, run, optimizer, dtype, device)
                for _ in range(args.warmup):  # Adam's state, compiling every shape
                    for batch in batches:
                        step(batch)
                if device.type == "cuda":
                    sync()
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    step(batches[0])
                    sync()
                    memory[label] = (
                        torch.cuda.max_memory_allocated(device) - before
                    ) / 2**20

        def run_all(label: str) -> Callable[[], None]:
            def go() -> None:
                for batch in batches:
                    steps[label](batch)
                sync()

            return go

        seconds = peers.interleaved({label: run_all(label) for label in steps}, reps)
    rows = peers.rate_rows(seconds, tokens)
    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.machine()
    )
    print(
        f"train_mfu: {size.name} (vocabulary {size.vocab:,}, d_model {size.d_model}, "
        f"{size.heads} heads, {size.layers}+{size.layers} layers, d_ff {size.d_ff}); "
        f"{device} ({machine}), {args.dtype}, dropout {args.dropout}, "
        f"torch {torch.__version__}, transformers {peers.transformers_version()}, "
        f"{reps} repetition(s)"
    )
    print(
        f"batches: {len(batches)} of {size.batch_size} pairs of {size.seq_len // 2}-"
        f"{size.seq_len - 1} tokens, {tokens / len(batches):,.0f} real tokens and "
        f"{flops / len(batches) / 1e9:,.2f} GFLOP (model FLOPs) each; parameters: "
        + ", ".join(f"{n} {c:,}" for n, c in counts.items() if "compiled" not in n)
    )
    print(
        f"peak: {peak / 1e12:,.1f} TFLOP/s"
        if peak
        else "peak: unknown (pass --peak-tflops for the MFU)"
    )
    print("\n### training step, real source + target tokens/s (higher is better)\n")
    print("\n".join(peers.rate_table(rows, next(iter(rows)))))
    extra = {}
    print("\n| model | model TFLOP/s (median) | MFU | peak MiB of a step |")
    print("|---|---:|---:|---:|")
    for label, times in seconds.items():
        achieved = flops / peers.summary(times["wall"])["median"]
        mfu = achieved / peak if peak else None
        extra[label] = {
            "tflops": achieved / 1e12,
            "mfu": mfu,
            "step_mib": memory.get(label),
        }
        print(
            f"| {label} | {achieved / 1e12:,.3f} | "
            f"{'n/a' if mfu is None else f'{mfu:.1%}'} | "
            f"{'n/a' if label not in memory else f'{memory[label]:,.0f}'} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "size": dataclasses.asdict(size),
                    "device": str(device),
                    "dtype": args.dtype,
                    "reps": reps,
                    "tokens": tokens,
                    "flops": flops,
                    "peak": peak,
                    "seconds": seconds,
                    "rows": rows,
                    "extra": extra,
                    "parameters": counts,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
