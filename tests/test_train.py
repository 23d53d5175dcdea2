"""Tests of aiayn.train (chapter 13): data, decoding, the training step, checkpoints, resume, the command."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.batching import Batch, make_batch
from aiayn.train import (
    PRESETS,
    Experiment,
    TrainConfig,
    Trainer,
    autocast_dtype,
    enable_grad_checkpointing,
    encode_pairs,
    exact_match,
    greedy_decode,
    load_checkpoint_model,
    main,
    make_loader,
    pick_device,
    register_preset,
    saved_activation_bytes,
    synthetic_pairs,
    synthetic_tokenizer,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = synthetic_tokenizer(10)
PAIRS = encode_pairs(TOKENIZER, synthetic_pairs("reverse", 240, n_symbols=10, min_len=1, max_len=8, seed=1))


def tiny_model(dropout: float = 0.1, **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig.tiny(TOKENIZER.vocab_size, max_len=9, dropout=dropout, **overrides))


def config(**overrides) -> TrainConfig:
    base = dict(steps=6, warmup=4, factor=0.5, log_every=0, device="cpu", progress=False)
    return TrainConfig(**{**base, **overrides})


def trainer(steps: int = 6, model: Transformer | None = None, loader=None, **overrides) -> Trainer:
    loader = make_loader(PAIRS, TOKENIZER, max_tokens=160) if loader is None else loader
    return Trainer(model or tiny_model(), config(steps=steps, **overrides), loader,
                   make_loader(PAIRS[:40], TOKENIZER, 160, shuffle=False), TOKENIZER, log=None)


def without_key_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The key bias has a zero gradient (chapter 2): Adam turns its rounding noise into full steps."""
    out = {}
    for name, value in state.items():
        if name.endswith("in_proj.bias"):
            d = value.numel() // 3
            value = torch.cat([value[:d], value[2 * d:]])  # b_Q and b_V
        out[name] = value
    return out


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    a, b = without_key_bias(a), without_key_bias(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


# --- data --------------------------------------------------------------------------------------------

def test_synthetic_pairs_are_deterministic_copies_and_reversals():
    copy_pairs = synthetic_pairs("copy", 50, n_symbols=7, min_len=2, max_len=5, seed=3)
    reverse_pairs = synthetic_pairs("reverse", 50, n_symbols=7, min_len=2, max_len=5, seed=3)
    assert copy_pairs == synthetic_pairs("copy", 50, n_symbols=7, min_len=2, max_len=5, seed=3)
    assert all(s == t for s, t in copy_pairs)
    assert [s for s, _ in copy_pairs] == [s for s, _ in reverse_pairs]
    assert all(t.split() == s.split()[::-1] for s, t in reverse_pairs)
    assert all(2 <= len(s.split()) <= 5 and set(s.split()) <= set("0123456") for s, _ in copy_pairs)
    assert synthetic_tokenizer(7).vocab_size == 11
    with pytest.raises(ValueError, match="task must be one of"):
        synthetic_pairs("sort", 3)
    with pytest.raises(ValueError, match="max_len"):
        synthetic_pairs("copy", 3, min_len=4, max_len=2)


def test_pick_device_and_amp():
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto").type in ("cpu", "mps")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("gpu0")
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="amp must be one of"):
        autocast_dtype("fp8", cpu)
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(accum_steps=0)


# --- decoding --------------------------------------------------------------------------------------

def reference_decode(model: Transformer, src: torch.Tensor, max_len: int) -> list[int]:
    """Greedy decoding of one unpadded source, one token at a time, in plain Python."""
    c = model.config
    tokens = [c.bos_id]
    with torch.no_grad():
        memory = model.encode(src[None])
        for _ in range(max_len):
            logits = model.decode(torch.tensor([tokens]), memory, src[None])  # [1, t, V]
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == c.eos_id:
                break
    return tokens[1:]


def test_greedy_decode_matches_one_sentence_at_a_time():
    model = tiny_model(dropout=0.0).eval()
    with torch.no_grad():  # make the end token likely, so that rows stop at different steps
        model.head.weight[model.config.eos_id] *= 6
    sources = [p[0] for p in PAIRS[:12]]
    batch = make_batch([(s, [4]) for s in sources], 0, 1, 2)  # padded sources: [12, src_len]
    out = greedy_decode(model, batch.src, max_len=7)  # [12, n]
    expected = [reference_decode(model, torch.tensor(s), 7) for s in sources]
    assert any(len(e) < 7 for e in expected) and any(e[-1] != 2 for e in expected)  # both kinds of rows
    assert out.size(1) == max(len(e) for e in expected)
    for row, e in zip(out.tolist(), expected):
        assert row == e + [0] * (out.size(1) - len(e))  # the tokens, then padding
    assert model.training is False
    model.train()
    greedy_decode(model, batch.src, max_len=3)
    assert model.training  # the mode is restored
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(model, batch.src, max_len=0)


