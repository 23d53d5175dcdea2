"""Tests of aiayn.attention (chapter 1): scaled dot-product and additive attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.attention import (
    AdditiveAttention,
    broadcast_shape,
    masked_softmax,
    scaled_dot_product_attention,
)


def random_qkv(
    *batch: int,
    q_len: int = 5,
    k_len: int = 7,
    d_k: int = 16,
    d_v: int = 12,
    seed: int = 0,
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, q_len, d_k, generator=g)
    k = torch.randn(*batch, k_len, d_k, generator=g)
    v = torch.randn(*batch, k_len, d_v, generator=g)
    return q, k, v


def test_matches_the_formula() -> None:
    q, k, v = random_qkv(3)
    out, w = scaled_dot_product_attention(q, k, v)
    expected_w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
    torch.testing.assert_close(w, expected_w)
    torch.testing.assert_close(out, expected_w @ v)
    assert out.shape == (3, 5, 12) and w.shape == (3, 5, 7)


@pytest.mark.parametrize("use_mask", [False, True])
def test_matches_torch_sdpa(use_mask: bool) -> None:
    q, k, v = random_qkv(2, 4)  # [batch, heads, seq, d]
    mask = None
    if use_mask:
        mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.5
        # torch's function returns NaN on empty rows; compare on the others
        mask[..., 0] = True
    ours, _ = scaled_dot_product_attention(q, k, v, mask)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masked_weights_are_zero_and_empty_rows_give_zeros(dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype) for t in random_qkv(2))
    mask = torch.rand(2, 5, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[0, 3] = False  # a query that may attend to nothing
    mask[1, :, 0] = True
    out, w = scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == dtype and w.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (w[~mask] == 0).all()
    assert (w[0, 3] == 0).all() and (out[0, 3] == 0).all()
    allowed_rows = mask.any(-1)
    torch.testing.assert_close(
        w.float().sum(-1)[allowed_rows],
        torch.ones(int(allowed_rows.sum())),
        atol=1e-2,
        rtol=0,
    )


def test_gradients_stay_finite_with_empty_rows() -> None:
    q, k, v = (t.requires_grad_() for t in random_qkv(2))
    mask = torch.ones(2, 5, 7, dtype=torch.bool)
    mask[1, 2] = False
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[1, 2] == 0).all()  # the empty row does not depend on its query


def test_masked_softmax_without_mask_is_softmax() -> None:
    scores = torch.randn(3, 4, 5)
    torch.testing.assert_close(masked_softmax(scores), torch.softmax(scores, -1))


def test_dropout_keeps_or_rescales_each_weight() -> None:
    torch.manual_seed(0)
    q, k, v = random_qkv(4)
    _, w = scaled_dot_product_attention(q, k, v)
    _, w_drop = scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    kept = w_drop != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(w_drop[kept], w[kept] / 0.75)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda q, k, v: scaled_dot_product_attention(q[0, 0], k, v),
            "at least 2 dimensions",
        ),
        (
            lambda q, k, v: scaled_dot_product_attention(q, k[..., :8], v),
            "same last dimension",
        ),
        (lambda q, k, v: scaled_dot_product_attention(q, k, v[:, :6]), "same length"),
        (
            lambda q, k, v: scaled_dot_product_attention(
                q, k[:1].expand(3, 7, 16).repeat(2, 1, 1), v
            ),
            "broadcast",
        ),
        (
            lambda q, k, v: scaled_dot_product_attention(
                q, k, v, mask=torch.ones(5, 7)
            ),
            "torch.bool",
        ),
        (
            lambda q, k, v: scaled_dot_product_attention(
                q, k, v, mask=torch.ones(5, 6).bool()
            ),
            "does not broadcast",
        ),
        (
            lambda q, k, v: scaled_dot_product_attention(
                q, k, v, mask=torch.ones(4, 2, 5, 7).bool()
            ),
            "does not broadcast",
        ),
        (
            lambda q, k, v: scaled_dot_product_attention(q, k, v, dropout_p=1.0),
            "dropout_p",
        ),
    ],
    ids=[
        "rank",
        "d_k",
        "length",
        "batch",
        "float-mask",
        "mask-shape",
        "mask-enlarges",
        "dropout",
    ],
)
def test_bad_input_is_a_clear_value_error(call, message: str) -> None:
    q, k, v = random_qkv(2)
    with pytest.raises(ValueError, match=message):
        call(q, k, v)


def test_additive_attention_shapes_mask_and_sizes() -> None:
    torch.manual_seed(0)
    attention = AdditiveAttention(d_q=10, d_k=6, d_attn=8)
    q = torch.randn(2, 3, 10)
    k, v = torch.randn(2, 4, 6), torch.randn(2, 4, 5)
    mask = torch.tensor([True, True, False, True]).expand(2, 1, 4)  # [batch, 1, k_len]
    out, w = attention(q, k, v, mask)
    assert out.shape == (2, 3, 5) and w.shape == (2, 3, 4)
    assert (w[..., 2] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3))
    # score(q, k) = v^T tanh(W_q q + W_k k), computed pair by pair
    with torch.no_grad():
        weights = torch.softmax(
            torch.stack(
                [
                    attention.v(
                        torch.tanh(attention.w_q(q[0, 1]) + attention.w_k(k[0, j]))
                    )
                    for j in (0, 1, 3)
                ]
            ).squeeze(-1),
            dim=0,
        )
    torch.testing.assert_close(w[0, 1, 3], weights[2])
    assert sum(p.numel() for p in attention.parameters()) == 10 * 8 + 6 * 8 + 8


# --- a 2-D mask when batch = q_len: [q_len, k_len], or PyTorch's key padding mask? ----


def test_a_2d_mask_is_refused_when_batch_equals_q_len() -> None:
    from aiayn.attention import check_attention_inputs
    from aiayn.masks import causal_mask
    from aiayn.multi_head import MultiHeadAttention

    q, k, v = random_qkv(3, 2, q_len=3, k_len=3)  # [batch 3, heads 2, q_len 3, d]
    # PyTorch's [batch, k_len]: True = pad
    key_padding = torch.tensor([[False, False, True]] * 3)
    with pytest.raises(ValueError, match="ambiguous") as refused:
        scaled_dot_product_attention(q, k, v, mask=key_padding)
    message = str(refused.value)
    assert "causal_mask(n)[None, None]" in message and "[1, 1, q_len, k_len]" in message
    assert "~key_padding_mask[:, None, None, :]" in message
    with pytest.raises(ValueError, match="ambiguous"):
        check_attention_inputs(q, k, v, causal_mask(3))
    layer = MultiHeadAttention(16, 4).eval()
    with pytest.raises(ValueError, match="ambiguous"):
        layer(torch.randn(3, 3, 16), mask=causal_mask(3))
    # Each reading, written with explicit axes, is accepted and means what it says.
    out, w = scaled_dot_product_attention(q, k, v, mask=~key_padding[:, None, None, :])
    assert (w[..., 2] == 0).all()
    _, w = scaled_dot_product_attention(q, k, v, mask=causal_mask(3)[None, None])
    assert torch.equal(w != 0, causal_mask(3).expand_as(w))
    # 3-D scores: the hints have one singleton axis fewer.
    with pytest.raises(ValueError, match=r"~key_padding_mask\[:, None, :\]"):
        scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0], mask=key_padding)


def test_2d_masks_stay_accepted_where_they_are_unambiguous() -> None:
    from aiayn.attention import check_attention_inputs
    from aiayn.masks import causal_mask

    q, k, v = random_qkv(2, q_len=3, k_len=3)  # batch 2 != q_len 3
    assert check_attention_inputs(q, k, v, causal_mask(3)) == (2, 3, 3)
    q, k, v = random_qkv(1, q_len=3, k_len=3)  # a batch of one
    assert check_attention_inputs(q, k, v, causal_mask(3)) == (1, 3, 3)
    # one query: [1, k_len] reads the same either way
    q, k, v = random_qkv(3, q_len=1, k_len=4)
    assert check_attention_inputs(q, k, v, torch.ones(1, 4, dtype=torch.bool)) == (
        3,
        1,
        4,
    )
    q, k, v = random_qkv(q_len=3, k_len=3)  # no batch dimension at all
    assert check_attention_inputs(q, k, v, causal_mask(3)) == (3, 3)


def test_the_broadcast_message_says_how_to_pass_a_pytorch_padding_mask() -> None:
    q, k, v = random_qkv(2, 4)  # [batch 2, heads 4, q_len 5, d]
    with pytest.raises(ValueError, match="does not broadcast") as refused:
        scaled_dot_product_attention(q, k, v, mask=torch.ones(2, 7, dtype=torch.bool))
    assert "~key_padding_mask[:, None, None, :]" in str(refused.value)


def test_broadcast_shape_follows_torch() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        shapes = [
            tuple(
                int(n)
                for n in torch.randint(
                    0, 4, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g
                )
            )
            for _ in range(int(torch.randint(1, 4, (1,), generator=g)))
        ]
        try:
            expected = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            expected = None
        assert broadcast_shape(*shapes) == expected, shapes
    assert broadcast_shape() == ()


def test_a_pytorch_key_padding_mask_for_a_batch_of_one_is_refused_everywhere() -> None:
    """[1, k_len] with True = padding must not be read as True = may attend."""
    from aiayn.decoder import Decoder
    from aiayn.multi_head import MultiHeadAttention

    q, k, v = random_qkv(1, 2, q_len=3, k_len=4)  # a batch of one
    # PyTorch: the last key is padding
    key_padding = torch.tensor([[False, False, False, True]])
    with pytest.raises(ValueError, match="ambiguous"):
        scaled_dot_product_attention(q, k, v, mask=key_padding)
    with pytest.raises(ValueError, match="ambiguous"):
        MultiHeadAttention(16, 4).eval()(torch.randn(1, 4, 16), mask=key_padding)
    decoder = Decoder(1, 16, 4, 32).eval()
    with pytest.raises(ValueError, match="memory_key_padding_mask"):
        decoder(torch.randn(1, 3, 16), torch.randn(1, 4, 16), memory_mask=key_padding)
    # the same padding, as an explicit mask
    _, w = scaled_dot_product_attention(q, k, v, mask=~key_padding[:, None, None, :])
    assert (w[..., 3] == 0).all()
    # batch 3: [1, k_len] can only be shared
    q, k, v = random_qkv(3, 2, q_len=1, k_len=4)
    scaled_dot_product_attention(q, k, v, mask=torch.ones(1, 4, dtype=torch.bool))


def test_half_precision_outputs_stay_close_to_float32() -> None:
    """float16 and bfloat16 give what float32 gives, to the precision of the dtype."""
    q, k, v = random_qkv(2)
    mask = torch.rand(2, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[0, 1] = False  # a query that may attend to nothing
    reference, _ = scaled_dot_product_attention(q, k, v, mask)
    for dtype in (torch.float16, torch.bfloat16):
        out, _ = scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), mask
        )
        torch.testing.assert_close(out.float(), reference, atol=5e-2, rtol=0)
        assert (out[0, 1] == 0).all()


# --- claims of the source documents (chapter 1, "What the documents say") -----------


def test_doc001_key_first_scores_normalise_over_queries() -> None:
    """e_ij = k_i . q_j normalised over j: no product with V, wrong weights."""
    q, k, v = random_qkv(q_len=3, k_len=5, d_k=4, d_v=4)
    a_doc = torch.softmax(k @ q.T / 2, dim=-1)  # [k_len, q_len]
    with pytest.raises(RuntimeError):
        a_doc @ v  # [5, 3] @ [5, 4]
    q, k, v = random_qkv(q_len=5, k_len=5, d_k=4, d_v=4)  # as many queries as keys
    _, weights = scaled_dot_product_attention(q, k, v)  # [q_len, k_len]
    a_doc = torch.softmax(k @ q.T / 2, dim=-1)  # row i: key i over the queries
    assert not torch.allclose(a_doc, weights)
    per_query = a_doc.sum(dim=0)  # the weight each query hands out
    assert not torch.allclose(per_query, torch.ones(5))


def test_doc001_column_layout_needs_v_times_a_transposed() -> None:
    """With columns [d, N], QK^T is [d, d] and AV^T is C^T; C = V A^T."""
    d, n = 6, 4
    qc, kc, vc = (t.T for t in random_qkv(q_len=n, k_len=n, d_k=d, d_v=d))  # [d, N]
    rows, _ = scaled_dot_product_attention(qc.T, kc.T, vc.T)  # row layout: [N, d]
    a = torch.softmax(qc.T @ kc / math.sqrt(d), dim=-1)  # e_ij = q_i . k_j: [N, N]
    assert (qc @ kc.T).shape == (d, d)
    torch.testing.assert_close(a @ vc.T, rows)  # the document's C = A V^T: C^T
    torch.testing.assert_close(vc @ a.T, rows.T)  # C = [c_1 ... c_N]: [d, N]


def test_minus_1e9_does_not_exist_in_float16() -> None:
    """doc003's mask constant overflows float16; the dtype's minimum does not."""
    scores = torch.randn(2, 3, dtype=torch.float16)
    blocked = torch.tensor([[False, True, False], [True, True, True]])
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(blocked, -1e9)
    weights = masked_softmax(scores, ~blocked)
    assert torch.isfinite(weights).all() and (weights[blocked] == 0).all()


def test_qk_and_av_each_cost_2n2d_flops() -> None:
    """doc000 counts QK^T and AV together as 2N^2D; each costs that, 4N^2D in all."""
    from aiayn.attention import count_flops

    d = 64
    for n in (128, 256, 512):
        x = torch.randn(n, d)
        assert (
            count_flops(lambda: scaled_dot_product_attention(x, x, x)) == 4 * n * n * d
        )
