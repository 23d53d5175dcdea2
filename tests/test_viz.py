"""Tests of aiayn.viz (chapter 17).

Recording attention with hooks, head statistics, head removal and the charts.
"""

from __future__ import annotations

import copy
import html
import re

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.decoding import greedy_search
from aiayn.train import (
    TrainConfig,
    Trainer,
    encode_pairs,
    make_loader,
    synthetic_pairs,
    synthetic_tokenizer,
)
from aiayn.viz import (
    ATTENTION_KINDS,
    STATISTICS,
    SentenceAttention,
    attention_chart,
    attention_layers,
    attention_maps,
    head_ablation,
    head_statistics,
    heads_chart,
    record_attention,
    sentence_attention,
    statistics_chart,
    statistics_rows,
    token_strings,
    without_heads,
)

PAD, BOS, EOS = 0, 1, 2
SRC = torch.tensor([[5, 9, 7, 4, 6], [8, 3, 11, PAD, PAD]])  # [2, 5]
TGT_IN = torch.tensor([[BOS, 4, 12, 7], [BOS, 9, PAD, PAD]])  # [2, 4]


def tiny(seed: int = 0, **overrides) -> Transformer:
    """An untrained tiny model: the mechanics hold for any weights."""
    torch.manual_seed(seed)
    return Transformer(TransformerConfig.tiny(20, **overrides)).eval()


