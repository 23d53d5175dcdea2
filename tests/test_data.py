"""Tests of aiayn.multi30k (chapter 16).

Multi30k files, the subword tokenizer, BLEU, recipes, presets and commands.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import sacrebleu
import torch

import aiayn.batching as batching
import aiayn.multi30k as data
from aiayn import Transformer
from aiayn.batching import load_checkpoint_model, tokenizer_from_dict
from aiayn.decoding import translate
from aiayn.multi30k import (
    CACHE_ENV,
    DATA_ENV,
    MULTI30K_SHA256,
    TINY_RECIPE,
    Multi30kRecipe,
    SubwordTokenizer,
    book_model,
    book_model_path,
    corpus_bleu,
    download_multi30k,
    evaluate_bleu,
    load_multi30k,
    multi30k_dir,
    normalize,
    read_lines,
    save_translation_model,
    split_files,
)
from conftest import HANG_S, local_multi30k

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No data directory set, an empty cache: every file must come from a download."""
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def shared_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The local copy that the environment variable names; a cache of the test's own."""
    directory = local_multi30k()
    monkeypatch.setenv(DATA_ENV, str(directory))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return directory


def copy_of(directory: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for name in MULTI30K_SHA256:
        shutil.copy(directory / name, target / name)
    return target


# --- the files ------------------------------------------------------------------------


def test_the_environment_variable_names_the_data(shared_data):
    assert multi30k_dir() == shared_data
    sizes = {
        split: len(load_multi30k(split)) for split in ("train", "valid", "test2016")
    }
    assert sizes == {"train": 29000, "valid": 1014, "test2016": 1000}
    first = load_multi30k("train")[0]
    assert first == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    assert load_multi30k("train", "en-de")[0] == first[::-1]


def test_an_argument_wins_over_the_environment_variable(shared_data, tmp_path):
    copy = copy_of(shared_data, tmp_path / "copy")
    (copy / "val.en.gz").unlink()
    with pytest.raises(ValueError, match="val.en.gz is missing"):
        load_multi30k("valid", root=copy)
    assert len(load_multi30k("test2016", root=copy)) == 1000  # the test files are there


def test_a_corrupt_file_is_refused_with_what_to_do(shared_data, tmp_path):
    copy = copy_of(shared_data, tmp_path / "copy")
    raw = bytearray((copy / "test_2016_flickr.en.gz").read_bytes())
    raw[100] ^= 0xFF  # one flipped byte
    (copy / "test_2016_flickr.en.gz").write_bytes(bytes(raw))
    with pytest.raises(
        ValueError, match=r"test_2016_flickr.en.gz has sha256 .* truncated or altered"
    ) as err:
        multi30k_dir(copy)
    assert DATA_ENV in str(err.value) and data.MULTI30K_URL in str(err.value)
    multi30k_dir(copy, splits=["train", "valid"])  # only the named splits are checked


def test_missing_files_and_directories_are_clear_errors(
    shared_data, tmp_path, monkeypatch
):
    with pytest.raises(ValueError, match="is not a directory"):
        multi30k_dir(tmp_path / "nowhere")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=rf"from {DATA_ENV}.*train.de.gz is missing"):
        load_multi30k("train")
    with pytest.raises(ValueError, match="split must be one of"):
        split_files("test")
    with pytest.raises(ValueError, match="direction must be one of"):
        load_multi30k("train", "de-fr", root=shared_data)


def test_a_download_fills_the_cache_atomically_and_once(isolated, monkeypatch):
    origin = local_multi30k().resolve().as_uri()
    directory = multi30k_dir(splits=["valid"], base_url=origin)
    assert directory == isolated / "cache" / "multi30k"
    # no partial files
    assert sorted(p.name for p in directory.iterdir()) == ["val.de.gz", "val.en.gz"]
    assert len(load_multi30k("valid")) == 1014

    def no_network(url, path, timeout=60.0):
        raise AssertionError(f"fetched {url} again")

    monkeypatch.setattr(data, "fetch", no_network)
    # verified files in the cache are not fetched again
    assert len(load_multi30k("valid")) == 1014


