"""Tests of aiayn.embedding (chapter 5): embeddings, prediction head, weight sharing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.embedding import PredictionHead, TokenEmbedding, tie_weights


def shared_model(
    vocab_size: int = 50, d_model: int = 16, pad_id: int | None = 0
) -> nn.ModuleDict:
    """Source and target embeddings and a head sharing one matrix."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "src_embed": TokenEmbedding(vocab_size, d_model, pad_id=pad_id),
            "tgt_embed": TokenEmbedding(vocab_size, d_model, pad_id=pad_id),
            "head": PredictionHead(d_model, vocab_size),
        }
    )
    tie_weights(model["head"], model["src_embed"], model["tgt_embed"])
    return model


def is_shared(model: nn.ModuleDict) -> bool:
    return (
        model["src_embed"].weight is model["tgt_embed"].weight is model["head"].weight
    )


# --- TokenEmbedding -------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [1, 16, 512])
def test_embedding_is_the_row_times_sqrt_d_model_exactly(d_model: int) -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(30, d_model)
    tokens = torch.randint(30, (3, 7))
    out = embed(tokens)
    assert out.shape == (3, 7, d_model)
    assert embed.scale == math.sqrt(d_model)
    assert torch.equal(out, embed.weight[tokens] * math.sqrt(d_model))
    # Independently of the module: row t of the table, looked up by hand.
    manual = torch.stack(
        [torch.stack([embed.weight[t] for t in row]) for row in tokens.tolist()]
    )
    assert torch.allclose(out, manual * math.sqrt(d_model), rtol=0, atol=0)


def test_initialisation_gives_unit_scale_embeddings() -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(5000, 256)
    assert abs(embed.weight.std().item() - 256**-0.5) < 0.002
    out = embed(torch.arange(5000).view(50, 100))
    assert abs(out.pow(2).mean().sqrt().item() - 1.0) < 0.02


def test_pad_row_is_zero_and_gets_no_gradient() -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(20, 8, pad_id=3)
    assert torch.equal(embed.weight[3], torch.zeros(8))
    tokens = torch.tensor([[1, 3, 5, 3], [3, 3, 2, 1]])
    out = embed(tokens)
    assert torch.equal(out[tokens == 3], torch.zeros(4, 8))
    (out * torch.randn_like(out)).sum().backward()
    grad = embed.weight.grad
    assert torch.equal(grad[3], torch.zeros(8))
    # the real tokens' rows do get gradient
    assert (grad[[1, 2, 5]].abs().sum(-1) > 0).all()
    assert torch.equal(grad[[0, 4, 6]], torch.zeros(3, 8))  # unused rows get none


def test_reset_parameters_zeroes_the_pad_row_again() -> None:
    embed = TokenEmbedding(20, 8, pad_id=0)
    with torch.no_grad():
        embed.weight.fill_(1.0)
    embed.reset_parameters()
    assert torch.equal(embed.weight[0], torch.zeros(8))
    assert embed.weight[1:].abs().sum() > 0


def test_no_pad_id_means_no_special_row() -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(20, 8)
    assert embed.pad_id is None
    assert embed.weight[0].abs().sum() > 0
    embed(torch.tensor([[0, 0]])).sum().backward()
    assert embed.weight.grad[0].abs().sum() > 0


def test_matches_nn_embedding_with_padding_idx() -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(40, 12, pad_id=1)
    reference = nn.Embedding(40, 12, padding_idx=1)
    with torch.no_grad():
        reference.weight.copy_(embed.weight)
    tokens = torch.randint(40, (4, 9))
    tokens[:, -2:] = 1
    assert torch.equal(embed(tokens), reference(tokens) * math.sqrt(12))
    embed(tokens).sum().backward()
    reference(tokens).sum().backward()
    assert torch.allclose(embed.weight.grad, reference.weight.grad * math.sqrt(12))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_integer_dtypes_are_accepted(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(50, 8)
    tokens = torch.randint(50, (2, 6))
    assert torch.equal(embed(tokens.to(dtype)), embed(tokens))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.float64, torch.bool]
)
def test_non_integer_tokens_are_rejected(dtype: torch.dtype) -> None:
    embed = TokenEmbedding(50, 8)
    with pytest.raises(ValueError, match=rf"dtype {dtype}.*tokens\.long\(\)"):
        embed(torch.ones(2, 3, dtype=dtype))


