"""Chapter 19: Hugging Face models into the book's Transformer, and out to CTranslate2.

Every Hugging Face model here is made from its family's config class with random
weights, saved with save_pretrained and loaded back from the folder: no network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")  # the extras are in requirements.txt; CI has them
pytest.importorskip("ctranslate2")

from transformers import (  # noqa: E402
    FSMTConfig,
    FSMTForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
)

from aiayn import Transformer, TransformerConfig  # noqa: E402
from aiayn.cli import export_main  # noqa: E402
from aiayn.decoding import (  # noqa: E402
    CTRANSLATE2_RULES,
    beam_search,
    greedy_search,
    translate,
)
from aiayn.multi30k import load_multi30k, pretrained  # noqa: E402
from aiayn.production import (  # noqa: E402
    CTranslate2Model,
    config_from_huggingface,
    export_ctranslate2,
    from_huggingface,
    load_huggingface,
)

REPO = Path(__file__).resolve().parents[1]

SIZES = [  # (layers, d_model, heads, d_ff): three configurations per family
    (1, 32, 4, 64),
    (2, 48, 6, 96),
    (2, 64, 8, 128),
]


def sizes(layers: int, d_model: int, heads: int, d_ff: int, std: float = 0.02) -> dict:
    """The size fields both families share; std, the weights' (0.02: the default)."""
    return dict(
        encoder_layers=layers,
        decoder_layers=layers + 1,
        d_model=d_model,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff,
        max_position_embeddings=64,
        init_std=std,
    )


def marian(size: tuple, std: float = 0.02, **extra: Any) -> MarianMTModel:
    fields = dict(
        vocab_size=97,
        pad_token_id=96,
        decoder_start_token_id=96,
        eos_token_id=0,
        activation_function="swish",
        **sizes(*size, std=std),
    )
    config = MarianConfig(**{**fields, **extra})
    model = MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_()
    return model


def fsmt(size: tuple, std: float = 0.02, **extra: Any) -> FSMTForConditionalGeneration:
    fields = dict(
        langs=["de", "en"],
        src_vocab_size=91,
        tgt_vocab_size=83,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        **sizes(*size, std=std),
    )
    config = FSMTConfig(**{**fields, **extra})
    return FSMTForConditionalGeneration(config)