def test_a_download_with_the_wrong_bytes_leaves_nothing(isolated, tmp_path):
    origin = copy_of(local_multi30k(), tmp_path / "origin")
    (origin / "val.en.gz").write_bytes(b"something else\n")
    with pytest.raises(ValueError, match="sent a file with sha256"):
        download_multi30k(isolated / "cache", ["val.en.gz"], base_url=origin.as_uri())
    assert list((isolated / "cache").iterdir()) == []


def test_no_network_and_no_download_are_clear_errors(isolated, monkeypatch):
    def offline(url, path, timeout=60.0):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(data, "fetch", offline)
    with pytest.raises(
        ValueError,
        match=r"cannot download https://raw.githubusercontent.com/multi30k/dataset/"
        r"a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw/train.de.gz",
    ):
        load_multi30k("train")
    with pytest.raises(ValueError, match="download=False"):
        load_multi30k("train", download=False)
    with pytest.raises(ValueError, match="not a file of Multi30k"):
        download_multi30k(isolated, ["train.fr.gz"])


def test_fetch_writes_through_a_partial_file(tmp_path):
    source = tmp_path / "source.txt"
    source.write_bytes(b"abc" * 1000)
    data.fetch(source.as_uri(), tmp_path / "copy.txt")
    assert (tmp_path / "copy.txt").read_bytes() == source.read_bytes()
    with pytest.raises(OSError):
        data.fetch((tmp_path / "missing.txt").as_uri(), tmp_path / "never.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.txt", "source.txt"]


def test_lines_end_only_at_newlines_and_normalize(tmp_path):
    path = tmp_path / "x.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("one\u2028still one\nzwei  Zeilen \n")
    assert read_lines(path) == ["one\u2028still one", "zwei  Zeilen "]
    assert normalize("  Ma\u0308dchen \t im   Schnee ") == "M\u00e4dchen im Schnee"


# --- the tokenizer --------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_data() -> list[tuple[str, str]]:
    return load_multi30k("train", root=local_multi30k())[:3000]


@pytest.fixture(scope="module")
def tokenizer(small_data) -> SubwordTokenizer:
    return SubwordTokenizer.train(
        [text for pair in small_data for text in pair], vocab_size=1000
    )


def test_the_tokenizer_follows_chapter_11s_protocol(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (
        0,
        1,
        2,
        3,
    )
    assert tokenizer.vocab_size == len(tokenizer) == 1000
    ids = tokenizer.encode("Ein Hund läuft.")
    assert ids and all(i >= 4 for i in ids)
    assert tokenizer.decode([1] + ids + [2, 9, 9, 0]) == "Ein Hund läuft."
    assert tokenizer.decode(torch.tensor(ids)) == "Ein Hund läuft."
    assert tokenizer.encode_batch(["Ein Hund läuft.", "a"]) == [
        ids,
        tokenizer.encode("a"),
    ]
    pieces = tokenizer.pieces("Ein Mann.")
    assert (
        pieces[0] == "▁Ein"
        and pieces[-1] == "."
        and "".join(pieces).replace("▁", " ").strip() == "Ein Mann."
    )
    assert tokenizer.decode(tokenizer.encode("Ein ☃ Hund")) == "Ein <unk> Hund"
    for bad in (
        lambda: tokenizer.encode(3),
        lambda: tokenizer.decode([5, 1000]),
        lambda: tokenizer.decode([-1]),
        lambda: tokenizer.decode(torch.zeros(2, 2, dtype=torch.long)),
        lambda: tokenizer.encode_batch("x"),
    ):
        with pytest.raises(ValueError):
            bad()


def test_decode_of_encode_is_the_normalised_text(tokenizer, small_data):
    spaced = "  Zwei   Männer\tim Schnee , lachend! "
    texts = [text for pair in small_data for text in pair] + [spaced]
    decoded = [tokenizer.decode(ids) for ids in tokenizer.encode_batch(texts)]
    assert decoded == [normalize(text) for text in texts]


def test_the_tokenizer_travels_in_dicts_and_files(tokenizer, tmp_path):
    again = tokenizer_from_dict(tokenizer.to_dict())
    assert isinstance(again, SubwordTokenizer)
    sentence = "Zwei Hunde spielen im Schnee."
    assert again.encode(sentence) == tokenizer.encode(sentence)
    assert all(isinstance(v, str) for v in tokenizer.to_dict().values())
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = SubwordTokenizer.load(tmp_path / "tokenizer.json")
    assert loaded.encode(sentence) == tokenizer.encode(sentence)
    for bad in (
        {"kind": "symbols"},
        {"kind": "subword"},
        {"kind": "subword", "tokenizer": "{"},
    ):
        with pytest.raises(ValueError):
            SubwordTokenizer.from_dict(bad)
    with pytest.raises(ValueError, match="no tokenizer file"):
        SubwordTokenizer.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="vocab_size"):
        SubwordTokenizer.train(["a b"], vocab_size=4)


