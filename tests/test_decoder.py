"""Tests of aiayn.decoder (chapter 8): DecoderLayer, Decoder, the incremental cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.attention import count_flops
from aiayn.decoder import Decoder, DecoderCache, DecoderLayer, DecoderLayerCache
from aiayn.masks import causal_mask, padding_mask, target_mask
from aiayn.multi_head import KVCache

D_MODEL, N_HEADS, D_FF = 32, 4, 64
PAD = 0
# [3, 6]
SRC = torch.tensor(
    [[5, 3, 8, 2, 9, 4], [7, 1, 6, PAD, PAD, PAD], [2, 2, 5, 8, PAD, PAD]]
)
TGT = torch.tensor([[1, 4, 6, 3, 9], [1, 7, 5, PAD, PAD], [1, 2, 3, 4, PAD]])  # [3, 5]

TORCH_NAMES = {
    "self_attn.in_proj.": "self_attn.in_proj_",
    "cross_attn.in_proj.": "multihead_attn.in_proj_",
    "cross_attn.out_proj.": "multihead_attn.out_proj.",
    "ffn.w_1.": "linear1.",
    "ffn.w_2.": "linear2.",
    "res_self.norm.": "norm1.",
    "res_cross.norm.": "norm2.",
    "res_ffn.norm.": "norm3.",
}


def torch_state_dict(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """Our layer's weights under torch.nn.TransformerDecoderLayer's names."""
    out = {}
    for name, value in layer.state_dict().items():
        for ours, theirs in TORCH_NAMES.items():
            name = name.replace(ours, theirs)
        out[name] = value
    return out


def randomize_vectors(module: nn.Module) -> None:
    """Non-default biases and LayerNorm parameters, so that parity is not trivial."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)


def inputs(tgt_len: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedded target [3, tgt_len, d_model] and a memory [3, 6, d_model]."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(3, tgt_len, D_MODEL, generator=gen), torch.randn(
        3, 6, D_MODEL, generator=gen
    )


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- parity with PyTorch --------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("float_causal", [False, True])
def test_layer_parity_with_torch(norm_first: bool, float_causal: bool) -> None:
    torch.manual_seed(0)
    ours = DecoderLayer(D_MODEL, N_HEADS, D_FF, norm_first=norm_first).eval()
    randomize_vectors(ours)
    theirs = nn.TransformerDecoderLayer(
        D_MODEL,
        N_HEADS,
        D_FF,
        dropout=0.1,
        activation="relu",
        batch_first=True,
        norm_first=norm_first,
    ).eval()
    theirs.load_state_dict(torch_state_dict(ours))  # strict
    x, memory = inputs()
    # PyTorch: masks say what to block, and both kinds must have the same type.
    if float_causal:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
        tgt_kpm = torch.zeros(TGT.shape).masked_fill(TGT == PAD, float("-inf"))
        mem_kpm = torch.zeros(SRC.shape).masked_fill(SRC == PAD, float("-inf"))
    else:
        tgt_mask, tgt_kpm, mem_kpm = ~causal_mask(5), TGT == PAD, SRC == PAD
    with torch.no_grad():
        out = ours(
            x,
            memory,
            self_mask=target_mask(TGT, PAD),
            memory_mask=padding_mask(SRC, PAD),
        )
        ref = theirs(
            x,
            memory,
            tgt_mask=tgt_mask,
            tgt_key_padding_mask=tgt_kpm,
            memory_key_padding_mask=mem_kpm,
        )
    assert out.shape == (3, 5, D_MODEL)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_stack_parity_with_torch_on_real_positions(norm_first: bool) -> None:
    torch.manual_seed(0)
    ours = Decoder(3, D_MODEL, N_HEADS, D_FF, norm_first=norm_first).eval()
    randomize_vectors(ours)
    template = nn.TransformerDecoderLayer(
        D_MODEL, N_HEADS, D_FF, batch_first=True, norm_first=norm_first
    )
    theirs = nn.TransformerDecoder(
        template, 3, norm=nn.LayerNorm(D_MODEL) if norm_first else None
    ).eval()
    for mine, their_layer in zip(ours.layers, theirs.layers):
        their_layer.load_state_dict(torch_state_dict(mine))
    if norm_first:
        theirs.norm.load_state_dict(ours.norm.state_dict())
    x, memory = inputs()
    with torch.no_grad():
        out = ours(
            x,
            memory,
            self_mask=target_mask(TGT, PAD),
            memory_mask=padding_mask(SRC, PAD),
        )
        ref = theirs(
            x,
            memory,
            tgt_mask=~causal_mask(5),
            tgt_key_padding_mask=TGT == PAD,
            memory_key_padding_mask=SRC == PAD,
        )
    real = TGT != PAD
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