def fsmt_wmt19(size: tuple, std: float = 0.02, **extra: Any) -> Any:
    """FSMT shaped as fairseq's WMT19 models: the decoder's FFN half the encoder's."""
    return fsmt(size, std, **{"decoder_ffn_dim": size[-1] // 2, **extra})


FAMILIES = {"marian": marian, "fsmt": fsmt, "wmt19": fsmt_wmt19}


def reloaded(model: Any) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return type(model).from_pretrained(folder).eval()


def output_matrix(hf: Any) -> torch.Tensor:
    if hf.config.model_type == "fsmt":
        return hf.model.decoder.output_projection.weight
    return hf.lm_head.weight


def padded_batch(
    c: TransformerConfig, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, c.src_vocab_size - 1, (4, 9), generator=g)
    tgt = torch.randint(3, c.tgt_vocab_size - 1, (4, 6), generator=g)
    src[:, -1] = c.eos_id
    src[1, 5], src[1, 6:] = c.eos_id, c.pad_id
    src[3, 2], src[3, 3:] = c.eos_id, c.pad_id
    tgt[:, 0] = c.bos_id
    tgt[2, 4:] = c.pad_id
    return src, tgt


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"d{s[1]}")
def test_logits_equal_huggingface(family: str, size: tuple) -> None:
    torch.manual_seed(0)
    hf = reloaded(FAMILIES[family](size))
    ours = from_huggingface(hf)
    assert not ours.training
    c = ours.config
    src, tgt = padded_batch(c)
    with torch.no_grad():
        theirs = hf(
            input_ids=src,
            attention_mask=(src != c.pad_id).long(),
            decoder_input_ids=tgt,
            use_cache=False,  # FSMT builds its causal mask only without the cache
        ).logits
        mine = ours(src, tgt)
    real = tgt != c.pad_id
    real[:, 0] = True  # Marian starts from the padding id
    assert theirs.shape == mine.shape
    assert (theirs - mine)[real].abs().max().item() < 1e-5
    assert theirs[real].abs().max().item() > 0.1  # not a comparison of zeros


def test_converted_configs_say_what_each_family_changes() -> None:
    m = config_from_huggingface(marian(SIZES[0]))
    assert (m.activation, m.positional, m.output_bias) == ("silu", "table", True)
    assert m.bos_id == m.pad_id == 96 and m.eos_id == 0
    assert m.share_embeddings and m.tie_output and not m.norm_first
    assert m.final_norm is False and m.dropout == 0.0
    f = config_from_huggingface(fsmt(SIZES[0]))
    assert (f.src_vocab_size, f.tgt_vocab_size, f.share_embeddings) == (91, 83, False)
    assert f.bos_id == f.eos_id == 2 and f.pad_id == 1 and not f.output_bias
    assert (f.n_encoder_layers, f.n_decoder_layers) == (1, 2)
    tied = fsmt(SIZES[0], tie_word_embeddings=False)
    assert config_from_huggingface(tied).tie_output is False
    assert f.decoder_d_ff is None  # one width for both stacks
    w = config_from_huggingface(fsmt_wmt19(SIZES[0]))
    assert (w.d_ff, w.decoder_d_ff) == (64, 32)
    converted = from_huggingface(fsmt_wmt19(SIZES[0]))
    widths = {layer.ffn.d_ff for layer in converted.encoder.layers}
    assert widths == {64} and {
        layer.ffn.d_ff for layer in converted.decoder.layers
    } == {32}
    with pytest.raises(ValueError, match="different attention heads"):
        config_from_huggingface(fsmt(SIZES[0], decoder_attention_heads=2))


PUBLISHED = sorted((REPO / "tests" / "published_configs").glob("*.json"))


def published(path: Path) -> Any:
    """A model of a published configuration, full size, with random weights."""
    fields = json.loads(path.read_text())
    if fields["model_type"] == "fsmt":
        return FSMTForConditionalGeneration(FSMTConfig(**fields)).eval()
    config = MarianConfig(**fields)
    # opus-mt-de-en's file is kept in part: what it leaves out must be implied by it
    assert config.pad_token_id == fields["decoder_start_token_id"]
    assert config.vocab_size == fields["decoder_vocab_size"]
    return MarianMTModel(config).eval()


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_published_configurations_convert(path: Path) -> None:
    """OPUS-MT base and big and fairseq's WMT19 convert at their published shapes.

    The configurations are the models' own files (tests/published_configs/README.md
    says where each comes from); the weights are random, the shapes are real.
    """
    fields = json.loads(path.read_text())
    torch.manual_seed(0)
    hf = published(path)
    ours = from_huggingface(hf)
    c = ours.config
    d_ff, decoder_d_ff = fields["encoder_ffn_dim"], fields["decoder_ffn_dim"]
    assert (c.d_model, c.n_heads) == (
        fields["d_model"],
        fields["encoder_attention_heads"],
    )
    assert (c.n_encoder_layers, c.n_decoder_layers) == (
        fields["encoder_layers"],
        fields["decoder_layers"],
    )
    assert (c.d_ff, c.decoder_d_ff) == (
        d_ff,
        None if decoder_d_ff == d_ff else decoder_d_ff,
    )
    assert c.max_len == fields["max_position_embeddings"]
    named = {"swish": "silu", "relu": "relu"}  # what each file says, in torch's word
    assert c.activation == named[fields["activation_function"]]
    assert {layer.ffn.d_ff for layer in ours.decoder.layers} == {decoder_d_ff}
    # every weight is carried over: the book's count is Hugging Face's, less the
    # position tables (a buffer here), plus Marian's logit bias (a buffer there)
    tables = hf.model.encoder.embed_positions.weight.numel() * 2
    bias = c.tgt_vocab_size if c.output_bias else 0
    assert ours.num_parameters() == hf.num_parameters() - tables + bias
    src = torch.tensor([[5, 6, 7, 8, 9, c.eos_id], [10, 11, c.eos_id] + [c.pad_id] * 3])
    tgt = torch.tensor([[c.bos_id, 12, 13, 14], [c.bos_id, 15, 16, 17]])
    with torch.no_grad():
        theirs = hf(
            input_ids=src,
            attention_mask=(src != c.pad_id).long(),
            decoder_input_ids=tgt,
            use_cache=False,
        ).logits
        mine = ours(src, tgt)
    assert (theirs - mine).abs().max().item() < 1e-5
    assert theirs.abs().max().item() > 0.1


def ended_often(hf: Any) -> Any:
    """Scale the end token's output row, so that some sentences end early.

    And no end token forced at the limit: the book's search does not force one.
    """
    with torch.no_grad():
        output_matrix(hf)[hf.config.eos_token_id] *= 8.0
    hf.generation_config.forced_eos_token_id = None
    return hf


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("beams", [1, 4])
def test_greedy_and_beam_equal_generate(family: str, beams: int) -> None:
    lengths = set()
    for seed, size in enumerate(SIZES):
        torch.manual_seed(seed)
        hf = ended_often(reloaded(FAMILIES[family](size, std=0.3)))
        ours = from_huggingface(hf)
        c = ours.config
        src = padded_batch(c, seed)[0]
        out = hf.generate(
            input_ids=src,
            attention_mask=(src != c.pad_id).long(),
            num_beams=beams,
            do_sample=False,
            max_new_tokens=12,
            length_penalty=0.0,
            early_stopping=False,
            bad_words_ids=[[c.pad_id]],
        )
        theirs = [[t for t in row if t != c.pad_id] for row in out[:, 1:].tolist()]
        if beams == 1:
            result = greedy_search(ours, src, max_len=12)
        else:
            result = beam_search(ours, src, beam_size=beams, alpha=0.0, max_len=12)
        mine = [[t for t in row if t != c.pad_id] for row in result.tokens.tolist()]
        assert mine == theirs, (size, mine, theirs)
        lengths |= {len(row) for row in mine}
    assert min(lengths) < 12 and max(lengths) == 12, lengths  # ends early and late


def sentencepiece_marian(folder: Path) -> Any:
    """A MarianTokenizer on a SentencePiece model trained here, saved in folder."""
    spm = pytest.importorskip("sentencepiece")
    from transformers import MarianTokenizer

    text = folder / "text.txt"
    sentences = [
        "ein Hund läuft über die Wiese",
        "zwei Kinder spielen im Schnee",
        "eine Frau liest ein Buch",
        "a dog runs across the meadow",
        "two children play in the snow",
        "a woman reads a book",
    ]
    text.write_text("\n".join(sentences * 20) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "spm"),
        vocab_size=40,
        model_type="unigram",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        unk_id=1,
        pad_id=-1,
    )
    pieces = [
        line.split("\t")[0] for line in open(folder / "spm.vocab", encoding="utf-8")
    ]
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = MarianTokenizer(
        source_spm=str(folder / "spm.model"),
        target_spm=str(folder / "spm.model"),
        vocab=str(folder / "vocab.json"),
    )
    return tokenizer, len(vocab)


