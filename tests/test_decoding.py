"""Tests of aiayn.decoding (chapter 15).

Greedy search, beam search, sampling, the cache and the command line.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn import Transformer, TransformerConfig
from aiayn.decoding import (
    MAX_LEN_MARGIN,
    DecodeResult,
    beam_search,
    default_max_len,
    greedy_search,
    length_penalty,
    sample,
    sampling_probs,
)
from conftest import HANG_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAD, BOS, EOS = 0, 1, 2
V = 20
SRC = torch.tensor(
    [[4, 9, 7, 3, 5, 6], [6, 8, 5, PAD, PAD, PAD], [3, 3, 9, 11, 7, PAD]]
)


def tiny(seed: int, **overrides) -> Transformer:
    """An untrained tiny model (the properties tested hold for any weights)."""
    torch.manual_seed(seed)
    return Transformer(TransformerConfig.tiny(V, **overrides)).eval()


class ForcedEnd(nn.Module):
    """A model whose sentence b writes the end token as token ends[b], never before."""

    def __init__(self, model: Transformer, ends: Tensor) -> None:
        super().__init__()
        self.model, self.ends, self.config = model, ends, model.config

    def encode(self, src: Tensor) -> Tensor:
        return self.model.encode(src)

    def new_cache(self):
        return self.model.new_cache()

    def decode(self, tgt: Tensor, memory: Tensor, src: Tensor, cache=None) -> Tensor:
        offset = cache.seq_len if cache is not None else 0
        # [rows, t, V]
        logits = self.model.decode(tgt, memory, src, cache=cache).clone()
        # beams: k rows per sentence
        ends = self.ends.repeat_interleave(tgt.size(0) // self.ends.numel())
        # position p predicts token number p + 1
        position = offset + torch.arange(tgt.size(1))
        here = (position[None, :] + 1) == ends[:, None]  # [rows, t]
        logits[..., EOS] = torch.where(here, torch.tensor(1e4), torch.tensor(-1e4))
        return logits


def teacher_forced_log_p(
    model: Transformer, src: Tensor, result: DecodeResult
) -> Tensor:
    """log P of the result's tokens, from one teacher-forced pass: [batch]."""
    tokens = result.tokens
    tgt_in = torch.cat(
        [tokens.new_full((tokens.size(0), 1), BOS), tokens[:, :-1]], dim=1
    )
    with torch.no_grad():
        log_p = model(src, tgt_in).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    real = torch.arange(tokens.size(1)) < result.lengths[:, None]
    return (log_p * real).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("norm_first", [False, True])