# --- causality and padding ------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_causality_later_inputs_do_not_change_earlier_outputs(norm_first: bool) -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF, norm_first=norm_first).eval()
    x, memory = inputs(tgt_len=7)
    for t in range(1, 7):
        changed = x.clone()
        changed[:, t:] = torch.randn(3, 7 - t, D_MODEL)
        with torch.no_grad():
            a = dec(
                x, memory, self_mask=causal_mask(7), memory_mask=padding_mask(SRC, PAD)
            )
            b = dec(
                changed,
                memory,
                self_mask=causal_mask(7),
                memory_mask=padding_mask(SRC, PAD),
            )
        torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-3)


def test_jacobian_is_block_lower_triangular() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, 8, 2, 16).double().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    memory = torch.randn(1, 4, 8, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(
        lambda t: dec(t, memory, self_mask=causal_mask(5)), x, vectorize=True
    )
    # [out position, in position]
    blocks = jac[0, :, :, 0].permute(0, 2, 1, 3).flatten(2).norm(dim=-1)
    future = ~causal_mask(5)
    assert blocks[future].eq(0).all()
    assert blocks[~future].gt(0).all()


def test_jacobians_without_causal_mask_and_over_a_padded_memory() -> None:
    """Without the causal mask the future reaches every output; padding never does."""
    torch.manual_seed(0)
    dec = Decoder(2, 16, 2, 32).double().eval()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    memory = torch.randn(1, 5, 16, dtype=torch.float64)
    pad = padding_mask(torch.tensor([[3, 8, 5, PAD, PAD]]), PAD)  # [1, 1, 1, 5]

    def blocks(jac: torch.Tensor) -> torch.Tensor:  # [1, t, d, 1, s, d] -> [t, s]
        return jac[0, :, :, 0].permute(0, 2, 1, 3).flatten(2).norm(dim=-1)

    jacobian = torch.autograd.functional.jacobian
    open_ = blocks(jacobian(lambda t: dec(t, memory, None, pad), x, vectorize=True))
    to_memory = blocks(
        jacobian(lambda m: dec(x, m, causal_mask(6), pad), memory, vectorize=True)
    )
    assert open_.gt(0).all()
    assert to_memory[:, 3:].eq(0).all() and to_memory[:, :3].gt(0).all()


def test_source_padding_does_not_change_outputs() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF).eval()
    x = torch.randn(1, 4, D_MODEL)
    source = torch.randn(1, 3, D_MODEL)
    padded = torch.cat([source, 10 * torch.randn(1, 4, D_MODEL)], dim=1)
    mask = padding_mask(torch.tensor([[3, 4, 5, PAD, PAD, PAD, PAD]]), PAD)
    with torch.no_grad():
        ref = dec(x, source, self_mask=causal_mask(4))
        out = dec(x, padded, self_mask=causal_mask(4), memory_mask=mask)
        unmasked = dec(x, padded, self_mask=causal_mask(4))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked, ref, atol=1e-3)