def test_load_huggingface_from_a_folder_translates_as_generate(tmp_path: Path) -> None:
    tokenizer, size = sentencepiece_marian(tmp_path)
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=size,
        pad_token_id=size - 1,
        decoder_start_token_id=size - 1,
        eos_token_id=0,
        activation_function="swish",
        **sizes(*SIZES[1], std=0.3),
    )
    hf = ended_often(MarianMTModel(config).eval())
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    model, ours = load_huggingface(folder)
    texts = ["ein Hund spielt im Schnee", "eine Frau", "zwei Kinder lesen ein Buch"]
    assert [ours.encode(t) for t in texts] == tokenizer(texts)["input_ids"]
    assert all(ours.encode(t)[-1] == 0 for t in texts)  # </s> ends the source
    mine = translate(model, ours, texts, method="greedy", max_len=12)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    out = hf.generate(
        **batch,
        num_beams=1,
        do_sample=False,
        max_new_tokens=12,
        bad_words_ids=[[size - 1]],
    )
    theirs = tokenizer.batch_decode(out, skip_special_tokens=True)
    assert mine == theirs
    assert ours.id_to_token(0) == "</s>" and repr(ours).startswith(
        "HuggingFaceTokenizer"
    )


def test_the_package_imports_without_the_extras() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "sys.modules['ctranslate2'] = None\n"
        "import aiayn\n"
        "from aiayn import from_huggingface\n"
        "from aiayn.production import export_ctranslate2, load_huggingface\n"
        "from aiayn.model import Transformer, TransformerConfig\n"
        "for call in (lambda: load_huggingface('x'),\n"
        "             lambda: export_ctranslate2(None, None, 'x')):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as err:\n"
        "        print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout.splitlines()
    # at 22e25ab: `pip install "aiayn[hf]"`, but no aiayn is on the package index
    repository = "git+https://github.com/literate-transformer/aiayn"
    assert out == [
        "this needs transformers, which is not installed: pip install transformers "
        f'sentencepiece sacremoses, or pip install "aiayn[hf] @ {repository}".',
        "this needs ctranslate2, which is not installed: pip install ctranslate2, "
        f'or pip install "aiayn[ctranslate2] @ {repository}".',
    ]