def test_greedy_cached_equals_recomputed(seed: int, norm_first: bool) -> None:
    model = tiny(seed, norm_first=norm_first)
    cached = greedy_search(model, SRC, max_len=25)
    recomputed = greedy_search(model, SRC, max_len=25, use_cache=False)
    assert torch.equal(cached.tokens, recomputed.tokens)
    assert torch.equal(cached.lengths, recomputed.lengths)
    assert torch.allclose(cached.log_probs, recomputed.log_probs, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beam_size", [2, 4])
def test_beam_cached_equals_recomputed(seed: int, beam_size: int) -> None:
    model = tiny(seed, norm_first=seed == 1)
    cached = beam_search(model, SRC, beam_size=beam_size, max_len=15, n_best=beam_size)
    recomputed = beam_search(
        model, SRC, beam_size=beam_size, max_len=15, n_best=beam_size, use_cache=False
    )
    assert torch.equal(cached.tokens, recomputed.tokens)
    assert torch.allclose(cached.scores, recomputed.scores, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
@pytest.mark.parametrize("max_len", [4, 20])
def test_beam_of_one_is_greedy(seed: int, max_len: int) -> None:
    model = tiny(seed)
    greedy = greedy_search(model, SRC, max_len=max_len)
    beam = beam_search(model, SRC, beam_size=1, alpha=0.6, max_len=max_len)
    assert torch.equal(beam.tokens, greedy.tokens)
    assert torch.equal(beam.log_probs, greedy.log_probs)
    assert torch.equal(beam.finished, greedy.finished)
    assert torch.allclose(
        beam.scores, greedy.log_probs / length_penalty(greedy.lengths, 0.6)
    )


def test_greedy_tokens_are_argmax_and_scores_are_log_p() -> None:
    model = tiny(0)
    out = greedy_search(model, SRC, max_len=10)
    tgt_in = torch.cat([torch.full((3, 1), BOS), out.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(SRC, tgt_in)
    logits[..., [PAD, BOS]] = float("-inf")  # never generated
    real = torch.arange(out.tokens.size(1)) < out.lengths[:, None]
    assert torch.equal(logits.argmax(-1)[real], out.tokens[real])
    assert torch.allclose(
        teacher_forced_log_p(model, SRC, out), out.log_probs, atol=1e-5
    )
    assert torch.equal(out.scores, out.log_probs)


def test_beam_scores_match_teacher_forcing_and_are_sorted() -> None:
    model = tiny(3)
    out = beam_search(model, SRC, beam_size=3, n_best=3, max_len=8)
    assert out.tokens.shape[:2] == (3, 3) and out.scores.shape == (3, 3)
    assert bool((out.scores[:, :-1] >= out.scores[:, 1:]).all())
    assert torch.allclose(out.scores, out.log_probs / length_penalty(out.lengths, 0.6))
    for j in range(3):
        one = DecodeResult(
            out.tokens[:, j],
            out.lengths[:, j],
            out.log_probs[:, j],
            out.scores[:, j],
            out.finished[:, j],
        )
        assert torch.allclose(
            teacher_forced_log_p(model, SRC, one), one.log_probs, atol=1e-5
        )
    best = beam_search(model, SRC, beam_size=3, max_len=8)
    assert torch.equal(best.scores, out.scores[:, 0])


def test_beam_rules_score_as_they_say_and_refuse_what_they_do_not_know() -> None:
    """|Y| ** alpha without the end token (an empty output: 1); the stop: k finished."""
    from aiayn.decoding import CTRANSLATE2_RULES, BeamRules

    model = tiny(3)
    out = beam_search(model, SRC, 3, 0.6, 8, n_best=3, rules=CTRANSLATE2_RULES)
    words = (out.lengths - out.finished.long()).clamp_min(1)  # |Y|, no end token
    assert torch.allclose(out.scores, out.log_probs / words.float() ** 0.6)
    assert bool((out.scores[:, :-1] >= out.scores[:, 1:]).all())
    book = beam_search(model, SRC, 3, 0.6, 8, n_best=3, rules=BeamRules())
    assert torch.equal(book.scores, beam_search(model, SRC, 3, 0.6, 8, n_best=3).scores)
    full = BeamRules(stop="full")  # never later than the book's stop: as good or worse
    assert bool(
        (
            beam_search(model, SRC, 3, 0.6, 8, rules=full).scores
            <= book.scores[:, 0] + 1e-6
        ).all()
    )
    for bad in ({"penalty": "linear"}, {"stop": "never"}, {"count_end": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BeamRules(**bad)


@pytest.mark.parametrize("use_cache", [True, False])
def test_each_sentence_stops_at_its_end_token(use_cache: bool) -> None:
    ends = torch.tensor([3, 7, 1])
    model = ForcedEnd(tiny(0), ends)
    for out in (
        greedy_search(model, SRC, max_len=12, use_cache=use_cache),
        beam_search(model, SRC, beam_size=3, max_len=12, use_cache=use_cache),
        sample(
            model,
            SRC,
            generator=torch.Generator().manual_seed(0),
            max_len=12,
            use_cache=use_cache,
        ),
    ):
        assert out.lengths.tolist() == ends.tolist()
        assert out.finished.all()
        assert out.tokens.shape == (3, 7)
        for b, n in enumerate(ends.tolist()):
            assert out.tokens[b, n - 1] == EOS
            assert bool((out.tokens[b, : n - 1] != EOS).all())
            assert bool((out.tokens[b, n:] == PAD).all())  # padding after the end
            assert bool((out.tokens[b, :n] != PAD).all())


def test_pad_and_start_token_are_never_generated() -> None:
    model = tiny(0)  # its favourite first token is the start token
    with torch.no_grad():
        first = model.decode(torch.full((3, 1), BOS), model.encode(SRC), SRC)[:, -1]
    assert (first.argmax(-1) == BOS).any()
    for out in (
        greedy_search(model, SRC, max_len=10),
        beam_search(model, SRC, max_len=10, n_best=4),
        sample(model, SRC, temperature=3.0, generator=torch.Generator().manual_seed(0)),
    ):
        real = out.tokens[out.tokens != PAD]
        assert not bool((real == BOS).any())
        assert int((out.tokens != PAD).sum()) == int(out.lengths.sum())


def test_default_max_len_is_source_length_plus_50() -> None:
    assert MAX_LEN_MARGIN == 50
    assert default_max_len(SRC, PAD).tolist() == [56, 53, 55]
    model = ForcedEnd(tiny(0), torch.tensor([1000, 1000, 1000]))  # never ends
    for out in (greedy_search(model, SRC), beam_search(model, SRC, beam_size=2)):
        assert out.lengths.tolist() == [56, 53, 55]
        assert not out.finished.any()
        assert out.tokens.size(1) == 56


def test_max_len_is_capped_by_the_positional_table() -> None:
    model = ForcedEnd(tiny(0, max_len=20), torch.tensor([1000, 1000, 1000]))
    assert greedy_search(model, SRC).lengths.tolist() == [20, 20, 20]
    with pytest.raises(ValueError, match="positional"):
        greedy_search(model, SRC, max_len=21)


def test_min_len_delays_the_end_token() -> None:
    # the end token at token 3, 6, 9
    model = ForcedEnd(tiny(0), torch.tensor([3, 6, 9]))
    out = greedy_search(model, SRC, min_len=5, max_len=8)
    # 3 is too early, 6 is allowed, 9 is too late
    assert out.lengths.tolist() == [8, 6, 8]
    assert out.finished.tolist() == [False, True, False]


def test_length_penalty() -> None:
    assert length_penalty(1, 0.6) == 1.0
    for n in (1, 2, 7, 50):
        for alpha in (0.0, 0.6, 1.0):
            assert math.isclose(length_penalty(n, alpha), (5 + n) ** alpha / 6**alpha)
    lengths = torch.tensor([1, 2, 3])
    assert torch.allclose(length_penalty(lengths, 0.6), ((5 + lengths) / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_alpha_changes_the_ranking_of_lengths() -> None:
    # the short one wins by log P, the long one with the paper's alpha
    short, long_ = -2.0 / length_penalty(3, 0.0), -3.0 / length_penalty(12, 0.0)
    assert short > long_
    assert -3.0 / length_penalty(12, 0.6) > -2.0 / length_penalty(3, 0.6)


def test_sampling_is_reproducible_and_its_limits_are_greedy() -> None:
    model = tiny(0)
    greedy = greedy_search(model, SRC, max_len=12)

    def run(seed: int, **kw) -> DecodeResult:
        return sample(
            model, SRC, generator=torch.Generator().manual_seed(seed), max_len=12, **kw
        )

    assert torch.equal(run(1).tokens, run(1).tokens)
    assert not torch.equal(
        run(1, temperature=2.0).tokens, run(2, temperature=2.0).tokens
    )
    for out in (
        run(3, temperature=1e-4),
        run(4, top_k=1),
        run(5, temperature=5.0, top_k=1),
    ):
        assert torch.equal(out.tokens, greedy.tokens)
        assert torch.allclose(out.log_probs, greedy.log_probs, atol=1e-6)
    cached, recomputed = (
        run(6),
        sample(
            model,
            SRC,
            generator=torch.Generator().manual_seed(6),
            max_len=12,
            use_cache=False,
        ),
    )
    assert torch.equal(cached.tokens, recomputed.tokens)


def test_sampling_probs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    p = sampling_probs(logits)
    assert torch.allclose(p, logits.softmax(-1))
    assert torch.allclose(sampling_probs(logits, 0.5), (logits / 0.5).softmax(-1))
    top = sampling_probs(logits, 1.0, top_k=5)
    assert ((top > 0).sum(-1) == 5).all() and torch.allclose(top.sum(-1), torch.ones(4))
    kept = logits.topk(5, dim=-1).indices
    assert torch.allclose(top.gather(-1, kept), logits.gather(-1, kept).softmax(-1))
    assert torch.equal(sampling_probs(logits, 1.0, top_k=30), p)
    assert torch.allclose(
        sampling_probs(logits, 1e4), torch.full((4, 30), 1 / 30), atol=1e-3
    )
    draws = torch.multinomial(
        p[0].expand(40_000, -1), 1, generator=torch.Generator().manual_seed(0)
    )
    frequency = torch.bincount(draws[:, 0], minlength=30) / 40_000
    assert (frequency - p[0]).abs().max() < 0.01


def test_model_mode_is_restored() -> None:
    model = tiny(0, dropout=0.1).train()
    greedy_search(model, SRC, max_len=3)
    beam_search(model, SRC, max_len=3)
    assert model.training


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: beam_search(m, SRC, beam_size=0), "beam_size"),
        (lambda m: beam_search(m, SRC, beam_size=2.0), "beam_size"),
        (lambda m: beam_search(m, SRC, beam_size=V), "beam_size"),
        (lambda m: beam_search(m, SRC, alpha=-0.1), "alpha"),
        (lambda m: beam_search(m, SRC, beam_size=2, n_best=3), "n_best"),
        (lambda m: sample(m, SRC, temperature=0.0), "temperature"),
        (lambda m: sample(m, SRC, temperature=-1.0), "temperature"),
        (lambda m: sample(m, SRC, top_k=0), "top_k"),
        (lambda m: sampling_probs(torch.zeros(3), temperature=0), "temperature"),
        (lambda m: greedy_search(m, SRC[:, :0]), "empty"),
        (
            lambda m: greedy_search(m, torch.zeros(2, 4, dtype=torch.long)),
            "only padding",
        ),
        (lambda m: greedy_search(m, SRC[0]), r"\[batch, src_len\]"),
        (lambda m: greedy_search(m, SRC.float()), "integer"),
        (lambda m: greedy_search(m, SRC, max_len=0), "max_len"),
        (lambda m: greedy_search(m, SRC, min_len=60), "min_len"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(tiny(0))


@pytest.fixture(scope="module")
def briefly_trained() -> Transformer:
    """A tiny model after 60 copy-task steps: inaccurate, never proposing pad or <s>."""
    from aiayn.train import (
        TrainConfig,
        Trainer,
        encode_pairs,
        make_loader,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    tokenizer = synthetic_tokenizer(10)
    pairs = encode_pairs(tokenizer, synthetic_pairs("copy", 2000, 10, 1, 8, seed=1))
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(tokenizer.vocab_size, max_len=30))
    config = TrainConfig(
        steps=60, warmup=20, factor=0.5, log_every=0, device="cpu", progress=False
    )
    Trainer(model, config, make_loader(pairs, tokenizer, 512), log=None).fit()
    return model.eval()


def test_greedy_equals_chapter_13_reference(briefly_trained: Transformer) -> None:
    from aiayn.train import greedy_decode

    src = torch.tensor(
        [
            [4, 9, 7, 3, 5, 6, 8, 11],
            [6, 8, 5, 12, PAD, PAD, PAD, PAD],
            [13, 13, 9, 11, 7, PAD, PAD, PAD],
        ]
    )
    for max_len in (3, 12, 25):
        reference = greedy_decode(briefly_trained, src, max_len=max_len)
        for use_cache in (True, False):
            ours = greedy_search(
                briefly_trained, src, max_len=max_len, use_cache=use_cache
            )
            assert torch.equal(ours.tokens, reference)
        beam = beam_search(briefly_trained, src, beam_size=1, max_len=max_len)
        assert torch.equal(beam.tokens, reference)


def test_beam_search_on_a_trained_model_is_the_same_without_the_cache(
    briefly_trained: Transformer,
) -> None:
    """Peaked distributions, unlike an untrained model's: the cache changes nothing."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(4, 14, (12, 8), generator=gen)  # the task's ten symbols
    src[torch.arange(8) >= torch.randint(1, 9, (12, 1), generator=gen)] = PAD
    for alpha in (0.0, 0.6):
        kw = dict(beam_size=4, alpha=alpha, n_best=4, max_len=12)
        cached = beam_search(briefly_trained, src, **kw)
        recomputed = beam_search(briefly_trained, src, use_cache=False, **kw)
        assert torch.equal(cached.tokens, recomputed.tokens)
        assert torch.equal(cached.lengths, recomputed.lengths)
        assert torch.allclose(cached.scores, recomputed.scores, atol=1e-5)


def test_the_best_k_of_each_hypothesis_hold_the_best_k_of_all_extensions() -> None:
    """doc004's candidates, the k best of each hypothesis' k best, are beam search's."""
    from aiayn.decoding import _candidates

    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 4):
        alive = torch.randn(3, k, generator=gen)  # log P of k hypotheses per sentence
        log_p = torch.randn(3 * k, V, generator=gen).log_softmax(-1)  # [3k, V]
        extended = alive[..., None] + log_p.view(3, k, V)  # every extension: [3, k, V]
        per_hypothesis = extended.topk(k, dim=-1).values.flatten(1)  # [3, k * k]
        pooled = per_hypothesis.topk(k, dim=-1).values  # doc004's k: [3, k]
        top, origin, token = _candidates(alive, log_p, k)  # the best 2k of kV: [3, 2k]
        assert torch.equal(pooled, top[:, :k])
        assert torch.equal(extended[torch.arange(3)[:, None], origin, token], top)


def run_aiayn(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m aiayn ARGS` in a subprocess importing the package from this tree."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "aiayn", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written by `python -m aiayn train --task copy --steps 30`."""
    directory = tmp_path_factory.mktemp("copy")
    done = run_aiayn(
        *"train --task copy --steps 30".split(),
        "--checkpoint-dir",
        str(directory),
        "--device",
        "cpu",
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    assert (directory / "last.pt").is_file()
    return directory / "last.pt"


def assert_valid_lines(stdout: str, n_inputs: int) -> None:
    """One output line per input, each made of the task's symbols (possibly none)."""
    lines = stdout.split("\n")
    assert lines[-1] == "" and len(lines) == n_inputs + 1, stdout
    for line in lines[:-1]:
        assert all(token in {str(d) for d in range(10)} for token in line.split()), line


def test_translate_cli(checkpoint: Path) -> None:
    done = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "3 1 4 1 5", "2 7", "9"
    )
    assert done.returncode == 0, done.stderr
    assert_valid_lines(done.stdout, 3)
    for options in (
        ["--greedy"],
        ["--sample", "--temperature", "0.7", "--top-k", "3", "--seed", "1"],
        ["--beam-size", "2", "--alpha", "0.0", "--max-len", "6"],
    ):
        done = run_aiayn(
            "translate",
            "--checkpoint",
            str(checkpoint.parent),
            *options,
            # a directory: its last.pt; lines from stdin
            stdin="1 2 3\n\n4 5 6 7\n",
        )
        assert done.returncode == 0, done.stderr
        assert_valid_lines(done.stdout, 3)
        assert done.stdout.split("\n")[1] == ""  # the empty line stays empty


def test_translate_cli_errors(checkpoint: Path, tmp_path: Path) -> None:
    missing = run_aiayn(
        "translate", "--checkpoint", str(tmp_path / "nothing.pt"), "1 2"
    )
    assert (
        missing.returncode == 2
        and "no checkpoint file" in missing.stderr
        and missing.stdout == ""
    )
    empty = run_aiayn("translate", "--checkpoint", str(checkpoint), stdin="\n  \n")
    assert empty.returncode == 2 and "nothing to translate" in empty.stderr
    bad = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "--beam-size", "0", "1 2"
    )
    assert (
        bad.returncode == 2
        and "--beam-size" in bad.stderr
        and bad.stderr.count("\n") == 1
    )
    device = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "--device", "gpu0", "1 2"
    )
    assert device.returncode == 2 and "unknown device 'gpu0'" in device.stderr
    both = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "--greedy", "--sample", "1 2"
    )
    assert both.returncode == 2 and "not allowed with" in both.stderr
    helped = run_aiayn("translate", "--help")
    assert helped.returncode == 0 and "--beam-size" in helped.stdout
    listed = run_aiayn("--help")
    assert "translate" in listed.stdout


# --- temperature and alpha: finite, in a range ----------------------------------------


@pytest.mark.parametrize(
    "temperature", [math.inf, 1e-300, 1e-5, 1e5, math.nan, -math.inf]
)
def test_temperatures_out_of_range_are_refused_before_sampling(
    temperature: float,
) -> None:
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(torch.zeros(2, V), temperature)
    with pytest.raises(ValueError, match="temperature") as refused:
        sample(tiny(0), SRC, temperature=temperature, max_len=4)
    if temperature > 0 and not math.isnan(temperature):
        assert "greedy_search" in str(refused.value)


def test_temperatures_at_the_ends_of_the_range_sample() -> None:
    from aiayn.decoding import MAX_TEMPERATURE, MIN_TEMPERATURE

    for temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        out = sample(
            tiny(0),
            SRC,
            temperature=temperature,
            max_len=4,
            generator=torch.Generator().manual_seed(0),
        )
        assert out.tokens.shape[0] == 3 and bool(torch.isfinite(out.log_probs).all())


@pytest.mark.parametrize("alpha", [math.inf, math.nan, -0.1, 11.0, 1e4, True])
def test_alpha_must_be_finite_and_in_range(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        beam_search(tiny(0), SRC, alpha=alpha, max_len=4)
    with pytest.raises(ValueError, match="alpha"):
        length_penalty(3, alpha)


# --- the stop check: no read of the device at every step ------------------------------


class BoolReads(TorchDispatchMode):
    """Counts reads of a tensor's boolean scalar, as bool(t.all()), bool(t.any()) do."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and args[0].dtype == torch.bool
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_decoding_loops_read_their_stop_flags_every_8_steps_off_the_cpu(
    monkeypatch,
) -> None:
    """With the accelerator's interval: far fewer reads, the same per-step results."""
    import aiayn.decoding as decoding

    model = ForcedEnd(tiny(0), torch.tensor([5, 41, 23]))  # sentence 1 ends at step 41
    runs = {
        "greedy": lambda: greedy_search(model, SRC, max_len=48),
        "sample": lambda: sample(
            model, SRC, max_len=48, generator=torch.Generator().manual_seed(0)
        ),
        "beam": lambda: beam_search(model, SRC, beam_size=3, max_len=48, n_best=2),
    }
    per_step, reads = {}, {}
    for name, run in runs.items():
        with BoolReads() as counter:
            per_step[name] = run()  # the CPU's way: a read at every step
        reads[name] = counter.count
    assert min(reads.values()) >= 41  # the loops ran 41 steps, each with a read
    # Pretend to be on an accelerator (the interval the loops use off the CPU).
    monkeypatch.setattr(decoding, "_stop_check_every", lambda device: 8, raising=False)
    for name, run in runs.items():
        with BoolReads() as counter:
            result = run()
        assert counter.count <= 41 // 8 + 3, (name, counter.count)
        for field in ("tokens", "lengths", "log_probs", "scores", "finished"):
            same = torch.equal(getattr(result, field), getattr(per_step[name], field))
            assert same, (name, field)
    assert per_step["greedy"].tokens.shape == (3, 41)  # trimmed to the longest sentence


def test_allowed_copies_nothing_to_the_device(monkeypatch) -> None:
    """The banned tokens are filled column by column: no index tensor at each step."""
    from aiayn.decoding import _allowed

    model, logits, made = tiny(0), torch.zeros(2, V), []
    real_tensor = torch.tensor
    monkeypatch.setattr(
        torch, "tensor", lambda *a, **k: made.append(a) or real_tensor(*a, **k)
    )
    out = _allowed(logits, model, 0, 2)
    assert (
        made == []
        and bool(torch.isinf(out[:, [PAD, BOS, EOS]]).all())
        and (logits == 0).all()
    )


# --- translate and the command line: over-long inputs, lines of stdin, bad options ----


class Characters:
    """One id per character ('a' is 3, 'b' is 4, ...): enough of chapter 11's API."""

    def encode(self, text: str) -> list[int]:
        return [3 + (ord(ch) - ord("a")) % (V - 3) for ch in text if ch != " "]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def test_translate_refuses_over_long_texts_before_decoding(monkeypatch) -> None:
    import aiayn.decoding as decoding

    model = tiny(0, max_len=12)
    monkeypatch.setattr(decoding, "beam_search", lambda *a, **k: pytest.fail("decoded"))
    texts = ["abc", "a" * 13, "", "b" * 20]
    listed = r"2 input\(s\).*texts\[1\] \(13 tokens\), texts\[3\] \(20 tokens\)"
    with pytest.raises(ValueError, match=listed):
        decoding.translate(model, Characters(), texts)
    assert "max_len=12" in str(
        pytest.raises(ValueError, decoding.translate, model, Characters(), texts).value
    )


def test_translate_cli_lines_end_only_at_newlines(checkpoint: Path) -> None:
    stdin = "1 2\x0c3\n4\x1c5\r\n6\u20287\n\n8 9"  # \f, \x1c and U+2028 inside lines
    done = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "--greedy", stdin=stdin
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split("\n")) == 5 + 1  # five input lines, five output lines
    assert done.stdout.split("\n")[3] == ""  # the empty fourth line stays empty


def test_translate_cli_translates_every_line_that_fits_and_names_the_others(
    checkpoint: Path,
) -> None:
    from aiayn.batching import load_checkpoint_model

    limit = load_checkpoint_model(checkpoint)[0].config.max_len
    long_line = " ".join(["3"] * (limit + 2))
    stdin = "\n".join(["1 2", long_line, "4 5", long_line + " 6"]) + "\n"
    done = run_aiayn(
        "translate", "--checkpoint", str(checkpoint), "--greedy", stdin=stdin
    )
    assert done.returncode == 1
    lines = done.stdout.split("\n")
    assert (
        len(lines) == 4 + 1 and lines[1] == lines[3] == "" and lines[0] and lines[2]
    ), done.stdout
    errors = done.stderr.strip().splitlines()
    assert errors[0] == (
        f"error: line 2: {limit + 2} tokens, more than the model's positional table "
        f"holds (max_len={limit}); shorten or split it"
    )
    assert errors[1].startswith(f"error: line 4: {limit + 3} tokens")
    assert (
        errors[2] == "error: 2 of 4 lines not translated; their output lines are empty."
    )


def test_translate_cli_names_a_line_that_is_not_utf8_and_translates_the_rest(
    checkpoint: Path,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "LC_ALL": "C.UTF-8",
        "PYTHONUTF8": "0",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "translate",
            "--checkpoint",
            str(checkpoint),
            "--greedy",
        ],
        input="1 2\n3 \xe4 4\n5 6\n".encode("latin-1"),
        capture_output=True,
        env=env,
        timeout=HANG_S,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stdout.decode().split("\n")
    assert len(lines) == 3 + 1 and lines[1] == "" and lines[0] and lines[2]
    assert done.stderr.decode().splitlines()[0] == (
        "error: line 2: not UTF-8 (byte 0xe4 at byte 3); "
        "convert it, e.g. with iconv -f latin1 -t utf-8"
    )


def test_translate_cli_at_a_terminal_says_it_reads_standard_input(
    checkpoint: Path,
) -> None:
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiayn",
            "translate",
            "--checkpoint",
            str(checkpoint),
            "--greedy",
        ],
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(follower)
    os.write(leader, b"1 2 3\n\x04")  # a line, then Ctrl-D
    out, err = run.communicate(timeout=HANG_S)
    os.close(leader)
    assert run.returncode == 0, err
    assert err.decode().startswith(
        "reading the texts from standard input, one per line; end with Ctrl-D"
    )
    assert len(out.decode().splitlines()) == 1


def test_translate_and_bleu_use_one_cpu_thread_unless_told(
    checkpoint: Path, monkeypatch, capsys
) -> None:
    from aiayn import cli

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert (
        cli.translate_main(["--checkpoint", str(checkpoint), "--device", "cpu", "1 2"])
        == 0
    )
    assert (
        cli.translate_main(
            ["--checkpoint", str(checkpoint), "--device", "cpu", "--threads", "2", "1"]
        )
        == 0
    )
    assert calls[0] == 1 and calls[2] == 2  # each followed by the number it found
    help_text = run_aiayn("bleu", "--help").stdout
    assert "--threads" in help_text and "--pretrained" in help_text


def test_translate_cli_refuses_non_finite_temperature_and_alpha(
    checkpoint: Path,
) -> None:
    for options in (
        ["--sample", "--temperature", "inf"],
        ["--sample", "--temperature", "1e-300"],
        ["--alpha", "inf"],
        ["--alpha", "nan"],
    ):
        done = run_aiayn(
            "translate", "--checkpoint", str(checkpoint), *options, "1 2 3"
        )
        assert done.returncode == 2 and done.stdout == "", (options, done.stderr)
        assert "error: " in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr


def test_sampling_never_calls_multinomial_which_reads_the_device_from_the_host(
    monkeypatch,
) -> None:
    """torch.multinomial checks its input on the host: on a GPU, a wait per token."""
    from aiayn.decoding import sample

    monkeypatch.setattr(
        torch, "multinomial", lambda *a, **k: pytest.fail("multinomial called")
    )
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(20, max_len=16)).eval()
    src = torch.randint(4, 20, (3, 5))
    out = sample(
        model,
        src,
        temperature=0.8,
        top_k=5,
        generator=torch.Generator().manual_seed(1),
        max_len=6,
    )
    assert out.tokens.shape[0] == 3


def test_one_sampling_draw_compiles_without_a_graph_break() -> None:
    from aiayn.decoding import sampling_probs
    from aiayn.variants import draw

    def step(logits: torch.Tensor) -> torch.Tensor:
        return draw(sampling_probs(logits, 0.7, 3))

    explained = torch._dynamo.explain(step)(torch.randn(4, 11))
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_draw_samples_with_the_given_probabilities() -> None:
    from aiayn.variants import draw

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    picks = draw(probs.expand(100_000, -1), torch.Generator().manual_seed(0))
    frequency = torch.bincount(picks, minlength=5) / 100_000
    assert (frequency - probs).abs().max() < 0.01 and frequency[4] == 0


def test_translate_refuses_a_model_whose_weights_hold_nan(checkpoint: Path) -> None:
    """Such a model translates all to one repeated token: refuse, naming the tensors."""
    from aiayn.batching import load_checkpoint_model
    from aiayn.decoding import translate
    from aiayn.model import content_hash

    model, tokenizer = load_checkpoint_model(checkpoint)
    with torch.no_grad():
        model.encoder.layers[0].ffn.w_1.weight[0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"weights hold NaN or inf \(encoder.layers.0.ffn.w_1.weight\)"
    ):
        translate(model, tokenizer, ["1 2 3"])
    # a file written by an older version, which did not refuse such weights
    saved = torch.load(checkpoint, weights_only=True)
    saved["state_dict"]["encoder.layers.0.ffn.w_1.weight"][0, 0] = float("nan")
    body = {k: v for k, v in saved.items() if k != "sha256"}
    broken = checkpoint.parent / "broken.pt"
    torch.save({**body, "sha256": content_hash(body)}, broken)
    for command in (["--greedy"], ["--sample"], []):
        done = run_aiayn("translate", "--checkpoint", str(broken), *command, "1 2 3")
        assert done.returncode == 2 and done.stdout == "", done.stderr
        said = "error: the model's weights hold NaN or inf"
        assert done.stderr.startswith(said), done.stderr


def test_translate_takes_any_iterable_names_a_missing_tokenizer_and_unreadable_texts(
    checkpoint: Path,
) -> None:
    from aiayn.batching import load_checkpoint_model
    from aiayn.decoding import translate

    model, tokenizer = load_checkpoint_model(checkpoint)
    assert translate(
        model, tokenizer, (t for t in ["1 2", "3"]), method="greedy"
    ) == translate(model, tokenizer, ["1 2", "3"], method="greedy")
    with pytest.raises(
        ValueError,
        match=r"translate needs a tokenizer with encode and decode \(chapter 11\), "
        r"got None; a checkpoint written by Transformer.save holds none",
    ):
        translate(model, None, ["1 2"])
    with pytest.raises(ValueError, match=r"texts must be strings; texts\[1\] is not"):
        translate(model, tokenizer, ["1 2", 3])
    with pytest.warns(
        UserWarning, match=r"1 text\(s\) are mostly unknown tokens .*texts\[1\] first"
    ):
        translate(model, tokenizer, ["1 2", "Zwei Hunde"], method="greedy")
