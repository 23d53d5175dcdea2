"""Tests of aiayn.masks (chapter 2) and of masked attention with those masks."""

from __future__ import annotations

import pytest
import torch

from aiayn.attention import scaled_dot_product_attention
from aiayn.masks import causal_mask, combine_masks, padding_mask, target_mask

PAD = 0


def test_causal_mask_is_lower_triangular_bool() -> None:
    m = causal_mask(4)
    assert m.shape == (4, 4) and m.dtype == torch.bool
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m, expected)
    i, j = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    assert torch.equal(causal_mask(7), j <= i)
    assert torch.equal(causal_mask(1), torch.ones(1, 1, dtype=torch.bool))


def test_causal_mask_device_argument() -> None:
    assert causal_mask(3, device="cpu").device.type == "cpu"
    assert causal_mask(3, device=torch.device("cpu")).device.type == "cpu"


def test_padding_mask_shape_and_values() -> None:
    tokens = torch.tensor([[5, 6, 7, PAD], [8, PAD, PAD, PAD], [1, 2, 3, 4]])
    m = padding_mask(tokens, PAD)
    assert m.shape == (3, 1, 1, 4) and m.dtype == torch.bool
    assert m[:, 0, 0].tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, True, True],
    ]
    # Another pad id: id 0 is then an ordinary token.
    assert padding_mask(tokens, 8)[:, 0, 0].tolist() == [
        [True, True, True, True],
        [False, True, True, True],
        [True, True, True, True],
    ]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_padding_mask_accepts_integer_dtypes(dtype: torch.dtype) -> None:
    tokens = torch.tensor([[3, 0, 0]], dtype=dtype)
    assert padding_mask(tokens, 0)[0, 0, 0].tolist() == [True, False, False]


def test_target_mask_is_padding_and_causal() -> None:
    tokens = torch.tensor([[1, 2, 3, PAD, PAD], [PAD, PAD, 1, 2, 3]])
    m = target_mask(tokens, PAD)
    assert m.shape == (2, 1, 5, 5) and m.dtype == torch.bool
    causal = causal_mask(5)
    not_pad = tokens != PAD  # [batch, k_len]
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert m[b, 0, i, j].item() == (
                    bool(causal[i, j]) and bool(not_pad[b, j])
                )
    # Left padding with a causal mask leaves the first padded queries with no key.
    assert (~m.any(dim=-1))[:, 0].tolist() == [
        [False] * 5,
        [True, True, False, False, False],
    ]


def test_combine_masks_and_broadcast() -> None:
    pad = padding_mask(torch.tensor([[1, 2, PAD], [3, PAD, PAD]]), PAD)  # [2, 1, 1, 3]
    causal = causal_mask(3)  # [3, 3]
    combined = combine_masks(pad, causal)
    assert combined.shape == (2, 1, 3, 3)
    assert torch.equal(combined, pad & causal)
    assert torch.equal(combine_masks(None, pad, None, causal), combined)
    assert combine_masks(causal) is causal
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    # AND semantics, not OR.
    a = torch.tensor([True, True, False, False])
    b = torch.tensor([True, False, True, False])
    assert combine_masks(a, b).tolist() == [True, False, False, False]


@pytest.mark.parametrize("heads", [1, 8])
def test_masks_broadcast_against_scores(heads: int) -> None:
    tokens = torch.tensor([[4, 5, 6, PAD], [7, PAD, PAD, PAD]])
    scores_shape = (2, heads, 4, 4)  # [batch, heads, q_len, k_len]
    for m in (causal_mask(4), padding_mask(tokens, PAD), target_mask(tokens, PAD)):
        assert torch.broadcast_shapes(m.shape, scores_shape) == scores_shape
    full = target_mask(tokens, PAD).expand(scores_shape)
    assert all(torch.equal(full[:, h], full[:, 0]) for h in range(heads))
    # The padding mask is the same for every query of a sentence.
    pad_full = padding_mask(tokens, PAD).expand(scores_shape)
    assert torch.equal(pad_full[:, :, 0], pad_full[:, :, 3])