@pytest.mark.parametrize(
    ("ids", "low", "high"),
    [([[1, 2, 50]], 1, 50), ([[0, -1, 3]], -1, 3), ([[-100, 7], [2, 99]], -100, 99)],
)
def test_out_of_range_ids_are_rejected_with_their_min_and_max(
    ids, low: int, high: int
) -> None:
    embed = TokenEmbedding(50, 8)
    with pytest.raises(ValueError, match=rf"\[0, 50\), got ids from {low} to {high}"):
        embed(torch.tensor(ids))


def test_negative_ids_mention_ignore_index() -> None:
    with pytest.raises(ValueError, match="ignore_index"):
        TokenEmbedding(50, 8)(torch.tensor([[-100, 1]]))


def test_boundary_ids_are_accepted() -> None:
    embed = TokenEmbedding(50, 8)
    assert embed(torch.tensor([[0, 49]])).shape == (1, 2, 8)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_wrong_rank_is_rejected(shape: tuple[int, ...]) -> None:
    embed = TokenEmbedding(50, 8)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        embed(torch.zeros(shape, dtype=torch.long))


def test_non_tensor_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="tensor of token ids"):
        TokenEmbedding(50, 8)([[1, 2, 3]])


def test_empty_batch_is_allowed() -> None:
    out = TokenEmbedding(50, 8)(torch.zeros(0, 5, dtype=torch.long))
    assert out.shape == (0, 5, 8)


@pytest.mark.parametrize(
    ("vocab_size", "d_model", "pad_id"),
    [(0, 8, None), (10, 0, None), (10, 8, 10), (10, 8, -1)],
)
def test_bad_constructor_arguments(
    vocab_size: int, d_model: int, pad_id: int | None
) -> None:
    with pytest.raises(ValueError):
        TokenEmbedding(vocab_size, d_model, pad_id=pad_id)


