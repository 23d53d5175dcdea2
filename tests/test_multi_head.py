"""Tests of aiayn.multi_head (chapter 3): MultiHeadAttention and KVCache."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.attention import scaled_dot_product_attention
from aiayn.masks import causal_mask, padding_mask, target_mask
from aiayn.multi_head import KVCache, MultiHeadAttention

D_MODEL, N_HEADS = 32, 4
TOKENS = torch.tensor([[5, 3, 8, 2, 9, 4], [7, 1, 6, 0, 0, 0]])  # 0 = padding


def pair() -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    """Our layer and PyTorch's in eval mode, the same non-zero weights and biases."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    with torch.no_grad():
        ours.in_proj.bias.normal_()
        ours.out_proj.bias.normal_()
    theirs = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj.weight)
        theirs.in_proj_bias.copy_(ours.in_proj.bias)
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    return ours, theirs


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A source [2, 6, d_model] and a target [2, 4, d_model]."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, D_MODEL, generator=gen), torch.randn(
        2, 4, D_MODEL, generator=gen
    )


@pytest.mark.parametrize(
    "case",
    ["self", "self_padding", "self_causal", "self_causal_padding", "cross_padding"],
)
@pytest.mark.parametrize("need_weights", [False, True])
def test_parity_with_torch_multihead_attention(case: str, need_weights: bool) -> None:
    ours, theirs = pair()
    src, tgt = inputs()
    pad = padding_mask(TOKENS, 0)  # True = real token
    kpm = ~pad[:, 0, 0, :]  # PyTorch: True = ignore
    causal = causal_mask(6)
    query, key_value, mask, t_kpm, t_attn = {
        "self": (src, None, None, None, None),
        "self_padding": (src, None, pad, kpm, None),
        "self_causal": (src, None, causal, None, ~causal),
        "self_causal_padding": (src, None, target_mask(TOKENS, 0), kpm, ~causal),
        "cross_padding": (tgt, src, pad, kpm, None),
    }[case]
    kv = query if key_value is None else key_value
    with torch.no_grad():
        out, w = ours(query, key_value, mask, need_weights=need_weights)
        ref, ref_w = theirs(
            query,
            kv,
            kv,
            key_padding_mask=t_kpm,
            attn_mask=t_attn,
            average_attn_weights=False,
        )
    assert out.shape == (2, query.size(1), D_MODEL)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if need_weights:
        assert w.shape == (2, N_HEADS, query.size(1), kv.size(1))
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
        with torch.no_grad():
            _, ref_avg = theirs(query, kv, kv, key_padding_mask=t_kpm, attn_mask=t_attn)
        torch.testing.assert_close(w.mean(dim=1), ref_avg, atol=1e-6, rtol=1e-5)
    else:
        assert w is None


