"""Data-parallel training (chapter 14): two processes under torchrun, gloo on a CPU."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aiayn import Transformer, TransformerConfig
from aiayn.train import (
    TrainConfig,
    Trainer,
    encode_pairs,
    make_loader,
    synthetic_pairs,
    synthetic_tokenizer,
)
from conftest import HANG_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6

# Run by torchrun in each of the two processes: the same model, data and TrainConfig as
# single_process() below, but each rank reads its own half of the batches.
SCRIPT = textwrap.dedent(
    f"""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from aiayn import Transformer, TransformerConfig
    from aiayn.runs import RunTrainer, init_distributed
    from aiayn.train import (
        TrainConfig,
        encode_pairs,
        make_loader,
        pick_device,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    out = Path(sys.argv[1])
    rank, world_size = init_distributed(pick_device("cpu"))
    assert world_size == 2 and dist.get_backend() == "gloo"
    tokenizer = synthetic_tokenizer(10)
    pairs = encode_pairs(tokenizer, synthetic_pairs("copy", 400, max_len=8, seed=1))
    torch.manual_seed(0)
    model = Transformer(
        TransformerConfig.tiny(tokenizer.vocab_size, max_len=9, dropout=0.0)
    )
    loader = make_loader(
        pairs, tokenizer, max_tokens=256, num_replicas=world_size, rank=rank
    )
    config = TrainConfig(
        steps={STEPS},
        warmup=20,
        label_smoothing=0.1,
        log_every=1,
        device="cpu",
        progress=False,
        checkpoint_dir=str(out / "checkpoints"),
    )
    trainer = RunTrainer(model, config, loader, tokenizer=tokenizer)
    trainer.fit()
    torch.save(trainer.model.state_dict(), out / f"rank{{rank}}.pt")
    dist.destroy_process_group()
    """
)


def single_process(accum_steps: int) -> Trainer:
    tokenizer = synthetic_tokenizer(10)
    pairs = encode_pairs(tokenizer, synthetic_pairs("copy", 400, max_len=8, seed=1))
    torch.manual_seed(0)
    model = Transformer(
        TransformerConfig.tiny(tokenizer.vocab_size, max_len=9, dropout=0.0)
    )
    config = TrainConfig(
        steps=STEPS,
        warmup=20,
        label_smoothing=0.1,
        log_every=0,
        device="cpu",
        progress=False,
        accum_steps=accum_steps,
    )
    trainer = Trainer(
        model, config, make_loader(pairs, tokenizer, max_tokens=256), log=None
    )
    trainer.fit()
    return trainer


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed",
)
def test_two_processes_train_like_one_process_with_twice_the_batch(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc_per_node 2".split(),
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Rank 0 alone logs and writes the checkpoint.
    assert sum(line.startswith("step") for line in result.stdout.splitlines()) == STEPS
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir() if p.name != "tensorboard") == [
        ".lock",
        "last.pt",
        "metrics.jsonl",
    ]
    rows = [
        json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]
    # rank 0 alone
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, STEPS + 1))

    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    # the ranks never drift apart
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)

    # TokenBatchSampler gives rank r the batches r, r + 2, r + 4, ...: one DDP step
    # reads batches 2k and 2k + 1, which is what one process reads with accum_steps=2.
    reference = single_process(accum_steps=2)
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert saved["training"]["history"]["loss"] == pytest.approx(
        reference.history["loss"], rel=1e-5
    )

    def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        for name, value in sorted(state.items()):
            # b_K has a zero gradient: Adam amplifies its rounding noise
            if name.endswith("in_proj.bias"):
                d = value.numel() // 3
                value = torch.cat([value[:d], value[2 * d :]])
            parts.append(value.flatten())
        return torch.cat(parts)

    ours, theirs = flat(reference.model.state_dict()), flat(rank0)
    relative = ((ours - theirs).norm() / ours.norm()).item()
    assert relative < 1e-4, relative


def torchrun_copy_run(tmp_path: Path, **popen) -> subprocess.Popen:
    """A long copy run of two processes under torchrun, once it logged 10 updates."""
    run = subprocess.Popen(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc_per_node 2".split(),
            *"-m aiayn train --task copy --steps 3000".split(),
            *"--device cpu --no-progress --log-every 5".split(),
            *"--checkpoint-every 1000 --train-size 2000".split(),
            *"--valid-size 50 --checkpoint-dir run".split(),
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S  # only against a hang
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 10):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.2)
    return run


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed",
)
def test_sigterm_stops_all_processes_after_the_same_update_and_rank_0_saves(tmp_path):
    run = torchrun_copy_run(tmp_path)
    run.send_signal(signal.SIGTERM)  # torchrun passes it on to both processes
    _, err = run.communicate(timeout=HANG_S)
    lines = [line for line in err.splitlines() if line.startswith("interrupted:")]
    # rank 0 alone reports
    assert len(lines) == 1 and "saved to run/last.pt" in lines[0], err
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["training"]
    # both processes' random states
    assert saved["step"] >= 10 and len(saved["rng"]) == 2
    # saved at the step where both stopped
    assert f"after step {saved['step']};" in lines[0]


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed",
)
def test_ctrl_c_twice_under_torchrun_is_answered_at_once_and_keeps_the_save(tmp_path):
    """At 22e25ab a first Ctrl-C said nothing; a second one 3 s later lost the save."""
    # a group of its own, as a terminal's foreground job
    run = torchrun_copy_run(tmp_path, start_new_session=True)
    os.killpg(run.pid, signal.SIGINT)
    time.sleep(3)
    # the run may have saved and ended already
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=HANG_S)
    said = [
        line
        for line in err.splitlines()
        if line.startswith("SIGINT: the run stops after this update")
    ]
    assert len(said) == 1, err  # rank 0 answers the first signal, once
    assert (
        sum(
            line.startswith("interrupted: stopped by SIGINT")
            for line in err.splitlines()
        )
        == 1
    ), err
    assert (
        torch.load(tmp_path / "run" / "last.pt", weights_only=True)["training"]["step"]
        >= 10
    )
