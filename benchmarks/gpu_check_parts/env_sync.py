"""gpu_check's env and sync parts: versions, the GPU, host synchronisations."""

from __future__ import annotations

import datetime
import platform
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import (
    ROOT,
    Context,
    count_syncs,
    fmt_counter,
    report,
    run_cli,
    short,
    synchronize,
)

if TYPE_CHECKING:  # torch is imported inside the parts, never by the driver
    import torch


# ----------------------------------------------------------------------------------
# env


def part_env(ctx: Context) -> None:
    """Versions, the GPU, the attention kernels enabled; what "auto" picks."""
    import torch

    import aiayn
    from aiayn.batching import pick_device
    from aiayn.train import autocast_dtype

    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}")
    print(
        f"python {platform.python_version()} | torch {torch.__version__} | "
        f"cuda {torch.version.cuda} | aiayn {aiayn.__version__} at {aiayn.__file__}"
    )
    if shutil.which("nvidia-smi"):
        query = "name,memory.total,driver_version,clocks.sm,power.limit"
        run_cli(ctx, ["nvidia-smi", f"--query-gpu={query}", "--format=csv"])
    if ctx.cuda and not torch.cuda.is_available():
        report("env.versions", "FAIL", f"--device {ctx.device}: no CUDA GPU visible")
        return
    name = "cpu"
    if ctx.cuda:
        name = describe_gpu(torch.device(ctx.device))
    auto = pick_device("auto")
    ours = Path(aiayn.__file__).resolve().is_relative_to(ROOT / "src")
    detail = (
        f"torch {torch.__version__}, {name}, pick_device('auto')={auto}, "
        f"amp auto -> {autocast_dtype('auto', auto)}"
    )
    if not ours:
        detail += f"; aiayn imported from {aiayn.__file__}, not this checkout"
    report("env.versions", "INFO" if ours else "WARN", detail)
    n = torch.cuda.device_count()
    report(
        "env.ddp",
        "SKIPPED",
        f"one GPU: NCCL refuses two ranks on one device ({n} CUDA device(s) "
        "visible; tests/test_ddp.py trains two processes with gloo on a CPU)",
    )


def describe_gpu(device: torch.device) -> str:
    """Print the GPU's properties and the kernels enabled; its name."""
    import torch

    p = torch.cuda.get_device_properties(device)
    b = torch.backends.cuda
    print(
        f"gpu {p.name} {p.total_memory / 2**30:.1f} GiB capability "
        f"{torch.cuda.get_device_capability(device)} | bf16 supported "
        f"{torch.cuda.is_bf16_supported()}"
    )
    print(
        f"sdpa enabled: flash {b.flash_sdp_enabled()} mem_efficient "
        f"{b.mem_efficient_sdp_enabled()} cudnn "
        f"{getattr(b, 'cudnn_sdp_enabled', lambda: '?')()} math "
        f"{b.math_sdp_enabled()} | matmul tf32 {b.matmul.allow_tf32}"
    )
    return p.name


# ----------------------------------------------------------------------------------
# sync