def test_half_precision_embedding() -> None:
    embed = TokenEmbedding(50, 8).to(torch.bfloat16)
    out = embed(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16


# --- PredictionHead -------------------------------------------------------------------


def test_head_shapes_and_formula() -> None:
    torch.manual_seed(0)
    head = PredictionHead(16, 100)
    x = torch.randn(3, 5, 16)
    logits = head(x)
    assert logits.shape == (3, 5, 100)
    assert torch.allclose(logits, x @ head.weight.T, atol=1e-6)
    assert head(x[:, -1]).shape == (3, 100)  # one position per sequence, for decoding
    assert head(x[0, 0]).shape == (100,)
    assert head.weight.shape == (100, 16) and head.bias is None


def test_head_bias_option_and_parameter_count() -> None:
    without = PredictionHead(512, 37000)
    with_bias = PredictionHead(512, 37000, bias=True)
    assert sum(p.numel() for p in without.parameters()) == 37000 * 512
    assert sum(p.numel() for p in with_bias.parameters()) == 37000 * 512 + 37000
    assert torch.equal(with_bias.bias, torch.zeros(37000))
    x = torch.randn(2, 512)
    with torch.no_grad():
        with_bias.weight.copy_(without.weight)
        with_bias.bias.fill_(0.5)
    assert torch.allclose(with_bias(x), without(x) + 0.5, atol=1e-5)
    assert "bias" not in without.state_dict() and "bias" in with_bias.state_dict()


def test_head_logits_are_order_one_at_initialisation() -> None:
    torch.manual_seed(0)
    head = PredictionHead(512, 5000)
    y = F.layer_norm(torch.randn(64, 512), (512,))
    with torch.no_grad():
        logits = head(y)
        loss = F.cross_entropy(logits, torch.randint(5000, (64,)))
    assert abs(logits.std().item() - 1.0) < 0.05
    assert abs(loss.item() - (math.log(5000) + 0.5)) < 0.5


def test_head_rejects_wrong_width_and_integer_input() -> None:
    head = PredictionHead(16, 100)
    with pytest.raises(ValueError, match="d_model=16"):
        head(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="TokenEmbedding"):
        head(torch.ones(2, 16, dtype=torch.long))


# --- tie_weights ----------------------------------------------------------------------


def test_tying_shares_one_parameter() -> None:
    model = shared_model()
    assert is_shared(model)
    assert len(list(model.parameters())) == 1
    assert model["src_embed"].weight.data_ptr() == model["head"].weight.data_ptr()


def test_tie_weights_returns_the_heads_parameter() -> None:
    head, embed = PredictionHead(8, 30), TokenEmbedding(30, 8)
    original = head.weight
    shared = tie_weights(head, embed)
    assert shared is original is head.weight is embed.weight


@pytest.mark.parametrize(("vocab_size", "d_model"), [(37000, 512), (1000, 64)])
def test_parameter_count_drops_by_vocab_times_d_model_per_tied_copy(
    vocab_size: int, d_model: int
) -> None:
    def build(n_tied: int) -> nn.ModuleDict:
        with torch.device("meta"):
            model = nn.ModuleDict(
                {
                    "src_embed": TokenEmbedding(vocab_size, d_model),
                    "tgt_embed": TokenEmbedding(vocab_size, d_model),
                    "head": PredictionHead(d_model, vocab_size),
                }
            )
        if n_tied:
            tie_weights(
                model["head"], *[model["tgt_embed"], model["src_embed"]][:n_tied]
            )
        return model

    counts = [sum(p.numel() for p in build(n).parameters()) for n in (0, 1, 2)]
    assert counts[0] == 3 * vocab_size * d_model
    assert counts[0] - counts[1] == vocab_size * d_model
    assert counts[1] - counts[2] == vocab_size * d_model
    if (vocab_size, d_model) == (37000, 512):
        assert counts[0] - counts[1] == 18_944_000


def test_tie_weights_zeroes_the_pad_rows() -> None:
    torch.manual_seed(0)
    head = PredictionHead(8, 30)
    assert head.weight[2].abs().sum() > 0
    tie_weights(
        head, TokenEmbedding(30, 8, pad_id=2), nn.Embedding(30, 8, padding_idx=5)
    )
    assert torch.equal(head.weight[2], torch.zeros(8))
    assert torch.equal(head.weight[5], torch.zeros(8))


def test_tie_weights_works_with_torch_modules() -> None:
    linear, embedding = nn.Linear(8, 30, bias=False), nn.Embedding(30, 8)
    tie_weights(linear, embedding)
    assert embedding.weight is linear.weight


def test_gradients_from_every_use_accumulate_in_the_shared_matrix() -> None:
    model = shared_model(vocab_size=20, d_model=8)
    separate = nn.ModuleDict(
        {
            "src_embed": TokenEmbedding(20, 8, pad_id=0),
            "tgt_embed": TokenEmbedding(20, 8, pad_id=0),
            "head": PredictionHead(8, 20),
        }
    )
    with torch.no_grad():
        for module in separate.values():
            module.weight.copy_(model["head"].weight)
    src, tgt_in, tgt_out = (
        torch.tensor([[1, 2, 3, 0]]),
        torch.tensor([[4, 5, 6]]),
        torch.tensor([[5, 6, 7]]),
    )

    def loss(m: nn.ModuleDict) -> torch.Tensor:
        context = m["src_embed"](src).mean(dim=1, keepdim=True)  # [1, 1, d]
        logits = m["head"](m["tgt_embed"](tgt_in) + context)  # [1, 3, V]
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())

    loss(model).backward()
    loss(separate).backward()
    grads = {name: module.weight.grad for name, module in separate.items()}
    shared_grad = model["head"].weight.grad
    assert torch.allclose(
        shared_grad, grads["src_embed"] + grads["tgt_embed"] + grads["head"], atol=1e-6
    )
    # Each use contributes: the sum differs from every single part.
    for grad in grads.values():
        assert not torch.allclose(shared_grad, grad)
    # The pad row gets gradient only from the head.
    assert torch.equal(grads["src_embed"][0], torch.zeros(8))
    assert torch.allclose(shared_grad[0], grads["head"][0])