def test_per_head_loop_equals_module() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    src, tgt = inputs()
    d_k = D_MODEL // N_HEADS
    # each [d_model, d_model], rows = output features
    w_q, w_k, w_v = layer.in_proj.weight.detach().chunk(3)
    b_q, b_k, b_v = layer.in_proj.bias.detach().chunk(3)
    for query, kv in ((src, src), (tgt, src)):
        heads = []
        for i in range(N_HEADS):
            rows = slice(i * d_k, (i + 1) * d_k)  # head i's own small projections
            head, _ = scaled_dot_product_attention(
                query @ w_q[rows].T + b_q[rows],
                kv @ w_k[rows].T + b_k[rows],
                kv @ w_v[rows].T + b_v[rows],
            )
            heads.append(head)
        expected = layer.out_proj(torch.cat(heads, dim=-1))
        with torch.no_grad():
            got, _ = layer(query, None if kv is query else kv)
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_mask", [False, True])
def test_fused_path_equals_need_weights_path(use_mask: bool) -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    src, tgt = inputs()
    mask = padding_mask(TOKENS, 0) if use_mask else None
    with torch.no_grad():
        for key_value in (None, src):
            query = src if key_value is None else tgt
            fused, none = layer(query, key_value, mask)
            explicit, weights = layer(query, key_value, mask, need_weights=True)
            assert none is None and weights is not None
            torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
            if mask is not None:  # blocked keys get exactly zero weight
                assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fully_masked_rows_are_zero_not_nan(
    dtype: torch.dtype, need_weights: bool, bias: bool
) -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, bias=bias).to(dtype)
    query, memory = (
        torch.randn(2, 3, 16, dtype=dtype),
        torch.randn(2, 5, 16, dtype=dtype),
    )
    allowed = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    allowed[0, :, 1] = False  # sequence 0, query 1: nothing to attend to
    allowed[1] = False  # sequence 1: every key is padding
    with torch.no_grad():
        out, weights = layer(query, memory, allowed, need_weights=need_weights)
        self_out, _ = layer(
            query, mask=torch.zeros(3, 3, dtype=torch.bool), need_weights=need_weights
        )
    assert torch.isfinite(out).all() and torch.isfinite(self_out).all()
    expected = layer.out_proj.bias.detach() if bias else torch.zeros(16, dtype=dtype)
    assert (out[0, 1] == expected).all() and (out[1] == expected).all()
    assert (self_out == expected).all()
    assert not torch.equal(out[0, 0], expected)  # rows with keys are untouched
    if need_weights:
        assert (weights[0, :, 1] == 0).all() and (weights[1] == 0).all()
        assert torch.isfinite(weights).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_rows_have_finite_gradients(need_weights: bool) -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4)
    query = torch.randn(2, 3, 16, requires_grad=True)
    memory = torch.randn(2, 5, 16, requires_grad=True)
    allowed = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    allowed[0, :, 1] = False
    out, _ = layer(query, memory, allowed, need_weights=need_weights)
    out.sum().backward()
    for t in (query, memory, *layer.parameters()):
        assert torch.isfinite(t.grad).all()
    assert (query.grad[0, 1] == 0).all()


def test_cached_decoding_equals_full_computation() -> None:
    torch.manual_seed(0)
    self_attn, cross_attn = (
        MultiHeadAttention(D_MODEL, N_HEADS).eval(),
        MultiHeadAttention(D_MODEL, N_HEADS).eval(),
    )
    src, tgt = inputs()
    pad = padding_mask(TOKENS, 0)
    with torch.no_grad():
        h, _ = self_attn(tgt, mask=causal_mask(4))
        full, _ = cross_attn(h, src, mask=pad)
        self_cache, cross_cache = KVCache(), KVCache()
        steps = []
        for t in range(4):
            h_t, _ = self_attn(tgt[:, t : t + 1], cache=self_cache)
            out_t, _ = cross_attn(h_t, src, mask=pad, cache=cross_cache)
            steps.append(out_t)
            assert self_cache.seq_len == t + 1 and cross_cache.seq_len == 6
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert self_cache.k.shape == (2, N_HEADS, 4, D_MODEL // N_HEADS)


def test_cache_with_several_new_positions_and_a_mask() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    _, tgt = inputs()
    causal = causal_mask(4)[None, None]  # [1, 1, 4, 4]: batch = q_len = 2 below
    with torch.no_grad():
        full, _ = layer(tgt, mask=causal)
        cache = KVCache()
        first, _ = layer(tgt[:, :2], mask=causal[..., :2, :2], cache=cache)
        # [2 new queries, 4 keys]
        rest, _ = layer(tgt[:, 2:], mask=causal[..., 2:, :], cache=cache)
    torch.testing.assert_close(
        torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5
    )


def test_cross_attention_cache_projects_the_memory_once() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 8)
    memory, query = torch.randn(1, 10, 64), torch.randn(1, 1, 64)
    cache = KVCache()
    counts = []
    for _ in range(3):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(query, memory, need_weights=True, cache=cache)
        counts.append(counter.get_total_flops())
    d, n = 64, 10
    assert counts[0] == 4 * d * d + 4 * n * d * d + 4 * n * d
    assert counts[1] == counts[2] == 4 * d * d + 4 * n * d
    k_before = cache.k
    with torch.no_grad():
        layer(query, memory, cache=cache)
    assert cache.k is k_before


