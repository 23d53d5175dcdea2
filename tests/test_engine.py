"""Tests of aiayn.runs (chapter 14).

The command line and its faults, and activation checkpointing.
"""

from __future__ import annotations

import copy
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.batching import load_checkpoint_model, make_batch
from aiayn.cli import PRESETS
from aiayn.cli import train_main as main
from aiayn.model import read_checkpoint
from aiayn.runs import enable_grad_checkpointing, saved_activation_bytes
from aiayn.train import (
    encode_pairs,
    greedy_decode,
    synthetic_pairs,
    synthetic_tokenizer,
)
from conftest import HANG_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# a quick copy task
SMALL = ["--train-size", "2000", "--valid-size", "50", "--no-progress"]


def train(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """python -m aiayn train ARGS in a subprocess, one thread, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "aiayn", "train", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """main(ARGS) in this process (no new interpreter): exit code, stdout, stderr."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- the command line -----------------------------------------------------------------


def test_the_copy_task_trains_and_writes_a_loadable_checkpoint(tmp_path):
    result = train(
        *"--task copy --steps 30 --checkpoint-dir run".split(), *SMALL, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (
        "training copy on cpu, 1 CPU thread(s)" in result.stdout
        and "exact match" in result.stdout
    )
    model, tokenizer = load_checkpoint_model(tmp_path / "run" / "last.pt")
    src = torch.tensor([tokenizer.encode("3 1 4 1 5")])
    assert greedy_decode(model, src, max_len=8).shape[0] == 1
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_help_is_the_same_whatever_the_process_imported(tmp_path):
    def help_text(prefix: str, *args: str) -> str:
        code = (
            f"{prefix}import sys; from aiayn.cli import train_main; "
            f"sys.exit(train_main({list(args)!r}))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=HANG_S,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    fresh = help_text("", "--help")
    assert fresh == help_text("import aiayn.multi30k, aiayn.viz; ", "--help")
    assert (
        all(name in fresh for name in PRESETS)
        and "--n-symbols" in fresh
        and "--vocab-size" in fresh
    )
    assert (
        "https://literate-transformer.github.io/aiayn" in fresh and "book/" not in fresh
    )
    # one parser, one parse
    assert help_text("", "--preset", "multi30k-de-en", "--help") == fresh
    overall = subprocess.run(
        [sys.executable, "-m", "aiayn", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=HANG_S,
    ).stdout
    assert "train" in overall and "book/" not in overall and ".md" not in overall


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "cuda:99"], "device 'cuda:99'"),
        (["--resume", "nothing/last.pt"], "no checkpoint at nothing/last.pt"),
        (["--preset", "sort"], "unknown preset 'sort'; the presets: copy"),
        (
            ["--preset", "multi30k-de-em"],
            "unknown preset 'multi30k-de-em' (did you mean multi30k-de-en?)",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_code_2(tmp_path, capsys, flags, message):
    assert main([*flags, "--checkpoint-dir", str(tmp_path / "run"), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--amp", "fp8"],
            "argument --amp: must be one of ('auto', 'bf16', 'fp16', 'off'), got 'fp8'",
        ),
        (["--steps", "0"], "argument --steps: must be an int of at least 1, got '0'"),
        (
            ["--warmup", "-3"],
            "argument --warmup: must be an int of at least 1, got '-3'",
        ),
        (["--n-symbols", "12", "--preset", "multi30k-de-en"], None),
    ],
)
def test_flags_argparse_refuses_exit_with_code_2(capsys, flags, message):
    # a flag of another preset: refused by the command, not argparse
    if message is None:
        assert main([*flags, "--device", "cpu"]) == 2
        assert (
            "--n-symbols is not a setting of the preset multi30k-de-en"
            in capsys.readouterr().err
        )
        return
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1


def test_a_damaged_checkpoint_is_one_error_line(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert (
        run_main(
            capsys, "--task", "copy", "--steps", "4", "--checkpoint-dir", run, *SMALL
        )[0]
        == 0
    )
    data = bytearray((tmp_path / "run" / "last.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "run" / "last.pt").write_bytes(bytes(data))
    code, _, err = run_main(capsys, "--resume", run, "--steps", "8")
    assert (
        code == 2
        and err.startswith("error: ")
        and "damaged" in err
        and err.count("\n") == 1
    )


# --- the faults of chapter 14, each reproduced through the command --------------------


def test_divergence_stops_with_exit_code_1_and_never_writes_nan(tmp_path, capsys):
    code, _, err = run_main(
        capsys,
        *"--task copy --steps 20 --factor 1e30".split(),
        *"--clip-norm none --keep-checkpoints 0".split(),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        *SMALL,
    )
    assert (
        code == 1
        and "error: training stopped at step" in err
        and "learning rate too high" in err
    )
    # diverged before its first checkpoint
    assert not (tmp_path / "run" / "last.pt").exists()


def test_a_fresh_run_refuses_a_folder_of_another_run(tmp_path, capsys):
    folder = str(tmp_path / "D")
    snapshots = [
        *"--checkpoint-every 10 --keep-checkpoints 3".split(),
        "--checkpoint-dir",
        folder,
        *SMALL,
    ]
    assert run_main(capsys, "--task", "copy", "--steps", "60", *snapshots)[0] == 0
    code, out, err = run_main(
        capsys, "--task", "copy", "--steps", "20", "--seed", "5", *snapshots
    )
    assert (
        code == 2
        and f"{folder} holds another run (its last.pt is at step 60)" in err
        and "--overwrite" in err
    )
    # no first line for a refused run
    assert "training" not in out and "(RunTrainer.resume in Python)" in err
    assert sorted(p.name for p in (tmp_path / "D").glob("step_*.pt")) == [
        "step_00000040.pt",
        "step_00000050.pt",
        "step_00000060.pt",
    ]  # untouched
    code, out, err = run_main(
        capsys, *"--task copy --steps 20 --seed 5".split(), "--overwrite", *snapshots
    )
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "D").glob("step_*.pt")) == [
        "step_00000010.pt",
        "step_00000020.pt",
    ]
    assert "average of the last 2 snapshots" in out  # its own two, not the first run's


def start_background_run(tmp_path: Path, folder: str) -> subprocess.Popen:
    """A long copy run in a subprocess, returned once it has logged 10 updates."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [
            sys.executable,
            *"-m aiayn train --task copy --steps 3000".split(),
            "--checkpoint-dir",
            folder,
            *"--log-every 5 --checkpoint-every 1000".split(),
            *SMALL,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / folder / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S  # only against a hang: a busy machine is slow
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 10):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return run


def test_sigterm_saves_the_run_which_resumes_exactly(tmp_path):
    run = start_background_run(tmp_path, "long")
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=HANG_S)
    assert run.returncode == 128 + signal.SIGTERM, err
    said, last = err.splitlines()  # at once, then at the end: no traceback
    assert said == (
        "SIGTERM: the run stops after this update and saves a checkpoint; "
        "send it again to stop without saving"
    )
    assert last.startswith("interrupted: stopped by SIGTERM after step ")
    step = read_checkpoint(tmp_path / "long" / "last.pt")["training"]["step"]
    assert (
        f"after step {step}; saved to long/last.pt; continue with --resume long/last.pt"
        in err
    )
    assert step >= 10  # however fast the machine ran on after the signal was sent
    end = str(step + 20)
    resumed = train("--resume", "long", "--steps", end, cwd=tmp_path)
    fresh = train(
        "--task",
        "copy",
        "--steps",
        end,
        *"--checkpoint-dir fresh --log-every 5 --checkpoint-every 1000".split(),
        *SMALL,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0 and fresh.returncode == 0, (
        resumed.stderr + fresh.stderr
    )
    a, b = (read_checkpoint(tmp_path / name / "last.pt") for name in ("long", "fresh"))
    assert all(
        torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]
    )
    assert a["training"]["history"]["loss"] == b["training"]["history"]["loss"]


def test_ctrl_c_saves_the_run_in_one_line_with_exit_code_130(tmp_path):
    run = start_background_run(tmp_path, "run")
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=HANG_S)
    said, last = err.splitlines()  # at once, then at the end: no traceback
    assert run.returncode == 130 and said.startswith(
        "SIGINT: the run stops after this update"
    )
    assert last.startswith("interrupted: stopped by SIGINT after step ")
    assert read_checkpoint(tmp_path / "run" / "last.pt")["training"]["step"] >= 10


def test_a_signal_to_the_process_and_its_group_still_saves(tmp_path):
    """`timeout -s INT` signals the program, then its process group: two SIGINTs."""
    run = start_background_run(tmp_path, "run")
    run.send_signal(signal.SIGINT)
    # the first handler call has run: an unguarded second one would raise
    time.sleep(0.3)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=HANG_S)
    assert (
        run.returncode == 130 and "interrupted: stopped by SIGINT after step " in err
    ), err
    assert err.count("SIGINT: the run stops") == 1  # the repeat is the same request
    assert read_checkpoint(tmp_path / "run" / "last.pt")["training"]["step"] >= 10


def test_a_second_run_in_the_same_folder_is_refused_by_the_lock(tmp_path):
    run = start_background_run(tmp_path, "busy")
    try:
        second = train(
            *"--task copy --steps 5 --checkpoint-dir busy".split(), *SMALL, cwd=tmp_path
        )
        assert second.returncode == 2
        assert f"another process (pid {run.pid}) is training into busy" in second.stderr
        assert second.stdout == ""  # not even the run's first line
    finally:
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=HANG_S)
    assert run.returncode == 143  # the first run was not disturbed, and stopped cleanly


def test_an_unwritable_folder_fails_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, out, err = run_main(
        capsys,
        "--task",
        "copy",
        "--checkpoint-dir",
        str(tmp_path / "file" / "run"),
        *SMALL,
    )
    assert code == 2 and err.startswith(
        f"error: cannot write checkpoints to {tmp_path / 'file' / 'run'}"
    )
    assert "| loss" not in out  # not a single update was spent


def test_resuming_with_another_task_or_other_data_names_the_difference(
    tmp_path, capsys
):
    run = str(tmp_path / "run")
    assert (
        run_main(
            capsys, "--task", "copy", "--steps", "4", "--checkpoint-dir", run, *SMALL
        )[0]
        == 0
    )
    code, _, err = run_main(capsys, "--resume", run, "--task", "reverse")
    assert code == 2 and "trained with the preset 'copy', not 'reverse'" in err
    code, _, err = run_main(capsys, "--resume", run, "--n-symbols", "12")
    assert code == 2 and "--n-symbols 10 there, 12 here" in err
    code, _, err = run_main(
        capsys, "--resume", run, "--max-tokens", "1024", "--steps", "8"
    )
    assert code == 2 and "data max_tokens=2048 there, 1024 here" in err
    code, out, err = run_main(
        capsys,
        "--resume",
        run + "/last.pt",
        *"--steps 8 --train-size 2000 --no-progress".split(),
    )
    # the same options, given again, are fine
    assert code == 0 and "from step 4 to 8" in out, err


def test_threads_flag_and_default(tmp_path):
    result = train(
        *"--task copy --steps 2 --threads 2 --checkpoint-dir run".split(),
        *SMALL,
        cwd=tmp_path,
    )
    assert result.returncode == 0 and "2 CPU thread(s)" in result.stdout
    before = torch.get_num_threads()
    assert (
        main(
            [
                *"--task copy --steps 1".split(),
                "--checkpoint-dir",
                str(tmp_path / "r2"),
                *SMALL,
            ]
        )
        == 0
    )
    assert torch.get_num_threads() == before  # main gives the process its threads back


# --- activation checkpointing ---------------------------------------------------------


def test_grad_checkpointing_gives_identical_gradients_and_saves_memory():
    tokenizer = synthetic_tokenizer(10)
    pairs = encode_pairs(
        tokenizer, synthetic_pairs("reverse", 64, n_symbols=10, max_len=8, seed=1)
    )
    torch.manual_seed(0)
    plain = Transformer(
        TransformerConfig.tiny(tokenizer.vocab_size, max_len=9, dropout=0.1)
    )
    checkpointed = copy.deepcopy(plain)
    assert enable_grad_checkpointing(checkpointed) == 4
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    batch = make_batch(pairs[:32], 0, 1, 2)

    def loss_of(model):
        torch.manual_seed(1)  # the same dropout masks for both
        return model(batch.src, batch.tgt_in).square().mean()

    loss_of(plain).backward()
    loss_of(checkpointed).backward()
    assert all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(plain.parameters(), checkpointed.parameters())
    )
    kept_plain = saved_activation_bytes(
        lambda: loss_of(plain), exclude=plain.parameters()
    )
    kept_ckpt = saved_activation_bytes(
        lambda: loss_of(checkpointed), exclude=checkpointed.parameters()
    )
    assert kept_ckpt < kept_plain / 4
    assert enable_grad_checkpointing(checkpointed, enable=False) == 4
    assert type(checkpointed.encoder.layers[0]) is type(plain.encoder.layers[0])


def test_grad_checkpointing_from_the_command_line(tmp_path, capsys):
    code, _, err = run_main(
        capsys,
        *"--task copy --steps 3 --grad-checkpointing".split(),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        *SMALL,
    )
    assert code == 0, err


def test_a_checkpoint_of_another_version_is_refused_saying_which_and_what_differs(
    tmp_path, capsys
):
    from aiayn.model import content_hash
    from aiayn.runs import RunTrainer
    from aiayn.train import make_loader

    assert (
        run_main(
            capsys,
            *"--task copy --steps 4".split(),
            "--checkpoint-dir",
            str(tmp_path / "run"),
            *SMALL,
        )[0]
        == 0
    )
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=True)

    def rewritten(name: str, change) -> Path:
        body = {k: v for k, v in saved.items() if k != "sha256"}
        body["training"] = change(dict(body["training"]))
        path = tmp_path / name
        torch.save({**body, "sha256": content_hash(body)}, path)
        return path

    older = rewritten(
        "older.pt",
        lambda t: {
            **t,
            "train_config": {**t["train_config"], "grad_checkpointing": False},
        },
    )
    code, out, err = run_main(capsys, "--resume", str(older), "--steps", "8")
    assert code == 2 and out == ""
    assert err.strip() == (
        f"error: {older} was written by another version of aiayn: not a TrainConfig: "
        "unknown fields ['grad_checkpointing']. Resume it with that version, "
        "or start a new run from its weights."
    )
    loader = make_loader(
        encode_pairs(synthetic_tokenizer(10), synthetic_pairs("copy", 50)),
        synthetic_tokenizer(10),
        256,
    )
    with pytest.raises(ValueError, match="unknown fields \\['grad_checkpointing'\\]"):
        RunTrainer.resume(older, loader)
    format1 = rewritten("format1.pt", lambda t: {**t, "version": 1})
    code, _, err = run_main(capsys, "--resume", str(format1), "--steps", "8")
    assert code == 2 and "written by another version of aiayn, in format 1" in err
    assert "names no preset" not in err


def test_resuming_an_older_copy_into_the_runs_folder_is_refused_unless_overwritten(
    tmp_path, capsys
):
    folder = tmp_path / "D"
    flags = ["--checkpoint-every", "10", "--keep-checkpoints", "5", *SMALL]
    assert (
        run_main(
            capsys,
            *"--task copy --steps 30".split(),
            "--checkpoint-dir",
            str(folder),
            *flags,
        )[0]
        == 0
    )
    backup = tmp_path / "backup_step30.pt"
    backup.write_bytes((folder / "last.pt").read_bytes())
    assert run_main(capsys, "--resume", str(folder), "--steps", "60", *flags)[0] == 0
    (folder / "step_00000070.pt.partial").write_bytes(b"left by a kill")
    before = sorted(p.name for p in folder.glob("step_*.pt"))
    code, _, err = run_main(
        capsys,
        "--resume",
        str(backup),
        "--checkpoint-dir",
        str(folder),
        "--steps",
        "60",
        *flags,
    )
    assert code == 2
    assert (
        f"{folder} holds this run up to step 60, later than step 30 that the resume "
        "starts from; it would lose last.pt and 3 snapshot(s) "
        "(step_00000040.pt, step_00000050.pt, step_00000060.pt)"
    ) in err
    assert read_checkpoint(folder / "last.pt")["training"]["step"] == 60  # nothing lost
    assert sorted(p.name for p in folder.glob("step_*.pt")) == before
    code, _, err = run_main(
        capsys,
        "--resume",
        str(backup),
        "--checkpoint-dir",
        str(folder),
        "--steps",
        "40",
        "--overwrite",
        *flags,
    )
    assert code == 0, err
    assert read_checkpoint(folder / "last.pt")["training"]["step"] == 40
    assert not list(folder.glob("*.partial"))  # the kill's leftover went at the claim


def test_a_full_disk_at_the_lock_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """At 22e25ab, [Errno 28] with 0 bytes free left the folder and its .lock."""
    import builtins

    import aiayn.runs as engine

    class NoSpace:
        """The lock file, made; writing the pid into it finds the disk full."""

        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    def no_space(file, mode="r", *args, **kwargs):
        handle = builtins.open(file, mode, *args, **kwargs)
        return NoSpace(handle) if str(file).endswith(".lock") else handle

    monkeypatch.setattr(engine, "open", no_space, raising=False)
    code, out, err = run_main(
        capsys, "--task", "copy", "--checkpoint-dir", str(tmp_path / "run"), *SMALL
    )
    assert code == 2 and err == (
        f"error: cannot write checkpoints to {tmp_path / 'run'}: No space left on "
        "device; make room on that disk, or choose another --checkpoint-dir "
        "(checkpoint_dir in Python).\n"
    )
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its .lock
