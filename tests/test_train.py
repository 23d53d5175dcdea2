"""Tests of aiayn.train (chapter 13) and of the RunTrainer of aiayn.runs (chapter 14).

Data, decoding, one update, the loop, checkpoints, resume and the guards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.batching import load_checkpoint_model, make_batch, pick_device
from aiayn.model import read_checkpoint
from aiayn.optim import LabelSmoothingLoss
from aiayn.runs import NonFiniteLoss, RunTrainer, TrainingInterrupted, claim_folder
from aiayn.train import (
    RunFolder,
    TrainConfig,
    Trainer,
    autocast,
    autocast_dtype,
    average_checkpoints,
    encode_pairs,
    exact_match,
    greedy_decode,
    make_loader,
    make_scaler,
    synthetic_pairs,
    synthetic_tokenizer,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = synthetic_tokenizer(10)
PAIRS = encode_pairs(
    TOKENIZER,
    synthetic_pairs("reverse", 240, n_symbols=10, min_len=1, max_len=8, seed=1),
)


def tiny_model(dropout: float = 0.1, **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        TransformerConfig.tiny(
            TOKENIZER.vocab_size, max_len=9, dropout=dropout, **overrides
        )
    )


def config(**overrides) -> TrainConfig:
    base = dict(
        steps=6, warmup=4, factor=0.5, log_every=0, device="cpu", progress=False
    )
    return TrainConfig(**{**base, **overrides})


def trainer(
    steps: int = 6, model: Transformer | None = None, loader=None, **overrides
) -> RunTrainer:
    loader = make_loader(PAIRS, TOKENIZER, max_tokens=160) if loader is None else loader
    return RunTrainer(
        model or tiny_model(),
        config(steps=steps, **overrides),
        loader,
        make_loader(PAIRS[:40], TOKENIZER, 160, shuffle=False),
        TOKENIZER,
        log=None,
    )


def without_key_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The key bias has a zero gradient (chapter 2).

    Adam turns its rounding noise into full steps.
    """
    out = {}
    for name, value in state.items():
        if name.endswith("in_proj.bias"):
            d = value.numel() // 3
            value = torch.cat([value[:d], value[2 * d :]])  # b_Q and b_V
        out[name] = value
    return out


