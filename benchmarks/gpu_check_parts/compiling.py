"""gpu_check's compile part: graphs and recompiles of a compiled RunTrainer."""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Iterator
from typing import Any

from .common import Context, report, timed


class DynamoNotes(logging.Handler):
    """What torch._dynamo logs about recompiling: the reasons, the limit reached."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the guard failures of a recompile, and any recompile-limit message."""
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_hits.append(message.splitlines()[0])
        if "Recompiling function" in message:
            for line in message.splitlines():
                if line.strip().startswith("- "):
                    self.reasons.append(line.strip()[2:])


class Recording:
    """A loader that notes the shape (batch, source, target) of each batch it yields."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.batch_sampler = loader, loader.batch_sampler
        self.shapes: list[tuple[int, int, int]] = []

    def __iter__(self) -> Iterator[Any]:
        """The loader's batches, noting each one's shape."""
        for batch in self.loader:
            self.shapes.append((*batch.src.shape, batch.tgt_in.size(1)))
            yield batch


def compile_trainer(ctx: Context, steps: int) -> tuple:
    """A RunTrainer with compile=True on the copy task's token-bucketed batches."""
    import torch

    from aiayn import Transformer, TransformerConfig
    from aiayn.runs import RunTrainer
    from aiayn.train import (
        TrainConfig,
        encode_pairs,
        make_loader,
        synthetic_pairs,
        synthetic_tokenizer,
    )

    tok = synthetic_tokenizer(10)
    n, max_tokens = (2000, 1024) if ctx.small else (20_000, 4096)
    pairs = encode_pairs(tok, synthetic_pairs("copy", n, max_len=40, seed=1))
    # sorted buckets, batches in shuffled order: the Multi30k presets' loader
    loader = Recording(make_loader(pairs, tok, max_tokens, pin_memory=ctx.cuda))
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(tok.vocab_size, max_len=64))
    config = TrainConfig(
        steps=steps,
        warmup=10,
        log_every=0,
        compile=True,
        amp="auto",
        device=ctx.device,
        progress=False,
    )
    return RunTrainer(model, config, loader, log=None), loader


def compile_steps(ctx: Context, trainer: Any, loader: Recording, steps: int) -> list:
    """Step seconds, printed with the graphs so far; stops short of the deadline."""
    import torch
    from torch._dynamo.utils import counters

    device, times = torch.device(ctx.device), []
    for i in range(steps):
        times.append(timed(trainer.train_step, device))
        graphs = counters["stats"].get("unique_graphs", 0)
        print(
            f"step {i + 1}: shape {loader.shapes[-1]}, {times[-1]:.2f}s, graphs so "
            f"far {graphs}",
            flush=True,
        )
        if ctx.left() < (5 if ctx.small else 30):  # a recompile: 25 s on a GPU
            print(f"stopping after {i + 1} steps: the part's time is nearly up")
            break
    return times


def part_compile(ctx: Context, backend: str) -> None:
    """Recompiles of the package's model over token-bucketed batch shapes."""
    import torch
    from torch._dynamo.utils import counters

    if backend != "inductor":  # the Trainer calls torch.compile(module)
        torch.compile = functools.partial(torch.compile, backend=backend)
    torch._logging.set_logs(recompiles=True)
    notes = DynamoNotes()
    logging.getLogger("torch._dynamo").addHandler(notes)
    steps = 6 if ctx.small else 20
    trainer, loader = compile_trainer(ctx, steps)
    times = compile_steps(ctx, trainer, loader, steps)
    losses = trainer.history["loss"]
    graphs = counters["stats"].get("unique_graphs", 0)
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8))
    hit = bool(notes.limit_hits) or graphs >= limit
    breaks = sum(counters["graph_break"].values())
    print("shapes (b, s, t):", loader.shapes)
    print("step seconds:", [round(t, 3) for t in times])
    print("loss:", [round(x, 3) for x in losses])
    ok = graphs <= 2 and not hit
    detail = (
        f"backend {backend}: {graphs} graphs for {len(set(loader.shapes))} distinct "
        f"shapes in {len(times)} steps, {breaks} graph breaks, recompile limit "
        f"({limit}) hit: {hit}; first step {times[0]:.1f}s, steady "
        f"{statistics.median(times[-5:]) * 1e3:.0f} ms, total {sum(times):.0f}s, "
        f"last loss {losses[-1]:.3f}"
    )
    if not ok:
        reasons = list(dict.fromkeys(r[:160] for r in notes.reasons))
        detail += "; recompiles: " + " | ".join(reasons[:6])
    report(f"compile.{backend}", "PASS" if ok else "FAIL", detail)