def test_training_the_tokenizer_is_deterministic(small_data):
    texts = [text for pair in small_data[:500] for text in pair]
    first = SubwordTokenizer.train(texts, vocab_size=600).to_dict()
    assert SubwordTokenizer.train(texts, vocab_size=600).to_dict() == first


def test_the_books_vocabulary_gives_back_every_sentence_of_every_split():
    """Chapter 16's 4,000 pieces: exact detokenization, and no unknown piece at all."""
    root = local_multi30k()
    splits = {split: load_multi30k(split, root=root) for split in data.MULTI30K_SPLITS}
    texts = [text for pair in splits["train"] for text in pair]
    tokenizer = SubwordTokenizer.train(texts, data.BOOK_RECIPE.vocab_size)
    for split, pairs in splits.items():
        texts = [text for pair in pairs for text in pair]
        ids = tokenizer.encode_batch(texts)
        assert [tokenizer.decode(i) for i in ids] == texts, split
        assert not any(tokenizer.unk_id in i for i in ids), split


# --- BLEU -----------------------------------------------------------------------------


def test_corpus_bleu_is_sacrebleu():
    hyps = ["A man in an orange hat is staring at something.", "Two dogs run ."]
    refs = ["A man in an orange hat starring at something.", "Two dogs are running."]
    score, signature = corpus_bleu(hyps, refs)
    assert score == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-12)
    assert "case:mixed" in signature and "tok:13a" in signature
    lower, lower_signature = corpus_bleu(
        [h.upper() for h in hyps], refs, lowercase=True
    )
    assert lower == pytest.approx(score, abs=1e-12) and "case:lc" in lower_signature
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        corpus_bleu(hyps, refs[:1])


def test_evaluate_bleu_scores_translate_in_order(tokenizer, small_data):
    torch.manual_seed(0)
    model = Transformer(TINY_RECIPE.model_config(tokenizer.vocab_size)).eval()
    pairs = small_data[:12]
    result = evaluate_bleu(
        model, tokenizer, pairs, method="greedy", max_len=8, batch_size=5
    )
    sources, references = [s for s, _ in pairs], [r for _, r in pairs]
    assert result.hypotheses == translate(
        model, tokenizer, sources, method="greedy", max_len=8
    )
    assert result.score == pytest.approx(
        sacrebleu.corpus_bleu(result.hypotheses, [references]).score
    )
    lower = sacrebleu.corpus_bleu(result.hypotheses, [references], lowercase=True).score
    assert result.lowercase_score == pytest.approx(lower) and result.method == "greedy"
    beam = evaluate_bleu(
        model, tokenizer, pairs[:3], method="beam", beam_size=2, max_len=6
    )
    assert len(beam.hypotheses) == 3 and beam.method == "beam"
    with pytest.raises(ValueError, match="method"):
        evaluate_bleu(model, tokenizer, pairs, method="sample")


# --- recipes, checkpoints, book_model -------------------------------------------------