def test_exact_match_counts_whole_sequences():
    model = tiny_model(dropout=0.0).eval()
    with torch.no_grad():
        model.head.weight[model.config.eos_id] *= 6  # most rows end within a few tokens
    sources = [p[0] for p in PAIRS[:20]]
    predicted = greedy_decode(model, make_batch([(s, [4]) for s in sources], 0, 1, 2).src, max_len=9)
    pairs, expected = [], 0
    for i, (source, row) in enumerate(zip(sources, predicted.tolist())):
        if 2 not in row:
            continue
        target = row[: row.index(2)]  # what the model writes before its end token
        if i % 2:
            target = target + [4]  # one token more: no longer an exact match
        else:
            expected += 1
        pairs.append((source, target))
    assert 0 < expected < len(pairs)
    assert exact_match(model, pairs, batch_size=7) == expected / len(pairs)


# --- one training step -----------------------------------------------------------------------------

def test_accumulating_two_halves_equals_one_full_batch():
    halves = [make_batch(PAIRS[0:7], 0, 1, 2), make_batch(PAIRS[7:20], 0, 1, 2)]  # unequal token counts
    full = make_batch(PAIRS[0:20], 0, 1, 2)
    two = trainer(steps=3, model=tiny_model(dropout=0.0), loader=halves, accum_steps=2, clip_norm=None)
    one = trainer(steps=3, model=tiny_model(dropout=0.0), loader=[full], clip_norm=None)
    h2, h1 = two.fit(), one.fit()
    assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)
    assert h2["grad_norm"] == pytest.approx(h1["grad_norm"], rel=1e-4)
    # Adam divides by sqrt(v): where a gradient is almost zero (a nearly dead ReLU unit), float
    # rounding of the two summation orders becomes a visible part of a step. 1e-3 is 5% of one
    # step at these learning rates; a wrong normalisation of the halves moves weights by a step.
    assert_close_weights(two.model.state_dict(), one.model.state_dict(), atol=1e-3)


def test_clipping_bounds_the_gradient_norm_seen_by_the_optimizer():
    for clip in (0.05, None):
        t = trainer(steps=2, clip_norm=clip)
        norms = []

        def record(optimizer, args, kwargs):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        t.optimizer.register_step_pre_hook(record)
        history = t.fit()
        assert all(n > 0.05 for n in history["grad_norm"])  # the norm before clipping
        if clip is None:
            assert norms == pytest.approx(history["grad_norm"], rel=1e-5)
        else:
            assert norms == pytest.approx([clip] * 2, rel=1e-4)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_runs_on_cpu(amp):
    t = trainer(steps=3, amp=amp)
    history = t.fit()
    assert t.amp_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    assert t.scaler.is_enabled() == (amp == "fp16")  # loss scaling only for float16
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # the weights stay float32


def test_grad_checkpointing_gives_identical_gradients_and_saves_memory():
    plain = tiny_model(dropout=0.1)
    checkpointed = copy.deepcopy(plain)
    assert enable_grad_checkpointing(checkpointed) == 4
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    batch = make_batch(PAIRS[:32], 0, 1, 2)

    def loss_of(model):
        torch.manual_seed(1)  # the same dropout masks for both
        return model(batch.src, batch.tgt_in).square().mean()

    loss_of(plain).backward()
    loss_of(checkpointed).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), checkpointed.parameters()))
    kept_plain = saved_activation_bytes(lambda: loss_of(plain), exclude=plain.parameters())
    kept_ckpt = saved_activation_bytes(lambda: loss_of(checkpointed), exclude=checkpointed.parameters())
    assert kept_ckpt < kept_plain / 4
    assert enable_grad_checkpointing(checkpointed, enable=False) == 4
    assert type(checkpointed.encoder.layers[0]) is type(plain.encoder.layers[0])
    t = trainer(steps=2, grad_checkpointing=True)
    assert all(torch.isfinite(torch.tensor(t.fit()["loss"])))


# --- checkpoints and resume --------------------------------------------------------------------------

