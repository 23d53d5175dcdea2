"""Tests of aiayn.variants (chapter 10): DecoderOnlyLM, EncoderOnlyModel and masking."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.embedding import PredictionHead, TokenEmbedding
from aiayn.encoder import Encoder
from aiayn.masks import causal_mask
from aiayn.positional import LearnedPositionalEmbedding
from aiayn.variants import DecoderOnlyLM, EncoderOnlyModel, mask_tokens

V, T, N_LAYERS, D_MODEL, N_HEADS, D_FF = 23, 16, 2, 32, 4, 64


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def layer_params(d: int, d_ff: int) -> int:
    """One encoder layer: attention 4d^2 + 4d, FFN 2 d d_ff + d_ff + d, two norms 4d."""
    return 4 * d * d + 2 * d * d_ff + d_ff + 9 * d


def small_lm(seed: int = 0, **kwargs) -> DecoderOnlyLM:
    torch.manual_seed(seed)
    return DecoderOnlyLM(V, T, N_LAYERS, D_MODEL, N_HEADS, D_FF, **kwargs).eval()


def small_encoder(seed: int = 0, **kwargs) -> EncoderOnlyModel:
    torch.manual_seed(seed)
    return EncoderOnlyModel(V, T, N_LAYERS, D_MODEL, N_HEADS, D_FF, **kwargs).eval()


def tokens(batch: int = 3, seq: int = 10, seed: int = 1, low: int = 0) -> torch.Tensor:
    return torch.randint(
        low, V, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


# ---------------------------------------------------------------- decoder-only


def test_decoder_only_structure_and_shapes() -> None:
    lm = small_lm()
    assert isinstance(lm.embed, TokenEmbedding) and isinstance(lm.head, PredictionHead)
    assert isinstance(lm.pos, LearnedPositionalEmbedding) and isinstance(
        lm.blocks, Encoder
    )
    assert all(layer.norm_first for layer in lm.blocks.layers)
    assert all(layer.ffn.activation == "gelu" for layer in lm.blocks.layers)
    # pre-norm stacks end with a LayerNorm (GPT-2's ln_f)
    assert lm.blocks.norm is not None
    with torch.no_grad():
        assert lm(tokens()).shape == (3, 10, V)
        assert lm(tokens(seq=T)).shape == (3, T, V)


def test_decoder_only_head_is_tied_to_the_embedding() -> None:
    lm = small_lm()
    assert lm.embed.weight is lm.head.weight
    assert isinstance(lm.head.weight, nn.Parameter) and lm.head.bias is None
    shared = [p for p in lm.parameters() if p is lm.head.weight]
    assert len(shared) == 1  # listed once, so an optimizer updates it once


def test_post_norm_variant_has_no_final_layernorm() -> None:
    lm = small_lm(norm_first=False, activation="relu")
    assert lm.blocks.norm is None and not lm.blocks.layers[0].norm_first
    expected = (V + T) * D_MODEL + N_LAYERS * layer_params(D_MODEL, D_FF)
    assert n_params(lm) == expected


def test_decoder_only_is_causal() -> None:
    lm = small_lm()
    x = tokens()
    for t in (0, 4, 9):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % V
        with torch.no_grad():
            before, after = lm(x), lm(changed)
        assert torch.allclose(before[:, :t], after[:, :t], atol=1e-6), (
            f"positions before {t} moved"
        )
        assert (before[:, t:] - after[:, t:]).abs().amax() > 1e-3, (
            f"position {t} did not move"
        )


def test_decoder_only_prefix_logits_do_not_depend_on_the_rest() -> None:
    lm = small_lm()
    x = tokens(seq=12)
    with torch.no_grad():
        full = lm(x)
        for t in (1, 5, 11):
            assert torch.allclose(lm(x[:, :t]), full[:, :t], atol=1e-5)


def test_decoder_only_matches_torch_transformer_encoder_with_causal_mask() -> None:
    """The GPT stack is torch's pre-norm TransformerEncoder with a causal mask.

    Both use GELU and a final LayerNorm.
    """
    lm = small_lm()
    torch.manual_seed(2)
    with torch.no_grad():  # no LayerNorm at its default gain and bias
        for p in lm.blocks.parameters():
            p.add_(0.1 * torch.randn_like(p))
    layer = nn.TransformerEncoderLayer(
        D_MODEL,
        N_HEADS,
        D_FF,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )
    reference = nn.TransformerEncoder(
        layer, N_LAYERS, norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=False
    ).eval()
    names = {
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
    state = {}
    for name, value in lm.blocks.state_dict().items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            state[f"layers.{i}.{names[rest]}"] = value
        else:
            state[name] = value  # norm.weight, norm.bias
    reference.load_state_dict(state)
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(3))
    # torch's convention: True = blocked
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    with torch.no_grad():
        ours = lm.blocks(x, mask=causal_mask(9))
        theirs = reference(x, mask=future)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_decoder_only_errors() -> None:
    lm = small_lm()
    with pytest.raises(ValueError, match="max_len=16"):
        lm(torch.zeros(1, T + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one token"):
        lm(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        lm(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        lm(torch.tensor([[-100, 1]]))
    with pytest.raises(ValueError, match="integer token ids"):
        lm(torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        lm(torch.tensor([1, 2, 3]))


# ------------------------------------------------------------------ generate


def test_generate_length_dtype_and_prompt() -> None:
    lm = small_lm()
    prompt = tokens(batch=2, seq=4)
    out = lm.generate(prompt, max_new_tokens=7, greedy=True)
    assert out.shape == (2, 11) and out.dtype == torch.long
    assert torch.equal(out[:, :4], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < V
    assert torch.equal(lm.generate(prompt, 0), prompt)
    # fills the context exactly
    assert lm.generate(prompt, T - 4, greedy=True).shape == (2, T)


def test_greedy_generate_appends_the_argmax() -> None:
    lm = small_lm()
    prompt = tokens(batch=2, seq=3)
    out = lm.generate(prompt, 6, greedy=True)
    with torch.no_grad():
        expected = lm(out[:, :-1]).argmax(-1)[:, 2:]
    assert torch.equal(expected, out[:, 3:])
    assert torch.equal(lm.generate(prompt, 6, greedy=True), out)


def test_sampling_is_reproducible_and_restores_the_mode() -> None:
    lm = small_lm()
    lm.train()
    prompt = tokens(batch=4, seq=2)
    a = lm.generate(
        prompt, 8, temperature=0.7, generator=torch.Generator().manual_seed(5)
    )
    b = lm.generate(
        prompt, 8, temperature=0.7, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a, b) and a.shape == (4, 10)
    assert lm.training  # generate switched to eval and back


def test_low_temperature_sampling_approaches_greedy() -> None:
    lm = small_lm()
    prompt = tokens(batch=4, seq=2)
    cold = lm.generate(
        prompt, 6, temperature=1e-4, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(cold, lm.generate(prompt, 6, greedy=True))


def test_generate_errors() -> None:
    lm = small_lm()
    prompt = tokens(batch=1, seq=5)
    with pytest.raises(ValueError, match="max_len=16"):
        lm.generate(prompt, max_new_tokens=12)
    with pytest.raises(ValueError, match="max_len=16"):
        lm.generate(tokens(batch=1, seq=T + 2), 0)
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        lm.generate(torch.tensor([[0, V + 3]]), 2)
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        # checked even when nothing is generated
        lm.generate(torch.tensor([[0, V + 3]]), 0)
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(prompt, 2, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(prompt, -1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(prompt, 2.0)
    # greedy ignores T
    assert lm.generate(prompt, 2, temperature=0.0, greedy=True).shape == (1, 7)


# ---------------------------------------------------------------- encoder-only


def test_encoder_only_structure_and_shapes() -> None:
    model = small_encoder(pad_id=0, n_classes=5)
    # post-norm, as BERT
    assert not model.encoder.layers[0].norm_first and model.encoder.norm is None
    x = tokens(low=1)
    with torch.no_grad():
        assert model.encode(x).shape == (3, 10, D_MODEL)
        assert model(x).shape == (3, 10, V)
        assert model.classify(x).shape == (3, 5)


def test_encoder_only_head_is_tied_and_has_a_bias() -> None:
    model = small_encoder(pad_id=0)
    assert model.embed.weight is model.mlm_head.weight
    assert model.mlm_head.bias is not None and model.mlm_head.bias.shape == (V,)
    assert torch.count_nonzero(model.embed.weight[0]) == 0  # the pad row


def test_encoder_only_is_bidirectional() -> None:
    model = small_encoder()
    x = tokens()
    changed = x.clone()
    changed[:, 7] = (changed[:, 7] + 1) % V
    with torch.no_grad():
        before, after = model.encode(x), model.encode(changed)
    moved = (before - after).abs().amax(dim=(0, 2))  # per position: [10]
    assert bool((moved > 1e-4).all()), (
        "every position, before and after 7, must see token 7"
    )


@pytest.mark.parametrize("pool", ["first", "mean"])
def test_encoder_only_padding_invariance(pool: str) -> None:
    model = small_encoder(pad_id=0, n_classes=3, pool=pool)
    x = tokens(batch=2, seq=6, low=1)  # no padding
    padded = torch.cat([x, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    ragged = padded.clone()
    ragged[1, 4:] = 0  # second row: 4 real tokens, 7 padding
    with torch.no_grad():
        assert torch.allclose(model.encode(padded)[:, :6], model.encode(x), atol=1e-5)
        assert torch.allclose(model.classify(padded), model.classify(x), atol=1e-5)
        assert torch.allclose(
            model.encode(ragged)[1, :4], model.encode(x[1:, :4])[0], atol=1e-5
        )
        assert torch.allclose(
            model.classify(ragged)[1], model.classify(x[1:, :4])[0], atol=1e-5
        )


def test_encoder_only_mean_pooling_is_the_mean_of_real_tokens() -> None:
    model = small_encoder(pad_id=0, n_classes=2, pool="mean")
    x = torch.tensor([[3, 4, 5, 0, 0]])
    with torch.no_grad():
        h = model.encode(x)
        assert torch.allclose(
            model.classify(x), model.classifier(h[:, :3].mean(1)), atol=1e-6
        )


def test_encoder_only_errors() -> None:
    with pytest.raises(ValueError, match="pool"):
        EncoderOnlyModel(V, T, 1, D_MODEL, N_HEADS, D_FF, pool="max")
    with pytest.raises(ValueError, match="n_classes"):
        EncoderOnlyModel(V, T, 1, D_MODEL, N_HEADS, D_FF, n_classes=0)
    model = small_encoder(pad_id=0)
    with pytest.raises(ValueError, match="no classifier"):
        model.classify(tokens())
    with pytest.raises(ValueError, match="max_len=16"):
        model(torch.ones(1, T + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        model(torch.tensor([[1, 2, V]]))


# ----------------------------------------------------------------- mask_tokens


def test_mask_tokens_proportions_labels_and_kept_ids() -> None:
    x = torch.randint(4, 500, (200, 200), generator=torch.Generator().manual_seed(0))
    x[:, -20:] = 0
    inputs, labels = mask_tokens(
        x,
        mask_id=3,
        vocab_size=500,
        keep_ids=(0,),
        generator=torch.Generator().manual_seed(1),
    )
    assert inputs.shape == labels.shape == x.shape and inputs.dtype == x.dtype
    chosen = labels != -100
    assert not chosen[:, -20:].any()  # padding is never chosen
    assert abs(chosen[:, :-20].float().mean().item() - 0.15) < 0.01
    assert torch.equal(labels[chosen], x[chosen]) and torch.equal(
        inputs[~chosen], x[~chosen]
    )
    masked = (inputs[chosen] == 3).float().mean().item()
    kept = (inputs[chosen] == x[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02
    again = mask_tokens(
        x, 3, 500, keep_ids=(0,), generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


def test_mask_tokens_errors() -> None:
    x = tokens()
    with pytest.raises(ValueError, match="p must be"):
        mask_tokens(x, 1, V, p=0.0)
    with pytest.raises(ValueError, match="mask_id"):
        mask_tokens(x, V, V)
    with pytest.raises(ValueError, match=r"\[0, vocab_size\)"):
        mask_tokens(x, 1, V - 10)


# ---------------------------------------------------------- parameter counts


def test_parameter_count_formulas() -> None:
    lm = small_lm()
    assert (
        n_params(lm)
        == (V + T) * D_MODEL + N_LAYERS * layer_params(D_MODEL, D_FF) + 2 * D_MODEL
    )
    model = small_encoder(pad_id=0, n_classes=4)
    expected = (
        (V + T) * D_MODEL
        + 2 * D_MODEL
        + N_LAYERS * layer_params(D_MODEL, D_FF)
        + V
        + (D_MODEL + 1) * 4
    )
    assert n_params(model) == expected


def test_gpt2_small_and_bert_base_sizes() -> None:
    with torch.device("meta"):
        gpt2 = DecoderOnlyLM(50257, 1024, 12, 768, 12, 3072)
        bert = EncoderOnlyModel(30522, 512, 12, 768, 12, 3072, pad_id=0)
    assert n_params(gpt2) == 124_439_808  # the released GPT-2 small checkpoint
    assert n_params(gpt2) == (50257 + 1024) * 768 + 12 * layer_params(768, 3072) + 1536
    d = 768
    # minus the head's bias, plus the segment embeddings and the pooler
    bert_released = n_params(bert) - 30522 + 2 * d + (d * d + d)
    # the released BERT-base checkpoint (published: 110M)
    assert bert_released == 109_482_240


def test_gpt3_sizes_give_175_billion_parameters_by_the_formula() -> None:
    """GPT-3's published sizes with GPT-2's vocabulary: the 175 billion it states."""
    d = 12288
    with torch.device("meta"):
        gpt3 = DecoderOnlyLM(50257, 2048, 96, d, 96, 4 * d)
    assert n_params(gpt3) == (50257 + 2048) * d + 96 * layer_params(d, 4 * d) + 2 * d
    assert round(n_params(gpt3) / 1e9) == 175


def test_doc003_gpt3_is_about_820_times_the_big_model() -> None:
    """doc003's "nearly 1000x" the big model (213M): about 820; the base (65M) 2,700."""
    d = 12288
    with torch.device("meta"):
        gpt3 = n_params(DecoderOnlyLM(50257, 2048, 96, d, 96, 4 * d))
    assert round(gpt3 / 213e6, -1) == 820
    assert round(gpt3 / 65e6, -2) == 2700