def assert_close_weights(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float
) -> None:
    a, b = without_key_bias(a), without_key_bias(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


# --- data -----------------------------------------------------------------------------


def test_synthetic_pairs_are_deterministic_copies_and_reversals():
    copy_pairs = synthetic_pairs("copy", 50, n_symbols=7, min_len=2, max_len=5, seed=3)
    reverse_pairs = synthetic_pairs(
        "reverse", 50, n_symbols=7, min_len=2, max_len=5, seed=3
    )
    assert copy_pairs == synthetic_pairs(
        "copy", 50, n_symbols=7, min_len=2, max_len=5, seed=3
    )
    assert all(s == t for s, t in copy_pairs)
    assert [s for s, _ in copy_pairs] == [s for s, _ in reverse_pairs]
    assert all(t.split() == s.split()[::-1] for s, t in reverse_pairs)
    assert all(
        2 <= len(s.split()) <= 5 and set(s.split()) <= set("0123456")
        for s, _ in copy_pairs
    )
    assert synthetic_tokenizer(7).vocab_size == 11
    with pytest.raises(ValueError, match="task must be one of"):
        synthetic_pairs("sort", 3)
    with pytest.raises(ValueError, match="max_len"):
        synthetic_pairs("copy", 3, min_len=4, max_len=2)


def test_more_synthetic_pairs_of_a_seed_only_append_pairs():
    """The first k of n pairs of a seed are the k pairs of that seed (chapter 13)."""
    for task in ("copy", "reverse"):
        first = synthetic_pairs(task, 100, seed=1)
        assert synthetic_pairs(task, 2000, seed=1)[:100] == first
        assert synthetic_pairs(task, 100, seed=2) != first


def test_pick_device_and_amp():
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto").type in ("cpu", "mps")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("gpu0")
    cpu = torch.device("cpu")
    assert (
        autocast_dtype("auto", cpu) is None
        and autocast_dtype("bf16", cpu) == torch.bfloat16
    )
    with pytest.raises(ValueError, match="amp must be one of"):
        autocast_dtype("fp8", cpu)
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(accum_steps=0)


@pytest.mark.parametrize(
    "capability, dtype",
    [((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_auto_precision_follows_the_gpu_generation(monkeypatch, capability, dtype):
    # A T4 (7.5) reports is_bf16_supported() == True although it only emulates bfloat16.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capability
    )
    assert autocast_dtype("auto", torch.device("cuda", 0)) == dtype
    assert autocast_dtype("off", torch.device("cuda", 0)) is None


# --- decoding -------------------------------------------------------------------------


def reference_decode(model: Transformer, src: torch.Tensor, max_len: int) -> list[int]:
    """Greedy decoding of one unpadded source, one token at a time, in plain Python."""
    c = model.config
    tokens = [c.bos_id]
    with torch.no_grad():
        memory = model.encode(src[None])
        for _ in range(max_len):
            # [1, t, V]
            logits = model.decode(torch.tensor([tokens]), memory, src[None])
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == c.eos_id:
                break
    return tokens[1:]


def test_greedy_decode_matches_one_sentence_at_a_time():
    model = tiny_model(dropout=0.0).eval()
    # make the end token likely, so that rows stop at different steps
    with torch.no_grad():
        model.head.weight[model.config.eos_id] *= 6
    sources = [p[0] for p in PAIRS[:12]]
    # padded sources: [12, src_len]
    batch = make_batch([(s, [4]) for s in sources], 0, 1, 2)
    out = greedy_decode(model, batch.src, max_len=7)  # [12, n]
    expected = [reference_decode(model, torch.tensor(s), 7) for s in sources]
    # both kinds of rows
    assert any(len(e) < 7 for e in expected) and any(e[-1] != 2 for e in expected)
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
    predicted = greedy_decode(
        model, make_batch([(s, [4]) for s in sources], 0, 1, 2).src, max_len=9
    )
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


# --- one training step ----------------------------------------------------------------


def test_accumulating_two_halves_equals_one_full_batch():
    # unequal token counts
    halves = [make_batch(PAIRS[0:7], 0, 1, 2), make_batch(PAIRS[7:20], 0, 1, 2)]
    full = make_batch(PAIRS[0:20], 0, 1, 2)
    two = trainer(
        steps=3,
        model=tiny_model(dropout=0.0),
        loader=halves,
        accum_steps=2,
        clip_norm=None,
    )
    one = trainer(steps=3, model=tiny_model(dropout=0.0), loader=[full], clip_norm=None)
    h2, h1 = two.fit(), one.fit()
    assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)
    assert h2["grad_norm"] == pytest.approx(h1["grad_norm"], rel=1e-4)
    # Adam divides by sqrt(v): where a gradient is almost zero (a nearly dead ReLU
    # unit), float rounding of the two summation orders becomes a visible part of a
    # step. 1e-3 is 5% of one step at these learning rates; a wrong normalisation of the
    # halves moves weights by a step.
    assert_close_weights(two.model.state_dict(), one.model.state_dict(), atol=1e-3)


def test_clipping_bounds_the_gradient_norm_seen_by_the_optimizer():
    for clip in (0.05, None):
        t = trainer(steps=2, clip_norm=clip)
        norms = []

        def record(optimizer, args, kwargs):
            grads = [
                p.grad
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            ]
            norms.append(
                torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
            )

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
    assert (
        autocast_dtype(t.config.amp, t.device)
        == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    )
    # loss scaling only for float16
    assert t.scaler.get_scale() == (2.0**16 if amp == "fp16" else 1.0)
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    # the weights stay float32
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


def test_bf16_autocast_on_cpu_keeps_layernorm_the_loss_and_gradients_in_float32():
    """Only the matrix products, and so the logits, run in bfloat16 (chapter 13)."""
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None  # float32 on a CPU
    model = tiny_model(dropout=0.0)
    batch = make_batch(PAIRS[:4], 0, 1, 2)
    with autocast("bf16", cpu):
        logits = model(batch.src, batch.tgt_in)  # [4, tgt_len, V]
        normed = model.encoder.layers[0].res_attn.norm(torch.randn(4, 3, 64))
    assert logits.dtype == torch.bfloat16 and normed.dtype == torch.float32
    loss = LabelSmoothingLoss(0.1)(logits, batch.tgt_out)  # log_softmax in float32
    loss.backward()
    assert loss.dtype == torch.float32
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {
        torch.float32
    }
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# --- checkpoints and resume -----------------------------------------------------------


def test_interrupted_and_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    # dropout 0.1: the random numbers must be restored too
    full = trainer(steps=14, eval_every=5)
    history = full.fit()
    assert full.batches.epoch >= 1  # the run crosses an epoch boundary
    first = trainer(steps=6, eval_every=5, checkpoint_dir=str(tmp_path))
    first.fit()
    resumed = trainer(
        steps=14, model=tiny_model(), eval_every=5, checkpoint_dir=str(tmp_path)
    )
    resumed.load_checkpoint(tmp_path / "last.pt")
    resumed_history = resumed.fit()
    assert resumed_history["loss"] == history["loss"]  # exactly, step for step
    assert resumed_history["lr"] == history["lr"]
    for step in (5, 10):
        assert (
            resumed_history["valid_loss"][resumed_history["valid_step"].index(step)]
            == history["valid_loss"][history["valid_step"].index(step)]
        )
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            full.model.state_dict().values(), resumed.model.state_dict().values()
        )
    )
    again = RunTrainer.resume(
        tmp_path / "last.pt", make_loader(PAIRS, TOKENIZER, 160), log=None
    )
    assert (
        again.step == 14
        and again.config.steps == 14
        and again.tokenizer.to_dict() == TOKENIZER.to_dict()
    )


def test_a_repeated_signal_is_one_request_and_none_interrupts_the_save():
    """`timeout` and torchrun's Ctrl-C deliver one signal twice: that must not abort."""
    from aiayn.runs import stop_on_signals

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a suite started with `&`
    with stop_on_signals(grace=0.5) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        # again at once, as `timeout -s INT` sends it
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        time.sleep(0.6)
        stop.saving = True
        os.kill(os.getpid(), signal.SIGTERM)  # while the checkpoint is written: ignored
        stop.saving = False
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # later, and not saving: stop at once
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_ends_the_update_saves_it_and_the_run_resumes_exactly(tmp_path):
    batches = list(make_loader(PAIRS, TOKENIZER, 160))

    class Signalled:
        """The batches of an epoch; a SIGTERM arrives while the 8th is read.

        The 8th batch belongs to the 4th update.
        """

        def __iter__(self):
            for i, b in enumerate(batches):
                if i == 7 and not (tmp_path / "sent").exists():
                    (tmp_path / "sent").touch()
                    os.kill(os.getpid(), signal.SIGTERM)
                yield b

    reference = trainer(steps=10, loader=batches, accum_steps=2).fit()
    t = trainer(
        steps=10,
        loader=Signalled(),
        accum_steps=2,
        checkpoint_dir=str(tmp_path / "run"),
    )
    with pytest.raises(
        TrainingInterrupted, match="SIGTERM after step 4; saved to"
    ) as stop:
        t.fit()
    assert stop.value.signum == signal.SIGTERM and stop.value.step == 4
    saved = read_checkpoint(tmp_path / "run" / "last.pt")["training"]
    # the update the signal fell in, whole
    assert saved["step"] == 4 and saved["data"]["position"] == 8
    # the handler is given back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    resumed = RunTrainer.resume(tmp_path / "run" / "last.pt", batches, log=None)
    assert resumed.fit()["loss"] == reference["loss"]  # exactly


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
        t.save_checkpoint(path)
    monkeypatch.undo()
    # the interrupted save left the old checkpoint alone
    assert path.read_bytes() == good
    assert not list(tmp_path.glob("*.partial"))

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        trainer().load_checkpoint(truncated)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        trainer().load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(
        ValueError, match="another configuration: d_ff=128 there, 64 here"
    ):
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
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), t.model.state_dict().values())
    )
    # chapter 9 reads it too
    assert Transformer.load(tmp_path / "last.pt").config == t.model.config