def test_output_depends_on_memory_through_cross_attention() -> None:
    torch.manual_seed(0)
    layer = DecoderLayer(D_MODEL, N_HEADS, D_FF).eval()
    x, memory = inputs()
    with torch.no_grad():
        a = layer(x, memory, self_mask=causal_mask(5))
        b = layer(x, torch.randn_like(memory), self_mask=causal_mask(5))
    assert not torch.allclose(a, b, atol=1e-3)


def test_every_layers_cross_attention_reads_the_memory() -> None:
    """The output has a gradient in the memory, and every layer's reading moves it."""
    torch.manual_seed(0)
    dec = Decoder(2, 16, 2, 32).eval()
    x, mask = torch.randn(1, 4, 16), causal_mask(4)
    memory = torch.randn(1, 5, 16, requires_grad=True)
    out = dec(x, memory, self_mask=mask)
    # A random readout: the plain sum of LayerNorm outputs has a zero gradient.
    (grad,) = torch.autograd.grad((out * torch.randn_like(out)).sum(), memory)
    assert grad.abs().gt(1e-3).any()
    other = torch.randn(1, 5, 16)
    with torch.no_grad():
        base = dec(x, memory, self_mask=mask)
        for layer in dec.layers:
            handle = layer.cross_attn.register_forward_pre_hook(
                lambda mod, args, kwargs: (args, {**kwargs, "key_value": other}),
                with_kwargs=True,
            )
            moved = dec(x, memory, self_mask=mask)
            handle.remove()
            assert not torch.allclose(moved, base)


