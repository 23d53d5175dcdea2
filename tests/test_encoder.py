"""Tests of aiayn.encoder (chapter 7): EncoderLayer and Encoder."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.autograd.functional import jacobian

from aiayn.encoder import Encoder, EncoderLayer
from aiayn.masks import padding_mask
from aiayn.multi_head import MultiHeadAttention
from aiayn.sublayers import PositionwiseFeedForward, Residual

D_MODEL, N_HEADS, D_FF = 32, 4, 64
# 0 = padding
TOKENS = torch.tensor([[5, 3, 8, 2, 9, 4], [7, 1, 6, 0, 0, 0], [2, 2, 0, 0, 0, 0]])
PAD = padding_mask(TOKENS, 0)  # ours, True = real token: [3, 1, 1, 6]
KEY_PADDING = TOKENS == 0  # PyTorch's, True = padding: [3, 6]
REAL = PAD[:, 0, 0, :]  # [3, 6]

TORCH_NAMES = {  # our parameter names -> torch.nn.TransformerEncoderLayer's
    "self_attn.in_proj.weight": "self_attn.in_proj_weight",
    "self_attn.in_proj.bias": "self_attn.in_proj_bias",
    "self_attn.out_proj.weight": "self_attn.out_proj.weight",
    "self_attn.out_proj.bias": "self_attn.out_proj.bias",
    "ffn.w_1.weight": "linear1.weight",
    "ffn.w_1.bias": "linear1.bias",
    "ffn.w_2.weight": "linear2.weight",
    "ffn.w_2.bias": "linear2.bias",
    "res_attn.norm.weight": "norm1.weight",
    "res_attn.norm.bias": "norm1.bias",
    "res_ffn.norm.weight": "norm2.weight",
    "res_ffn.norm.bias": "norm2.bias",
}


def perturb(module: nn.Module, seed: int = 0) -> nn.Module:
    """Add noise to every parameter, so that no LayerNorm gain is 1 and no bias 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return module


def to_torch(layer: EncoderLayer) -> dict[str, torch.Tensor]:
    """Our layer's state dict under torch.nn.TransformerEncoderLayer's names."""
    return {TORCH_NAMES[name]: value for name, value in layer.state_dict().items()}


def source(batch: int = 3, src_len: int = 6, seed: int = 1) -> torch.Tensor:
    """Random embedded source vectors [batch, src_len, d_model]."""
    return torch.randn(
        batch, src_len, D_MODEL, generator=torch.Generator().manual_seed(seed)
    )