# --- guards of a long run (chapter 13; the faults of chapter 14) ----------------------


def test_a_non_finite_update_is_skipped_and_adam_is_left_alone():
    t = trainer(steps=1, clip_norm=None)
    t.fit()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    adam_steps = {int(s["step"]) for s in t.optimizer.state.values()}
    with torch.no_grad():
        # any batch with token 5 now has a NaN loss
        t.model.src_embed.weight[5].fill_(float("nan"))
    t.model.src_embed.weight.register_hook(lambda g: g)  # (keeps the graph as it is)
    t.config = dataclasses.replace(t.config, steps=2)
    t.train_step()
    assert not math.isfinite(t.history["loss"][-1])
    with torch.no_grad():
        t.model.src_embed.weight[5] = before["src_embed.weight"][5]
    # no update
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())
    assert {int(s["step"]) for s in t.optimizer.state.values()} == adam_steps


def test_a_diverging_run_stops_with_a_clear_error_and_keeps_its_good_checkpoint(
    tmp_path,
):
    good = trainer(steps=2, checkpoint_dir=str(tmp_path))
    good.fit()
    kept = (tmp_path / "last.pt").read_bytes()
    t = RunTrainer.resume(
        tmp_path / "last.pt",
        make_loader(PAIRS, TOKENIZER, max_tokens=160),
        log=None,
        config=dataclasses.replace(good.config, steps=40, checkpoint_every=1),
    )
    with torch.no_grad():  # the weights are finite, but every loss from now on is NaN
        t.model.head.weight.mul_(1e38)
    with pytest.raises(
        NonFiniteLoss,
        match=r"stopped at step \d+: the loss or gradient norm was NaN or inf in "
        r"the last 5 updates.*a learning rate too high.*keeps the last",
    ):
        t.fit()
    assert t.step <= 2 + 10  # stopped within one read of the log
    with torch.no_grad():
        t.model.encoder.layers[0].ffn.w_1.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLoss, match="its weights hold NaN or inf"):
        t.save_checkpoint()
    saved = read_checkpoint(tmp_path / "last.pt")
    assert all(
        torch.isfinite(v).all()
        for v in saved["state_dict"].values()
        if v.is_floating_point()
    )
    assert kept != (tmp_path / "last.pt").read_bytes() or saved["training"]["step"] == 2


