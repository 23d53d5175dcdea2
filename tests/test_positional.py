"""Tests of aiayn.positional (chapter 4).

The sinusoidal table and the two position modules.
"""

from __future__ import annotations

import math

import pytest
import torch

from aiayn.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_table,
)


def closed_form(max_len: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)) and PE(pos, 2i+1) = cos(...), per entry."""
    out = torch.empty(max_len, d_model, dtype=torch.float64)
    for pos in range(max_len):
        for dim in range(d_model):
            angle = pos / 10000 ** (2 * (dim // 2) / d_model)
            out[pos, dim] = math.sin(angle) if dim % 2 == 0 else math.cos(angle)
    return out


def shift_matrix(k: int, d_model: int) -> torch.Tensor:
    """Block-diagonal M_k with PE(pos + k) = M_k PE(pos), built without the package."""
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        theta = k / 10000 ** (2 * i / d_model)
        c, s = math.cos(theta), math.sin(theta)
        m[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]])
    return m


def test_table_matches_the_closed_form() -> None:
    reference = closed_form(60, 16)
    assert torch.allclose(
        sinusoidal_table(60, 16, dtype=torch.float64), reference, atol=1e-12
    )
    table32 = sinusoidal_table(60, 16)
    assert table32.dtype == torch.float32 and table32.shape == (60, 16)
    # rounded once from float64
    assert (table32.double() - reference).abs().max() <= 2**-25


def test_table_stays_exact_at_large_positions() -> None:
    # Position 4999: float32 arithmetic would be off by ~1e-4 here; the table is not.
    table = sinusoidal_table(5000, 8)
    angles = [4999 / 10000 ** (2 * i / 8) for i in range(4)]
    exact = torch.tensor(
        [f(a) for a in angles for f in (math.sin, math.cos)], dtype=torch.float64
    )
    assert torch.allclose(table[4999].double(), exact, atol=1e-7)


def test_table_is_bounded_and_has_constant_norm() -> None:
    table = sinusoidal_table(1000, 64, dtype=torch.float64)
    assert table.abs().max() <= 1.0
    # sqrt(d_model / 2)
    norm = torch.full((1000,), math.sqrt(32.0), dtype=torch.float64)
    assert torch.allclose(table.norm(dim=-1), norm)


def test_first_dimensions_have_the_highest_frequency() -> None:
    sines = sinusoidal_table(1000, 64, dtype=torch.float64)[:, 0::2]  # [1000, 32]
    sign_changes = (sines[:-1] * sines[1:] < 0).sum(dim=0)
    assert sign_changes[0] > 300 and sign_changes[-1] == 0
    assert bool((sign_changes[1:] <= sign_changes[:-1]).all())


@pytest.mark.parametrize("k", [1, 3, 17, 250])
def test_shift_by_k_is_a_fixed_rotation(k: int) -> None:
    table = sinusoidal_table(800, 32, dtype=torch.float64)
    m_k = shift_matrix(k, 32)
    for pos in (0, 5, 99, 500):
        assert torch.allclose(m_k @ table[pos], table[pos + k], atol=1e-10)
    assert torch.allclose(m_k.T @ m_k, torch.eye(32, dtype=torch.float64), atol=1e-12)


def test_dot_product_depends_only_on_the_offset() -> None:
    table = sinusoidal_table(200, 32, dtype=torch.float64)
    omega = torch.tensor(
        [10000 ** (-2 * i / 32) for i in range(16)], dtype=torch.float64
    )
    for k in (-7, 1, 2, 40):
        expected = torch.cos(k * omega).sum()
        for pos in (50, 80, 120):
            assert torch.allclose(table[pos] @ table[pos + k], expected, atol=1e-10)


def test_table_rejects_odd_width_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="even"):
        sinusoidal_table(10, 7)
    with pytest.raises(ValueError, match="even"):
        SinusoidalPositionalEncoding(d_model=7)
    with pytest.raises(ValueError, match="max_len"):
        sinusoidal_table(0, 8)


def test_sinusoidal_module_adds_the_table() -> None:
    torch.manual_seed(0)
    module = SinusoidalPositionalEncoding(d_model=16, max_len=50)
    x = torch.randn(3, 12, 16)
    out = module(x)
    assert out.shape == (3, 12, 16)
    assert torch.allclose(
        out - x, closed_form(12, 16).float().expand(3, 12, 16), atol=1e-6
    )


def test_sinusoidal_table_is_a_non_persistent_buffer() -> None:
    module = SinusoidalPositionalEncoding(d_model=16, max_len=50)
    assert list(module.parameters()) == []
    assert dict(module.named_buffers())["pe"].shape == (50, 16)
    assert "pe" not in module.state_dict()
    # Loading a state_dict saved with another max_len works: the table is not in it.
    module.load_state_dict(
        SinusoidalPositionalEncoding(d_model=16, max_len=10).state_dict()
    )


def test_buffer_moves_and_converts_with_the_module() -> None:
    assert (
        SinusoidalPositionalEncoding(16, max_len=20).to("meta").pe.device.type == "meta"
    )
    assert (
        SinusoidalPositionalEncoding(16, max_len=20).double().pe.dtype == torch.float64
    )
    if torch.cuda.is_available():
        module = SinusoidalPositionalEncoding(16, max_len=20).to("cuda")
        assert (
            module.pe.is_cuda and module(torch.randn(1, 5, 16, device="cuda")).is_cuda
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_embeddings_keep_their_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    modules = (
        SinusoidalPositionalEncoding(16, max_len=20),
        LearnedPositionalEmbedding(20, 16),
    )
    for module in modules:
        with torch.no_grad():
            out = module(x.to(dtype))
            assert out.dtype == dtype
            assert torch.allclose(out.float(), module(x), atol=0.05)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SinusoidalPositionalEncoding(d_model=16, max_len=30),
        lambda: LearnedPositionalEmbedding(max_len=30, d_model=16),
    ],
)
def test_offset_gives_the_encoding_of_later_positions(make) -> None:
    torch.manual_seed(0)
    module = make()
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        full = module(x)
        for t in range(9):
            assert torch.equal(module(x[:, t : t + 1], offset=t), full[:, t : t + 1])
        assert torch.equal(module(x[:, 4:], offset=4), full[:, 4:])
        # The last positions of the table are reachable, one past them is not.
        assert module(x[:, :2], offset=28).shape == (2, 2, 16)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SinusoidalPositionalEncoding(d_model=16, max_len=30),
        lambda: LearnedPositionalEmbedding(max_len=30, d_model=16),
    ],
)
def test_bad_inputs_raise_clear_value_errors(make) -> None:
    module = make()
    x = torch.randn(2, 9, 16)
    with pytest.raises(ValueError, match=r"length 40.*max_len=30.*max_len=40"):
        module(torch.randn(1, 40, 16))
    with pytest.raises(ValueError, match=r"positions 25\.\.33.*max_len=34"):
        module(x, offset=25)
    with pytest.raises(ValueError, match=r"\[batch, seq_len, d_model\]"):
        module(x[0])
    with pytest.raises(ValueError, match=r"\[batch, seq_len, d_model\]"):
        module(x[None])
    with pytest.raises(ValueError, match="d_model=16"):
        module(x[..., :8])
    with pytest.raises(ValueError, match="offset"):
        module(x, offset=-1)


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="dropout"):
        SinusoidalPositionalEncoding(16, dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        LearnedPositionalEmbedding(10, 16, dropout=-0.1)
    with pytest.raises(ValueError, match="at least 1"):
        LearnedPositionalEmbedding(0, 16)


def test_learned_embedding_parameters_and_gradients() -> None:
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(max_len=30, d_model=16)
    assert sum(p.numel() for p in module.parameters()) == 30 * 16
    assert list(module.state_dict()) == ["embedding.weight"]
    x = torch.randn(2, 5, 16)
    out = module(x, offset=3)
    assert out.shape == (2, 5, 16)
    assert torch.allclose(out, x + module.embedding.weight[3:8])
    out.sum().backward()
    used = module.embedding.weight.grad.abs().sum(-1) != 0  # [30]
    assert used.nonzero().flatten().tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "make",
    [
        lambda: SinusoidalPositionalEncoding(d_model=64, max_len=30, dropout=0.5),
        lambda: LearnedPositionalEmbedding(max_len=30, d_model=64, dropout=0.5),
    ],
)
def test_dropout_acts_in_training_only(make) -> None:
    torch.manual_seed(0)
    module = make()
    x = torch.randn(4, 20, 64)
    with torch.no_grad():
        train_out = module(x)
        module.eval()
        eval_out = module(x)
        assert torch.equal(module(x), eval_out)  # deterministic in eval mode
    zeroed = (train_out == 0).float().mean().item()
    assert 0.4 < zeroed < 0.6
    kept = train_out != 0
    assert torch.allclose(train_out[kept], 2 * eval_out[kept])


def test_table_matches_the_formula_at_the_papers_size() -> None:
    """Entries at d_model = 512, up to position 4999, as the paper writes PE."""
    table64 = sinusoidal_table(5000, 512, dtype=torch.float64)
    for pos in (0, 1, 2, 17, 999, 4999):
        for dim in range(0, 512, 37):
            angle = pos / 10000 ** (2 * (dim // 2) / 512)
            exact = math.sin(angle) if dim % 2 == 0 else math.cos(angle)
            assert abs(table64[pos, dim].item() - exact) < 1e-12
    rounding = (sinusoidal_table(5000, 512).double() - table64).abs().max()
    assert rounding <= 2**-25  # within half a float32 step


def test_an_unchecked_slice_fails_without_naming_positions() -> None:
    """The bare add of a too short table fails cryptically; the module says why."""
    long = torch.randn(1, 40, 16)
    with pytest.raises(RuntimeError) as bare:
        long + sinusoidal_table(30, 16)[: long.size(1)]
    assert "position" not in str(bare.value)
    with pytest.raises(ValueError, match="positions 0..39"):
        SinusoidalPositionalEncoding(16, max_len=30)(long)


# --- claims of the source documents (chapter 4, "What the documents say") -----------


def test_doc001_rotation_acts_on_the_column_vector() -> None:
    """R(k) PE(i) is PE(i + k); PE(i) as a row times R(k) is PE(i - k)."""
    table = sinusoidal_table(40, 32, dtype=torch.float64)
    i, k = 20, 5
    r_k = shift_matrix(k, 32)
    assert torch.allclose(r_k @ table[i], table[i + k])
    row = table[i] @ r_k  # PE(i)^T R(k)
    assert torch.allclose(row, table[i - k]) and not torch.allclose(row, table[i + k])


def test_a_plain_tensor_table_breaks_half_precision_where_a_buffer_does_not() -> None:
    """doc003 keeps the table as a plain attribute, which .to(dtype) leaves alone."""

    class PlainAttribute(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = sinusoidal_table(100, 16)  # a plain tensor, not a buffer
            self.first_layer = torch.nn.Linear(16, 8)

        def forward(self, emb: torch.Tensor) -> torch.Tensor:
            return self.first_layer(emb + self.table[: emb.size(1)])

    emb = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        PlainAttribute().to(torch.bfloat16)(emb)  # float32 sum into a bfloat16 layer
    buffered = torch.nn.Sequential(
        SinusoidalPositionalEncoding(16, 100), torch.nn.Linear(16, 8)
    ).to(torch.bfloat16)
    assert buffered(emb).dtype == torch.bfloat16


def test_doc004_worked_example_is_right_but_for_cos_0_02() -> None:
    """doc004's d_model = 4 example: only PE(2, 3) = cos(0.02) = 0.99980 is off."""
    claimed = torch.tensor(  # the document's vectors for positions 0, 1, 2
        [
            [0.000, 1.000, 0.000, 1.000],
            [0.841, 0.540, 0.010, 1.000],
            [0.909, -0.416, 0.020, 0.999],
        ],
        dtype=torch.float64,
    )
    table = sinusoidal_table(3, 4, dtype=torch.float64).round(decimals=3)
    assert ((table - claimed).abs() > 1e-9).nonzero().tolist() == [[2, 3]]
    assert f"{math.cos(0.02):.5f}" == "0.99980" and table[2, 3].item() == 1.0