def test_doc003_prompt_tokens_do_not_see_later_prompt_tokens() -> None:
    """doc003's prompt that acts like an encoder: under the causal mask it does not."""
    x = tokens(batch=1, seq=10, low=1)
    changed = x.clone()
    changed[0, 3] = 1 + x[0, 3] % (V - 1)  # the last token of a prompt of 4
    lm, bert = small_lm(), small_encoder()
    with torch.no_grad():
        lm_moved = (lm(changed) - lm(x))[0, :3].abs().amax()
        bert_moved = (bert.encode(changed) - bert.encode(x))[0, :3].abs().amax(-1)
    assert lm_moved < 1e-6  # prompt tokens 0..2 do not see prompt token 3
    assert (bert_moved > 1e-4).all()  # an encoder's do


# --------------------------------------------------------------------- training


def alphabet_runs(n_words: int, seed: int) -> str:
    """Toy text: words of 4 consecutive letters of 'abcdefgh' (cyclic), random starts.

    For example 'efgh habc ...'.
    """
    firsts = torch.randint(
        0, 8, (n_words,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return " ".join(
        "".join("abcdefgh"[(first + k) % 8] for k in range(4)) for first in firsts
    )


def test_decoder_only_training_smoke() -> None:
    """40 steps of AdamW: the loss falls well below the unigram baseline.

    To get there the model must use the previous letter.
    """
    text = alphabet_runs(500, seed=0)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    freq = torch.bincount(data).double() / len(data)
    unigram = -(freq * freq.log()).sum().item()  # about 2.16 nats, log V = 2.20
    torch.manual_seed(0)
    lm = DecoderOnlyLM(
        len(chars), 24, n_layers=1, d_model=32, n_heads=2, d_ff=64, dropout=0.0
    )
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        rows = torch.randint(0, len(data) - 25, (16,), generator=g)
        window = data[rows[:, None] + torch.arange(25)]
        loss = F.cross_entropy(
            lm(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    final = sum(losses[-5:]) / 5
    assert losses[0] > math.log(len(chars)) and final < unigram - 0.5


def test_encoder_only_mlm_training_smoke() -> None:
    """The masked-token loss of one fixed batch falls to near zero.

    So the gradients reach every part of the model.
    """
    x = torch.randint(1, V, (8, 16), generator=torch.Generator().manual_seed(0))
    inputs, labels = mask_tokens(
        x, 0, V, keep_ids=(0,), generator=torch.Generator().manual_seed(0)
    )
    assert (labels != -100).sum() > 5
    torch.manual_seed(0)
    model = EncoderOnlyModel(
        V, 16, n_layers=1, d_model=32, n_heads=2, d_ff=64, dropout=0.0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        # ignore_index=-100
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0] and losses[-1] < 0.2


def test_variants_use_the_public_token_check() -> None:
    import aiayn.variants as variants
    from aiayn.embedding import check_token_ids

    assert variants.check_token_ids is check_token_ids
    assert not hasattr(variants, "_check_tokens")
