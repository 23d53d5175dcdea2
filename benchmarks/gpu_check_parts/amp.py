"""gpu_check's amp part: the GPU recipe's model in each precision, and on a T4."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
from collections.abc import Iterator
from typing import Any

from .common import BENCHMARKS, Context, gib, random_pairs, report, timed


@contextlib.contextmanager
def pretend_t4() -> Iterator[None]:
    """Capability 7.5 for "auto"; attention limited to the kernels a T4 has."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (7, 5)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.cuda.get_device_capability = real


def amp_setup(ctx: Context) -> tuple:
    """The recipe's model config, two batches of 12,000 positions, and their FLOPs."""
    from aiayn.batching import make_batch
    from aiayn.multi30k import GPU_RECIPE

    sys.path.insert(0, str(BENCHMARKS))
    import peers
    import train_mfu

    vocab = 500 if ctx.small else 10_000
    c = GPU_RECIPE.model_config(vocab)
    if ctx.small:
        c = dataclasses.replace(
            c, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64
        )
    # max_tokens 12,000: b * max(src_len, tgt_len + 1) <= 12,000
    shapes = (
        [(40, 10, 9), (20, 20, 19)] if ctx.small else [(400, 30, 29), (190, 63, 62)]
    )
    batches = [
        make_batch(random_pairs(b, s, t, vocab, seed=i), c.pad_id, c.bos_id, c.eos_id)
        for i, (b, s, t) in enumerate(shapes)
    ]
    size = peers.Size(
        "gpu recipe", vocab, c.d_model, c.n_heads, c.n_encoder_layers, c.d_ff,
        0, 0, 0, 0, (0, 0),
    )  # fmt: skip
    return c, batches, [train_mfu.train_flops(size, b) for b in batches]


def amp_steps(ctx: Context, amp: str, config: Any, batches: list) -> tuple:
    """Six updates in one precision: the trainer, step seconds, peak memory."""
    import torch

    from aiayn import Transformer
    from aiayn.runs import RunTrainer, check_finite
    from aiayn.train import TrainConfig

    device = torch.device(ctx.device)
    torch.manual_seed(0)
    train_config = TrainConfig(
        steps=100, warmup=4000, amp=amp, device=ctx.device, log_every=0, progress=False
    )
    trainer = RunTrainer(Transformer(config), train_config, batches * 100, log=None)
    scale0 = float(trainer.scaler.get_scale())
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed(trainer.train_step, device) for _ in range(6)]
    peak = reserved = math.nan
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    check_finite(trainer, weights=True)
    return trainer, scale0, times, peak, reserved


def on_a_t4(reserved: float, flops: list) -> tuple[bool, str]:
    """Whether the recipe fits a 16 GB T4, and how long its 4,000 steps take there."""
    fits = reserved / 2**30 < 14.0  # a T4 has 15 GiB, less the CUDA context
    per_step = statistics.mean(flops)
    return fits, (
        f" ({'fits' if fits else 'does NOT fit'} a 16 GB T4 with margin); GPU "
        f"recipe on a T4: {per_step / 1e12:.2f} TFLOP/step x 4000 = "
        f"{per_step * 4000 / 20e12 / 60:.0f} min at 20 TFLOP/s, "
        f"{per_step * 4000 / 10e12 / 60:.0f} at 10"
    )


def amp_mode(ctx: Context, mode: str, config: Any, batches: list, flops: list) -> float:
    """Train six steps in one precision mode, report it; its first loss."""
    import gc

    import torch

    from aiayn.train import autocast_dtype

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    amp = "auto" if mode == "t4" else mode
    with pretend_t4() if mode == "t4" else contextlib.nullcontext():
        dtype = autocast_dtype(amp, torch.device(ctx.device))
        trainer, scale0, times, peak, reserved = amp_steps(ctx, amp, config, batches)
    h = trainer.history
    losses, norms = h["loss"], h["grad_norm"]
    scale1 = float(trainer.scaler.get_scale())
    skipped = sum(1 for g in norms if not math.isfinite(g))
    # steps 3 to 6 alternate the two shapes: 2 of each
    t_a, t_b = statistics.median(times[2::2]), statistics.median(times[3::2])
    tflops = (flops[0] / t_a + flops[1] / t_b) / 2 / 1e12
    print(
        f"[{mode}] autocast {dtype}, scaler {scale0:g} -> {scale1:g}, losses "
        f"{[round(x, 3) for x in losses]}, grad norms {[round(x, 2) for x in norms]}, "
        f"step s {[round(x, 3) for x in times]}, peak {gib(peak)} GiB allocated, "
        f"{gib(reserved)} GiB reserved, {tflops:.1f} model TFLOP/s",
        flush=True,
    )
    ok = all(math.isfinite(x) for x in losses) and skipped < len(losses)
    detail = (
        f"autocast {str(dtype).replace('torch.', '')}, first loss {losses[0]:.3f}, "
        f"last {losses[-1]:.3f}, skipped {skipped}/6, scale {scale0:g}->{scale1:g}, "
        f"{t_a * 1e3:.0f}/{t_b * 1e3:.0f} ms per step, {tflops:.0f} TFLOP/s, peak "
        f"{gib(peak)} GiB ({gib(reserved)} reserved)"
    )
    if mode == "t4":
        fits, note = on_a_t4(reserved, flops)
        ok = ok and dtype == torch.float16 and scale0 == 65536.0 and fits
        detail += note
    report(f"amp.{mode}", "PASS" if ok else "FAIL", detail)
    return losses[0]


def part_amp(ctx: Context) -> None:
    """The GPU recipe's model in fp32, bf16, fp16 and on a pretended T4."""
    config, batches, flops = amp_setup(ctx)
    modes = ("off", "bf16", "fp16") + (("t4",) if ctx.cuda else ())
    first = {mode: amp_mode(ctx, mode, config, batches, flops) for mode in modes}
    if not ctx.cuda:
        report("amp.t4", "SKIPPED", "the T4 path needs CUDA")
    diffs = {k: abs(v - first["off"]) / first["off"] for k, v in first.items()}
    diffs.pop("off")
    report(
        "amp.first_loss",
        "PASS" if all(d < 0.02 for d in diffs.values()) else "WARN",
        "relative difference of the first loss to fp32: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
    )
