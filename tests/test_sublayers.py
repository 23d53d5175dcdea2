"""Tests of aiayn.sublayers (chapter 6).

The position-wise feed-forward network and the residual wrapper.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.attention import scaled_dot_product_attention
from aiayn.multi_head import MultiHeadAttention
from aiayn.sublayers import ACTIVATIONS, PositionwiseFeedForward, Residual


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def by_hand_layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)  # biased variance
    return norm.weight * (x - mu) / torch.sqrt(var + norm.eps) + norm.bias


def randomize_norm(norm: nn.LayerNorm, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))


# --- PositionwiseFeedForward ----------------------------------------------------------


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_ffn_matches_its_formula(activation: str) -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 64, activation=activation)
    x = randn(3, 7, 16)
    hidden = x @ ffn.w_1.weight.T + ffn.w_1.bias
    if activation == "relu":
        hidden = torch.clamp(hidden, min=0)
    elif activation == "silu":  # SiLU(z) = z sigmoid(z), "swish"
        hidden = hidden / (1 + torch.exp(-hidden))
    else:  # GELU(z) = z Phi(z)
        hidden = hidden * 0.5 * (1 + torch.erf(hidden / math.sqrt(2)))
    expected = hidden @ ffn.w_2.weight.T + ffn.w_2.bias
    out = ffn(x)
    assert out.shape == (3, 7, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_ffn_activations_differ_and_default_is_relu() -> None:
    assert PositionwiseFeedForward(8, 32).activation == "relu"
    assert set(ACTIVATIONS) == {"relu", "gelu", "silu"}
    torch.manual_seed(0)
    relu = PositionwiseFeedForward(8, 32)
    torch.manual_seed(0)
    gelu = PositionwiseFeedForward(8, 32, activation="gelu")
    x = randn(4, 8)
    assert not torch.allclose(relu(x), gelu(x))


def test_gelu_is_z_phi_z_with_a_dip_and_a_close_tanh_form() -> None:
    """GELU is z Phi(z), dips to about -0.17, and its tanh form stays within 1e-3."""
    z = torch.linspace(-4, 4, 801)
    gelu = ACTIVATIONS["gelu"](z)
    by_erf = z * 0.5 * (1 + torch.erf(z / math.sqrt(2)))  # z * Phi(z)
    torch.testing.assert_close(gelu, by_erf, atol=1e-6, rtol=0)
    assert round(gelu.min().item(), 2) == -0.17
    assert (F.gelu(z, approximate="tanh") - gelu).abs().max() < 1e-3


def test_ffn_equals_two_width_one_convolutions() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 48)
    conv_1, conv_2 = nn.Conv1d(16, 48, kernel_size=1), nn.Conv1d(48, 16, kernel_size=1)
    with torch.no_grad():
        conv_1.weight.copy_(ffn.w_1.weight.unsqueeze(-1))
        conv_1.bias.copy_(ffn.w_1.bias)
        conv_2.weight.copy_(ffn.w_2.weight.unsqueeze(-1))
        conv_2.bias.copy_(ffn.w_2.bias)
    x = randn(2, 9, 16)
    as_convolutions = conv_2(F.relu(conv_1(x.transpose(1, 2)))).transpose(1, 2)
    torch.testing.assert_close(ffn(x), as_convolutions, atol=1e-5, rtol=1e-5)


def test_ffn_is_position_wise() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 64)
    x = randn(2, 6, 16)
    out = ffn(x)
    per_position = torch.stack([ffn(x[:, t]) for t in range(6)], dim=1)
    torch.testing.assert_close(out, per_position, atol=1e-6, rtol=1e-5)
    changed = x.clone()
    changed[:, 2] += 1.0
    moved = (ffn(changed) - out).abs().amax(dim=-1) > 1e-6  # [2, 6]
    assert moved[:, 2].all() and not moved[:, [0, 1, 3, 4, 5]].any()


@pytest.mark.parametrize(("d_model", "d_ff"), [(512, 2048), (1024, 4096), (8, 3)])
def test_ffn_parameter_count(d_model: int, d_ff: int) -> None:
    ffn = PositionwiseFeedForward(d_model, d_ff)
    assert (
        sum(p.numel() for p in ffn.parameters()) == 2 * d_model * d_ff + d_ff + d_model
    )
    assert ffn.w_1.in_features == d_model and ffn.w_1.out_features == d_ff
    assert ffn.w_2.in_features == d_ff and ffn.w_2.out_features == d_model


def test_ffn_base_model_has_2099712_parameters() -> None:
    assert (
        sum(p.numel() for p in PositionwiseFeedForward(512, 2048).parameters())
        == 2_099_712
    )


def test_ffn_hidden_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 256, dropout=0.5)
    x = randn(4, 5, 16)
    hidden = F.relu(ffn.w_1(x))
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn.w_2(hidden))
    assert torch.equal(ffn(x), ffn(x))
    ffn.train()
    assert not torch.allclose(ffn(x), ffn.w_2(hidden))
    assert not torch.equal(ffn(x), ffn(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activation": "swish"}, "activation must be one of"),
        ({"activation": "ReLU"}, "activation must be one of"),
        ({"dropout": 1.0}, "dropout must be in"),
        ({"dropout": -0.1}, "dropout must be in"),
        ({"d_ff": 0}, "d_ff must be a positive int"),
        ({"d_model": 2.5}, "d_model must be a positive int"),
    ],
)
def test_ffn_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"d_model": 16, "d_ff": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        PositionwiseFeedForward(**args)


def test_ffn_width_mismatch_is_a_clear_error() -> None:
    ffn = PositionwiseFeedForward(16, 64)
    with pytest.raises(ValueError, match="d_model=16"):
        ffn(torch.randn(2, 5, 32))
    with pytest.raises(ValueError, match="d_model=16"):
        ffn(torch.tensor(1.0))


# --- Residual -------------------------------------------------------------------------


def test_residual_post_norm_formula() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 64)
    res = Residual(16)
    randomize_norm(res.norm, seed=1)
    x = randn(2, 5, 16)
    assert res.norm_first is False  # the paper's placement is the default
    expected = by_hand_layer_norm(x + ffn(x), res.norm)
    torch.testing.assert_close(res(x, ffn), expected, atol=1e-5, rtol=1e-5)


def test_residual_pre_norm_formula() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(16, 64)
    res = Residual(16, norm_first=True)
    randomize_norm(res.norm, seed=2)
    x = randn(2, 5, 16)
    expected = x + ffn(by_hand_layer_norm(x, res.norm))
    torch.testing.assert_close(res(x, ffn), expected, atol=1e-5, rtol=1e-5)


def test_residual_works_with_any_callable() -> None:
    res = Residual(8)
    x = randn(3, 8)
    zeros = res(x, torch.zeros_like)  # a sublayer that returns zeros: LayerNorm(x)
    torch.testing.assert_close(zeros, F.layer_norm(x, (8,)))
    pre = Residual(8, norm_first=True)
    assert torch.equal(pre(x, torch.zeros_like), x)  # pre-norm: x + 0


def test_residual_eps_is_the_layer_norms() -> None:
    res = Residual(8, eps=1e-3)
    assert res.norm.eps == 1e-3 and res.norm.normalized_shape == (8,)
    constant = torch.full((2, 8), 5.0)
    out = res(constant, torch.zeros_like)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, res.norm.bias.expand(2, 8))


def test_residual_dropout_off_in_eval_on_in_train() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(64, 256)
    res = Residual(64, dropout=0.25, norm_first=True)
    x = randn(8, 10, 64)
    branch = ffn(res.norm(x)).detach()

    res.eval()
    first, second = res(x, ffn), res(x, ffn)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, x + branch)

    res.train()
    # exactly the dropped-out branch, since pre-norm adds it to x
    dropped_out = res(x, ffn) - x
    zeroed = dropped_out == 0
    assert 0.2 < zeroed.float().mean().item() < 0.3
    torch.testing.assert_close(
        dropped_out[~zeroed], branch[~zeroed] / 0.75, atol=1e-5, rtol=1e-4
    )
    assert not torch.equal(res(x, ffn), res(x, ffn))


def test_residual_post_norm_dropout_is_applied_before_the_sum() -> None:
    torch.manual_seed(0)
    res = Residual(32, dropout=0.5)
    x = randn(4, 32)
    branch = randn(4, 32, seed=1)
    torch.manual_seed(3)
    out = res(x, lambda h: branch)
    torch.manual_seed(3)
    mask = F.dropout(torch.ones(4, 32), p=0.5, training=True)  # the same random draw
    torch.testing.assert_close(out, F.layer_norm(x + branch * mask, (32,)))


@pytest.mark.parametrize("norm_first", [False, True])
def test_residual_gradient_flows_through_both_paths(norm_first: bool) -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 32)
    res = Residual(8, norm_first=norm_first)
    x = randn(2, 3, 8).requires_grad_()
    res(x, ffn).pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in [*ffn.parameters(), *res.parameters()])


def test_pre_norm_skip_path_is_the_identity() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(6, 24)
    res = Residual(6, norm_first=True)
    x0 = randn(6)
    jac = torch.autograd.functional.jacobian(lambda t: res(t, ffn), x0)
    branch = torch.autograd.functional.jacobian(lambda t: ffn(res.norm(t)), x0)
    torch.testing.assert_close(jac - torch.eye(6), branch, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda res, x: res(x, lambda h: (h, None)), "must return one tensor"),
        (
            lambda res, x: res(x, lambda h: h.mean(dim=1, keepdim=True)),
            "keep the shape",
        ),
        (lambda res, x: res(x, lambda h: h[..., :4]), "keep the shape"),
        (lambda res, x: res(torch.randn(2, 5, 4), lambda h: h), "d_model=8"),
    ],
)
def test_residual_bad_calls(call, message: str) -> None:
    res = Residual(8)
    with pytest.raises(ValueError, match=message):
        call(res, randn(2, 5, 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"eps": 0.0}, "eps"),
        ({"d_model": 0}, "d_model"),
    ],
)
def test_residual_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Residual(**{"d_model": 8, **kwargs})


# --- LayerNorm vs BatchNorm on padded batches -----------------------------------------


def pad(sentences: list[torch.Tensor], length: int) -> torch.Tensor:
    batch = torch.zeros(len(sentences), length, sentences[0].size(-1))
    for i, s in enumerate(sentences):
        batch[i, : len(s)] = s
    return batch


def test_layer_norm_ignores_batch_mates_and_padding_batch_norm_does_not() -> None:
    a = randn(5, 8, seed=0)
    mates = [randn(3, 8, seed=1), randn(2, 8, seed=2)]
    other = [3 * randn(4, 8, seed=3) + 1, randn(1, 8, seed=4)]
    batches = [
        pad([a, *mates], 5),
        pad([a, *mates], 9),
        pad([a, *other], 5),
        pad([a], 5),
    ]

    # post-norm with a sublayer that returns zeros is a bare LayerNorm
    res = Residual(8)
    randomize_norm(res.norm, seed=5)
    ln_outputs = [res(b, torch.zeros_like)[0, :5] for b in batches]
    for out in ln_outputs[1:]:
        torch.testing.assert_close(out, ln_outputs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        ln_outputs[0], by_hand_layer_norm(a, res.norm), atol=1e-5, rtol=1e-5
    )

    bn = nn.BatchNorm1d(8)
    bn_outputs = [bn(b.transpose(1, 2)).transpose(1, 2)[0, :5] for b in batches]
    for out in bn_outputs[1:]:
        assert not torch.allclose(out, bn_outputs[0], atol=1e-4)


def test_layer_norm_does_not_leak_later_positions() -> None:
    x = randn(2, 5, 8)
    changed = x.clone()
    changed[0, 4] += 1.0
    res = Residual(8)
    delta = res(changed, torch.zeros_like) - res(x, torch.zeros_like)
    assert (delta[0, :4] == 0).all() and (delta[1] == 0).all()


# --- claims of the source documents (chapter 6, "What the documents say") -----------


def test_doc004_attention_not_linear() -> None:
    """Attention, the FFN and LayerNorm are not linear; attention is linear in V."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 2, bias=False)  # nothing affine to blame
    ffn = PositionwiseFeedForward(16, 64)
    nn.init.zeros_(ffn.w_1.bias)
    nn.init.zeros_(ffn.w_2.bias)
    sublayers = {  # name -> (f, whether f(2x) = 2f(x))
        "self-attention": (lambda t: attention(t)[0], False),  # 4x the scores
        "feed-forward": (ffn, True),  # ReLU respects positive scaling, not sums
        "LayerNorm": (nn.LayerNorm(16), False),
    }
    x, y = randn(2, 1, 6, 16)  # two inputs [1, seq, d_model]
    with torch.no_grad():
        for f, homogeneous in sublayers.values():
            assert not torch.allclose(f(2 * x + 3 * y), 2 * f(x) + 3 * f(y), atol=1e-4)
            assert torch.allclose(f(2 * x), 2 * f(x), atol=1e-4) == homogeneous
    q, k, v_1, v_2 = randn(4, 1, 6, 16, seed=1)  # fixed queries and keys: fixed weights

    def attend(v: torch.Tensor) -> torch.Tensor:
        return scaled_dot_product_attention(q, k, v)[0]

    torch.testing.assert_close(
        attend(2 * v_1 + 3 * v_2), 2 * attend(v_1) + 3 * attend(v_2), atol=1e-5, rtol=0
    )


def test_doc003_batch_norm_at_inference() -> None:
    """In evaluation mode BatchNorm normalizes one token; only training mode fails."""
    batch_norm, layer_norm = nn.BatchNorm1d(8), nn.LayerNorm(8)
    batch_norm(randn(4, 8, 5))  # a training batch updates the running statistics
    one_token = randn(1, 8, 1, seed=1)  # [batch=1, d, seq=1]
    batch_norm.eval()
    assert torch.isfinite(batch_norm(one_token)).all()
    batch_norm.train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        batch_norm(one_token)
    token = one_token.transpose(1, 2)  # [1, 1, d]
    assert torch.equal(layer_norm.train()(token), layer_norm.eval()(token))
