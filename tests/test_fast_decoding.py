"""Chapter 18's FastDecoder: the eager searches' outputs, two compiled programs.

The fast path must write exactly what chapter 15's searches write (greedy and beam,
every model variant the package builds), drop the rows of ended sentences without
changing anything, and compile one program for the source pass and one for the
step, whatever the batch sizes and lengths of a run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from aiayn import Transformer, TransformerConfig
from aiayn.decoding import (
    CTRANSLATE2_RULES,
    Steps,
    beam_search,
    greedy_search,
    sample,
    translate,
)
from aiayn.fast_decoding import FastDecoder, FastSteps

VARIANTS = {  # the choices of chapters 9, 10 and 19 that the step must follow
    "paper": {},
    "pre-norm": dict(norm_first=True),
    "learned positions": dict(positional="learned"),
    "production": dict(
        activation="silu", final_norm=False, output_bias=True, share_embeddings=False
    ),
    "start is padding": dict(bos_id=0, pad_id=0),
    "narrow decoder": dict(decoder_d_ff=24),
}


def small_model(seed: int = 0, **changes: Any) -> Transformer:
    torch.manual_seed(seed)
    fields = dict(
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=64,
    )
    model = Transformer(TransformerConfig(31, 31, **{**fields, **changes})).eval()
    with torch.no_grad():  # a likelier end token: outputs of different lengths
        model.head.weight[model.config.eos_id] *= 4.0
    return model


def sources(model: Transformer, rows: int, seed: int = 0) -> Tensor:
    """A padded batch of sources of different lengths, ids above the special ones."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    src = torch.randint(4, c.src_vocab_size, (rows, 9), generator=g)
    for i in range(rows):
        end = 2 + (i * 5) % 7
        src[i, end] = c.eos_id
        src[i, end + 1 :] = c.pad_id
    return src


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fast_path_writes_what_the_eager_searches_write(variant: str) -> None:
    model = small_model(**VARIANTS[variant])
    fast = FastDecoder(compile=False)
    lengths = set()
    for rows, seed in ((1, 0), (2, 1), (7, 2), (12, 3)):
        src = sources(model, rows, seed)
        for search, options in (
            (greedy_search, {}),
            (beam_search, {}),
            (beam_search, dict(beam_size=3, alpha=0.0, min_len=2)),
            (beam_search, dict(rules=CTRANSLATE2_RULES)),
            (beam_search, dict(n_best=2)),
        ):
            eager = search(model, src, max_len=20, **options)
            faster = search(model, src, max_len=20, steps=fast, **options)
            assert torch.equal(eager.tokens, faster.tokens), (search, options)
            assert torch.equal(eager.lengths, faster.lengths)
            assert torch.equal(eager.finished, faster.finished)
            torch.testing.assert_close(eager.scores, faster.scores)
            lengths.update(eager.lengths.flatten().tolist())
    assert len(lengths) >= 2  # sentences end at different steps: rows are dropped


def test_rows_are_dropped_once_an_eighth_have_ended_and_never_below_two() -> None:
    model = small_model(**VARIANTS["production"])
    calls = []

    class Counting(FastSteps):
        def __call__(self, tokens: Tensor) -> Tensor:
            calls.append(tokens.size(0))
            return super().__call__(tokens)

    def steps(model: Transformer, src: Tensor, use_cache: bool, length: int) -> Any:
        return Counting(model, src, FastDecoder(compile=False))

    src = sources(model, 16)
    out = greedy_search(model, src, max_len=30, steps=steps)
    assert out.lengths.unique().numel() > 2
    assert calls[0] == 16 and min(calls) >= 2
    assert calls == sorted(calls, reverse=True) and calls[-1] < 16
    assert torch.equal(out.tokens, greedy_search(model, src, max_len=30).tokens)


def test_eager_steps_keep_every_row_and_sampling_never_drops_any() -> None:
    assert Steps.shrinks is False and FastSteps.shrinks is True
    model = small_model()
    src = sources(model, 9)
    for temperature in (0.5, 2.0):
        draws = [
            sample(
                model,
                src,
                temperature,
                generator=torch.Generator().manual_seed(5),
                max_len=20,
                steps=steps,
            ).tokens
            for steps in (None, FastDecoder(compile=False))
        ]
        assert torch.equal(*draws)  # the same rows draw from the same stream


def test_a_reorder_not_yet_applied_composes_with_the_next() -> None:
    model = small_model()
    src = sources(model, 4)
    steps = FastDecoder(compile=False)(model, src)
    tokens = torch.full((4, 1), model.config.bos_id)
    steps(tokens)
    steps.reorder(torch.tensor([3, 3, 1, 0]), sources=True)
    steps.reorder(torch.tensor([2, 0]), sources=True)  # rows 1 and 3 of the old
    assert steps.index.tolist() == [1, 3]
    assert torch.equal(steps.src_mask, steps.src_mask[[0, 1]])
    logits = steps(torch.full((2, 2), 5))
    assert logits.shape == (2, model.config.tgt_vocab_size)


def test_translate_takes_the_fast_path() -> None:
    class Tokens:
        def encode(self, text: str) -> list[int]:
            return [4 + int(w) for w in text.split()] + [2]

        def decode(self, ids: Any) -> str:
            return " ".join(str(int(i)) for i in ids if int(i) > 3)

    model = small_model()
    texts = [" ".join(str(i % 20) for i in range(n)) for n in range(1, 12)]
    fast = FastDecoder(compile=False)
    for method in ("greedy", "beam"):
        eager = translate(model, Tokens(), texts, method=method, batch_size=4)
        assert (
            translate(model, Tokens(), texts, method=method, batch_size=4, steps=fast)
            == eager
        )
    assert fast.warmup_seconds == 0.0  # eager: nothing was compiled


def test_inductor_makes_two_programs_for_every_batch_shape() -> None:
    """A whole run, compiled for real: 8 batch shapes, one source and one step."""
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]  # other tests of this process may have compiled
    model = small_model()
    fast = FastDecoder()  # inductor
    shapes = [(3, 0), (5, 1), (8, 2), (11, 3), (4, 4), (16, 5), (6, 6), (9, 7)]
    for rows, seed in shapes:
        src = sources(model, rows, seed)[:, : 5 + seed % 4]
        src[:, -1] = model.config.eos_id
        for search in (greedy_search, beam_search):
            eager = search(model, src, max_len=16)
            assert torch.equal(
                eager.tokens, search(model, src, max_len=16, steps=fast).tokens
            )
    assert stats["unique_graphs"] - before <= 2, dict(stats)
    assert fast.warmup_seconds > 0.0  # the first call of each compiled pass, timed
