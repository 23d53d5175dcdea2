"""Tests of aiayn.model (chapter 9).

The configuration, the full model, its initialisation and its checkpoints.
"""

from __future__ import annotations

import datetime
import math
import random
import re
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.batching import SymbolTokenizer
from aiayn.decoder import DecoderCache
from aiayn.masks import causal_mask, padding_mask, target_mask
from aiayn.model import (
    CHECKPOINT_FORMAT,
    Transformer,
    TransformerConfig,
    checkpoint_dict,
    content_hash,
    eval_mode,
    init_weights,
    load_state_dict_checked,
    read_checkpoint,
    write_checkpoint,
)
from conftest import HANG_S  # noqa: E402

V = 20
# [3, 7]
SRC = torch.tensor(
    [[5, 6, 7, 8, 2, 0, 0], [9, 10, 11, 12, 13, 14, 2], [3, 4, 2, 0, 0, 0, 0]]
)
# [3, 6]
TGT = torch.tensor([[1, 8, 7, 6, 5, 0], [1, 14, 13, 12, 11, 10], [1, 4, 3, 0, 0, 0]])
REAL = TGT != 0


def tiny(**overrides) -> Transformer:
    """A tiny model in evaluation mode, seeded."""
    torch.manual_seed(0)
    return Transformer(TransformerConfig.tiny(V, **overrides)).eval()


# --- configuration --------------------------------------------------------------------


def test_presets_have_the_papers_sizes():
    base, big = TransformerConfig.base(), TransformerConfig.big()
    assert (
        base.d_model,
        base.n_heads,
        base.n_encoder_layers,
        base.n_decoder_layers,
        base.d_ff,
        base.dropout,
    ) == (512, 8, 6, 6, 2048, 0.1)
    assert (
        big.d_model,
        big.n_heads,
        big.n_encoder_layers,
        big.n_decoder_layers,
        big.d_ff,
        big.dropout,
    ) == (1024, 16, 6, 6, 4096, 0.3)
    assert (
        base.src_vocab_size == base.tgt_vocab_size == 37000
        and base.share_embeddings
        and base.tie_output
    )
    small, tiny_cfg = TransformerConfig.small(8000), TransformerConfig.tiny(V)
    assert (small.d_model, small.n_heads, small.n_encoder_layers, small.d_ff) == (
        256,
        4,
        3,
        1024,
    )
    assert (
        tiny_cfg.d_model,
        tiny_cfg.n_encoder_layers,
        tiny_cfg.n_decoder_layers,
        tiny_cfg.d_ff,
    ) == (64, 2, 2, 128)
    assert TransformerConfig.big(32000, dropout=0.1).dropout == 0.1