def test_recipes_make_shared_embedding_models_and_keys():
    config = TINY_RECIPE.model_config(500)
    assert (
        config.share_embeddings
        and config.tie_output
        and config.src_vocab_size == config.tgt_vocab_size
    )
    same = Multi30kRecipe(
        TINY_RECIPE.direction,
        TINY_RECIPE.vocab_size,
        dataclasses.replace(TINY_RECIPE.model),
        dataclasses.replace(TINY_RECIPE.schedule),
        TINY_RECIPE.max_tokens,
    )
    assert TINY_RECIPE.key() == same.key()
    for change in (
        dict(schedule=data.schedule(steps=20, warmup=10, factor=1.0, seed=1)),
        dict(model=dataclasses.replace(TINY_RECIPE.model, activation="gelu")),
        # every setting of the model is in the key
        dict(vocab_size=501),
        dict(max_tokens=256),
    ):
        changed = dataclasses.replace(TINY_RECIPE, **change)
        assert changed.key() != TINY_RECIPE.key(), change
    # the model's vocabulary is the tokenizer's, so its placeholder sizes do not
    # change the key
    assert (
        dataclasses.replace(
            TINY_RECIPE,
            model=dataclasses.replace(
                TINY_RECIPE.model, src_vocab_size=7, tgt_vocab_size=7
            ),
        ).key()
        == TINY_RECIPE.key()
    )
    assert TINY_RECIPE.train_config(log_every=3).steps == TINY_RECIPE.schedule.steps
    # one declaration per setting: the recipe holds the configurations of the model
    # and of the schedule
    assert {f.name for f in dataclasses.fields(Multi30kRecipe)} == {
        "direction",
        "vocab_size",
        "model",
        "schedule",
        "max_tokens",
    }
    for bad in (
        lambda: Multi30kRecipe(model=data.joint_model(d_model=30, n_heads=4)),
        lambda: Multi30kRecipe(direction="fr-en"),
        lambda: Multi30kRecipe(schedule=data.schedule(factor=0.0)),
        lambda: Multi30kRecipe(max_tokens=0),
        lambda: Multi30kRecipe(model={"d_model": 256}),
    ):
        with pytest.raises(ValueError):
            bad()


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory) -> Path:
    """A tiny untrained model saved with the subword tokenizer."""
    torch.manual_seed(0)
    model = Transformer(TINY_RECIPE.model_config(tokenizer.vocab_size))
    path = save_translation_model(
        model, tokenizer, tmp_path_factory.mktemp("model") / "model.pt"
    )
    return path


def test_a_saved_model_loads_with_its_tokenizer(checkpoint, tokenizer):
    assert checkpoint.with_name("tokenizer.json").is_file()
    raw = torch.load(checkpoint, weights_only=True)
    assert raw["tokenizer"]["kind"] == "subword"
    model, again = load_checkpoint_model(checkpoint)
    assert (
        isinstance(again, SubwordTokenizer) and again.to_dict() == tokenizer.to_dict()
    )
    assert not model.training and model.config.share_embeddings