@pytest.mark.parametrize("size", [0, -2, 2.0, True, "3", None])
def test_causal_mask_rejects_bad_sizes(size: object) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        causal_mask(size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (torch.tensor([1, 2, 3]), r"\[batch, seq_len\]"),
        (torch.ones(2, 3, 4, dtype=torch.long), r"\[batch, seq_len\]"),
        ([[1, 2, 3]], r"\[batch, seq_len\]"),
        (torch.tensor([[1.0, 2.0, 0.0]]), "integer token ids"),
        (torch.tensor([[True, False]]), "integer token ids"),
        (torch.zeros(2, 0, dtype=torch.long), "no positions"),
    ],
)
def test_padding_and_target_mask_reject_bad_tokens(
    tokens: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        padding_mask(tokens, PAD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        target_mask(tokens, PAD)  # type: ignore[arg-type]


@pytest.mark.parametrize("pad_id", [0.0, None, True])
def test_padding_mask_rejects_bad_pad_id(pad_id: object) -> None:
    with pytest.raises(ValueError, match="pad_id"):
        padding_mask(torch.tensor([[1, 0]]), pad_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [torch.ones(3, 3), torch.ones(3, 3, dtype=torch.int64), [[True]]]
)
def test_combine_masks_rejects_non_bool(bad: object) -> None:
    with pytest.raises(ValueError, match="torch.bool"):
        combine_masks(causal_mask(3), bad)  # type: ignore[arg-type]


def test_combine_masks_rejects_shapes_that_do_not_broadcast() -> None:
    pad = padding_mask(torch.tensor([[1, 2, 3, PAD]]), PAD)  # [1, 1, 1, 4]
    with pytest.raises(ValueError, match="do not broadcast"):
        combine_masks(pad, causal_mask(3))


def _attend(
    tokens: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked self-attention over random q, k, v with target_mask(tokens), on a CPU."""
    gen = torch.Generator().manual_seed(0)
    batch, seq = tokens.shape
    q, k, v = (torch.randn(batch, 2, seq, 8, generator=gen).to(dtype) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v, target_mask(tokens, PAD))
    return out, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masked_attention_zero_weight_on_future_and_padding(dtype: torch.dtype) -> None:
    tokens = torch.tensor([[1, 2, 3, 4, PAD, PAD], [1, 2, 3, 4, 5, 6]])
    out, w = _attend(tokens, dtype)  # w: [2, 2, 6, 6]
    assert w.dtype == dtype and torch.isfinite(out).all()
    allowed = target_mask(tokens, PAD).expand_as(w)
    assert (w[~allowed] == 0).all(), "blocked keys must get exactly zero weight"
    assert (w[~causal_mask(6).expand_as(w)] == 0).all(), "no weight on the future"
    assert (w[0, :, :, 4:] == 0).all(), "no weight on padding keys"
    # Every query here keeps at least one key, so every row sums to one.
    sums = w.float().sum(dim=-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fully_masked_rows_give_zeros_not_nan(dtype: torch.dtype) -> None:
    # Left padding: queries 0-2 of the first sentence may attend to nothing;
    # the second sentence is all padding.
    tokens = torch.tensor([[PAD, PAD, PAD, 1, 2], [PAD, PAD, PAD, PAD, PAD]])
    out, w = _attend(tokens, dtype)  # out: [2, 2, 5, 8], w: [2, 2, 5, 5]
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert (w[0, :, :3] == 0).all() and (out[0, :, :3] == 0).all()
    assert (w[1] == 0).all() and (out[1] == 0).all()
    # The queries that can see a real token still attend normally.
    sums = w[0, :, 3:].float().sum(dim=-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-2)
    assert (out[0, :, 3:] != 0).any()


def test_naive_inf_fill_gives_nan_where_the_book_gives_zeros() -> None:
    """The failure the masks guard against, so that the test above can fail."""
    mask = target_mask(torch.tensor([[PAD, 1, 2]]), PAD)  # query 0 sees nothing
    scores = torch.randn(1, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    naive = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    assert torch.isnan(naive[0, 0, 0]).all()
    q = k = v = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(1))
    _, w = scaled_dot_product_attention(q, k, v, mask)
    assert (w[0, 0, 0] == 0).all()


def test_causal_mask_stops_the_future_from_leaking() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 5, 4, generator=gen) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[..., 3:, :] += 1.0
    v2[..., 3:, :] -= 1.0
    mask = causal_mask(5)
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    out2, _ = scaled_dot_product_attention(q, k2, v2, mask)
    assert torch.equal(out[..., :3, :], out2[..., :3, :])
    assert not torch.allclose(out[..., 3:, :], out2[..., 3:, :])