def test_structure_and_attributes() -> None:
    layer = EncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.2)
    assert (
        isinstance(layer.self_attn, MultiHeadAttention)
        and layer.self_attn.dropout == 0.2
    )
    assert isinstance(layer.ffn, PositionwiseFeedForward) and layer.ffn.dropout.p == 0.2
    assert isinstance(layer.res_attn, Residual) and isinstance(layer.res_ffn, Residual)
    assert layer.res_attn.dropout.p == layer.res_ffn.dropout.p == 0.2
    assert not layer.res_attn.norm_first and not layer.res_ffn.norm_first
    assert sorted(layer.state_dict()) == sorted(TORCH_NAMES)
    encoder = Encoder(3, D_MODEL, N_HEADS, D_FF)
    assert isinstance(encoder.layers, nn.ModuleList) and len(encoder.layers) == 3
    assert all(isinstance(m, EncoderLayer) for m in encoder.layers)
    # every layer has its own weights
    assert (
        encoder.layers[0].ffn.w_1.weight.data_ptr()
        != encoder.layers[1].ffn.w_1.weight.data_ptr()
    )


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_layer_parity_with_torch(norm_first: bool, masked: bool) -> None:
    torch.manual_seed(0)
    ours = perturb(
        EncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.1, norm_first=norm_first)
    ).eval()
    theirs = nn.TransformerEncoderLayer(
        D_MODEL,
        N_HEADS,
        D_FF,
        dropout=0.1,
        activation="relu",
        batch_first=True,
        norm_first=norm_first,
    ).eval()
    theirs.load_state_dict(to_torch(ours))
    x = source()
    mask, kpm = (PAD, KEY_PADDING) if masked else (None, None)
    with torch.no_grad():  # PyTorch's fast path
        out = ours(x, mask)
        fast = theirs(x, src_key_padding_mask=kpm)
    # autograd on: PyTorch's ordinary path
    slow = theirs(x, src_key_padding_mask=kpm).detach()
    assert out.shape == x.shape
    torch.testing.assert_close(out, fast, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_stack_parity_with_torch_on_real_positions(norm_first: bool) -> None:
    torch.manual_seed(0)
    ours = perturb(
        Encoder(3, D_MODEL, N_HEADS, D_FF, norm_first=norm_first, final_norm=True)
    ).eval()
    template = nn.TransformerEncoderLayer(
        D_MODEL, N_HEADS, D_FF, batch_first=True, norm_first=norm_first
    )
    theirs = nn.TransformerEncoder(
        template,
        num_layers=3,
        norm=nn.LayerNorm(D_MODEL),
        enable_nested_tensor=not norm_first,
    ).eval()
    for our_layer, their_layer in zip(ours.layers, theirs.layers):
        their_layer.load_state_dict(to_torch(our_layer))
    theirs.norm.load_state_dict(ours.norm.state_dict())
    x = source()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
        with torch.no_grad():
            out = ours(x, PAD)
            fast = theirs(x, src_key_padding_mask=KEY_PADDING)
            plain_ours, plain_theirs = ours(x), theirs(x)
    torch.testing.assert_close(out[REAL], fast[REAL], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain_ours, plain_theirs, atol=1e-5, rtol=1e-5)
    # nested-tensor fast path: padded rows are zeros, then LayerNorm -> its bias
    if not norm_first:
        torch.testing.assert_close(fast[~REAL], theirs.norm.bias.expand_as(fast[~REAL]))
    else:  # no fast path for pre-norm layers: the padded positions agree as well
        torch.testing.assert_close(out, fast, atol=1e-5, rtol=1e-5)
    slow = theirs(x, src_key_padding_mask=KEY_PADDING).detach()
    torch.testing.assert_close(out, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_does_not_change_real_tokens(norm_first: bool) -> None:
    torch.manual_seed(0)
    encoder = perturb(Encoder(2, D_MODEL, N_HEADS, D_FF, norm_first=norm_first)).eval()
    x = source()
    with torch.no_grad():
        batched = encoder(x, PAD)  # [3, 6, d_model]
        for row in range(3):
            n_real = int(REAL[row].sum())
            # the sentence without its padding
            alone = encoder(x[row : row + 1, :n_real])
            torch.testing.assert_close(
                batched[row, :n_real], alone[0], atol=1e-5, rtol=1e-5
            )
        # other padding values at the padded positions change nothing at the real ones
        noisy = x.clone()
        noisy[~REAL] = 100.0 * torch.randn(int((~REAL).sum()), D_MODEL)
        torch.testing.assert_close(
            encoder(noisy, PAD)[REAL], batched[REAL], atol=1e-5, rtol=1e-5
        )
        unmasked = encoder(x)
    assert torch.isfinite(batched).all()
    # without the mask they differ
    assert not torch.allclose(unmasked[1, :3], batched[1, :3], atol=1e-3)


def test_gradient_reaches_only_real_inputs() -> None:
    torch.manual_seed(0)
    encoder = Encoder(2, D_MODEL, N_HEADS, D_FF).eval()
    x = source().requires_grad_(True)
    # weighted: a sum alone would be constant after a LayerNorm with unit gain
    weights = torch.randn(D_MODEL, generator=torch.Generator().manual_seed(2))
    (encoder(x, PAD)[REAL] @ weights).sum().backward()
    assert (x.grad[~REAL] == 0).all()
    assert (x.grad[REAL].abs().sum(-1) > 0).all()


def test_permutation_equivariance() -> None:
    torch.manual_seed(0)
    encoder = Encoder(2, D_MODEL, N_HEADS, D_FF).eval()
    x = source()
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        torch.testing.assert_close(
            encoder(x[:, perm]), encoder(x)[:, perm], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            encoder(x[:, perm], PAD[..., perm]),
            encoder(x, PAD)[:, perm],
            atol=1e-5,
            rtol=1e-5,
        )


def test_parameter_counts() -> None:
    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    base = EncoderLayer(512, 8, 2048)
    assert count(base) == 3_152_384
    assert count(base.self_attn) == 4 * 512 * 512 + 4 * 512
    assert count(base.ffn) == 2 * 512 * 2048 + 2048 + 512
    assert count(base) == count(
        nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    )
    assert count(Encoder(6, 512, 8, 2048)) == 6 * 3_152_384 == 18_914_304
    assert count(Encoder(6, 512, 8, 2048, norm_first=True)) == 18_914_304 + 1_024
    assert count(EncoderLayer(1024, 16, 4096)) == 12_596_224


@pytest.mark.parametrize(
    ("norm_first", "final_norm", "expected"),
    [
        (False, None, False),
        (True, None, True),
        (False, True, True),
        (True, False, False),
        (False, False, False),
    ],
)
def test_final_norm_default(
    norm_first: bool, final_norm: bool | None, expected: bool
) -> None:
    encoder = Encoder(
        2,
        D_MODEL,
        N_HEADS,
        D_FF,
        norm_first=norm_first,
        final_norm=final_norm,
        eps=1e-6,
    )
    assert (encoder.norm is not None) == expected
    if expected:
        assert isinstance(encoder.norm, nn.LayerNorm) and encoder.norm.eps == 1e-6
    assert all(layer.norm_first == norm_first for layer in encoder.layers)


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    encoder = Encoder(2, D_MODEL, N_HEADS, D_FF, dropout=0.3)
    x = source()
    encoder.train()
    assert not torch.allclose(encoder(x, PAD), encoder(x, PAD))
    encoder.eval()
    with torch.no_grad():
        assert torch.equal(encoder(x, PAD), encoder(x, PAD))
    no_dropout = Encoder(2, D_MODEL, N_HEADS, D_FF, dropout=0.0)
    no_dropout.load_state_dict(encoder.state_dict())
    no_dropout.train()
    with torch.no_grad():
        torch.testing.assert_close(no_dropout(x, PAD), encoder(x, PAD))


def test_gelu_activation_matches_torch() -> None:
    torch.manual_seed(0)
    ours = perturb(EncoderLayer(D_MODEL, N_HEADS, D_FF, activation="gelu")).eval()
    theirs = nn.TransformerEncoderLayer(
        D_MODEL, N_HEADS, D_FF, activation="gelu", batch_first=True
    ).eval()
    theirs.load_state_dict(to_torch(ours))
    x = source()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(x, PAD),
            theirs(x, src_key_padding_mask=KEY_PADDING),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Encoder(0, D_MODEL, N_HEADS, D_FF), "n_layers"),
        (lambda: Encoder(2.0, D_MODEL, N_HEADS, D_FF), "n_layers"),
        (lambda: Encoder(True, D_MODEL, N_HEADS, D_FF), "n_layers"),
        (lambda: EncoderLayer(D_MODEL, 5, D_FF), "divisible"),
        (lambda: EncoderLayer(0, N_HEADS, D_FF), "positive"),
        (lambda: EncoderLayer(D_MODEL, N_HEADS, 0), "d_ff"),
        (lambda: EncoderLayer(D_MODEL, N_HEADS, D_FF, activation="tanh"), "activation"),
        (lambda: EncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=1.0), "dropout"),
        (lambda: EncoderLayer(D_MODEL, N_HEADS, D_FF, eps=0.0), "eps"),
    ],
)
def test_bad_sizes(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("module", ["layer", "stack"])
def test_bad_inputs(module: str) -> None:
    net = (
        EncoderLayer(D_MODEL, N_HEADS, D_FF)
        if module == "layer"
        else Encoder(2, D_MODEL, N_HEADS, D_FF)
    )
    x = source()
    with pytest.raises(ValueError, match=r"\[batch, src_len, d_model\]"):
        net(TOKENS)  # token ids, not vectors
    with pytest.raises(ValueError, match="unsqueeze"):
        net(x[0])  # one sentence without its batch axis
    with pytest.raises(ValueError, match="d_model=32"):
        net(torch.randn(3, 6, 16))
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        net(x, KEY_PADDING)  # PyTorch's convention and shape
    with pytest.raises(ValueError, match="torch.bool"):
        net(x, PAD.float())
    with pytest.raises(ValueError, match="broadcast"):
        net(x, PAD[..., :5])
    with pytest.raises(ValueError, match="mask"):
        net(x, PAD[:, 0])  # [batch, 1, src_len]: three axes


def test_jacobian_blocks_show_where_positions_mix() -> None:
    """The FFN sublayer mixes no positions, one layer all, and padding reaches none."""
    torch.manual_seed(0)
    layer, stack = EncoderLayer(16, 4, 32).eval(), Encoder(2, 16, 4, 32).eval()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))  # [n, d]
    mask = padding_mask(torch.tensor([[3, 9, 4, 7, 0, 0]]), 0)  # the last two padded

    def block_norms(f) -> torch.Tensor:
        """||dy_i/dx_j|| for every output position i and input position j: [n, n]."""
        return jacobian(f, x, vectorize=True).pow(2).sum(dim=(1, 3)).sqrt()

    ffn = block_norms(lambda t: layer.res_ffn(t, layer.ffn))
    diagonal = torch.eye(6, dtype=torch.bool)
    assert (ffn[~diagonal] == 0).all() and (ffn[diagonal] > 0).all()
    assert (block_norms(lambda t: layer(t[None])[0]) > 0).all()
    padded = block_norms(lambda t: stack(t[None], mask)[0])
    assert (padded[:4, 4:] == 0).all()  # real outputs ignore the padded inputs
    assert (padded[:4, :4] > 0).all() and (padded[4:, :4] > 0).all()


def test_the_defaults_build_the_papers_encoder() -> None:
    """Encoder(6, 512, 8, 2048) has the paper's d_k = 64, P_drop = 0.1 and post-norm."""
    encoder = Encoder(n_layers=6, d_model=512, n_heads=8, d_ff=2048)
    first = encoder.layers[0]
    assert len(encoder.layers) == 6 and encoder.norm is None
    assert (first.d_model, first.self_attn.n_heads, first.self_attn.d_k) == (512, 8, 64)
    assert first.ffn.d_ff == 4 * 512 and first.ffn.activation == "relu"
    assert first.res_attn.dropout.p == first.res_ffn.dropout.p == 0.1
    assert not first.norm_first