def test_from_huggingface_refuses_what_it_cannot_convert() -> None:
    with pytest.raises(
        ValueError, match="MarianMTModel or an FSMTForConditionalGeneration"
    ):
        from_huggingface(torch.nn.Linear(2, 2))
    uneven = marian(SIZES[0], decoder_attention_heads=2)
    with pytest.raises(ValueError, match="different attention heads"):
        from_huggingface(uneven)
    odd = marian(SIZES[0], activation_function="tanh")
    with pytest.raises(ValueError, match="activation 'tanh'"):
        from_huggingface(odd)
    from transformers import MarianForCausalLM

    decoder_only = MarianForCausalLM(odd.config)  # at 22e25ab: an AttributeError
    with pytest.raises(ValueError, match="got MarianForCausalLM"):
        from_huggingface(decoder_only)


def test_a_folder_without_tokenizer_or_with_a_pickle_is_one_line(
    tmp_path: Path,
) -> None:
    """At 22e25ab: a 38-line TypeError, and a 32-line UnpicklingError."""
    import os

    torch.manual_seed(0)
    folder = tmp_path / "no-tokenizer"
    marian(SIZES[0]).save_pretrained(folder)
    with pytest.raises(
        ValueError, match="holds no tokenizer that transformers can read"
    ) as caught:
        load_huggingface(folder)
    assert "\n" not in str(caught.value) and "source.spm" in str(caught.value)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo this must never run",))

    pickled = tmp_path / "pickled"
    marian(SIZES[0]).save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"model.shared.weight": Payload()}, pickled / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match="pickled weights file .* refuses to run"
    ) as caught:
        load_huggingface(pickled)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="cannot load .*missing"):
        load_huggingface(tmp_path / "missing")


class Strings:
    """A tokenizer of token strings t0, t1, ...: enough to name a vocabulary."""

    def id_to_token(self, i: int) -> str:
        return f"t{i}"


