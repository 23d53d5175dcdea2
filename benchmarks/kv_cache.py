#!/usr/bin/env python3
"""Two layouts of the self-attention key-value cache, side by side, on the CPU.

Chapter 3's `KVCache` grows by `torch.cat` at every decoding step, which copies
every cached position again: decoding m tokens copies about m^2 / 2 positions (in
beam search the reorder of every step copies the cache into tensors one position
longer, and the next step writes into that room instead of concatenating).
The usual remedy is a buffer with room to spare, written in place, that doubles
when it is full; beam search then reorders into a second buffer instead of a new
tensor. This script decodes the same batch with both layouts, alternating them,
and prints generated tokens per second and their ratio. The buffer layout lives
only here (`BufferCache`), installed in every layer's self-attention cache; the
model and the searches are the package's.

What it shows on a CPU: attention over a slice of a larger buffer is not
contiguous, and PyTorch's attention kernels pay for that (they copy, or read with
a stride) about what the buffer saves on concatenation; see benchmarks/README.md.

    python benchmarks/kv_cache.py                  # book size, 32 sentences, m = 40
    python benchmarks/kv_cache.py --gen-len 120 --reps 5
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn import multi_head
from aiayn.decoding import beam_search, greedy_search
from aiayn.multi_head import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, next to this file
import peers


class BufferCache:
    """A self-attention cache in a buffer with room to spare, written in place.

    It offers what the package reads of a KVCache: k, v, seq_len and reorder.
    """

    made = 0  # how many were made: the benchmark checks that they were used

    def __init__(self) -> None:
        BufferCache.made += 1
        self.seq_len = 0  # positions held
        self.buf_k: Tensor | None = None  # [batch, n_heads, room, d_k]
        self.buf_v: Tensor | None = None
        self.spare: tuple[Tensor, Tensor] | None = None  # reorder's target

    @property
    def k(self) -> Tensor | None:
        """The cached keys, a view [batch, n_heads, seq_len, d_k] of the buffer."""
        return None if self.buf_k is None else self.buf_k[:, :, : self.seq_len]

    @property
    def v(self) -> Tensor | None:
        """The cached values, a view of the buffer."""
        return None if self.buf_v is None else self.buf_v[:, :, : self.seq_len]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new positions [b, h, new, d_k]; return views of all of them."""
        start, end = self.seq_len, self.seq_len + k.size(-2)
        if self.buf_k is None or end > self.buf_k.size(-2):  # double the room
            room = max(end, 2 * start, 16)
            new_k = k.new_empty(*k.shape[:2], room, k.size(-1))
            new_v = v.new_empty(*v.shape[:2], room, v.size(-1))
            if start:
                new_k[:, :, :start] = self.k
                new_v[:, :, :start] = self.v
            self.buf_k, self.buf_v, self.spare = new_k, new_v, None
        self.buf_k[:, :, start:end] = k
        self.buf_v[:, :, start:end] = v
        self.seq_len = end
        return self.k, self.v

    def reorder(self, index: Tensor, room: int = 0) -> None:
        """Rows `index` into the spare buffers, which then become the cache.

        `room` (positions to leave free) is KVCache's; the buffer has room already.
        """
        if self.buf_k is None or self.buf_v is None:
            return
        if self.spare is None or self.spare[0].size(0) != index.numel():
            old = (self.buf_k, self.buf_v)
            self.buf_k = self.buf_k.index_select(0, index)
            self.buf_v = self.buf_v.index_select(0, index)
            self.spare = old if old[0].shape == self.buf_k.shape else None
            return
        n, (k, v) = self.seq_len, self.spare
        torch.index_select(self.k, 0, index, out=k[:, :, :n])
        torch.index_select(self.v, 0, index, out=v[:, :, :n])
        self.spare, (self.buf_k, self.buf_v) = (self.buf_k, self.buf_v), (k, v)


_project = multi_head.MultiHeadAttention._project


def _project_buffered(
    self: Any,
    query: Tensor,
    key_value: Tensor | None,
    cache: KVCache | BufferCache | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """MultiHeadAttention._project, appending in place to a BufferCache."""
    if not isinstance(cache, BufferCache):
        return _project(self, query, key_value, cache)
    q, k, v = _project(self, query, key_value, None)  # [b, h, new, d_k]
    k, v = cache.append(k, v)
    return q, k, v


def buffered(model: Any) -> Any:
    """The model's new_cache, with a BufferCache in every self-attention."""
    plain = model.new_cache

    def new_cache() -> Any:
        cache = plain()
        for layer in cache:
            layer.self_attn = BufferCache()
        return cache

    return new_cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=["book", "base", "smoke"], default="book")
    p.add_argument("--gen-len", type=int, default=40, help="tokens per sentence (40)")
    p.add_argument("--batch", type=int, default=32, help="source sentences (32)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (7)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = peers.SIZES[args.size]
    model = peers.build_model("aiayn", size, 0.0).eval()
    src = peers.decode_source(size, args.batch)
    m, plain_cache = args.gen_len, model.new_cache
    print(
        f"{args.size}: {args.batch} sentences, exactly {m} generated tokens each; "
        f"CPU ({platform.machine()}), float32, {args.threads} thread(s), "
        f"torch {torch.__version__}, {args.reps} repetitions\n"
    )
    multi_head.MultiHeadAttention._project = _project_buffered
    try:
        for label, beams in (("greedy", 1), ("beam 4", 4)):

            def search(layout: str, beams: int = beams) -> Tensor:
                model.new_cache = plain_cache if layout == "cat" else buffered(model)
                if beams == 1:
                    return greedy_search(model, src, max_len=m, min_len=m).tokens
                return beam_search(
                    model, src, beam_size=beams, max_len=m, min_len=m
                ).tokens

            with torch.inference_mode():
                made = BufferCache.made
                same = torch.equal(search("cat"), search("buffer"))
                assert BufferCache.made > made, "the buffer layout was not used"
                runs = {
                    "torch.cat (the package)": lambda: search("cat"),
                    "buffer": lambda: search("buffer"),
                }
                seconds = peers.interleaved(runs, args.reps)
            rows = peers.rate_rows(seconds, src.size(0) * m)
            rows = {"aiayn": rows["torch.cat (the package)"], "buffer": rows["buffer"]}
            print(f"### {label}: generated tokens/s, the same tokens: {same}\n")
            print(
                "\n".join(peers.rate_table(rows))
                .replace("| aiayn |", "| torch.cat |")
                .replace("ratio aiayn/model", "ratio torch.cat/model")
            )
            print()
    finally:
        multi_head.MultiHeadAttention._project = _project
        model.new_cache = plain_cache
    return 0


if __name__ == "__main__":
    sys.exit(main())