def test_the_scaler_skips_only_in_float16_on_purpose():
    cpu = torch.device("cpu")
    assert make_scaler("fp16", cpu).get_scale() == 2.0**16
    assert (
        make_scaler("off", cpu).get_scale()
        == make_scaler("bf16", cpu).get_scale()
        == 1.0
    )


def test_a_new_run_refuses_a_folder_of_another_run_and_overwrite_cleans_it(tmp_path):
    first = trainer(
        steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep_checkpoints=3
    )
    first.fit()
    assert [p.name for p in first.folder.snapshots()] == [
        "step_00000002.pt",
        "step_00000004.pt",
        "step_00000006.pt",
    ]
    with pytest.raises(
        ValueError,
        match="holds another run .its last.pt is at step 6.*--resume.*--overwrite",
    ):
        trainer(steps=2, checkpoint_dir=str(tmp_path), seed=5).fit()
    assert len(first.folder.snapshots()) == 3  # nothing was touched
    second = trainer(
        steps=4,
        checkpoint_dir=str(tmp_path),
        seed=5,
        overwrite=True,
        checkpoint_every=2,
        keep_checkpoints=3,
    )
    second.fit()
    assert [p.name for p in second.folder.snapshots()] == [
        "step_00000002.pt",
        "step_00000004.pt",
    ]
    rows = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    # the old run's log is gone
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    # only the new run's snapshots
    model, _ = average_checkpoints(second.folder.snapshots())
    assert (
        read_checkpoint(tmp_path / "last.pt")["training"]["run_id"] == second.run["id"]
    )


def test_a_resumed_run_drops_the_snapshots_and_log_lines_after_its_step(tmp_path):
    t = trainer(
        steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep_checkpoints=5
    )
    t.fit()
    backup = tmp_path / "backup.pt"
    t.save_checkpoint(backup)
    copy_at_4 = trainer(steps=4, checkpoint_dir=str(tmp_path / "other"))
    copy_at_4.fit()
    resumed = RunTrainer.resume(
        tmp_path / "last.pt",
        make_loader(PAIRS, TOKENIZER, 160),
        log=None,
        config=dataclasses.replace(t.config, steps=8),
    )
    resumed.fit()
    assert [p.name for p in resumed.folder.snapshots()][-1] == "step_00000008.pt"
    rows = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    # each step once
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))