def n_hooks(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: on a busy machine, several threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reverser() -> tuple[Transformer, object, list]:
    """A tiny model trained for 400 steps to reverse digit strings, on one thread.

    This is chapter 17's run.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digits = synthetic_tokenizer(10)
        train = encode_pairs(
            digits, synthetic_pairs("reverse", 20_000, 10, 3, 8, seed=1)
        )
        test = encode_pairs(digits, synthetic_pairs("reverse", 100, 10, 3, 8, seed=2))
        torch.manual_seed(0)
        model = Transformer(TransformerConfig.tiny(digits.vocab_size, max_len=9))
        config = TrainConfig(
            steps=400, warmup=100, factor=2.0, log_every=0, device="cpu", progress=False
        )
        Trainer(
            model, config, make_loader(train, digits, 1024, bucket_size=1), log=None
        ).fit()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), digits, test


def test_attention_layers_by_kind() -> None:
    model = tiny(n_encoder_layers=3, n_decoder_layers=2)
    layers = attention_layers(model)
    assert [len(layers[k]) for k in ATTENTION_KINDS] == [3, 2, 2]
    assert layers["encoder"][2] is model.encoder.layers[2].self_attn
    assert layers["cross"][1] is model.decoder.layers[1].cross_attn
    with pytest.raises(ValueError, match="no EncoderLayer or DecoderLayer"):
        attention_layers(torch.nn.Linear(2, 2))


def test_hooks_removed_also_after_an_error() -> None:
    model = tiny()
    with record_attention(model):
        assert n_hooks(model) == 2 * 3 * 2  # a pre-hook and a hook per attention module
        model(SRC, TGT_IN)
    assert n_hooks(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with record_attention(model):
            raise RuntimeError("boom")
    assert n_hooks(model) == 0


def test_outputs_unchanged() -> None:
    model = tiny()
    with torch.no_grad():
        plain = model(SRC, TGT_IN)
        with record_attention(model) as record:
            recorded = model(SRC, TGT_IN)
        again = model(SRC, TGT_IN)
    assert torch.allclose(plain, recorded, atol=1e-5)
    assert torch.equal(plain, again)  # nothing left behind
    assert list(record) == list(ATTENTION_KINDS)


def test_callers_get_what_they_asked_for() -> None:
    model = tiny(n_encoder_layers=1)
    layer = model.encoder.layers[0].self_attn
    x = torch.randn(2, 5, 64)
    with torch.no_grad(), record_attention(model) as record:
        assert layer(x)[1] is None
        assert layer(x, need_weights=True)[1].shape == (2, 4, 5, 5)
        # need_weights by position
        assert layer(x, None, None, True)[1].shape == (2, 4, 5, 5)
        assert layer(x, None, None, False)[1] is None
    # four calls stacked along the queries
    assert record["encoder"][0].shape == (2, 4, 4 * 5, 5)


def test_shapes_rows_and_masks() -> None:
    maps = attention_maps(tiny(), SRC, TGT_IN)
    assert maps["encoder"].shape == (2, 2, 4, 5, 5)
    assert maps["decoder_self"].shape == (2, 2, 4, 4, 4)
    assert maps["cross"].shape == (2, 2, 4, 4, 5)
    for w in maps.values():
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6)
        assert (w >= 0).all()
    assert (maps["encoder"][:, 1, :, :, 3:] == 0).all()  # padded source keys
    assert (maps["cross"][:, 1, :, :, 3:] == 0).all()
    assert (maps["decoder_self"].triu(diagonal=1) == 0).all()  # causal


def test_attention_maps_restores_training_mode() -> None:
    model = tiny(dropout=0.5).train()
    a, b = attention_maps(model, SRC, TGT_IN), attention_maps(model, SRC, TGT_IN)
    assert model.training
    assert torch.equal(a["encoder"], b["encoder"])  # eval mode inside: no dropout


def test_record_missing_kind_and_nothing_recorded() -> None:
    model = tiny()
    with record_attention(model) as record:
        model.encode(SRC)
    assert list(record) == ["encoder"]
    with pytest.raises(KeyError, match="nothing recorded"):
        record["cross"]
    with pytest.raises(KeyError, match="no such attention"):
        record["decoder"]


def test_step_by_step_decoding_equals_teacher_forcing() -> None:
    model = tiny()
    with record_attention(model) as record:
        result = greedy_search(model, SRC[:1], max_len=6)
    steps = record["cross"][0].size(2)
    tgt = torch.cat([torch.tensor([[BOS]]), result.tokens[:, : steps - 1]], dim=1)
    forced = attention_maps(model, SRC[:1], tgt)
    for kind in ATTENTION_KINDS:
        assert torch.allclose(record.stacked(kind), forced[kind], atol=1e-5)


def test_token_strings() -> None:
    digits = synthetic_tokenizer(10)
    assert token_strings(digits, [1, 4, 5, 2]) == ["<s>", "0", "1", "</s>"]

    class Subwords:
        def id_to_token(self, i: int) -> str:
            return f"tok{i}"

    class DecodeOnly:
        def decode(self, ids: list[int]) -> str:
            return "+".join(map(str, ids))

    class Wrapper:  # like chapter 16's SubwordTokenizer around a Hugging Face tokenizer
        tokenizer = Subwords()

    assert token_strings(Subwords(), [3, 7]) == ["tok3", "tok7"]
    assert token_strings(Wrapper(), [3, 7]) == ["tok3", "tok7"]
    assert token_strings(DecodeOnly(), [3, 7]) == ["3", "7"]


def test_without_heads() -> None:
    model = tiny()
    layer = model.encoder.layers[1].self_attn
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        full = layer(x)[0]
        with without_heads(model, [("encoder", 1, h) for h in range(4)]):
            none = layer(x)[0]
        with without_heads(model, []):
            assert torch.equal(layer(x)[0], full)  # no head off: nothing changes
        with without_heads(model, [("encoder", 1, 0)]):
            three = layer(x)[0]
            # the hand-made equivalent: zero head 0's slice of the concatenation
            q, k, v = layer.in_proj(x).chunk(3, -1)
            heads = [
                torch.softmax(q[..., s] @ k[..., s].transpose(1, 2) / 4, -1) @ v[..., s]
                for s in (slice(i * 16, (i + 1) * 16) for i in range(4))
            ]
            heads[0] = torch.zeros_like(heads[0])
            by_hand = layer.out_proj(torch.cat(heads, -1))
    assert torch.allclose(none, layer.out_proj.bias.expand_as(none))
    assert torch.allclose(three, by_hand, atol=1e-5)
    assert not torch.allclose(three, full)
    assert n_hooks(model) == 0
    for bad, message in [
        (("encoder", 2, 0), "layers 0 to 1"),
        (("cross", 0, 4), "heads 0 to 3"),
        (("self", 0, 0), "kind must be one of"),
        (("encoder", 0), "triples"),
    ]:
        with pytest.raises(ValueError, match=message):
            with without_heads(model, [bad]):
                pass


def test_head_ablation_shapes_and_baseline() -> None:
    model = tiny()
    pairs = [([5, 9, 7, 4], [4, 12, 7]), ([8, 3], [9]), ([6, 6, 7], [7, 7, 8, 9])]
    loss, rise = head_ablation(model, pairs, batch_size=2)
    assert loss > 0 and set(rise) == set(ATTENTION_KINDS)
    assert all(r.shape == (2, 4) and torch.isfinite(r).all() for r in rise.values())
    assert n_hooks(model) == 0
    with pytest.raises(ValueError, match="no sentence pairs"):
        head_ablation(model, [])


def test_head_statistics_of_an_untrained_model() -> None:
    model = tiny()
    pairs = [
        ([5, 9, 7, 4, 5], [4, 12, 7, 12, 4]),
        ([8, 3], [9, 9]),
        ([6, 6, 7], [7, 7, 8, 9]),
    ]
    stats = head_statistics(model, pairs, batch_size=2, special={"six": {6}})
    assert {kind: tuple(s) for kind, s in stats.items()} == {
        kind: (*STATISTICS[kind], "six") for kind in ATTENTION_KINDS
    }
    for kind, s in stats.items():
        for name, v in s.items():
            assert v.shape == (2, 4)
            if name not in ("distance", "entropy", "order"):
                assert ((v >= 0) & (v <= 1) | v.isnan()).all(), (kind, name)
    # no target token is a 6: NaN, not 0
    assert stats["decoder_self"]["six"].isnan().all()
    assert (stats["encoder"]["entropy"] >= 0).all()
    rows = statistics_rows(stats["cross"])
    assert len(rows) == 8 and set(rows[0]) == {
        "layer",
        "head",
        *STATISTICS["cross"],
        "six",
    }
    with pytest.raises(ValueError, match="replace built-in"):
        head_statistics(model, pairs, special={"copy": {6}})


def test_reverse_model_draws_the_anti_diagonal(reverser) -> None:
    model, digits, test = reverser
    order = head_statistics(model, test)["cross"]["order"]  # [layers, heads]
    assert order.min() < -0.9  # some head follows the source backwards
    assert order[-1].mean() < -0.8  # and the last layer as a whole
    sa = sentence_attention(model, digits, "2 7 1 8 4 5 9 0", "0 9 5 4 8 1 7 2")
    assert (
        sa.source == list("27184590")
        and sa.output[-1] == "</s>"
        and sa.target[0] == "<s>"
    )
    # last layer, mean of the heads
    looked_at = sa.weights["cross"][-1].mean(0).argmax(-1)[:8]
    assert (looked_at == torch.arange(7, -1, -1)).sum() >= 7


def reorder_heads(model: Transformer, order: list[int]) -> Transformer:
    """A copy of model with its heads in `order`: new head k is old head order[k]."""
    model = copy.deepcopy(model)
    for modules in attention_layers(model).values():
        for attn in modules:
            d_k = attn.d_k
            features = torch.cat([torch.arange(h * d_k, (h + 1) * d_k) for h in order])
            # the same rows of W^Q, W^K and W^V, and the same columns of W^O
            rows = torch.cat([features + part * attn.d_model for part in range(3)])
            with torch.no_grad():
                attn.in_proj.weight.copy_(attn.in_proj.weight[rows])
                attn.in_proj.bias.copy_(attn.in_proj.bias[rows])
                attn.out_proj.weight.copy_(attn.out_proj.weight[:, features])
    return model


def test_reordered_heads_compute_the_same_function() -> None:
    """Heads in reverse order: the same logits, and head h's statistics at 3 - h."""
    model = tiny()
    reversed_heads = reorder_heads(model, [3, 2, 1, 0])
    with torch.no_grad():
        logits, reordered = model(SRC, TGT_IN), reversed_heads(SRC, TGT_IN)
    assert torch.allclose(logits, reordered, atol=1e-5)
    pairs = [([5, 9, 7, 4, 5], [4, 12, 7, 12, 4]), ([8, 3], [9, 9]), ([6, 7], [7, 8])]
    before = head_statistics(model, pairs)
    moved = head_statistics(reversed_heads, pairs)
    for kind, stats in before.items():
        for name, v in stats.items():
            flipped = v.flip(-1)  # head h -> head 3 - h: [layers, heads]
            assert torch.allclose(moved[kind][name], flipped, atol=1e-5, equal_nan=True)
    # the heads differ, so the statistics did move
    assert not torch.allclose(moved["encoder"]["entropy"], before["encoder"]["entropy"])


def test_sentence_attention_with_greedy_output(reverser) -> None:
    model, digits, _ = reverser
    sa = sentence_attention(model, digits, "1 2 3")
    assert (
        len(sa.target) == len(sa.output)
        and sa.target[0] == "<s>"
        and sa.output[-1] == "</s>"
    )
    assert sa.weights["cross"].shape[2:] == (len(sa.output), 3)
    with pytest.raises(ValueError, match="no tokens"):
        sentence_attention(model, digits, "")


# The book's text column on a 400-pixel-wide phone is 368 px, and vega-embed adds 28 px
# beside a chart (both measured in Chromium): a wider chart scrolls sideways.
PHONE_CHART_WIDTH = 368 - 28


def test_the_grid_of_heads_shows_the_tokens_and_fits_a_phone() -> None:
    """Every panel of heads_chart carries the key tokens, every row the query tokens.

    At most two heads share a row, so that the chart fits a phone.
    """
    vlc = pytest.importorskip("vl_convert")
    pytest.importorskip("altair")
    source = (
        "▁Ein ▁Mann ▁hält ▁ein ▁kleines ▁Kind , ▁das ▁einen ▁Rucksack ▁trägt .".split()
    )
    output = "▁A ▁man ▁holding ▁a ▁small ▁child ▁wearing ▁a ▁backpack . </s>".split()
    torch.manual_seed(0)
    weights = {  # chapter 17's sentence and model shape: 3 layers of 4 heads
        "encoder": torch.randn(3, 4, 12, 12).softmax(-1),
        "decoder_self": torch.randn(3, 4, 11, 11).softmax(-1),
        "cross": torch.randn(3, 4, 11, 12).softmax(-1),
    }
    sa = SentenceAttention(source, ["<s>", *output[:-1]], output, weights)
    for kind in ATTENTION_KINDS:
        spec = heads_chart(sa, kind).to_dict()
        assert spec.get("columns", sa.n_heads) <= 2, (
            "a wrapped facet, at most two heads to a row"
        )
        svg = vlc.vegalite_to_svg(spec)
        width = float(re.search(r'<svg[^>]* width="([0-9.]+)"', svg).group(1))
        assert width <= PHONE_CHART_WIDTH, f"{kind}: {width} px"
        texts = [
            html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)
        ]
        queries, keys = sa.axes(kind)
        assert all(f"layer {l}, head {h}" in texts for l in range(3) for h in range(4))
        for token in keys:
            # under each of the 12 panels
            assert texts.count(token) >= 12, (kind, token)
        for token in queries:
            assert texts.count(token) >= 6, (kind, token)  # beside each of the 6 rows