# --- incremental decoding -------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_full_computation(norm_first: bool) -> None:
    torch.manual_seed(0)
    dec = Decoder(3, D_MODEL, N_HEADS, D_FF, norm_first=norm_first).eval()
    x, memory = inputs(tgt_len=8)
    mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        full = dec(x, memory, self_mask=causal_mask(8), memory_mask=mask)
        cache = dec.new_cache()
        assert cache.seq_len == 0 and cache.batch_size is None and len(cache) == 3
        steps = []
        for t in range(8):
            assert cache.seq_len == t  # the positional offset of the next position
            steps.append(dec(x[:, t : t + 1], memory, memory_mask=mask, cache=cache))
    assert cache.seq_len == 8 and cache.batch_size == 3
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    for layer_cache in cache.layers:
        assert layer_cache.self_attn.k.shape == (3, N_HEADS, 8, D_MODEL // N_HEADS)
        assert layer_cache.cross_attn.k.shape == (3, N_HEADS, 6, D_MODEL // N_HEADS)


def test_layer_with_its_own_cache_equals_full_computation() -> None:
    torch.manual_seed(0)
    layer = DecoderLayer(D_MODEL, N_HEADS, D_FF).eval()
    x, memory = inputs()
    mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        full = layer(x, memory, self_mask=causal_mask(5), memory_mask=mask)
        cache = DecoderLayerCache()
        steps = [
            layer(x[:, t : t + 1], memory, memory_mask=mask, cache=cache)
            for t in range(5)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_several_new_positions_with_a_mask() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF).eval()
    x, memory = inputs(tgt_len=7)
    mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        full = dec(x, memory, self_mask=causal_mask(7), memory_mask=mask)
        cache = dec.new_cache()
        # batch = 3 new positions: the masks need their explicit [1, 1, ...] axes
        a = dec(
            x[:, :3],
            memory,
            self_mask=causal_mask(3)[None, None],
            memory_mask=mask,
            cache=cache,
        )
        b = dec(
            x[:, 3:6],
            memory,
            self_mask=causal_mask(6)[-3:][None, None],
            memory_mask=mask,
            cache=cache,
        )
        c = dec(x[:, 6:], memory, memory_mask=mask, cache=cache)
    torch.testing.assert_close(torch.cat([a, b, c], dim=1), full, atol=1e-5, rtol=1e-5)


def test_cross_attention_keys_and_values_are_computed_once() -> None:
    torch.manual_seed(0)
    d, n_layers, src_len = D_MODEL, 2, 6
    dec = Decoder(n_layers, d, N_HEADS, D_FF).eval()
    x, memory = inputs()
    cache = dec.new_cache()

    def step_flops(t: int) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            dec(x[:, t : t + 1], memory, cache=cache)
        return counter.get_total_flops()

    first = step_flops(0)
    kept = [(lc.cross_attn.k, lc.cross_attn.v) for lc in cache.layers]
    second = step_flops(1)
    for t in range(2, 5):
        step_flops(t)
    for lc, (k, v) in zip(cache.layers, kept):
        assert lc.cross_attn.k is k and lc.cross_attn.v is v
    # The first step also projects the memory: 2 * 2 * batch * src_len * d * d FLOPs per
    # layer (W^K and W^V). A single query on the CPU attends with chapter 1's products,
    # which the counter sees: the second step's self-attention reads one cached key
    # more, 4 * batch * d FLOPs per layer.
    batch = x.size(0)
    projection, one_key = 2 * 2 * batch * src_len * d * d, 4 * batch * d
    assert first - second == n_layers * (projection - one_key)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_step_flops_match_the_formulas_of_the_chapter(n_layers: int) -> None:
    """C(t) per cached step and R(t) per recomputed prefix, per layer (chapter 8)."""
    d, d_ff, n, steps = 64, 256, 7, 6
    with torch.device("meta"):
        dec = Decoder(n_layers, d, 4, d_ff).eval()
        memory, target = torch.empty(3, n, d), torch.empty(3, steps, d)
    cache, b = dec.new_cache(), 3
    for t in range(1, steps + 1):
        step = count_flops(lambda: dec(target[:, t - 1 : t], memory, cache=cache))
        mask = causal_mask(t, device="meta")[None, None]
        prefix = count_flops(lambda: dec(target[:, :t], memory, self_mask=mask))
        c = 12 * d * d + 4 * t * d + 4 * n * d + 4 * d * d_ff
        c += 4 * n * d * d if t == 1 else 0
        r = t * (12 * d * d + 4 * d * d_ff) + 4 * t * t * d + 4 * n * d * d
        r += 4 * t * n * d
        assert step == n_layers * b * c, t
        assert prefix == n_layers * b * r, t


def test_reorder_follows_a_beam_search() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF, norm_first=True).eval()
    x, memory = inputs(tgt_len=7)
    mask = padding_mask(SRC, PAD)
    # drop nothing, duplicate sequence 0, grow the batch to 4
    keep = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        cache = dec.new_cache()
        for t in range(3):
            dec(x[:, t : t + 1], memory, memory_mask=mask, cache=cache)
        cache.reorder(keep)
        assert cache.batch_size == 4 and cache.seq_len == 3
        xk, mk, maskk = x[keep], memory[keep], mask[keep]
        rest = [
            dec(xk[:, t : t + 1], mk, memory_mask=maskk, cache=cache)
            for t in range(3, 7)
        ]
        full = dec(xk, mk, self_mask=causal_mask(7), memory_mask=maskk)
    torch.testing.assert_close(
        torch.cat(rest, dim=1), full[:, 3:], atol=1e-5, rtol=1e-5
    )


def test_reorder_within_shared_sources_may_keep_the_cross_attention_cache() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF, norm_first=True).eval()
    x, memory = inputs(tgt_len=5)
    rows = torch.tensor([0, 0, 1, 1])  # two rows ("beams") per source
    xr, mr, maskr = x[rows], memory[rows], padding_mask(SRC, PAD)[rows]
    swap = torch.tensor([1, 0, 3, 3])  # every row moves only among its source's rows
    with torch.no_grad():
        cache = dec.new_cache()
        for t in range(2):
            dec(xr[:, t : t + 1], mr, memory_mask=maskr, cache=cache)
        cross_before = [layer.cross_attn.k for layer in cache]
        cache.reorder(swap, cross_attention=False)
        assert all(layer.cross_attn.k is k for layer, k in zip(cache, cross_before))
        rest = [
            dec(xr[swap][:, t : t + 1], mr, memory_mask=maskr, cache=cache)
            for t in range(2, 5)
        ]
        full = dec(xr[swap], mr, self_mask=causal_mask(5), memory_mask=maskr)
    torch.testing.assert_close(
        torch.cat(rest, dim=1), full[:, 2:], atol=1e-5, rtol=1e-5
    )