def test_one_optimizer_step_updates_all_three_uses() -> None:
    model = shared_model(vocab_size=20, d_model=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model["head"].weight.detach().clone()
    logits = model["head"](model["tgt_embed"](torch.tensor([[1, 2]])))
    F.cross_entropy(logits.flatten(0, 1), torch.tensor([2, 3])).backward()
    optimizer.step()
    assert not torch.equal(model["head"].weight, before)
    assert is_shared(model)
    assert torch.equal(model["src_embed"].weight, model["head"].weight)


def test_tie_weights_rejects_mismatched_shapes_and_missing_embeddings() -> None:
    head = PredictionHead(8, 30)
    with pytest.raises(ValueError, match=r"\[31, 8\].*\[30, 8\]"):
        tie_weights(head, TokenEmbedding(31, 8))
    with pytest.raises(ValueError, match=r"\[30, 16\]"):
        tie_weights(head, TokenEmbedding(30, 16))
    with pytest.raises(ValueError, match="at least one embedding"):
        tie_weights(head)
    with pytest.raises(ValueError, match="weight"):
        tie_weights(nn.ReLU(), TokenEmbedding(30, 8))
    # A failed call changes nothing.
    embed = TokenEmbedding(30, 8)
    with pytest.raises(ValueError):
        tie_weights(head, embed, TokenEmbedding(31, 8))
    assert embed.weight is not head.weight


def test_conversions_and_copies_keep_the_tie() -> None:
    model = shared_model()
    assert is_shared(model.double())
    assert model["head"].weight.dtype == torch.float64
    assert is_shared(model.to(torch.bfloat16))
    clone = copy.deepcopy(model)
    assert is_shared(clone) and clone["head"].weight is not model["head"].weight


def test_state_dict_round_trip_keeps_the_tie(tmp_path) -> None:
    model = shared_model()
    state = model.state_dict()
    assert set(state) == {"src_embed.weight", "tgt_embed.weight", "head.weight"}
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == 1

    path = tmp_path / "tied.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1

    torch.manual_seed(1)
    fresh = nn.ModuleDict(
        {
            "src_embed": TokenEmbedding(50, 16, pad_id=0),
            "tgt_embed": TokenEmbedding(50, 16, pad_id=0),
            "head": PredictionHead(16, 50),
        }
    )
    tie_weights(fresh["head"], fresh["src_embed"], fresh["tgt_embed"])
    assert not torch.equal(fresh["head"].weight, model["head"].weight)
    fresh.load_state_dict(loaded)
    assert is_shared(fresh)
    assert torch.equal(fresh["head"].weight, model["head"].weight)
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh["src_embed"](tokens), model["src_embed"](tokens))


def test_shared_checkpoint_is_stored_once(tmp_path) -> None:
    shared, separate = tmp_path / "shared.pt", tmp_path / "separate.pt"
    torch.save(shared_model(vocab_size=1000, d_model=64).state_dict(), shared)
    untied = nn.ModuleDict(
        {
            "src_embed": TokenEmbedding(1000, 64),
            "tgt_embed": TokenEmbedding(1000, 64),
            "head": PredictionHead(64, 1000),
        }
    )
    torch.save(untied.state_dict(), separate)
    matrix_bytes = 1000 * 64 * 4
    assert shared.stat().st_size < 1.1 * matrix_bytes
    assert separate.stat().st_size > 3 * matrix_bytes


# --- check_token_ids: public, and no read of a device's values ------------------------


def test_check_token_ids_is_public_and_checks_ids_on_the_cpu() -> None:
    import aiayn.embedding as embedding

    assert "check_token_ids" in embedding.__all__
    ids = torch.tensor([[1, 2, 3]], dtype=torch.int16)
    assert embedding.check_token_ids(ids, 10).dtype == torch.int64
    with pytest.raises(
        ValueError, match=r"\[0, vocab_size\) = \[0, 10\), got ids from 1 to 10"
    ):
        embedding.check_token_ids(torch.tensor([[1, 10]]), 10)
    with pytest.raises(ValueError, match="ignore_index"):
        embedding.check_token_ids(torch.tensor([[-100, 3]]), 10)
    with pytest.raises(
        ValueError, match=r"prompt must hold integer token ids.*prompt\.long\(\)"
    ):
        embedding.check_token_ids(torch.ones(1, 2), 10, "prompt")
    with pytest.raises(ValueError, match=r"prompt\.unsqueeze\(0\)"):
        embedding.check_token_ids(torch.ones(3, dtype=torch.long), 10, "prompt")


def test_ids_off_the_cpu_are_not_read() -> None:
    """Reading a meta tensor (no values) raises: the check must not try, as on a GPU."""
    from aiayn.embedding import check_token_ids

    meta = torch.full((2, 3), 99, device="meta")  # out of range, were it read
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta.max().item()  # what a read of the values does on this device
    assert check_token_ids(meta, vocab_size=10).shape == (2, 3)
    # no read needed: still checked
    with pytest.raises(ValueError, match="integer token ids"):
        check_token_ids(meta.float(), vocab_size=10)
    embed = TokenEmbedding(10, 4).to("meta")
    assert embed(meta).shape == (2, 3, 4)


def test_the_unchecked_lookup_names_no_id() -> None:
    """Without the checks, the lookup only says that an index is out of range."""
    with pytest.raises(IndexError, match="index out of range in self"):
        F.embedding(torch.tensor([[1, 2, 100]]), torch.zeros(100, 4))
