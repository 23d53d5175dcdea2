"""Tests of chapter 18's counts: FLOPs, path lengths, memory and decoding steps.

The chapter derives each crossover length from the FLOPs of the table; these tests
count the FLOPs of the package's layers on both sides of it, for the base model, and
check the claims of the source documents that the chapter's errata correct.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from aiayn import Transformer, TransformerConfig
from aiayn.attention import count_flops, scaled_dot_product_attention
from aiayn.decoding import greedy_search
from aiayn.multi_head import MultiHeadAttention
from aiayn.runs import saved_activation_bytes
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


@pytest.mark.parametrize("n", [25, 100, 512, 3072, 8192])
def test_attention_products_share_of_an_encoder_layer_is_n_over_n_plus_6d(
    n: int,
) -> None:
    """The products' share of an encoder layer's FLOPs is exactly n / (n + 6d)."""
    total = products(n) + projections(n) + ffn(n)
    assert products(n) * (n + 6 * D) == n * total


def test_doc003_attention_cheaper_than_lstm() -> None:
    """doc003: attention costs more than an RNN; it costs less than an LSTM below 2d."""
    assert 2 * D == 1024
    for n in (25, 50, 100, 1023):
        assert rnn(n) == 4 * n * D * D and projections(n) == 8 * n * D * D
        assert rnn(n) < attention_layer(n) < lstm(n), n
    assert attention_layer(1024) == lstm(1024)


def band_mask(n: int, r: int) -> torch.Tensor:
    """True where query i may attend key j: i - r < j <= i."""
    offset = torch.arange(n)[:, None] - torch.arange(n)  # i - j: [n, n]
    return (offset >= 0) & (offset < r)


Layer = Callable[[torch.Tensor], torch.Tensor]


def causal_conv(k: int, dilation: int, width: int = 8) -> Layer:
    """A convolution: position i sees i, i - dilation, ..., i - (k-1) dilation."""
    conv = nn.Conv1d(width, width, k, dilation=dilation)
    pad = (k - 1) * dilation  # zeros before the first position
    # [batch, n, width] -> [batch, n, width]
    return lambda y: conv(F.pad(y.transpose(1, 2), (pad, 0))).transpose(1, 2)


def layers_to_connect(make_layer: Callable[[int], Layer], n: int = 64) -> int:
    """The fewest stacked layers make_layer(0), make_layer(1), ... whose output n-1
    depends on input 0 (a nonzero gradient: before that it is exactly zero)."""
    torch.manual_seed(0)
    x = torch.randn(1, n, 8, requires_grad=True)  # [batch, n, width]
    stack: list[Layer] = []
    while len(stack) < n:
        stack.append(make_layer(len(stack)))
        y = x
        for layer in stack:
            y = layer(y)  # [batch, n, width]
        (grad,) = torch.autograd.grad(y[0, -1].sum(), x)
        if bool(grad[0, 0].abs().sum() > 0):
            return len(stack)
    raise AssertionError("not connected after n layers")


def windowed_layer(r: int, n: int = 64) -> Layer:
    """A self-attention layer in which position i sees positions i-r+1 .. i."""
    attention, mask = MultiHeadAttention(8, 2), band_mask(n, r)
    return lambda y: attention(y, mask=mask)[0]  # [batch, n, width]


def test_path_length_of_self_attention_is_one_layer_and_of_a_window_n_over_r() -> None:
    """At n = 64: one self-attention layer; ceil(63 / 7) = 9 windows of r = 8."""
    assert layers_to_connect(lambda i: lambda y: MultiHeadAttention(8, 2)(y)[0]) == 1
    assert layers_to_connect(lambda i: windowed_layer(8)) == 9


def test_doc004_conv_path() -> None:
    """doc004's O(log_k n) holds for dilated kernels only: n = 64, k = 3: 32 and 4."""
    assert layers_to_connect(lambda i: causal_conv(3, 1)) == 32
    assert layers_to_connect(lambda i: causal_conv(3, 3**i)) == 4


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.2f}"


def test_doc003_quadratic_memory() -> None:
    """doc003, doc004: O(n^2) memory; at n = 1024 the fused paths keep far less."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 8, 1024, 64, requires_grad=True).unbind(0)
    kept = {}
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
            kept[backend] = mib(saved_activation_bytes(run, [q, k, v]))
    assert kept == {SDPBackend.MATH: "36.00", SDPBackend.FLASH_ATTENTION: "2.03"}
    layer = MultiHeadAttention(D, HEADS)
    x = torch.randn(1, 1024, D, requires_grad=True)  # [batch, n, d_model]
    inputs = [x, *layer.parameters()]
    fused = saved_activation_bytes(lambda: layer(x)[0], inputs)
    explicit = saved_activation_bytes(lambda: layer(x, need_weights=True)[0], inputs)
    assert (mib(fused), mib(explicit)) == ("8.03", "42.00")


def test_doc003_lstm_memory() -> None:
    """doc003: O(1) memory per step for an RNN; training keeps every step's state."""
    torch.manual_seed(0)
    lstm_layer = nn.LSTM(256, 256, batch_first=True)
    lengths, kept = [128, 256, 512], []
    for n in lengths:
        x = torch.randn(8, n, 256, requires_grad=True)  # [batch, n, d]
        inputs = [x, *lstm_layer.parameters()]
        kept.append(saved_activation_bytes(lambda: lstm_layer(x)[0], inputs))
    exponent = np.polyfit(np.log(lengths), np.log(kept), 1)[0]
    assert abs(exponent - 1) < 0.05


def decoding_flops(model: Transformer, src: torch.Tensor, use_cache: bool, m: int):
    """(attention products, all) FLOPs of each step of greedy search, m steps."""
    attention, total = [], []

    def after_step(*_: object) -> None:  # the head runs once per step
        attention.append(counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0))
        total.append(counter.get_total_flops())

    hook = model.head.register_forward_hook(after_step)
    try:
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            greedy_search(model, src, max_len=m, min_len=m, use_cache=use_cache)
    finally:
        hook.remove()
    attention, total = np.array(attention), np.array(total)
    return np.diff(attention, prepend=0), np.diff(total, prepend=0), total


def test_the_rest_of_a_cached_step_is_constant_and_of_a_recomputed_one_grows() -> None:
    """Beyond attention, steps cost a constant (cache) or grow linearly (recomputed)."""
    torch.manual_seed(0)
    config = TransformerConfig(
        64,
        64,
        d_model=128,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=512,
        dropout=0.0,
        max_len=129,
    )
    model = Transformer(config).eval()
    src = torch.randint(4, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    fit = [32, 64, 128]
    slopes = {}
    for use_cache in (True, False):
        attention, step, cumulative = decoding_flops(model, src, use_cache, 128)
        rest = step - attention
        growth = rest[1:] if use_cache else np.diff(rest[1:])
        assert len(set(growth.tolist())) == 1, use_cache
        slopes[use_cache] = np.polyfit(
            np.log(fit), np.log(cumulative[np.array(fit) - 1]), 1
        )[0]
    assert slopes[True] < 1.3 and slopes[False] > 1.8  # in all: about m, about m^2