def test_cache_reorder_selects_batch_rows() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    src, _ = inputs()
    cache = KVCache()
    with torch.no_grad():
        layer(src[:, :3], cache=cache)
        k, v = cache.k.clone(), cache.v.clone()
        cache.reorder(torch.tensor([1, 1, 0]))
    assert (
        cache.k.shape[0] == 3
        and torch.equal(cache.k[0], k[1])
        and torch.equal(cache.v[2], v[0])
    )
    assert KVCache().seq_len == 0


def test_reorder_with_room_is_filled_in_place_by_the_next_append() -> None:
    torch.manual_seed(0)
    # [batch 3, heads, 5 cached, d_k 8]
    k, v = torch.randn(2, 3, N_HEADS, 5, 8).unbind(0)
    # one new position, 4 rows
    new_k, new_v = torch.randn(2, 4, N_HEADS, 1, 8).unbind(0)
    index = torch.tensor([2, 0, 0, 1])
    plain, roomy = KVCache(k, v), KVCache(k, v)
    plain.reorder(index)
    roomy.reorder(index, room=1)
    # room unseen
    assert torch.equal(roomy.k, plain.k) and torch.equal(roomy.v, plain.v)
    assert roomy.seq_len == 5 and roomy.spare is not None
    spare_k = roomy.spare[0]
    out_k, out_v = roomy.append(new_k, new_v)
    assert out_k is spare_k and out_k.is_contiguous() and roomy.spare is None  # no copy
    plain.append(new_k, new_v)
    assert torch.equal(roomy.k, plain.k) and torch.equal(roomy.v, plain.v)
    # room for one position, two arrive: the cache concatenates instead
    two = KVCache(k, v)
    two.reorder(index, room=1)
    two.append(torch.cat([new_k, new_k], 2), torch.cat([new_v, new_v], 2))
    assert two.seq_len == 7 and torch.equal(two.k[:, :, :5], plain.k[:, :, :5])
    # a second reorder before the append reads the first one's rows
    twice = KVCache(k, v)
    twice.reorder(index, room=1)
    twice.reorder(torch.tensor([3, 3]), room=1)
    twice.append(new_k[:2], new_v[:2])
    assert torch.equal(twice.k[:, :, :5], k[[1, 1]]) and torch.equal(
        twice.k[:, :, 5:], new_k[:2]
    )
    # keys set by hand after the reorder are kept: the room is not theirs
    replaced = KVCache(k, v)
    replaced.reorder(index, room=1)
    replaced.k, replaced.v = torch.zeros(2, 4, N_HEADS, 5, 8).unbind(0)
    replaced.append(new_k, new_v)
    assert torch.equal(replaced.k, torch.cat([torch.zeros(4, N_HEADS, 5, 8), new_k], 2))
    assert torch.equal(replaced.v, torch.cat([torch.zeros(4, N_HEADS, 5, 8), new_v], 2))


def test_reorder_with_room_under_autograd_keeps_the_graph() -> None:
    k = torch.randn(2, N_HEADS, 3, 8, requires_grad=True)
    cache = KVCache(k * 1.0, k * 2.0)
    cache.reorder(torch.tensor([1, 0]), room=1)  # out= cannot record gradients: no room
    assert cache.spare is None
    cache.append(torch.zeros(2, N_HEADS, 1, 8), torch.zeros(2, N_HEADS, 1, 8))
    cache.k.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))


def test_a_single_query_on_the_cpu_matches_torch_nn() -> None:
    ours, theirs = pair()
    src, tgt = inputs()
    pad = padding_mask(TOKENS, 0)  # [2, 1, 1, 6]
    query = tgt[:, :1]  # [2, 1, d_model]: one query, as in decoding
    with torch.no_grad():
        out, weights = ours(query, src, mask=pad)
        expected, _ = theirs(query, src, src, key_padding_mask=~pad[:, 0, 0])
        explicit, w = ours(query, src, mask=pad, need_weights=True)
    assert weights is None and w.shape == (2, N_HEADS, 1, 6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, explicit, atol=0, rtol=0)
    # a query with nothing to attend to
    nothing = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    with torch.no_grad():
        empty, _ = ours(query, src, mask=nothing)
    torch.testing.assert_close(empty, ours.out_proj.bias.expand(2, 1, D_MODEL))


