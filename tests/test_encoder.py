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


# --- claims of the source documents (chapter 7, "What the documents say") -----------


class EncoderLayerAsInDoc002(nn.Module):
    """Doc 002's encoder layer, reduced: separate Q/K/V maps, heads in the batch."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.Wq, self.Wk, self.Wv, self.Wo = (
            nn.Linear(d_model, d_model) for _ in range(4)
        )
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)  # one module, three places

    def attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape

        def fold(t: torch.Tensor) -> torch.Tensor:  # [b, n, d] -> [b * h, n, d_k]
            return t.view(b, n, self.n_heads, self.d_k).transpose(1, 2).flatten(0, 1)

        q, k, v = fold(self.Wq(x)), fold(self.Wk(x)), fold(self.Wv(x))
        scores = (q @ k.transpose(-2, -1)) * self.d_k**-0.5  # [b * h, n, n]
        if mask is not None:  # documented as [batch, q_len, k_len], 1 = attend
            per_head = mask.unsqueeze(1).repeat(1, self.n_heads, 1, 1)  # [b, h, n, n]
            scores = scores.masked_fill(per_head.flatten(0, 1) == 0, float("-inf"))
        context = torch.softmax(scores, dim=-1) @ v  # [b * h, n, d_k]
        context = context.view(b, self.n_heads, n, self.d_k).transpose(1, 2)
        return self.Wo(context.reshape(b, n, -1))  # [b, n, d]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        hidden = self.dropout(torch.relu(self.fc1(x)))  # [b, n, d_ff]
        return self.norm2(x + self.dropout(self.fc2(hidden)))


def test_doc002_layer_is_ours_but_takes_three_axis_masks_only() -> None:
    """doc002's layer computes ours; the 4-axis padding mask fails in its repeat."""
    torch.manual_seed(0)
    ours = perturb(EncoderLayer(D_MODEL, N_HEADS, D_FF)).eval()
    doc = EncoderLayerAsInDoc002(D_MODEL, N_HEADS, D_FF).eval()
    # in_proj splits into W_q, W_k, W_v; the other weights come in the same order
    w, b = ours.self_attn.in_proj.weight.chunk(3), ours.self_attn.in_proj.bias.chunk(3)
    values = [w[0], b[0], w[1], b[1], w[2], b[2], *list(ours.state_dict().values())[2:]]
    doc.load_state_dict(dict(zip(doc.state_dict(), values)))
    x = source()
    with torch.no_grad():
        torch.testing.assert_close(doc(x), ours(x), atol=1e-5, rtol=1e-5)
        three_axes = PAD[:, 0]  # [batch, 1, src_len]
        torch.testing.assert_close(
            doc(x, three_axes), ours(x, PAD), atol=1e-5, rtol=1e-5
        )
        with pytest.raises(RuntimeError, match="repeat"):
            doc(x, PAD)  # [batch, 1, 1, src_len]


class EncoderLayerAsInDoc004(nn.Module):
    """Doc 004's encoder layer: it builds on two classes the document never defines."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)  # here: chapter 3's
        self.norm1, self.dropout1 = nn.LayerNorm(d_model), nn.Dropout(dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)  # noqa: F821 (defined nowhere)
        self.norm2, self.dropout2 = nn.LayerNorm(d_model), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        attended = self.self_attn(x, x, x, mask)  # query, key, value, mask -> output
        x = self.norm1(x + self.dropout1(attended))
        return self.norm2(x + self.dropout2(self.ffn(x)))


class AttentionAsDoc004Calls(nn.Module):
    """(query, key, value, mask) -> output only: the interface doc 004's layer calls."""

    def __init__(self, attention: MultiHeadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, query, key, value, mask=None) -> torch.Tensor:
        return self.attention(query, key_value=value, mask=mask)[0]  # key is value