def test_charts(reverser) -> None:
    alt = pytest.importorskip("altair")
    model, digits, test = reverser
    sa = sentence_attention(model, digits, "3 1 4", "4 1 3")
    chart = attention_chart(sa, layer=1, head=2)
    assert isinstance(chart, alt.VConcatChart) and len(chart.vconcat) == 3
    spec = chart.to_dict()  # validates against the Vega-Lite schema
    params = {p["name"]: p for p in spec["params"]}
    assert params["layer"]["value"] == 1 and params["layer"]["bind"]["max"] == 1
    assert params["head"]["value"] == 2 and params["head"]["bind"]["max"] == 3
    rows = sum(len(d) for d in spec["datasets"].values())
    assert rows == 2 * 4 * (3 + 4 + 4)  # one row per (layer, head, query)
    assert len(attention_chart(sa, kinds=["cross"]).vconcat) == 1
    with pytest.raises(ValueError, match="kind must be one of"):
        attention_chart(sa, kinds=["self"])
    with pytest.raises(ValueError, match="layer must be in"):
        attention_chart(sa, layer=2)
    facet = heads_chart(sa, "encoder")
    assert isinstance(facet, alt.FacetChart)
    facet.to_dict()
    stats = head_statistics(model, test[:20])
    table = statistics_chart(stats["cross"], "cross")
    assert isinstance(table, alt.LayerChart)
    table.to_dict()