def test_config_round_trip_through_plain_dict():
    config = TransformerConfig.small(8000, norm_first=True, positional="learned")
    data = config.to_dict()
    assert all(v is None or type(v) in (int, float, str, bool) for v in data.values())
    assert TransformerConfig.from_dict(data) == config


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: TransformerConfig.base(n_heads=7), "not divisible by n_heads"),
        (
            lambda: TransformerConfig.small(8000, tgt_vocab_size=6000),
            "share_embeddings",
        ),
        (lambda: TransformerConfig.tiny(V, pad_id=V), "pad_id"),
        (lambda: TransformerConfig.tiny(V, eos_id=-1), "eos_id"),
        (lambda: TransformerConfig.tiny(V, pad_id=2), "padding mask would hide"),
        (lambda: TransformerConfig.base(dropout=1.0), "dropout"),
        (lambda: TransformerConfig.base(d_model=0), "d_model must be an int"),
        (lambda: TransformerConfig.base(n_encoder_layers=True), "n_encoder_layers"),
        (lambda: TransformerConfig.base(positional="rotary"), "positional"),
        (lambda: TransformerConfig.base(activation="tanh"), "activation"),
        (lambda: TransformerConfig.tiny(V, d_model=63, n_heads=7), "even d_model"),
        (lambda: TransformerConfig.base(final_norm=0), "final_norm"),
        (lambda: TransformerConfig.base(num_layers=6), "unknown config field"),
        (lambda: TransformerConfig.from_dict({"d_model": 512}), "missing fields"),
        (lambda: TransformerConfig.from_dict([1, 2]), "mapping"),
    ],
)
def test_bad_configs_are_refused(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_config_is_frozen():
    with pytest.raises(Exception):
        TransformerConfig.tiny(V).d_model = 32  # type: ignore[misc]


# --- the model ------------------------------------------------------------------------


def test_forward_shapes_and_encode_decode():
    model = tiny()
    with torch.no_grad():
        logits = model(SRC, TGT)
        memory = model.encode(SRC)
        assert memory.shape == (3, 7, 64) and logits.shape == (3, 6, V)
        assert torch.allclose(model.decode(TGT, memory, SRC), logits)
        # a ready mask
        assert torch.allclose(model.decode(TGT, memory, padding_mask(SRC, 0)), logits)
        y = model.decoder(
            model.positional(model.tgt_embed(TGT)),
            memory,
            self_mask=target_mask(TGT, 0),
            memory_mask=padding_mask(SRC, 0),
        )  # the stages by hand: [3, 6, 64]
        assert torch.allclose(model.head(y), logits, atol=1e-6)


def test_eval_mode_restores_the_previous_mode_even_after_an_error():
    """eval_mode switches dropout off inside, and the old mode back on the way out."""
    model = tiny().train()
    with pytest.raises(RuntimeError, match="inside"), eval_mode(model):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("inside")
    assert all(m.training for m in model.modules())
    with eval_mode(model.eval()):
        pass
    assert not model.training


def test_tied_weights_are_one_parameter():
    model = tiny()
    assert model.src_embed.weight is model.tgt_embed.weight is model.head.weight
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert (
        sum(t.numel() for t in model.state_dict().values())
        == model.num_parameters() + 2 * V * 64
    )
    only_output = tiny(share_embeddings=False)
    assert only_output.tgt_embed.weight is only_output.head.weight
    assert only_output.src_embed.weight is not only_output.tgt_embed.weight
    only_inputs = tiny(tie_output=False)
    assert (
        only_inputs.src_embed.weight
        is only_inputs.tgt_embed.weight
        is not only_inputs.head.weight
    )
    assert bool((model.head.weight[0] == 0).all())  # the pad row starts at zero


def test_causal_and_padding_invariant():
    model = tiny()
    with torch.no_grad():
        logits = model(SRC, TGT)
        changed = TGT.clone()
        changed[:, 3] = 4
        after = model(SRC, changed)
        assert torch.allclose(after[:, :3], logits[:, :3], atol=1e-6)
        assert not torch.allclose(after[:, 3:], logits[:, 3:])
        alone = model(SRC[:1, :5], TGT[:1, :5])
        assert torch.allclose(alone, logits[:1, :5], atol=1e-5)
        more_padding = torch.cat([SRC[:1], torch.zeros(1, 4, dtype=torch.long)], 1)
        assert torch.allclose(model(more_padding, TGT[:1, :5]), alone, atol=1e-5)


def test_the_stacks_without_masks_read_the_future_and_forward_never_does():
    """The trap of a model whose masks default to None: the decoder reads ahead."""
    model = tiny()
    changed = TGT.clone()
    changed[:, 4] = 3  # another token at position 4
    with torch.no_grad():
        memory = model.encode(SRC)

        def unmasked(tgt: torch.Tensor) -> torch.Tensor:
            return model.head(
                model.decoder(model.positional(model.tgt_embed(tgt)), memory)
            )

        assert not torch.allclose(unmasked(changed)[:, :4], unmasked(TGT)[:, :4])
        assert torch.allclose(model(SRC, changed)[:, :4], model(SRC, TGT)[:, :4])


def test_parity_with_torch_transformer():
    """Same weights and final LayerNorms, opposite mask conventions: the same logits.

    They are compared at the real positions, not at the padding.
    """
    model = tiny(final_norm=True, dropout=0.1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    enc = {
        "self_attn.in_proj.": "self_attn.in_proj_",
        "ffn.w_1.": "linear1.",
        "ffn.w_2.": "linear2.",
        "res_attn.norm.": "norm1.",
        "res_ffn.norm.": "norm2.",
    }
    dec = {
        "self_attn.in_proj.": "self_attn.in_proj_",
        "cross_attn.in_proj.": "multihead_attn.in_proj_",
        "cross_attn.out_proj.": "multihead_attn.out_proj.",
        "ffn.w_1.": "linear1.",
        "ffn.w_2.": "linear2.",
        "res_self.norm.": "norm1.",
        "res_cross.norm.": "norm2.",
        "res_ffn.norm.": "norm3.",
    }
    state = {}
    for stack, names in (("encoder", enc), ("decoder", dec)):
        for name, value in getattr(model, stack).state_dict().items():
            for ours, theirs in names.items():
                name = name.replace(ours, theirs)
            state[f"{stack}.{name}"] = value
    ref = nn.Transformer(64, 4, 2, 2, 128, 0.1, batch_first=True).eval()
    ref.load_state_dict(state)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = model(SRC, TGT)
        y = ref(
            model.positional(model.src_embed(SRC)),
            model.positional(model.tgt_embed(TGT)),
            tgt_mask=~causal_mask(TGT.size(1)),
            src_key_padding_mask=SRC == 0,
            tgt_key_padding_mask=TGT == 0,
            memory_key_padding_mask=SRC == 0,
        )
        theirs = model.head(y)
    assert torch.allclose(ours[REAL], theirs[REAL], atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_full_decoding(norm_first):
    model = tiny(norm_first=norm_first)
    with torch.no_grad():
        full = model(SRC, TGT)
        memory = model.encode(SRC)
        cache = model.new_cache()
        offsets, steps = [], []
        for t in range(TGT.size(1)):
            offsets.append(cache.seq_len)
            steps.append(model.decode(TGT[:, t : t + 1], memory, SRC, cache=cache))
        assert offsets == list(range(TGT.size(1)))
        assert torch.allclose(torch.cat(steps, 1)[REAL], full[REAL], atol=1e-5)
        cache = model.new_cache()
        chunks = [
            model.decode(TGT[:, a:b], memory, SRC, cache=cache)
            for a, b in ((0, 2), (2, 5), (5, 6))
        ]
        assert torch.allclose(torch.cat(chunks, 1)[REAL], full[REAL], atol=1e-5)
        assert isinstance(model.new_cache(), DecoderCache)


def test_learned_positions_and_gelu_run():
    model = tiny(positional="learned", activation="gelu", norm_first=True)
    with torch.no_grad():
        out = model(SRC, TGT)
    assert out.shape == (3, 6, V) and torch.isfinite(out).all()
    # table + final norms
    assert model.num_parameters() == tiny().num_parameters() + 1024 * 64 + 2 * 2 * 64


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m: m(SRC.float(), TGT), "integer token ids"),
        (lambda m: m(SRC, TGT.float()), "integer token ids"),
        (lambda m: m(SRC, TGT + V), r"tgt: token ids must lie in \[0, vocab_size\)"),
        (lambda m: m(SRC - 1, TGT), r"src: token ids must lie"),
        (lambda m: m(SRC, TGT[:2]), "src holds 3 sequences but tgt holds 2"),
        (lambda m: m(SRC[0], TGT), r"\[batch, src_len\]"),
        (lambda m: m(torch.ones(1, 1025, dtype=torch.long), TGT[:1]), "max_len=1024"),
        (
            lambda m: m.decode(TGT, m.encode(SRC)[:2], SRC[:2]),
            "tgt holds 3 sequences but memory 2",
        ),
        (lambda m: m.decode(TGT, m.encode(SRC), SRC[:, :5]), "memory was encoded from"),
        (lambda m: m.decode(TGT[:, :1], m.encode(SRC), SRC, cache=[]), "DecoderCache"),
        (lambda m: m.decode(TGT, torch.zeros(3, 64), SRC), "encoder output"),
        (lambda m: Transformer({"src_vocab_size": V}), "TransformerConfig"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, words):
    with pytest.raises(ValueError, match=words):
        call(tiny())


def test_too_long_with_cache_names_the_offset():
    model = tiny(max_len=8)
    with torch.no_grad():
        memory = model.encode(SRC)
        cache = model.new_cache()
        model.decode(TGT, memory, SRC, cache=cache)  # positions 0-5
        with pytest.raises(ValueError, match="after 6 cached positions"):
            model.decode(TGT[:, :3], memory, SRC, cache=cache)


# --- parameters and FLOPs -------------------------------------------------------------


def _layers(d: int, d_ff: int) -> int:
    encoder_layer = 4 * d * d + 2 * d * d_ff + d_ff + 9 * d
    decoder_layer = 8 * d * d + 2 * d * d_ff + d_ff + 15 * d
    return 6 * encoder_layer + 6 * decoder_layer


@pytest.mark.parametrize(
    "share, tie, base_count, big_count",
    [
        (True, True, 63_082_496, 214_245_376),
        (False, True, 82_026_496, 252_133_376),
        (True, False, 82_026_496, 252_133_376),
        (False, False, 100_970_496, 290_021_376),
    ],
)
def test_parameter_counts_on_meta(share, tie, base_count, big_count):
    with torch.device("meta"):
        base = Transformer(
            TransformerConfig.base(share_embeddings=share, tie_output=tie)
        )
        big = Transformer(TransformerConfig.big(share_embeddings=share, tie_output=tie))
    matrices = 3 - share - tie
    assert (
        base.num_parameters()
        == base_count
        == _layers(512, 2048) + matrices * 37000 * 512
    )
    assert (
        big.num_parameters()
        == big_count
        == _layers(1024, 4096) + matrices * 37000 * 1024
    )


def test_training_flops_match_six_n_d_plus_attention():
    with torch.device("meta"):
        model = Transformer(TransformerConfig.base())
        x_src = torch.empty(8, 25, 512, requires_grad=True)
        x_tgt = torch.empty(8, 25, 512, requires_grad=True)
        mask = torch.ones(8, 1, 1, 25, dtype=torch.bool)
        causal = causal_mask(25)
        labels = torch.zeros(200, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        memory = model.encoder(model.positional(x_src), mask=mask)
        y = model.decoder(
            model.positional(x_tgt), memory, self_mask=causal, memory_mask=mask
        )
        F.cross_entropy(model.head(y).flatten(0, 1), labels).backward()
    n = model.num_parameters()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    attention = 3 * 8 * (6 * 4 * 25**2 + 6 * 4 * (25**2 + 25 * 25)) * 512
    assert counter.get_total_flops() == 6 * (n - vectors) * 200 + attention
    assert abs(counter.get_total_flops() / (6 * n * 200) - 1) < 0.02


# --- initialisation and precision -----------------------------------------------------


def test_init_is_xavier_per_matrix():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.small(1000))
    layer = model.decoder.layers[0]
    # each [256, 256]: sqrt(6 / 512) bound
    for w in layer.cross_attn.in_proj.weight.chunk(3):
        assert (
            w.abs().max() <= math.sqrt(6 / 512)
            and abs(w.std().item() * math.sqrt(256) - 1) < 0.03
        )
    assert (
        abs(layer.ffn.w_1.weight.std().item() / math.sqrt(2 / (256 + 1024)) - 1) < 0.03
    )
    assert abs(model.head.weight.std().item() * math.sqrt(256) - 1) < 0.03
    assert all(
        bool((p == 0).all()) for n, p in model.named_parameters() if n.endswith("bias")
    )
    assert all(
        bool((m.weight == 1).all())
        for m in model.modules()
        if isinstance(m, nn.LayerNorm)
    )
    with torch.no_grad():
        model.head.weight.fill_(1.0)
    init_weights(model)
    assert (
        bool((model.src_embed.weight[0] == 0).all()) and model.head.weight.std() < 0.1
    )


def test_init_weights_draws_w_q_w_k_w_v_apart_where_torch_packs_them():
    """Each third of in_proj gets Xavier's 1/d_model; torch's packed one half that."""
    torch.manual_seed(0)
    ours = tiny(d_model=512, n_heads=8).encoder.layers[0].self_attn.in_proj.weight
    for w in ours.detach().chunk(3):  # W^Q, W^K, W^V: [512, 512] each
        assert abs(w.std().item() * math.sqrt(512) - 1) < 0.01
    theirs = nn.MultiheadAttention(512, 8).in_proj_weight  # [1536, 512]
    assert abs(theirs.std().item() * math.sqrt(1024) - 1) < 0.01


def test_at_initialisation_every_layer_is_standardised_and_the_loss_near_log_v():
    """Post-norm layers end in a LayerNorm; Xavier branches do not echo the input."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.small(8000)).eval()
    stds = []
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.register_forward_hook(lambda m, args, out: stds.append(out.std().item()))
    src, tgt, labels = (torch.randint(3, 8000, (2, 16)) for _ in range(3))
    with torch.no_grad():
        logits = model(src, tgt)  # [2, 16, 8000]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert len(stds) == 6 and all(abs(s - 1) < 0.01 for s in stds)
    assert abs(logits.std().item() - 1) < 0.05
    assert abs(loss - math.log(8000) - 0.5) < 0.5  # log V + 1/2: unit-variance logits
    assert (logits.argmax(-1) == tgt).float().mean() < 0.5  # no echo of the input


def test_bfloat16_autocast_on_cpu_has_no_nan():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.small(V))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(SRC, TGT)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), TGT.flatten())
    loss.backward()
    assert (
        logits.dtype == torch.bfloat16
        and torch.isfinite(logits).all()
        and torch.isfinite(loss)
    )
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        reference = model(SRC, TGT)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(SRC, TGT)
    assert ((low.float() - reference).norm() / reference.norm()) < 0.02


# --- checkpoints ----------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    model = tiny()
    path = tmp_path / "model.pt"
    model.save(path)
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"format", "config", "state_dict", "tokenizer", "sha256"}
    restored = Transformer.load(path).eval()
    assert restored.config == model.config
    assert restored.src_embed.weight is restored.head.weight
    with torch.no_grad():
        assert torch.equal(restored(SRC, TGT), model(SRC, TGT))
    assert not (tmp_path / "model.pt.partial").exists()
    other = tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_weights(path)
    with torch.no_grad():
        assert torch.equal(other(SRC, TGT), model(SRC, TGT))


def test_wrong_config_checkpoint_is_a_clear_value_error(tmp_path):
    path = tmp_path / "model.pt"
    tiny().save(path)
    wider = tiny(d_model=32)
    with pytest.raises(ValueError, match="d_model=64 there, 32 here"):
        wider.load_weights(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    with pytest.raises(
        ValueError,
        match=r"of another shape: src_embed.weight is \[20, 64\] there, "
        r"\[20, 32\] here",
    ):
        load_state_dict_checked(wider, state)
    with pytest.raises(ValueError, match="missing"):
        load_state_dict_checked(
            tiny(), {k: v for k, v in state.items() if "decoder" not in k}
        )
    with pytest.raises(ValueError, match="one shared matrix here"):
        load_state_dict_checked(
            tiny(), tiny(share_embeddings=False, tie_output=False).state_dict()
        )
    with pytest.raises(ValueError, match="max_len=16 there"):
        tiny(positional="learned", max_len=16).save(tmp_path / "learned.pt")
        tiny(positional="learned", max_len=32).load_weights(tmp_path / "learned.pt")


def test_sinusoidal_model_loads_into_a_longer_table(tmp_path):
    short = tiny(max_len=16)
    short.save(tmp_path / "short.pt")
    longer = tiny(max_len=64)
    longer.load_weights(tmp_path / "short.pt")
    with torch.no_grad():
        assert torch.equal(longer(SRC, TGT), short(SRC, TGT))
        assert longer(torch.randint(3, V, (1, 40)), TGT[:1]).shape == (1, 6, V)


def test_a_mismatch_is_one_message_where_torch_writes_a_line_per_tensor():
    """load_state_dict_checked names the misfits in one line; torch lists them all."""
    state, wider = tiny().state_dict(), tiny(d_model=32)
    with pytest.raises(RuntimeError) as theirs:
        wider.load_state_dict(state)
    with pytest.raises(ValueError, match=r"and \d+ more") as ours:
        load_state_dict_checked(wider, state)
    assert len(str(theirs.value).splitlines()) > 50
    assert len(str(ours.value).splitlines()) == 1


def test_truncated_missing_and_foreign_files(tmp_path):
    path = tmp_path / "model.pt"
    tiny().save(path)
    data = path.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        Transformer.load(tmp_path / "truncated.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        Transformer.load(tmp_path / "empty.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Transformer.load(tmp_path / "missing.pt")
    torch.save(tiny().state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="not written by Transformer.save"):
        Transformer.load(tmp_path / "bare.pt")


def test_checkpoint_dict_stores_a_shared_matrix_once(tmp_path):
    model = tiny()
    checkpoint = checkpoint_dict(model, None, step=7)
    state = checkpoint["state_dict"]
    assert checkpoint["step"] == 7 and checkpoint["tokenizer"] is None
    assert (
        state["src_embed.weight"] is state["head.weight"] is state["tgt_embed.weight"]
    )
    assert all(not t.requires_grad and t.device.type == "cpu" for t in state.values())
    path = write_checkpoint(checkpoint, tmp_path / "deep" / "folder" / "model.pt")
    with zipfile.ZipFile(path) as archive:
        arrays = [n for n in archive.namelist() if re.search(r"/data/\d+$", n)]
    assert len(arrays) == len(state) - 2  # three names, one matrix
    loaded = read_checkpoint(path)["state_dict"]
    assert loaded["src_embed.weight"].data_ptr() == loaded["head.weight"].data_ptr()
    with pytest.raises(ValueError, match="writes \\['config'\\] itself"):
        checkpoint_dict(model, config=1)
    with pytest.raises(ValueError, match="takes a Transformer"):
        checkpoint_dict(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="checkpoint_dict"):
        write_checkpoint({"state_dict": {}}, tmp_path / "x.pt")


def test_single_byte_flips_raise_or_change_nothing(tmp_path):
    model = tiny()
    path = tmp_path / "model.pt"
    model.save(path)
    data = path.read_bytes()
    original = content_hash(read_checkpoint(path))
    # the pickle and the zip records, where flips are rarer
    with zipfile.ZipFile(path) as archive:
        first = min(archive.infolist(), key=lambda i: i.header_offset)
        structure = list(range(first.header_offset + first.compress_size + 200)) + list(
            range(len(data) - 2000, len(data))
        )
    rng = random.Random(0)
    anywhere = [rng.randrange(len(data)) for _ in range(100)]
    raised = []
    for pos in anywhere + rng.sample(structure, 100):
        damaged = bytearray(data)
        damaged[pos] ^= rng.randrange(1, 256)
        (tmp_path / "damaged.pt").write_bytes(damaged)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about some damaged pickles
            try:
                loaded = read_checkpoint(tmp_path / "damaged.pt")
            except ValueError:
                raised.append(pos)
                continue
        assert content_hash(loaded) == original, (
            f"a flip at byte {pos} changed the content"
        )
    # most of the file is tensor bytes
    assert sum(pos in raised for pos in anywhere) >= 90


def test_a_flipped_tensor_byte_names_the_damage(tmp_path):
    model = tiny()
    path = tmp_path / "model.pt"
    model.save(path)
    data = bytearray(path.read_bytes())
    matrix = model.head.weight.detach().numpy().tobytes()
    data[data.find(matrix) + len(matrix) // 2 + 3] ^= 0x40
    path.write_bytes(data)
    assert not torch.equal(
        torch.load(path, weights_only=True)["state_dict"]["head.weight"],
        model.head.weight,
    )  # torch.load alone does not notice
    with pytest.raises(ValueError, match="damaged after it was written"):
        Transformer.load(path)


def test_files_without_a_hash_still_load(tmp_path):
    model = tiny()
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "config": model.config.to_dict(),
            "state_dict": model.state_dict(),
        },
        tmp_path / "old.pt",
    )
    with torch.no_grad():
        assert torch.equal(
            Transformer.load(tmp_path / "old.pt").eval()(SRC, TGT), model(SRC, TGT)
        )


class Opaque:
    """A class the safe loader does not know."""


def test_python_objects_are_refused_by_name_not_called_corrupt(tmp_path):
    when = datetime.datetime(2017, 6, 12)
    cases = {
        "datetime.datetime": {"format": CHECKPOINT_FORMAT, "when": when},
        f"{__name__}.Opaque": {"format": CHECKPOINT_FORMAT, "object": Opaque()},
    }
    for i, (name, content) in enumerate(cases.items()):
        torch.save(content, tmp_path / f"foreign{i}.pt")
        with pytest.raises(ValueError) as info:
            read_checkpoint(tmp_path / f"foreign{i}.pt")
        message = str(info.value)
        assert (
            "safe loader" in message
            and name in message
            and "weights_only=False" in message
        )
        assert "truncated" not in message


def test_a_shared_matrix_holding_nan_is_one_matrix_and_is_never_saved(tmp_path):
    model = tiny()
    with torch.no_grad():
        model.head.weight[3, 5] = float("nan")
    with pytest.raises(
        ValueError, match="src_embed.weight, tgt_embed.weight, head.weight"
    ):
        model.save(tmp_path / "nan.pt")  # one matrix under three names, named by each
    state = {k: v.clone() for k, v in model.state_dict().items()}
    load_state_dict_checked(tiny(), state)  # NaN in all three names: one matrix
    # genuinely different matrices are still refused
    state["tgt_embed.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="one shared matrix here"):
        load_state_dict_checked(tiny(), state)


def test_a_failed_write_is_a_clear_oserror_and_keeps_the_old_file(
    tmp_path, monkeypatch
):
    path = tmp_path / "model.pt"
    tiny().save(path)
    good = path.read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"the first bytes of a checkpoint")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
            "writing file data/0: file write failed"
        )

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        tiny(d_model=32).save(path)
    message = str(info.value)
    assert (
        str(path) in message
        and "PytorchStreamWriter failed writing file data/0" in message
    )
    assert "enforce fail" not in message and "MiB are free" in message
    assert "previous file there is untouched" in message
    with pytest.raises(OSError, match="nothing was written there"):
        tiny().save(tmp_path / "new.pt")

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"the first bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny().save(path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert not (tmp_path / "new.pt").exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 2).half(),
        torch.randn(5).bfloat16(),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),
        torch.tensor(7),
        torch.arange(12).reshape(3, 4).t(),
        torch.zeros(0, 4),
    ],
    ids=[
        "float16",
        "bfloat16",
        "bool",
        "0-dim float",
        "0-dim int64",
        "transposed",
        "empty",
    ],
)
def test_content_hash_round_trips(tmp_path, tensor):
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "tensor": tensor,
        "plain": [1, 2.5, None, "x", True],
    }
    write_checkpoint(checkpoint, tmp_path / "t.pt")
    loaded = read_checkpoint(tmp_path / "t.pt")
    assert content_hash(loaded) == content_hash(checkpoint)
    assert loaded["tensor"].dtype == tensor.dtype and torch.equal(
        loaded["tensor"], tensor
    )
    changed = {
        **checkpoint,
        "tensor": tensor.clone().reshape(-1).flip(0).reshape(tensor.shape),
    }
    if tensor.numel() > 1 and not torch.equal(changed["tensor"], tensor):
        assert content_hash(changed) != content_hash(checkpoint)
    assert (
        content_hash({"a": 1}) != content_hash({"a": True}) != content_hash({"a": "1"})
    )
    assert content_hash([1, [2]]) != content_hash([[1], 2])


def test_top_level_import():
    import aiayn
    from aiayn import Transformer as TopTransformer
    from aiayn import TransformerConfig as TopConfig

    assert TopTransformer is Transformer and TopConfig is TransformerConfig
    assert {"Transformer", "TransformerConfig"} <= set(aiayn.__all__)


def test_cached_decode_of_as_many_new_positions_as_sentences() -> None:
    """decode gives its masks explicit axes, so batch = new positions = 3 is clear."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(20)).eval()
    src = torch.tensor([[4, 9, 7, 3], [6, 8, 0, 0], [3, 3, 9, 0]])  # [3, 4]
    # [3, 6]
    tgt = torch.tensor([[1, 5, 3, 7, 9, 4], [1, 8, 6, 2, 5, 5], [1, 11, 9, 3, 3, 2]])
    with torch.no_grad():
        full = model(src, tgt)  # [3, 6, 20]
        memory, cache = model.encode(src), model.new_cache()
        chunks = [
            model.decode(tgt[:, a:b], memory, src, cache=cache)
            for a, b in ((0, 3), (3, 6))
        ]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_full_disk_is_named_as_one_even_when_torch_reports_an_unexpected_position(
    tmp_path, monkeypatch
):
    """On a full disk, torch.save's zip writer reports 'unexpected pos', not ENOSPC."""
    path = tmp_path / "model.pt"

    def short_write(obj, f, *args, **kwargs):
        f.write(b"the first bytes")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1024"
        )

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(
        OSError,
        match=r"could not write the checkpoint .*model.pt \(the disk is full\); "
        r".* MiB are free on that disk, and nothing was written there",
    ):
        tiny().save(path)
    monkeypatch.undo()
    import builtins

    import aiayn.model as model_module

    def to_dev_full(file, mode="r", *args, **kwargs):  # a disk with 0 bytes free
        return builtins.open(
            "/dev/full" if str(file).endswith(".partial") else file,
            mode,
            *args,
            **kwargs,
        )

    if not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    monkeypatch.setattr(model_module, "open", to_dev_full, raising=False)
    with pytest.raises(OSError, match=r"\(the disk is full\)"):
        tiny().save(path)
    assert not path.exists() and not list(tmp_path.glob("*.partial"))


def test_weights_with_nan_or_inf_are_never_written_and_are_named(tmp_path):
    from aiayn.model import nonfinite_weights

    model = tiny()
    with torch.no_grad():
        model.encoder.layers[0].ffn.w_1.weight[0, 0] = float("nan")
        model.decoder.layers[0].ffn.w_2.bias[1] = float("inf")
    assert nonfinite_weights(model) == [
        "encoder.layers.0.ffn.w_1.weight",
        "decoder.layers.0.ffn.w_2.bias",
    ]
    with pytest.raises(
        ValueError,
        match=r"refusing to write .*model.pt: the weights hold NaN or inf in "
        r"encoder.layers.0.ffn.w_1.weight, decoder.layers.0.ffn.w_2.bias\.",
    ):
        model.save(tmp_path / "model.pt")
    assert not list(tmp_path.iterdir())


def test_a_file_size_limit_is_named_as_one_not_as_a_full_disk(tmp_path):
    """At 22e25ab a write stopped by `ulimit -f` was reported as "the disk is full"."""
    code = (
        "import resource, signal, sys, torch\n"
        "from aiayn import Transformer, TransformerConfig\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)"
        "  # a write past the limit fails, EFBIG\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    Transformer(TransformerConfig.tiny(20)).save(sys.argv[1])\n"
        "except OSError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model.pt")],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert "file-size limit (ulimit -f)" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "model.pt").exists()


def test_a_config_of_another_version_says_so_and_swapped_arguments_are_named():
    from aiayn.decoding import translate
    from aiayn.model import nonfinite_weights

    fields = TransformerConfig.tiny(20).to_dict()
    with pytest.raises(
        ValueError, match=r"unknown fields \['rope'\].*newer one: update the package"
    ):
        # at 22e25ab: no version hint
        TransformerConfig.from_dict({**fields, "rope": True})
    tokenizer = SymbolTokenizer([str(i) for i in range(10)])
    with pytest.raises(
        ValueError,
        match="takes a Transformer first, got SymbolTokenizer; are the arguments",
    ):
        translate(tokenizer, tiny(), ["1 2"])  # at 22e25ab: AttributeError ... 'items'
    with pytest.raises(
        ValueError, match="takes a model or a state_dict, got SymbolTokenizer"
    ):
        nonfinite_weights(tokenizer)
