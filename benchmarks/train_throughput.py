#!/usr/bin/env python3
"""Training throughput of `aiayn.Transformer` and `torch.nn.Transformer`, same size.

Both models get the same embeddings, sinusoidal positions and tied prediction head
(aiayn's), so the comparison is between the encoder-decoder cores: this book's
layers (chapters 3 to 9) and PyTorch's. Both train on the same batches with the
same loss (label smoothing 0.1) and the same optimizer (Adam, 0.9, 0.98, 1e-9):
one step is forward, backward and optimizer update. The two models alternate,
repetition by repetition, so that a machine that slows down or speeds up affects
both alike; the script prints the median tokens per second of each and their ratio.

    python benchmarks/train_throughput.py                          # small model, CPU
    python benchmarks/train_throughput.py --device cuda --dtype bf16 \\
        --d-model 512 --heads 8 --layers 6 --d-ff 2048 --batch-size 64 --seq-len 32
    python benchmarks/train_throughput.py --device cuda --dtype bf16 --compile

Tokens are the real (non-pad) source and target tokens of a batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import Tensor, nn

from aiayn import Transformer, TransformerConfig
from aiayn.batching import Batch, make_batch, pick_device
from aiayn.embedding import PredictionHead, TokenEmbedding, tie_weights
from aiayn.masks import causal_mask
from aiayn.optim import LabelSmoothingLoss, make_optimizer
from aiayn.positional import SinusoidalPositionalEncoding

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TorchTransformerModel(nn.Module):
    """torch.nn.Transformer between aiayn's embeddings, positions and tied head."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.config = c
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model, pad_id=c.pad_id)
        self.tgt_embed = TokenEmbedding(c.tgt_vocab_size, c.d_model, pad_id=c.pad_id)
        self.positional = SinusoidalPositionalEncoding(
            c.d_model, c.max_len, dropout=c.dropout
        )
        self.core = nn.Transformer(
            d_model=c.d_model,
            nhead=c.n_heads,
            num_encoder_layers=c.n_encoder_layers,
            num_decoder_layers=c.n_decoder_layers,
            dim_feedforward=c.d_ff,
            dropout=c.dropout,
            batch_first=True,
        )
        self.head = PredictionHead(c.d_model, c.tgt_vocab_size)
        tie_weights(self.head, self.tgt_embed, self.src_embed)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        pad = self.config.pad_id
        y = self.core(
            self.positional(self.src_embed(src)),  # [b, s, d]
            self.positional(self.tgt_embed(tgt)),  # [b, t, d]
            tgt_mask=~causal_mask(tgt.size(1), device=tgt.device),  # True = blocked
            tgt_is_causal=True,
            src_key_padding_mask=src == pad,
            tgt_key_padding_mask=tgt == pad,
            memory_key_padding_mask=src == pad,
        )  # [b, t, d]
        return self.head(y)  # [b, t, V]


def make_batches(
    n: int, batch_size: int, seq_len: int, vocab: int, seed: int
) -> list[Batch]:
    """n batches of random pairs, lengths uniform in [seq_len / 2, seq_len - 1]."""
    # unequal lengths: the batches have some padding, as real ones do
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        pairs = []
        for _ in range(batch_size):
            s, t = torch.randint(seq_len // 2, seq_len, (2,), generator=g).tolist()
            pairs.append(
                (
                    torch.randint(4, vocab, (s,), generator=g),
                    torch.randint(4, vocab, (t,), generator=g),
                )
            )
        batches.append(make_batch(pairs, pad_id=0, bos_id=1, eos_id=2))
    return batches


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="fp32",
        help="autocast dtype (fp32: no autocast)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--layers", type=int, default=2, help="encoder layers and decoder layers"
    )
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument(
        "--reps", type=int, default=7, help="repetitions of each model, interleaved"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first (compilation happens here)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch.set_num_threads (0: PyTorch's default)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = DTYPES[args.dtype]

    config = TransformerConfig(
        args.vocab,
        args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_encoder_layers=args.layers,
        n_decoder_layers=args.layers,
        d_ff=args.d_ff,
        dropout=args.dropout,
        final_norm=True,
        max_len=args.seq_len + 1,
    )
    torch.manual_seed(0)
    models = {
        "aiayn": Transformer(config).to(device),
        "torch.nn": TorchTransformerModel(config).to(device),
    }
    counts = {
        name: sum(p.numel() for p in m.parameters()) for name, m in models.items()
    }
    optimizers = {name: make_optimizer(m, lr=1e-4) for name, m in models.items()}
    criterion = LabelSmoothingLoss(0.1, ignore_index=config.pad_id)
    steps = {
        name: (torch.compile(m) if args.compile else m) for name, m in models.items()
    }
    batches = [
        b.to(device)
        for b in make_batches(
            args.steps, args.batch_size, args.seq_len, args.vocab, seed=0
        )
    ]
    tokens = sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    def run(name: str, batches: list[Batch]) -> None:
        model, optimizer = steps[name], optimizers[name]
        for b in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(b.src, b.tgt_in)  # [b, t, V]
            criterion(logits, b.tgt_out).backward()
            optimizer.step()

    print(
        f"device {device}, dtype {args.dtype}, compile {args.compile}, "
        f"threads {torch.get_num_threads()}"
    )
    print(
        f"model: d_model {args.d_model}, {args.heads} heads, "
        f"{args.layers}+{args.layers} layers, d_ff {args.d_ff}, vocab {args.vocab}; "
        "parameters: " + ", ".join(f"{n} {c:,}" for n, c in counts.items())
    )
    print(
        f"batches: {args.batch_size} pairs of up to {args.seq_len} tokens, "
        f"{tokens / len(batches):,.0f} real tokens each"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors.*")
        for name in models:
            run(name, batches[: args.warmup])
        sync()
        rates: dict[str, list[float]] = {name: [] for name in models}
        for rep in range(args.reps):
            # alternate who goes first
            order = list(models) if rep % 2 == 0 else list(models)[::-1]
            for name in order:
                sync()
                start = time.perf_counter()
                run(name, batches)
                sync()
                rates[name].append(tokens / (time.perf_counter() - start))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(
            f"{name:9s} median {medians[name]:12,.0f} tokens/s   "
            f"(min {min(r):,.0f}, max {max(r):,.0f})"
        )
    print(f"ratio aiayn / torch.nn: {medians['aiayn'] / medians['torch.nn']:.3f}")


if __name__ == "__main__":
    main()
