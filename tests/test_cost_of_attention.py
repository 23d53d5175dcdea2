"""Tests of chapter 18's counts: where the attention products overtake the rest.

The chapter derives each crossover length from the FLOPs of the table; these tests
count the FLOPs of the package's layers on both sides of it, for the base model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from aiayn.attention import count_flops, scaled_dot_product_attention
from aiayn.multi_head import MultiHeadAttention
from aiayn.sublayers import PositionwiseFeedForward

D, D_FF, HEADS = 512, 2048, 8  # the base model's d_model, d_ff and heads


def products(n: int) -> int:
    """FLOPs of QK^T and AV of all heads on n positions."""
    with torch.device("meta"):  # shapes only, no arithmetic
        q = torch.empty(1, HEADS, n, D // HEADS)  # [batch, heads, n, d_k]
        return count_flops(lambda: scaled_dot_product_attention(q, q, q))


def module_flops(make: Callable[[], nn.Module], n: int, **kwargs: object) -> int:
    """FLOPs of one call of the module make() on n positions."""
    with torch.device("meta"):
        module, x = make(), torch.empty(1, n, D)  # x: [batch, n, d_model]
        return count_flops(lambda: module(x, **kwargs))


def attention_layer(n: int) -> int:
    """FLOPs of the whole MultiHeadAttention, projections and products."""
    return module_flops(lambda: MultiHeadAttention(D, HEADS), n, need_weights=True)


def projections(n: int) -> int:
    """FLOPs of W^Q, W^K, W^V and W^O."""
    return attention_layer(n) - products(n)


def ffn(n: int) -> int:
    """FLOPs of the feed-forward network."""
    return module_flops(lambda: PositionwiseFeedForward(D, D_FF), n)


def recurrent(make_cell: Callable[[], nn.Module], n: int) -> int:
    """FLOPs of a recurrent cell along n positions: one step on a batch of n states.

    Every step does the same products, so n steps cost one step on n states.
    """
    with torch.device("meta"):
        cell, x = make_cell(), torch.empty(n, D)  # n inputs x_t: [n, d]
        h = torch.empty(n, D)  # [n, d]
        state = (h, h) if isinstance(cell, nn.LSTMCell) else h
        return count_flops(lambda: cell(x, state))


def lstm(n: int) -> int:
    return recurrent(lambda: nn.LSTMCell(D, D), n)


def rnn(n: int) -> int:
    return recurrent(lambda: nn.RNNCell(D, D), n)


CROSSOVERS = {  # name: (the other cost, the attention cost, the length where they meet)
    "projections": (projections, products, 2 * D),
    "feed-forward network": (ffn, products, D_FF),
    "projections and feed-forward network": (
        lambda n: projections(n) + ffn(n),
        products,
        2 * D + D_FF,
    ),
    "plain RNN": (rnn, products, D),
    "LSTM against the whole attention layer": (lstm, attention_layer, 2 * D),
}


@pytest.mark.parametrize("name", CROSSOVERS)
def test_attention_overtakes_at_the_derived_length(name: str) -> None:
    """Attention costs less one position below the derived length, more one above."""
    other, attention, n_cross = CROSSOVERS[name]
    around = (n_cross - 1, n_cross, n_cross + 1)
    signs = [(attention(n) > other(n)) - (attention(n) < other(n)) for n in around]
    assert signs == [-1, 0, 1], f"{name}: {signs} at n = {around}"