def test_cross_attention_cache_is_contiguous() -> None:
    layer = MultiHeadAttention(D_MODEL, N_HEADS).eval()
    src, tgt = inputs()
    cache = KVCache()
    with torch.no_grad():
        layer(tgt[:, :1], src, cache=cache)
    assert cache.k.is_contiguous() and cache.v.is_contiguous()


def test_parameter_count_is_4d2_plus_4d() -> None:
    for d_model, n_heads in ((32, 1), (32, 4), (512, 8), (512, 64)):
        layer = MultiHeadAttention(d_model, n_heads)
        assert (
            sum(p.numel() for p in layer.parameters()) == 4 * d_model**2 + 4 * d_model
        )
        no_bias = MultiHeadAttention(d_model, n_heads, bias=False)
        assert sum(p.numel() for p in no_bias.parameters()) == 4 * d_model**2


@pytest.mark.parametrize("n_heads", [1, 8])
def test_flops_of_self_attention(n_heads: int) -> None:
    d, n = 512, 300
    layer = MultiHeadAttention(d, n_heads).to("meta")
    x = torch.empty(1, n, d, device="meta")
    for need_weights in (False, True):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(x, need_weights=need_weights)
        assert counter.get_total_flops() == 8 * n * d * d + 4 * n * n * d


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS, dropout=0.5)
    src, _ = inputs()
    with torch.no_grad():
        layer.train()
        a, _ = layer(src)
        b, _ = layer(src)
        _, w_train = layer(src, need_weights=True)
        layer.eval()
        c, _ = layer(src)
        d, _ = layer(src)
        _, w_eval = layer(src, need_weights=True)
        layer.dropout = 0.0
        e, _ = layer(src)
    assert not torch.allclose(a, b)
    assert torch.equal(c, d) and torch.equal(c, e)  # eval: as without dropout
    kept = w_train != 0
    assert (~kept).any() and torch.allclose(w_train[kept], 2 * w_eval[kept])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda layer, x: MultiHeadAttention(512, 6), "not divisible by n_heads"),
        (lambda layer, x: MultiHeadAttention(0, 1), "must be positive"),
        (lambda layer, x: MultiHeadAttention(32, 4, dropout=1.0), "dropout"),
        (lambda layer, x: layer(x[0]), "[batch, seq_len, d_model]"),
        (lambda layer, x: layer(x[None]), "[batch, seq_len, d_model]"),
        (lambda layer, x: layer(x, x[0]), "key_value must have shape"),
        (lambda layer, x: layer(torch.randn(2, 6, 16)), "d_model=32"),
        (lambda layer, x: layer(x, torch.randn(2, 6, 16)), "key_value has 16 features"),
        (lambda layer, x: layer(x, torch.randn(3, 6, 32)), "same batch size"),
        (lambda layer, x: layer(x, mask=torch.ones(6, 6)), "torch.bool"),
        (
            lambda layer, x: layer(x, mask=torch.ones(2, 6, 6, dtype=torch.bool)),
            "mask.unsqueeze(1)",
        ),
        (
            lambda layer, x: layer(x, mask=torch.ones(6, 5, dtype=torch.bool)),
            "does not broadcast",
        ),
        (
            lambda layer, x: layer(x, mask=torch.ones(2, 3, 6, 6, dtype=torch.bool)),
            "does not broadcast",
        ),
        (
            lambda layer, x: layer(
                x, cache=KVCache(torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8))
            ),
            "KVCache",
        ),
    ],
)
def test_bad_input_raises_a_clear_value_error(call, message: str) -> None:
    layer = MultiHeadAttention(D_MODEL, N_HEADS)
    x = torch.randn(2, 6, D_MODEL)
    with pytest.raises(ValueError) as info:
        call(layer, x)
    assert message in str(info.value)