def test_reorder_of_an_empty_cache_and_repr() -> None:
    cache = DecoderCache(2)
    cache.reorder(torch.tensor([0, 0]))  # nothing cached yet: nothing to do
    assert cache.seq_len == 0 and cache.batch_size is None
    assert repr(cache) == "DecoderCache(n_layers=2, seq_len=0, batch_size=None)"
    assert isinstance(cache[0], DecoderLayerCache) and isinstance(
        cache[1].self_attn, KVCache
    )


# --- structure and parameters ---------------------------------------------------------


def test_parameter_counts() -> None:
    with torch.device("meta"):
        base = DecoderLayer(512, 8, 2048)
        big = DecoderLayer(1024, 16, 4096)
        stack = Decoder(6, 512, 8, 2048)
        pre = Decoder(6, 512, 8, 2048, norm_first=True)
    assert count(base) == 4_204_032
    assert count(base.self_attn) == count(base.cross_attn) == 4 * 512 * 512 + 4 * 512
    assert count(base.ffn) == 2 * 512 * 2048 + 2048 + 512
    assert count(base.res_self) == count(base.res_cross) == count(base.res_ffn) == 1024
    assert count(big) == 16_796_672
    assert count(stack) == 6 * 4_204_032 == 25_224_192
    assert count(pre) == count(stack) + 1024


def layer_formula(d: int, d_ff: int) -> int:
    """Parameters of one decoder layer: 2 attention blocks + FFN + 3 LayerNorms."""
    return 2 * (4 * d * d + 4 * d) + (2 * d * d_ff + d_ff + d) + 3 * 2 * d


@pytest.mark.parametrize("d, n_heads, d_ff", [(512, 8, 2048), (1024, 16, 4096)])
def test_component_and_stack_counts_match_the_formula(
    d: int, n_heads: int, d_ff: int
) -> None:
    """Each projection, the layer and both stacks of the paper's models (chapter 8)."""
    with torch.device("meta"):
        layer = DecoderLayer(d, n_heads, d_ff)
        post = Decoder(6, d, n_heads, d_ff)
        pre = Decoder(6, d, n_heads, d_ff, norm_first=True)
    for attn in (layer.self_attn, layer.cross_attn):
        assert count(attn.in_proj) == 3 * d * d + 3 * d
        assert count(attn.out_proj) == d * d + d
    assert count(layer.ffn.w_1) == d * d_ff + d_ff
    assert count(layer.ffn.w_2) == d_ff * d + d
    assert count(layer) == layer_formula(d, d_ff)
    assert count(post) == 6 * layer_formula(d, d_ff)
    assert count(pre) == count(post) + 2 * d


def test_final_norm_and_attributes() -> None:
    assert Decoder(2, 16, 2, 32).norm is None
    assert isinstance(Decoder(2, 16, 2, 32, norm_first=True).norm, nn.LayerNorm)
    assert Decoder(2, 16, 2, 32, norm_first=True, final_norm=False).norm is None
    assert isinstance(Decoder(2, 16, 2, 32, final_norm=True).norm, nn.LayerNorm)
    dec = Decoder(
        2, 16, 2, 32, dropout=0.2, activation="gelu", norm_first=True, eps=1e-6
    )
    layer = dec.layers[1]
    assert (
        len(dec.layers) == 2
        and isinstance(dec.new_cache(), DecoderCache)
        and len(dec.new_cache()) == 2
    )
    assert layer.ffn.activation == "gelu" and layer.self_attn.dropout == 0.2
    assert all(
        r.norm_first and r.norm.eps == 1e-6
        for r in (layer.res_self, layer.res_cross, layer.res_ffn)
    )


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF, dropout=0.3)
    x, memory = inputs()
    dec.train()
    assert not torch.allclose(dec(x, memory), dec(x, memory))
    dec.eval()
    torch.testing.assert_close(dec(x, memory), dec(x, memory), atol=0, rtol=0)