def test_doc002_frequencies_without_the_minus_sign_alias() -> None:
    """doc002's 10000^(+2i/d): 28 of 32 pairs above pi, neighbours 0.096 apart."""
    two_i = torch.arange(0, 64, 2, dtype=torch.float64)  # [32]
    pos = torch.arange(128, dtype=torch.float64)[:, None]  # [128, 1]
    tables, factors = {}, {}
    for name, sign in (("paper", -1), ("doc002", 1)):
        factors[name] = torch.exp(sign * math.log(10000.0) * two_i / 64)  # [32]
        angles = pos * factors[name]  # [128, 32]
        tables[name] = torch.stack((angles.sin(), angles.cos()), -1).flatten(-2)
    paper = sinusoidal_table(128, 64, dtype=torch.float64)  # [128, 64]
    assert torch.allclose(tables["paper"], paper)
    assert round(factors["doc002"].max().item()) == 7499
    assert int((factors["doc002"] > math.pi).sum()) == 28

    def neighbours(table: torch.Tensor) -> float:
        unit = table / table.norm(dim=-1, keepdim=True)  # [128, 64]
        return round((unit[:-1] * unit[1:]).sum(-1).mean().item(), 3)

    assert neighbours(tables["paper"]) == 0.966
    assert neighbours(tables["doc002"]) == 0.096