def test_doc004_layer_builds_on_classes_it_never_defines(monkeypatch) -> None:
    """doc004's layer stops at FeedForward; completed, it is our post-norm layer."""
    with pytest.raises(NameError, match="name 'FeedForward' is not defined"):
        EncoderLayerAsInDoc004(D_MODEL, N_HEADS, D_FF, 0.1)
    monkeypatch.setitem(globals(), "FeedForward", PositionwiseFeedForward)
    doc = EncoderLayerAsInDoc004(D_MODEL, N_HEADS, D_FF, 0.1).eval()
    x = source()
    with pytest.raises(ValueError, match="mask must be"):  # x arrives as the mask
        doc(x, PAD)
    torch.manual_seed(0)
    ours = perturb(EncoderLayer(D_MODEL, N_HEADS, D_FF)).eval()
    doc.self_attn, doc.ffn = AttentionAsDoc004Calls(ours.self_attn), ours.ffn
    doc.norm1.load_state_dict(ours.res_attn.norm.state_dict())
    doc.norm2.load_state_dict(ours.res_ffn.norm.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(doc(x, PAD), ours(x, PAD), atol=1e-5, rtol=1e-5)


class EncoderBlockAsInDoc003(nn.Module):
    """Doc 003's encoder block, reduced: packed Q/K/V, Sequential FFN, no mask."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        # nn.Linear keeps its bias by default, and the document does not switch it off
        self.W_qkv = nn.Linear(d_model, 3 * d_model)
        self.W_o = nn.Linear(d_model, d_model)
        expand, shrink = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.ffn = nn.Sequential(expand, nn.ReLU(), nn.Dropout(dropout), shrink)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.n_heads, self.dropout = n_heads, nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.W_qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x [b, h, n, d_k]
        weights = torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1)
        return self.W_o((weights @ v).transpose(1, 2).reshape(b, n, d))  # [b, n, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # no mask: padding is attended
        x = self.norm1(x + self.dropout(self.attention(x)))
        return self.norm2(x + self.dropout(self.ffn(x)))


def test_doc003_block_table_misses_the_attention_biases() -> None:
    """doc003's rows are right but sum to 3,150,336; its block has 3,152,384."""

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    base = EncoderLayer(512, 8, 2048)
    params = dict(base.named_parameters())
    doc003_rows = [  # the document's table: its count, our parameters of that row
        (786_432, ["self_attn.in_proj.weight"]),  # W^Q, W^K, W^V
        (262_144, ["self_attn.out_proj.weight"]),  # W^O
        (1_048_576, ["ffn.w_1.weight"]),
        (1_048_576, ["ffn.w_2.weight"]),
        (2_560, ["ffn.w_1.bias", "ffn.w_2.bias"]),
        (1_024, ["res_attn.norm.weight", "res_attn.norm.bias"]),
        (1_024, ["res_ffn.norm.weight", "res_ffn.norm.bias"]),
    ]
    for claimed, names in doc003_rows:
        assert sum(params[name].numel() for name in names) == claimed
    table = sum(claimed for claimed, _ in doc003_rows)
    missing = sum(params[f"self_attn.{n}_proj.bias"].numel() for n in ("in", "out"))
    assert table == 3_150_336 and missing == 4 * 512 == 2_048
    block = EncoderBlockAsInDoc003(512, 8, 2048)
    assert count(block) == count(base) == table + missing == 3_152_384
    assert table == count(base.self_attn) + count(base.ffn)  # LayerNorms: 2 * 1,024
    assert (6 * count(base), 6 * table) == (18_914_304, 18_902_016)
    assert round(count(base) / 1e6, 2) == round(table / 1e6, 2) == 3.15
    assert round(6 * count(base) / 1e6, 1) == round(6 * table / 1e6, 1) == 18.9
    assert round(count(base.ffn) / count(base), 2) == round(2 / 3, 2)  # two thirds


def test_doc003_block_computes_our_layer() -> None:
    """With our weights copied in, doc003's block computes our post-norm layer."""
    torch.manual_seed(0)
    ours = perturb(EncoderLayer(D_MODEL, N_HEADS, D_FF)).eval()
    block = EncoderBlockAsInDoc003(D_MODEL, N_HEADS, D_FF).eval()
    # the block registers its weights in the order of this chapter's layer
    block.load_state_dict(dict(zip(block.state_dict(), ours.state_dict().values())))
    x = source()
    with torch.no_grad():
        torch.testing.assert_close(block(x), ours(x), atol=1e-5, rtol=1e-5)