def test_attention_weights_can_be_requested_with_a_hook() -> None:
    torch.manual_seed(0)
    layer = DecoderLayer(D_MODEL, N_HEADS, D_FF).eval()
    captured = {}
    layer.cross_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: (args, {**kwargs, "need_weights": True}),
        with_kwargs=True,
    )
    layer.cross_attn.register_forward_hook(
        lambda mod, args, out: captured.update(weights=out[1])
    )
    x, memory = inputs()
    with torch.no_grad():
        layer(x, memory, self_mask=causal_mask(5), memory_mask=padding_mask(SRC, PAD))
    weights = captured["weights"]
    assert weights.shape == (3, N_HEADS, 5, 6)
    assert weights[1, :, :, 3:].eq(0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, N_HEADS, 5))


def test_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF, norm_first=True)
    x, memory = inputs()
    dec(
        x, memory, self_mask=target_mask(TGT, PAD), memory_mask=padding_mask(SRC, PAD)
    ).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dec.parameters())


# --- bad input ------------------------------------------------------------------------


def _filled_cache(dec: Decoder) -> tuple[DecoderCache, torch.Tensor, torch.Tensor]:
    x, memory = inputs()
    cache = dec.new_cache()
    with torch.no_grad():
        dec(x[:, :1], memory, cache=cache)
    return cache, x, memory