def test_doc001_base_1000_shrinks_the_longest_wavelength() -> None:
    """doc001's 1000 for 10000: the longest wavelength 6,116 positions, not 60,611."""
    paper = sinusoidal_table(100, 512, dtype=torch.float64)
    with_1000 = sinusoidal_table(100, 512, base=1000.0, dtype=torch.float64)
    assert not torch.allclose(with_1000, paper)
    for table, longest in ((paper, 60_611), (with_1000, 6_116)):
        omega = math.atan2(table[1, -2], table[1, -1])  # the last pair's angle at 1
        assert round(2 * math.pi / omega) == longest


def test_doc001_no_offset_is_closer_than_a_neighbour() -> None:
    """doc001's 62,832 is no limit: up to 100,000, neighbours are the nearest pair."""
    two_i = torch.arange(0, 512, 2, dtype=torch.float64)  # [256]
    omega = torch.exp(-math.log(10000.0) * two_i / 512)  # [256]
    # ||PE(p) - PE(p + k)||^2 = d_model - 2 sum_i cos(w_i k), 10,000 offsets at a time
    distance = torch.cat(
        [
            (512 - 2 * torch.cos(ks[:, None] * omega).sum(-1)).sqrt()
            for ks in torch.arange(1, 100_001, dtype=torch.float64).split(10_000)
        ]
    )  # [100000]
    table = sinusoidal_table(2, 512, dtype=torch.float64)
    assert math.isclose(distance[0], (table[1] - table[0]).norm(), rel_tol=1e-12)
    assert distance.argmin().item() == 0 and round(distance[0].item(), 2) == 3.71
    assert round(distance[62_831].item(), 1) == 23.4
