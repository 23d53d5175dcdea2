"""Tests of `python -m aiayn bleu` (chapter 20): options are checked before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aiayn.cli as cli
from aiayn import Transformer
from aiayn.multi30k import (
    DATA_ENV,
    TINY_RECIPE,
    SubwordTokenizer,
    load_multi30k,
    save_translation_model,
)
from conftest import local_multi30k


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untrained model and a small subword tokenizer, in one checkpoint file."""
    pairs = load_multi30k("train", root=local_multi30k())[:500]
    tokenizer = SubwordTokenizer.train(
        [text for pair in pairs for text in pair], vocab_size=300
    )
    torch.manual_seed(0)
    model = Transformer(TINY_RECIPE.model_config(tokenizer.vocab_size))
    # what a trained checkpoint records
    task = {"data": "multi30k", "direction": "de-en"}
    return save_translation_model(
        model, tokenizer, tmp_path_factory.mktemp("bleu") / "model.pt", task
    )


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the data or decoding fails the test: the command must stop before."""
    monkeypatch.setattr(
        cli, "load_multi30k", lambda *a, **k: pytest.fail("read the data")
    )
    monkeypatch.setattr(cli, "evaluate_bleu", lambda *a, **k: pytest.fail("decoded"))


@pytest.mark.parametrize("limit", ["0", "-1", "two"])
def test_limit_must_be_a_positive_number_of_sentences(
    checkpoint, no_work, capsys, limit
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.bleu_main(
            ["--checkpoint", str(checkpoint), "--limit", limit, "--device", "cpu"]
        )
    assert stopped.value.code == 2
    assert "--limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    "where", ["a directory", "a missing directory", "under a file"]
)
def test_an_unwritable_output_is_refused_before_any_work(
    checkpoint, no_work, capsys, tmp_path, where
) -> None:
    output = {
        "a directory": tmp_path,
        "a missing directory": tmp_path / "missing" / "out.txt",
        "under a file": checkpoint / "out.txt",
    }[where]
    code = cli.bleu_main(
        ["--checkpoint", str(checkpoint), "--output", str(output), "--device", "cpu"]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.startswith("error: ")
        and str(output) in err
        and "--output" in err
    )


def test_limit_and_output_work_together(
    checkpoint, capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(local_multi30k()))
    existing = tmp_path / "out.txt"
    existing.write_text("old\n", encoding="utf-8")
    code = cli.bleu_main(
        [
            "--checkpoint",
            str(checkpoint),
            *"--limit 2 --greedy --device cpu".split(),
            "--output",
            str(existing),
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "test2016 de-en, 2 sentences, greedy" in capsys.readouterr().out
    # replaced, not appended
    assert len(existing.read_text(encoding="utf-8").splitlines()) == 2
    fresh = tmp_path / "fresh.txt"  # a refused run leaves no file behind
    assert (
        cli.bleu_main(
            ["--checkpoint", str(tmp_path / "none.pt"), "--output", str(fresh)]
        )
        == 2
    )
    assert not fresh.exists()