def test_book_model_reads_the_cache_without_training(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = book_model_path()
    assert (
        path.parent.name == f"multi30k-de-en-{data.BOOK_RECIPE.key()}"
        and path.is_relative_to(tmp_path)
    )
    path.parent.mkdir(parents=True)
    shutil.copy(checkpoint, path)
    monkeypatch.setattr(
        data, "train_multi30k", lambda *a, **k: pytest.fail("book_model trained")
    )
    model, tokenizer = book_model()
    assert isinstance(tokenizer, SubwordTokenizer) and not model.training


def test_cpu_has_bf16_is_a_bool(monkeypatch):
    monkeypatch.delenv("AIAYN_CPU_BF16", raising=False)
    assert isinstance(batching.cpu_has_bf16(), bool)


def test_cpu_has_bf16_can_be_switched_off_and_on(monkeypatch):
    """AIAYN_CPU_BF16 reproduces a processor without (or with) bfloat16 instructions."""
    monkeypatch.setenv("AIAYN_CPU_BF16", "0")
    assert batching.cpu_has_bf16() is False
    monkeypatch.setenv("AIAYN_CPU_BF16", "1")
    assert batching.cpu_has_bf16() is True
    monkeypatch.setenv("AIAYN_CPU_BF16", "no")
    with pytest.raises(ValueError, match="AIAYN_CPU_BF16 must be 0 or 1, got 'no'"):
        batching.cpu_has_bf16()


# --- commands in fresh processes ------------------------------------------------------


def run_aiayn(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m aiayn ARGS` in a new process, importing the package from this tree."""
    env = {
        **os.environ,
        **(env or {}),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    return subprocess.run(
        [sys.executable, "-m", "aiayn", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=HANG_S,
    )


def test_translate_reads_a_subword_checkpoint_in_a_fresh_process(checkpoint):
    done = run_aiayn(
        "translate",
        "--checkpoint",
        str(checkpoint),
        "--greedy",
        "--max-len",
        "6",
        "Ein Hund läuft.",
        "Zwei Frauen.",
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split("\n")) == 3  # two lines and the final newline
    model, tokenizer = load_checkpoint_model(checkpoint)
    texts = ["Ein Hund läuft.", "Zwei Frauen."]
    expected = translate(model, tokenizer, texts, method="greedy", max_len=6)
    assert done.stdout.splitlines() == expected  # as this process translates


def test_book_model_in_a_new_process_translates_as_this_one(checkpoint, tmp_path):
    """The chapter's two lines (book_model, translate) in a fresh Python process."""
    path = book_model_path().relative_to(data.cache_dir())  # as under any cache
    (tmp_path / path).parent.mkdir(parents=True)
    shutil.copy(checkpoint, tmp_path / path)
    german = ["Ein kleiner Junge spielt im Park.", "Zwei Frauen lesen Zeitung."]
    two_lines = (
        "from aiayn.multi30k import book_model\n"
        "from aiayn.decoding import translate\n"
        "model, tokenizer = book_model()\n"
        f"print(*translate(model, tokenizer, {german!r}), sep='\\n')\n"
    )
    env = {
        **os.environ,
        CACHE_ENV: str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [sys.executable, "-c", two_lines],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    expected = translate(*load_checkpoint_model(checkpoint), german)
    assert done.stdout.splitlines() == expected


def test_the_preset_trains_two_steps_and_bleu_scores_the_checkpoint(tmp_path):
    env = {DATA_ENV: str(local_multi30k()), CACHE_ENV: str(tmp_path / "cache")}
    done = run_aiayn(
        *"train --preset multi30k-de-en --model tiny --steps 2".split(),
        *"--device cpu --train-size 200 --bleu-size 5".split(),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--no-progress",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "training multi30k-de-en on cpu" in done.stdout and "valid BLEU" in done.stdout
    )
    model, tokenizer = load_checkpoint_model(tmp_path / "run" / "last.pt")
    assert (
        isinstance(tokenizer, SubwordTokenizer)
        and model.config.d_model == TINY_RECIPE.model.d_model
    )
    scored = run_aiayn(
        "bleu",
        "--checkpoint",
        str(tmp_path / "run"),
        *"--limit 4 --greedy --device cpu".split(),
        "--output",
        str(tmp_path / "out.txt"),
        env=env,
    )
    assert scored.returncode == 0, scored.stderr
    assert (
        "test2016 de-en, 4 sentences, greedy: BLEU" in scored.stdout
        and "signature: nrefs:1|case:mixed" in scored.stdout
    )
    assert len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == 4
    missing = run_aiayn("bleu", "--checkpoint", str(tmp_path / "none.pt"), env=env)
    assert missing.returncode == 2 and "error:" in missing.stderr


def test_the_preset_picks_the_recipe_that_fits_the_device(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(DATA_ENV, str(local_multi30k()))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    on_cpu = data.multi30k_experiment(
        "multi30k-de-en", data.Multi30kTask(vocab_size=300, train_size=200), cpu
    )
    assert (
        on_cpu.options["model"] == "book"
        and on_cpu.model_config.d_model == data.BOOK_RECIPE.model.d_model
    )
    # as chapter 16 trains it
    assert on_cpu.train_config.amp == ("bf16" if batching.cpu_has_bf16() else "off")
    assert not on_cpu.train_config.compile and capsys.readouterr().err == ""
    gpu = data.Multi30kTask(model="gpu", vocab_size=300, train_size=200)
    asked = data.multi30k_experiment("multi30k-en-de", gpu, cpu)
    # given explicitly, it is honoured...
    assert asked.model_config.d_model == data.GPU_RECIPE.model.d_model
    # ... with a warning of the time it takes
    assert "--model book trains" in capsys.readouterr().err


def test_the_recipes_train_in_bf16_or_fp32_on_a_cpu_and_auto_on_a_gpu(monkeypatch):
    """Chapter 16 prints recipe_amp's precision; on a GPU "auto" (bf16; fp16 on T4)."""
    monkeypatch.setenv("AIAYN_CPU_BF16", "1")
    assert batching.recipe_amp(torch.device("cpu")) == "bf16"
    monkeypatch.setenv("AIAYN_CPU_BF16", "0")
    assert batching.recipe_amp(torch.device("cpu")) == "off"
    assert batching.recipe_amp(torch.device("cuda")) == "auto"


def test_corpus_bleu_of_no_sentences_is_a_clear_error():
    with pytest.raises(ValueError, match="corpus_bleu needs at least one sentence"):
        data.corpus_bleu([], [])