def sync_setup(ctx: Context) -> tuple:
    """The sync part's tokenizer, loaders and model size."""
    from aiayn import TransformerConfig
    from aiayn.train import (
        encode_pairs,
        make_loader,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    tok = synthetic_tokenizer(10)
    n_train, n_valid = (1000, 100) if ctx.small else (4000, 300)
    pairs = encode_pairs(tok, synthetic_pairs("copy", n_train, max_len=30, seed=1))
    valid = encode_pairs(tok, synthetic_pairs("copy", n_valid, max_len=30, seed=2))
    loader = make_loader(pairs, tok, max_tokens=2048, pin_memory=ctx.cuda)
    valid_loader = make_loader(valid, tok, max_tokens=2048, shuffle=False)
    size = TransformerConfig.tiny if ctx.small else TransformerConfig.small
    return tok, loader, valid_loader, size(tok.vocab_size, max_len=64)


def sync_trainer(ctx: Context, loader: Any, config: Any, steps: int) -> Any:
    """A new RunTrainer of a fresh model, the same every time."""
    import torch

    from aiayn import Transformer
    from aiayn.runs import RunTrainer
    from aiayn.train import TrainConfig

    torch.manual_seed(0)
    train_config = TrainConfig(
        steps=steps,
        warmup=10,
        log_every=0,
        amp="auto",
        device=ctx.device,
        progress=False,
    )
    return RunTrainer(Transformer(config), train_config, loader, log=None)


def report_syncs(ctx: Context, check: str, status: str, detail: str) -> None:
    """A row of the sync part; off CUDA nothing is counted: SKIPPED, the code ran."""
    if not ctx.cuda:
        status = "SKIPPED"
        detail = f"set_sync_debug_mode needs CUDA (the code ran on {ctx.device})"
    report(check, status, detail)


def check_train_step_syncs(ctx: Context, trainer: Any) -> None:
    """Five updates in "error" mode: any synchronising call raises."""
    import traceback

    import torch

    if not ctx.cuda:
        trainer.train_step()
        report_syncs(ctx, "sync.train_step", "SKIPPED", "")
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            trainer.train_step()
        ok, where = True, "5 Trainer.train_step() calls ran with "
        where += "set_sync_debug_mode('error')"
    except RuntimeError as err:
        ok = False
        tb = traceback.extract_tb(err.__traceback__)
        frames = [f"{short(f.filename)}:{f.lineno} {f.name}" for f in tb]
        frames = [f for f in frames if f.startswith("aiayn/")][-3:]
        where = f"{str(err).splitlines()[0][:90]} at {' <- '.join(reversed(frames))}"
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    report("sync.train_step", "PASS" if ok else "FAIL", where)


def check_decode_syncs(ctx: Context, model: Any, vocab: int) -> None:
    """Synchronisations of greedy, beam and sampling decoding, per call and step."""
    import torch

    from aiayn.decoding import beam_search, greedy_search, sample

    device = torch.device(ctx.device)
    n, m = (8, 8) if ctx.small else (32, 40)  # exactly m tokens each
    lengths = torch.randint(10, 26, (n,))
    src = torch.nn.utils.rnn.pad_sequence(
        [torch.randint(4, vocab, (int(k),)) for k in lengths], batch_first=True
    ).to(device)  # [n, longest]
    gen = torch.Generator(device=device).manual_seed(0)
    searches = {
        "greedy": lambda: greedy_search(model, src, max_len=m, min_len=m),
        "beam4": lambda: beam_search(model, src, beam_size=4, max_len=m, min_len=m),
        "sample": lambda: sample(model, src, max_len=m, min_len=m, generator=gen),
    }
    for name, search in searches.items():
        search()  # warm-up
        synchronize(device)
        with count_syncs(ctx.cuda) as found:
            search()
        total = sum(found.values())
        # about 9 a call: checks, limits, the stop flag every 8 steps, the final cut
        per_step = max(0, total - 9) / m
        report_syncs(
            ctx,
            f"sync.decode_{name}",
            "PASS" if per_step < 0.5 else "WARN",
            f"{total} syncs for {m} steps (~{per_step:.1f} per step beyond the ~9 "
            f"per call): {fmt_counter(found)}",
        )


def part_sync(ctx: Context) -> None:
    """Host synchronisations of training, evaluation and decoding."""
    import torch

    from aiayn.train import evaluate

    tok, loader, valid_loader, config = sync_setup(ctx)
    steps = 12 if ctx.small else 40
    trainer = sync_trainer(ctx, loader, config, steps)
    for _ in range(3):  # lazy initialisations (cuBLAS handles, Adam, the scaler)
        trainer.train_step()
    synchronize(torch.device(ctx.device))
    check_train_step_syncs(ctx, trainer)
    trainer = sync_trainer(ctx, loader, config, steps)
    trainer.train_step()
    with count_syncs(ctx.cuda) as found:
        trainer.fit()
    n = sum(found.values())
    report_syncs(
        ctx,
        "sync.fit",
        "INFO",
        f"{n} syncs in {steps - 1} updates ({n / (steps - 1):.2f}/update; flush "
        f"every 10 expected): {fmt_counter(found)}",
    )
    with count_syncs(ctx.cuda) as found:
        evaluate(trainer.model, valid_loader, trainer.criterion, trainer.config.amp)
    report_syncs(
        ctx,
        "sync.evaluate",
        "INFO",
        f"{sum(found.values())} syncs for {len(list(valid_loader))} batches: "
        f"{fmt_counter(found)}",
    )
    check_decode_syncs(ctx, trainer.model.eval(), tok.vocab_size)