def exported(family: str, folder: Path) -> tuple[Transformer, Any, Any, list, list]:
    """A converted model of family that often ends early, exported to CTranslate2.

    Returns the model, CTranslate2's translator, a padded batch, its sentences as
    token strings, and the tokens the export suppresses.
    """
    import ctranslate2

    torch.manual_seed(1)
    hf = ended_often(FAMILIES[family](SIZES[1], std=0.3).eval())
    model = from_huggingface(hf)
    c = model.config
    export_ctranslate2(model, Strings(), folder)
    translator = ctranslate2.Translator(str(folder))
    src = padded_batch(c)[0]
    sources = [[f"t{i}" for i in row if i != c.pad_id] for row in src.tolist()]
    banned = json.loads((folder / "aiayn_export.json").read_text())
    return model, translator, src, sources, banned["suppress_tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_models_export_to_ctranslate2_exactly(
    family: str, tmp_path: Path
) -> None:
    """Post-norm, SiLU, a logit bias, a start token that is padding or </s>."""
    model, translator, src, sources, banned = exported(family, tmp_path / "ct2")
    mine = greedy_search(model, src, max_len=12)
    assert banned == [f"t{model.config.pad_id}"]  # the start is pad, or </s>
    results = translator.translate_batch(
        sources,
        beam_size=1,
        max_decoding_length=12,
        min_decoding_length=0,
        return_end_token=True,
        suppress_sequences=[banned],
    )
    theirs = [[int(t[1:]) for t in r.hypotheses[0]] for r in results]
    ours = [row[: int(n)] for row, n in zip(mine.tokens.tolist(), mine.lengths)]
    assert theirs == ours


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_with_ctranslate2s_rules_decodes_as_ctranslate2(
    family: str, tmp_path: Path
) -> None:
    """BeamRules names what CTranslate2 does: with its rules, the same beams."""
    model, translator, src, sources, banned = exported(family, tmp_path / "ct2")
    results = translator.translate_batch(
        sources,
        beam_size=4,
        length_penalty=0.6,
        max_decoding_length=12,
        min_decoding_length=0,
        suppress_sequences=[banned],
    )
    theirs = [[int(t[1:]) for t in r.hypotheses[0]] for r in results]
    out = beam_search(model, src, 4, 0.6, max_len=12, rules=CTRANSLATE2_RULES)
    ours = [
        row[: int(n) - int(ended)]  # without the end token, as CTranslate2's
        for row, n, ended in zip(out.tokens.tolist(), out.lengths, out.finished)
    ]
    assert ours == theirs


@pytest.fixture(scope="module")
def shipped() -> tuple[Transformer, Any]:
    return pretrained("multi30k-de-en")


def test_exported_shipped_model_translates_test2016_exactly(
    shipped: tuple, tmp_path: Path
) -> None:
    model, tokenizer = shipped
    torch.set_num_threads(1)
    sources = [source for source, _ in load_multi30k("test2016", "de-en")]
    assert len(sources) == 1000
    export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    book = translate(model, tokenizer, sources, method="greedy", batch_size=100)
    engine = CTranslate2Model(tmp_path / "ct2", tokenizer).translate(
        sources, method="greedy", batch_size=100
    )
    assert sum(a == b for a, b in zip(book, engine)) == 1000