def test_interrupted_and_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    full = trainer(steps=14, eval_every=5)  # dropout 0.1: the random numbers must be restored too
    history = full.fit()
    assert full.epoch >= 1  # the run crosses an epoch boundary
    first = trainer(steps=6, eval_every=5, checkpoint_dir=str(tmp_path))
    first.fit()
    resumed = trainer(steps=14, model=tiny_model(), eval_every=5, checkpoint_dir=str(tmp_path))
    resumed.load_checkpoint(tmp_path / "last.pt")
    resumed_history = resumed.fit()
    assert resumed_history["loss"] == history["loss"]  # exactly, step for step
    assert resumed_history["lr"] == history["lr"]
    for step in (5, 10):
        assert resumed_history["valid_loss"][resumed_history["valid_step"].index(step)] == \
            history["valid_loss"][history["valid_step"].index(step)]
    assert all(torch.equal(a, b) for a, b in zip(full.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))
    again = Trainer.resume(tmp_path / "last.pt", make_loader(PAIRS, TOKENIZER, 160), log=None)
    assert again.step == 14 and again.config.steps == 14 and again.tokenizer.to_dict() == TOKENIZER.to_dict()


def test_an_interrupt_saves_the_last_completed_step(tmp_path):
    batches = list(make_loader(PAIRS, TOKENIZER, 160))

    class Interrupted:
        """The batches of one epoch, with a Ctrl-C while the 8th batch is being read."""

        def __iter__(self):
            for i, b in enumerate(batches):
                if i == 7:
                    raise KeyboardInterrupt
                yield b

    t = trainer(steps=10, loader=Interrupted(), accum_steps=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["training"]
    assert saved["step"] == 3 and saved["batch_in_epoch"] == 6  # not the 7th batch of the broken step


def test_checkpoints_are_atomic_and_bad_files_give_clear_errors(tmp_path, monkeypatch):
    t = trainer(steps=2, checkpoint_dir=str(tmp_path))
    t.fit()
    path = tmp_path / "last.pt"
    good = path.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        t.save_checkpoint()
    monkeypatch.undo()
    assert path.read_bytes() == good  # the interrupted save left the old checkpoint alone
    assert not list(tmp_path.glob("*.partial"))

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        trainer().load_checkpoint(truncated)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        trainer().load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="another configuration: d_ff=128 there, 64 here"):
        trainer(model=tiny_model(d_ff=64)).load_checkpoint(path)
    with pytest.raises(ValueError, match="warmup=4 there, 8 here"):
        trainer(warmup=8).load_checkpoint(path)
    bare = tmp_path / "model.pt"
    tiny_model().save(bare)
    with pytest.raises(ValueError, match="no training state"):
        trainer().load_checkpoint(bare)


def test_checkpoint_holds_only_plain_types_and_loads_as_a_model(tmp_path):
    t = trainer(steps=2, checkpoint_dir=str(tmp_path))
    t.fit()
    raw = torch.load(tmp_path / "last.pt", weights_only=True)
    assert {"format", "config", "state_dict", "tokenizer", "training"} <= set(raw)
    model, tokenizer = load_checkpoint_model(tmp_path / "last.pt")
    assert not model.training and tokenizer.to_dict() == TOKENIZER.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), t.model.state_dict().values()))
    assert Transformer.load(tmp_path / "last.pt").config == t.model.config  # chapter 9 reads it too


# --- the command line --------------------------------------------------------------------------------

def test_command_line_trains_and_writes_a_loadable_checkpoint(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "aiayn", "train", "--task", "copy", "--steps", "30", "--device", "cpu",
         "--checkpoint-dir", str(tmp_path), "--no-progress", "--train-size", "2000", "--valid-size", "50"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "checkpoint:" in result.stdout and "exact match" in result.stdout
    model, tokenizer = load_checkpoint_model(tmp_path / "last.pt")
    src = torch.tensor([tokenizer.encode("3 1 4 1 5")])
    assert greedy_decode(model, src, max_len=8).shape[0] == 1
    help_text = subprocess.run([sys.executable, "-m", "aiayn", "train", "--help"], capture_output=True,
                               text=True, cwd=ROOT, timeout=60).stdout
    assert "--preset" in help_text and "reverse" in help_text and "--n-symbols" in help_text


def test_a_registered_preset_is_trained_by_main(tmp_path, capsys):
    def build(args):
        return Experiment(tiny_model(dropout=0.0).config, TOKENIZER, PAIRS[:60], PAIRS[:10],
                          config(steps=2, checkpoint_dir=str(tmp_path)), max_tokens=160,
                          metric=lambda model: 0.5, metric_name="half")

    register_preset("test-preset", build, help="a preset of the tests")
    try:
        assert main(["--preset", "test-preset", "--no-progress"]) == 0
    finally:
        del PRESETS["test-preset"]
    assert "half 0.5000" in capsys.readouterr().out and (tmp_path / "last.pt").is_file()
    with pytest.raises(SystemExit):
        main(["--preset", "no-such-preset"])
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err