def test_a_second_run_cannot_train_into_a_locked_folder(tmp_path):
    holder = RunFolder(tmp_path)
    with claim_folder(holder, "someone", 0, overwrite=False):
        t = trainer(steps=2, checkpoint_dir=str(tmp_path))
        with pytest.raises(
            ValueError, match=f"another process .pid {os.getpid()}. is training into"
        ):
            t.fit()
        assert t.step == 0  # refused before any update
    # released: the folder is free again
    trainer(steps=2, checkpoint_dir=str(tmp_path)).fit()


def test_an_unwritable_folder_is_refused_before_any_update(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    t = trainer(steps=2, checkpoint_dir=str(tmp_path / "a_file" / "run"))
    with pytest.raises(ValueError, match="cannot write checkpoints to .*a_file/run"):
        t.fit()
    assert t.step == 0


def test_resuming_on_other_data_names_the_difference(tmp_path):
    trainer(steps=2, checkpoint_dir=str(tmp_path)).fit()
    last = tmp_path / "last.pt"
    copies = encode_pairs(
        TOKENIZER,
        synthetic_pairs("copy", 240, n_symbols=10, min_len=1, max_len=8, seed=1),
    )
    with pytest.raises(ValueError, match="another configuration: data pairs_sha256="):
        trainer(loader=make_loader(copies, TOKENIZER, 160)).load_checkpoint(last)
    with pytest.raises(ValueError, match="data max_tokens=160 there, 200 here"):
        trainer(loader=make_loader(PAIRS, TOKENIZER, 200)).load_checkpoint(last)


def test_the_log_writes_metrics_jsonl_and_tensorboard(tmp_path):
    t = trainer(steps=4, checkpoint_dir=str(tmp_path), log_every=2, eval_every=2)
    t.metric = ("half", lambda model: 0.5)
    t.fit()
    rows = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert {"lr", "grad_norm"} <= set(rows[0]) and any(
        "tokens_per_s" in r for r in rows
    )
    assert [(r["step"], r["half"]) for r in rows if "valid_loss" in r] == [
        (2, 0.5),
        (4, 0.5),
    ]
    pytest.importorskip("tensorboard")
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


class RecordingLoader:
    """A loader that notes the (batch, src_len, tgt_len) of each batch it yields."""

    def __init__(self, loader):
        self.loader, self.batch_sampler, self.shapes = loader, loader.batch_sampler, []

    def __iter__(self):
        for batch in self.loader:
            self.shapes.append((*batch.src.shape, batch.tgt_in.size(1)))
            yield batch


def test_compile_makes_one_dynamic_graph_for_every_batch_shape(monkeypatch):
    """Token buckets give a new (batch, src_len, tgt_len) at nearly every step: after
    the first shape the compiler must mark the sizes dynamic and reuse that graph,
    not compile one per shape (a set of sizes in chapter 1's broadcast_shape did)."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda m, **kw: real_compile(m, backend="aot_eager", **kw)
    )
    torch._dynamo.reset()
    counters.clear()
    pairs = encode_pairs(
        TOKENIZER,
        synthetic_pairs("copy", 2000, n_symbols=10, min_len=1, max_len=24, seed=3),
    )
    loader = RecordingLoader(
        make_loader(pairs, TOKENIZER, max_tokens=600, bucket_size=None)
    )
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(TOKENIZER.vocab_size, max_len=25))
    t = RunTrainer(model, config(steps=12, compile=True), loader, log=None)
    try:
        for _ in range(12):
            t.train_step()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert len(set(loader.shapes)) >= 8, loader.shapes
    assert graphs <= 2, f"{graphs} graphs for {len(set(loader.shapes))} batch shapes"


def test_the_fixed_scaler_keeps_a_scale_of_1_after_a_skipped_update():
    """A scale-1 scaler halving at every inf would shrink the loss towards underflow."""
    weight = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([weight], lr=0.1)
    scaler = make_scaler("off", torch.device("cpu"))
    for grad in (
        [1.0, 2.0, 3.0],
        [float("inf"), 1.0, 1.0],
        [float("nan"), 1.0, 1.0],
        [1.0, 1.0, 1.0],
    ):
        adam.zero_grad()
        scaler.scale((weight * torch.tensor(grad)).sum()).backward()
        scaler.step(adam)
        scaler.update()
        assert scaler.get_scale() == 1.0
    assert int(adam.state[weight]["step"]) == 2  # the two bad updates were skipped


def test_resuming_where_auto_means_another_precision_starts_a_fresh_scaler(
    tmp_path, monkeypatch
):
    """amp="auto" is float32 on this CPU and float16 on a T4: the saved scale-1 scaler
    must not be loaded into the float16 run, which would then never scale its losses."""
    import aiayn.train as train

    t = trainer(steps=4, amp="auto", checkpoint_dir=str(tmp_path / "run"))
    t.fit()
    assert t.scaler.get_growth_interval() == 2**30  # the scale-1 scaler of float32
    real = train.autocast_dtype
    monkeypatch.setattr(
        train,
        "autocast_dtype",
        lambda amp, device: torch.float16 if amp == "auto" else real(amp, device),
    )
    said = []
    resumed = RunTrainer.resume(
        tmp_path / "run" / "last.pt",
        make_loader(PAIRS, TOKENIZER, 160),
        log=said.append,
    )
    assert (
        resumed.scaler.get_growth_interval() == 2000
        and resumed.scaler.get_scale() == 65536.0
    )
    assert any("loss scaling starts afresh" in line for line in said)
    monkeypatch.setattr(train, "autocast_dtype", real)
    again = RunTrainer.resume(
        tmp_path / "run" / "last.pt", make_loader(PAIRS, TOKENIZER, 160), log=None
    )
    # the same precision: loaded as saved
    assert again.scaler.state_dict() == t.scaler.state_dict()


# --- the plain loop and the run trainer -----------------------------------------------


def test_the_plain_trainer_is_at_most_200_lines_and_its_module_names_no_later_chapter():
    import ast

    source = (ROOT / "src" / "aiayn" / "train.py").read_text(encoding="utf-8")
    trainer_class = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "Trainer"
    )
    assert trainer_class.end_lineno - trainer_class.lineno + 1 <= 200
    docstrings = [
        ast.get_docstring(n) or ""
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
    ]
    assert not [
        d for d in docstrings if "chapter 14" in d.lower() or "chapters 13, 14" in d
    ]


def test_building_a_trainer_leaves_the_global_random_state_alone():
    models, loader = [tiny_model(), tiny_model()], make_loader(PAIRS, TOKENIZER, 160)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    Trainer(models[0], config(), loader, log=None)
    RunTrainer(models[1], config(), loader, log=None)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_plain_trainer_learns_and_runs_the_same_for_the_same_seed(tmp_path):
    def run() -> Trainer:
        t = Trainer(
            tiny_model(),
            config(steps=8, checkpoint_dir=str(tmp_path / "plain")),
            make_loader(PAIRS, TOKENIZER, 160),
            log=None,
        )
        t.fit()
        return t

    first = run()
    assert first.history["loss"][-1] < first.history["loss"][0]
    assert sorted(
        p.name for p in (tmp_path / "plain").iterdir() if p.name != "tensorboard"
    ) == ["last.pt", "metrics.jsonl"]  # no lock: that is the RunTrainer's
    torch.manual_seed(99)  # fit() of a new run seeds dropout itself
    assert run().history["loss"] == first.history["loss"]
    again = Trainer.resume(
        tmp_path / "plain" / "last.pt", make_loader(PAIRS, TOKENIZER, 160), log=None
    )
    assert again.step == 8 and type(again) is Trainer
    assert (
        "rng" not in first.state_dict()
        and "rng"
        in RunTrainer(
            tiny_model(), config(), make_loader(PAIRS, TOKENIZER, 160), log=None
        ).state_dict()
    )


def test_the_first_signal_is_answered_at_once_a_second_under_torchrun_keeps_the_save():
    """At 22e25ab nothing was printed at the first signal, and under torchrun a second
    Ctrl-C 3 s later (the processes still agreeing on the update to stop after) lost the
    save."""
    from aiayn.runs import stop_on_signals

    said = []
    with stop_on_signals(grace=0.2, say=said.append, patient=True) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        # at least the grace: a repeat, not the same signal delivered twice
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # patient: no KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGINT
    assert said == ["SIGINT: the run stops after this update and saves a checkpoint"]
    said.clear()
    with pytest.raises(KeyboardInterrupt):
        with stop_on_signals(grace=0.2, say=said.append) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
            # one process: a second signal stops at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
    assert said == [
        "SIGTERM: the run stops after this update and saves a checkpoint; "
        "send it again to stop without saving"
    ]


# --- what the documents say: the cost of training (chapter 13) ------------------------

P100_FLOPS = 9.5e12  # sustained FLOPs per second of one P100 (the paper, Table 2)
TABLE2 = {  # the paper's Table 2: BLEU EN-DE, BLEU EN-FR, training FLOPs EN-DE, EN-FR
    "Deep-Att + PosUnk": (None, 39.2, None, 1.0e20),
    "GNMT + RL": (24.6, 39.92, 2.3e19, 1.4e20),
    "ConvS2S": (25.16, 40.46, 9.6e18, 1.5e20),
    "MoE": (26.03, 40.56, 2.0e19, 1.2e20),
    "GNMT + RL Ensemble": (26.30, 41.16, 1.8e20, 1.1e21),
    "Transformer (base)": (27.3, 38.1, 3.3e18, 3.3e18),
    "Transformer (big)": (28.4, 41.8, 2.3e19, 2.3e19),
}
DOC003 = {  # doc003's copy: BLEU EN-DE, BLEU EN-FR, one "Training Cost (FLOPs)"
    "Deep-Att + PosUnk": (None, 39.2, 1.0e20),
    "GNMT + RL": (26.30, 39.92, 2.3e19),
    "ConvS2S": (25.16, 40.46, 1.5e20),
    "Transformer (base)": (27.3, 38.1, 3.3e18),
}


def test_table2_costs_are_hours_times_8_p100s():
    """12 hours and 3.5 days x 8 GPUs x 9.5 TFLOPS: 3.28e18 and 2.30e19, as rounded."""
    for name, hours, estimate in (("base", 12, "3.28e+18"), ("big", 84, "2.30e+19")):
        flops = hours * 3600 * 8 * P100_FLOPS
        assert f"{flops:.2e}" == estimate
        assert f"{flops:.1e}" == f"{TABLE2[f'Transformer ({name})'][2]:.1e}"


def test_base_model_arithmetic_is_29_percent_of_table2():
    """6 FLOPs per parameter and token, 25,000 tokens a side: 9.46e17 in 100k steps."""
    with torch.device("meta"):  # shapes only, no memory
        base = Transformer(TransformerConfig.base())
    encoder = sum(p.numel() for p in base.encoder.parameters())
    decoder = sum(p.numel() for p in base.decoder.parameters())
    decoder += base.head.weight.numel()  # the output matrix sees the target tokens
    assert (encoder, decoder) == (18_914_304, 44_168_192)
    per_step = 6 * (encoder * 25_000 + decoder * 25_000)
    assert f"{per_step:.2e}" == "9.46e+12"
    assert f"{per_step * 100_000:.2e}" == "9.46e+17"
    assert f"{per_step * 100_000 / TABLE2['Transformer (base)'][2]:.0%}" == "29%"


def test_doc003_cost_column_mixes_language_pairs():
    """doc003 takes costs from both columns, and GNMT + RL's EN-DE BLEU (26.30) from
    the ensemble; within one language pair the paper's comparison stands."""
    pairs = {
        name: [
            lang for lang, v in zip(("EN-DE", "EN-FR"), TABLE2[name][2:]) if v == cost
        ]
        for name, (_, _, cost) in DOC003.items()
    }
    assert pairs == {
        "Deep-Att + PosUnk": ["EN-FR"],
        "GNMT + RL": ["EN-DE"],  # 2.3e19
        "ConvS2S": ["EN-FR"],  # 1.5e20; its EN-DE cost is 9.6e18
        "Transformer (base)": ["EN-DE", "EN-FR"],
    }
    bleu = {
        name: row[:2] for name, row in DOC003.items() if row[:2] != TABLE2[name][:2]
    }
    assert bleu == {"GNMT + RL": (26.30, 39.92)}
    assert TABLE2["GNMT + RL Ensemble"][0] == 26.30 and TABLE2["GNMT + RL"][0] == 24.6
    singles = [n for n in TABLE2 if "Ensemble" not in n and "Transformer" not in n]
    best = max(singles, key=lambda n: TABLE2[n][1])  # by EN-FR BLEU
    assert best == "MoE" and TABLE2[best][3] == 1.2e20
    assert TABLE2["Transformer (big)"][3] < TABLE2[best][3] / 4  # EN-FR: under 1/4
    third = TABLE2["Transformer (base)"][2] / TABLE2["ConvS2S"][2]  # EN-DE
    assert abs(third - 1 / 3) < 0.02
