#!/usr/bin/env python3
"""Decoding throughput with and without the key-value cache, side by side (chapter 15).

For greedy search and beam search, and for several output lengths m, this
decodes the same batch with `use_cache=True` and `use_cache=False` in one run,
alternating the two, and prints the output tokens per second of each and their
ratio. Throughput counts output tokens, batch * m per run (a beam search extends
beam_size hypotheses per sentence to write them). `min_len = max_len = m`
makes every sentence write exactly m tokens, so
both sides do the same search (chapter 15 checks that they return the same
tokens). The model is untrained: the cost of decoding does not depend on the
weights.

    python benchmarks/decode_throughput.py                      # CPU-sized defaults
    python benchmarks/decode_throughput.py --preset small --device cuda --batch-size 64
    python benchmarks/decode_throughput.py --preset base --device cuda \\
        --lengths 32 64 128 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from aiayn import Transformer, TransformerConfig
from aiayn.batching import pick_device
from aiayn.decoding import beam_search, greedy_search

PRESETS = {
    "tiny": lambda vocab: TransformerConfig.tiny(vocab),  # d_model 64, 2 + 2 layers
    "cpu": lambda vocab: TransformerConfig(
        vocab,
        vocab,
        d_model=128,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=512,
        dropout=0.0,
    ),
    # d_model 256, 3 + 3 layers
    "small": lambda vocab: TransformerConfig.small(vocab, dropout=0.0),
    # the paper's base model
    "base": lambda vocab: TransformerConfig.base(vocab, dropout=0.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="model size (default: cpu)",
    )
    parser.add_argument(
        "--vocab", type=int, default=1000, help="vocabulary size (default 1000)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sentences per batch (default 8)"
    )
    parser.add_argument(
        "--beam-size", type=int, default=4, help="beam size (default 4, the paper's)"
    )
    parser.add_argument(
        "--src-len", type=int, default=20, help="source length (default 20)"
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128],
        help="output lengths m (default 16 32 64 128)",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="timed runs per setting; the median counts"
    )
    parser.add_argument(
        "--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (CPU)"
    )
    return parser.parse_args(argv)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device: torch.device) -> float:
    """Seconds one call of fn() takes, waiting for the device."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    torch.manual_seed(0)
    config = PRESETS[args.preset](args.vocab)
    # the positional table holds the source and every generated length (and </s>)
    longest = max(max(args.lengths), args.src_len) + 1
    config = TransformerConfig.from_dict({**config.to_dict(), "max_len": longest})
    model = Transformer(config).to(device).eval()
    src = torch.randint(
        4,
        args.vocab,
        (args.batch_size, args.src_len),
        generator=torch.Generator().manual_seed(0),
    ).to(device)  # [batch, src_len]
    decoders = {
        "greedy": lambda m, use: greedy_search(
            model, src, max_len=m, min_len=m, use_cache=use
        ),
        f"beam {args.beam_size}": lambda m, use: beam_search(
            model, src, beam_size=args.beam_size, max_len=m, min_len=m, use_cache=use
        ),
    }
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"decode throughput, {args.preset} model "
        f"({model.num_parameters():,} parameters), batch {args.batch_size}, "
        f"source length {args.src_len}, {name}, torch {torch.__version__}"
    )
    print(
        f"{'decoder':8s} {'m':>5s} {'cached tok/s':>14s} "
        f"{'recomputed tok/s':>17s} {'ratio':>7s}"
    )
    summary = {}
    for label, run in decoders.items():
        run(4, True), run(4, False)  # warm up
        for m in args.lengths:
            times = {True: [], False: []}
            for _ in range(args.reps):
                for use in (True, False):  # alternate, so that drifts hit both alike
                    times[use].append(timed(lambda: run(m, use), device))
            tokens = args.batch_size * m  # output tokens of one run
            cached, recomputed = (
                tokens / statistics.median(times[use]) for use in (True, False)
            )
            summary[(label, m)] = cached / recomputed
            print(
                f"{label:8s} {m:5d} {cached:14,.0f} {recomputed:17,.0f} "
                f"{cached / recomputed:7.1f}"
            )
    longest = max(args.lengths)
    speedups = (f"{label} {summary[(label, longest)]:.1f}x" for label in decoders)
    print(f"speedup of the cache at m = {longest}: " + ", ".join(speedups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