@pytest.mark.parametrize(
    "case, match",
    [
        ("rank", r"x must have shape \[batch, tgt_len, d_model\]"),
        ("memory_rank", r"memory must have shape \[batch, src_len, d_model\]"),
        ("width", "d_model=32"),
        ("memory_width", "memory has 16 features"),
        ("empty", "no positions"),
        ("batch", "repeat_interleave"),
        ("int_mask", "torch.bool"),
        ("float_mask", "torch.bool"),
        ("mask_shape", "does not broadcast"),
        ("mask_3d", "does not broadcast"),
        ("memory_mask_shape", "padding_mask"),
        ("torch_key_padding_mask", "memory_key_padding_mask"),
        ("cache_type", "DecoderCache"),
        ("cache_layers", "built for 3 layers"),
        ("cache_batch", "reorder"),
        ("cache_source", "source of length 6"),
        ("cache_no_mask", r"causal_mask\(4\)\[-3:\]"),
        ("cache_mask_too_short", "does not broadcast"),
        ("layer_cache_type", "DecoderLayerCache"),
    ],
)
def test_bad_input_raises_a_clear_value_error(case: str, match: str) -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF).eval()
    cache, x, memory = _filled_cache(dec)
    before = [(lc.self_attn.k, lc.cross_attn.k) for lc in cache.layers]
    calls = {
        "rank": lambda: dec(x[0], memory),
        "memory_rank": lambda: dec(x, memory[0]),
        "width": lambda: dec(x[..., :16], memory),
        "memory_width": lambda: dec(x, memory[..., :16]),
        "empty": lambda: dec(x[:, :0], memory),
        "batch": lambda: dec(x, memory[:2]),
        "int_mask": lambda: dec(x, memory, self_mask=causal_mask(5).long()),
        "float_mask": lambda: dec(
            x, memory, self_mask=nn.Transformer.generate_square_subsequent_mask(5)
        ),
        "mask_shape": lambda: dec(x, memory, self_mask=causal_mask(4)),
        "mask_3d": lambda: dec(
            x, memory, self_mask=causal_mask(5)[None].expand(3, 5, 5)
        ),
        "memory_mask_shape": lambda: dec(
            x, memory, memory_mask=padding_mask(SRC[:, :5], PAD)
        ),
        # batch == tgt_len == 3: this shape would broadcast as a
        # [tgt_len, src_len] mask.
        "torch_key_padding_mask": lambda: dec(x[:, :3], memory, memory_mask=SRC == PAD),
        "cache_type": lambda: dec(x[:, 1:2], memory, cache=KVCache()),
        "cache_layers": lambda: dec(x[:, 1:2], memory, cache=DecoderCache(3)),
        "cache_batch": lambda: dec(x[:2, 1:2], memory[:2], cache=cache),
        "cache_source": lambda: dec(x[:, 1:2], torch.randn(3, 5, D_MODEL), cache=cache),
        "cache_no_mask": lambda: dec(x[:, 1:4], memory, cache=cache),
        "cache_mask_too_short": lambda: dec(
            x[:, 1:4], memory, self_mask=causal_mask(3), cache=cache
        ),
        "layer_cache_type": lambda: dec.layers[0](x[:, 1:2], memory, cache=cache),
    }
    with pytest.raises(ValueError, match=match):
        calls[case]()
    # A rejected call leaves the cache as it was.
    assert cache.seq_len == 1 and cache.batch_size == 3
    assert all(
        lc.self_attn.k is k and lc.cross_attn.k is ck
        for lc, (k, ck) in zip(cache.layers, before)
    )


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="n_layers"):
        Decoder(bad, 16, 2, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_layers"):
        DecoderCache(bad)  # type: ignore[arg-type]


def test_bad_constructor_arguments_come_from_the_sublayers() -> None:
    with pytest.raises(ValueError, match="divisible"):
        DecoderLayer(30, 4, 64)
    with pytest.raises(ValueError, match="activation"):
        DecoderLayer(32, 4, 64, activation="tanh")
    with pytest.raises(ValueError, match="dropout"):
        DecoderLayer(32, 4, 64, dropout=1.0)
    with pytest.raises(ValueError, match="d_ff"):
        DecoderLayer(32, 4, 0)
    with pytest.raises(ValueError, match="eps"):
        DecoderLayer(32, 4, 64, eps=0.0)


@pytest.mark.parametrize(
    "index, match",
    [
        (torch.tensor([0, 3]), "valid: 0 to 2"),
        (torch.tensor([-1]), "valid: 0 to 2"),
        (torch.tensor([[0, 1]]), "1-D tensor"),
        (torch.tensor([0.0, 1.0]), "1-D tensor"),
        (torch.tensor([True, False, True]), "1-D tensor"),
        ([0, 1], "1-D tensor"),
    ],
)
def test_bad_reorder_index(index: object, match: str) -> None:
    torch.manual_seed(0)
    dec = Decoder(2, D_MODEL, N_HEADS, D_FF).eval()
    cache, _, _ = _filled_cache(dec)
    with pytest.raises(ValueError, match=match):
        cache.reorder(index)  # type: ignore[arg-type]
    assert cache.batch_size == 3


def test_reorder_checks_cpu_indices_and_does_not_read_others() -> None:
    """reorder reads the index on the CPU only: on a GPU the read stalls beam search."""
    cache = DecoderCache(2)
    # a cache of 3 sequences on the meta device: shapes, no values
    for layer in cache.layers:
        for kv in (layer.self_attn, layer.cross_attn):
            kv.k = kv.v = torch.empty(3, N_HEADS, 4, D_MODEL // N_HEADS, device="meta")
    with pytest.raises(ValueError, match="valid: 0 to 2"):
        cache.reorder(torch.tensor([0, 3]))
    index = torch.tensor([0, 2, 2, 1], device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        int(index.max())  # reading the values of a meta tensor fails
    cache.reorder(index)
    assert cache.batch_size == 4 and cache.layers[1].cross_attn.v.shape[0] == 4