def test_quantized_export_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model, tokenizer = pretrained("multi30k-de-en")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_ctranslate2(model, tokenizer, tmp_path / "int8", quantization="int8")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_export_command(shipped: tuple, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "int8"
    assert (
        export_main(
            [
                "--ctranslate2",
                str(out),
                *"--pretrained multi30k-de-en --quantization int8".split(),
            ]
        )
        == 0
    )
    assert "7,578,624 parameters in int8" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {
        "aiayn_export.json",
        "aiayn_tokenizer.json",
        "config.json",
        "model.bin",
        "shared_vocabulary.json",
    }
    vocab = json.loads((out / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert vocab[:4] == ["<pad>", "<s>", "</s>", "<unk>"] and len(vocab) == 8000
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )

    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    assert (
        export_main(["--ctranslate2", str(keep), "--pretrained", "multi30k-de-en"]) == 2
    )
    assert "holds files that no export of this package wrote" in capsys.readouterr().err
    assert (keep / "notes.txt").read_text() == "keep me"

    bare = tmp_path / "bare.pt"
    shipped[0].save(bare)  # a checkpoint of the model alone
    args = ["--ctranslate2", str(tmp_path / "x"), "--checkpoint", str(bare)]
    assert export_main(args) == 2
    assert "holds no tokenizer" in capsys.readouterr().err
    missing = tmp_path / "no-such-model"  # not shipped, not a folder
    assert (
        export_main(
            ["--ctranslate2", str(tmp_path / "y"), "--pretrained", str(missing)]
        )
        == 2
    )
    assert capsys.readouterr().err == f"error: there is no folder {missing}.\n"
    assert export_main(["--ctranslate2", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == (
        "error: give the model as --checkpoint PATH or --pretrained NAME "
        "(checkpoint= or pretrained= in Python).\n"
    )


def test_config_options_default_to_the_paper() -> None:
    c = TransformerConfig.tiny(11)
    assert (c.activation, c.positional, c.scale_embeddings, c.output_bias) == (
        "relu",
        "sinusoidal",
        True,
        False,
    )
    assert "positional.pe" not in Transformer(c).state_dict()
    table = Transformer(TransformerConfig.tiny(11, positional="table"))
    assert "positional.pe" in table.state_dict()
    plain = Transformer(TransformerConfig.tiny(11, scale_embeddings=False))
    assert plain.src_embed.scale == 1.0
    assert Transformer(
        TransformerConfig.tiny(11, output_bias=True)
    ).head.bias.shape == (11,)
    with pytest.raises(ValueError, match="pad_id=2 equals eos_id=2"):
        TransformerConfig.tiny(11, pad_id=2)
    with pytest.raises(ValueError, match="output_bias must be True or False"):
        TransformerConfig.tiny(11, output_bias=1)


def test_a_start_token_that_is_padding_decodes_as_with_the_cache() -> None:
    torch.manual_seed(0)
    c = TransformerConfig.tiny(13, bos_id=0, pad_id=0, eos_id=2, activation="silu")
    model = Transformer(c).eval()
    src = torch.randint(3, 13, (2, 5))
    tgt = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 3]])
    with torch.no_grad():
        full = model(src, tgt)  # the start position is not hidden as padding
        memory, cache = model.encode(src), model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, src, cache) for i in range(4)]
    assert torch.isfinite(full).all()
    assert torch.allclose(full, torch.cat(steps, dim=1), atol=1e-5)


def test_ctranslate2_model_caps_outputs_at_the_position_table(tmp_path: Path) -> None:
    """At 22e25ab a Marian of 64 positions failed on 5 short texts.

    `translate` handles those texts; the CTranslate2 export must too.
    """
    tokenizer, size = sentencepiece_marian(tmp_path)
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=size,
        pad_token_id=size - 1,
        decoder_start_token_id=size - 1,
        eos_token_id=0,
        activation_function="swish",
        **sizes(*SIZES[0]),  # 64 positions; random weights rarely end a sentence
    )
    folder = tmp_path / "model"
    MarianMTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, ours = load_huggingface(folder)
    texts = ["zwei Kinder spielen im Schnee und eine Frau liest ein Buch"] * 5
    assert len(ours.encode(texts[0])) + 50 > model.config.max_len == 64
    book = translate(model, ours, texts, method="greedy")
    export_ctranslate2(model, ours, tmp_path / "ct2")
    engine = CTranslate2Model(tmp_path / "ct2", ours)
    assert engine.translate(texts, method="greedy") == book
    with pytest.raises(ValueError, match="texts must be a list of strings"):
        engine.translate("ein Hund")  # at 22e25ab: translated character by character
    with pytest.raises(
        ValueError, match="method must be 'beam' or 'greedy', got 'sample'"
    ):
        # at 22e25ab: run as beam search
        engine.translate(["ein Hund"], method="sample")