def test_fused_path_leaves_out_cudnn_attention(monkeypatch):
    """The fused call runs with cuDNN's attention off, and the switch is put back.

    cuDNN plans every new shape again (a third of a second per batch shape in the
    recorded H200 run), and its answer for a query with no keys differs; the
    switches that sdpa_kernel sets are global, so they are read during the call.
    """
    import torch.nn.functional as F

    from aiayn.multi_head import FUSED_KERNELS

    seen = []
    fused = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    out, _ = mha(x, mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))
    assert seen == [(False, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in FUSED_KERNELS
    reference, _ = mha(x, need_weights=True)  # chapter 1's function
    assert torch.allclose(out, reference, atol=1e-6)

    # a choice made around the model holds, cuDNN's kernel alone included
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for outer, expected in [
        ([SDPBackend.MATH], (False, False, True)),
        ([SDPBackend.CUDNN_ATTENTION], (True, False, False)),
        ([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], (False, False, True)),
    ]:
        seen.clear()
        with sdpa_kernel(outer):
            try:
                mha(x)
            except RuntimeError:  # no cuDNN kernel on a CPU: what ran is recorded
                pass
        assert seen == [expected], outer


def test_the_fused_path_compiles_into_one_graph_without_cudnn():
    """Under torch.compile the layer runs FUSED_KERNELS: one graph, no break."""
    import torch._dynamo

    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    explained = torch._dynamo.explain(mha)(x, mask=torch.ones(2, 1, 1, 5, dtype=bool))
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_a_mask_passed_to_pytorch_unflipped_inverts_it() -> None:
    """True means may attend here and ignore in torch.nn: a mask must be flipped."""
    ours, theirs = pair()
    src, _ = inputs()
    pad = padding_mask(TOKENS, 0)  # [batch, 1, 1, k_len], True = real token
    with torch.no_grad():
        right, _ = ours(src, mask=pad)
        flipped, _ = theirs(src, src, src, key_padding_mask=~pad[:, 0, 0])
        unflipped, _ = theirs(src, src, src, key_padding_mask=pad[:, 0, 0])
    torch.testing.assert_close(flipped, right, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unflipped[1], right[1], atol=1e-3)


# --- claims of the source documents (chapter 3, "What the documents say") -----------


def test_doc000_chunck_is_not_a_tensor_method() -> None:
    """doc000 cuts the packed projection with `chunck`; the method is `chunk`."""
    layer = MultiHeadAttention(D_MODEL, N_HEADS)
    src, _ = inputs()
    packed = layer.in_proj(src)  # [batch, seq, 3 d_model]
    with pytest.raises(AttributeError, match="chunck"):
        packed.chunck(3, dim=-1)
    assert [t.shape for t in packed.chunk(3, dim=-1)] == [(2, 6, D_MODEL)] * 3


def test_doc001_head_shapes_in_the_column_layout() -> None:
    """With heads [h, d_head, N], the scores are Q'^T K' and the contexts V' A'^T."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS, bias=False).eval()
    n, d_head = 6, D_MODEL // N_HEADS
    h = torch.randn(D_MODEL, n)  # hidden states as columns: [d_model, N]
    w_q, w_k, w_v = layer.in_proj.weight.detach().chunk(3)  # rows: W^T, [d, d]
    qh, kh, vh = (
        (w @ h).reshape(N_HEADS, d_head, n) for w in (w_q, w_k, w_v)
    )  # [h, d_head, N]
    assert (qh @ kh.transpose(-2, -1)).shape == (N_HEADS, d_head, d_head)
    a = torch.softmax(qh.transpose(-2, -1) @ kh / d_head**0.5, dim=-1)  # [h, N, N]
    a_vt = a @ vh.transpose(-2, -1)  # the document's C' = A' V'^T: [h, N, d_head]
    assert a_vt.shape == (N_HEADS, n, d_head)
    heads = torch.cat(  # each head in the row layout, as columns: [d_model, N]
        [
            scaled_dot_product_attention(*(t[i].T for t in (qh, kh, vh)))[0]
            for i in range(N_HEADS)
        ],
        dim=-1,
    ).T
    with torch.no_grad():  # the layer with W^O = I returns the heads concatenated
        layer.out_proj.weight.copy_(torch.eye(D_MODEL))
        concat, _ = layer(h.T[None])  # [1, N, d_model]
    torch.testing.assert_close(heads, concat[0].T, atol=1e-5, rtol=1e-5)
    right = (vh @ a.transpose(-2, -1)).reshape(D_MODEL, n)  # V' A'^T
    torch.testing.assert_close(right, heads, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a_vt.reshape(D_MODEL, n), heads, atol=1e-3)
