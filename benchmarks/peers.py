#!/usr/bin/env python3
"""The book's `aiayn.Transformer` against two peers of the same size.

The peers are Hugging Face's `MarianMTModel` (the architecture of Marian NMT and of
the OPUS-MT models), built with random weights from a `MarianConfig` of the same
size, and `torch.nn.Transformer` between the book's embeddings and tied head (the
`TorchTransformerModel` of train_throughput.py). All three are the paper's post-norm
encoder-decoder with ReLU, sinusoidal positions, embeddings scaled by sqrt(d_model)
and one matrix shared by the source and target embeddings and the output layer. Every
run is float32, on the CPU with one thread (`--threads`) unless `--device` names a
GPU, and measures, side by side:

1. train: tokens per second of a full training step (zero_grad, forward, the same
   label-smoothed cross-entropy, backward, the same Adam update) of the three models
   on the same batches of random token pairs with padding;
2. memory: the MiB that one training step adds to the process's resident memory, in
   a fresh process per model and repetition (the script runs itself with a hidden
   flag). That process builds the model and Adam, runs one step so that Adam's
   state exists, returns freed heap to the system (glibc's `malloc_trim(0)`),
   resets the kernel's resident-memory high-water mark (writing "5" to
   /proc/self/clear_refs resets VmHWM), reads the resident memory (/proc/self/statm),
   runs a second step on the same batch and reads VmHWM of /proc/self/status: the
   step's cost is that peak minus the resident memory before it, the activations,
   gradients and temporaries (the weights and Adam's state are in the baseline).
   `resource.getrusage(...).ru_maxrss` is not used, because it also keeps the
   parent's high-water mark when the child is spawned with vfork. On a CUDA device
   it is instead the peak that the step allocates there beyond what was allocated
   before it (`torch.cuda.max_memory_allocated`), in this process. Next to it, the
   MiB of activations that autograd saves for the backward pass of one step
   (`torch.autograd.graph.saved_tensors_hooks`, each storage once, weights left
   out): the part of the step's memory that the model's code decides, the same on
   every machine;
3. decode: generated tokens per second of greedy search and beam search (beam 4) of
   aiayn (`greedy_search`, `beam_search`) and of Marian (`generate`), each writing
   exactly `--gen-len` tokens per sentence of the same source batch.

Each measurement is interleaved: in every repetition every model runs once, in an
order that rotates from one repetition to the next, after an untimed warm-up. The
tables give the median, min and max over the repetitions, measured by wall time
(time.perf_counter) and by the process's CPU time (time.process_time), and the ratio
of aiayn's median to each peer's.

    python benchmarks/peers.py                         # both sizes, every measurement
    python benchmarks/peers.py --size book             # the book's size only
    python benchmarks/peers.py --size base --only train --only memory --json base.json
    python benchmarks/peers.py --smoke                 # a tiny model, in seconds

Sizes: `book` (vocabulary 4,000, d_model 256, 4 heads, 3 + 3 layers, d_ff 512) and
`base` (vocabulary 8,000, the paper's base model: d_model 512, 8 heads, 6 + 6
layers, d_ff 2048). Marian needs `transformers` (benchmarks/requirements.txt);
without it the script says so in one line and measures the other two.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import Transformer, TransformerConfig
from aiayn.batching import Batch, pick_device
from aiayn.decoding import beam_search, greedy_search
from aiayn.optim import make_optimizer

# benchmarks/ is no package: import train_throughput.py, next to this file, by path
sys.path.insert(0, str(Path(__file__).resolve().parent))
_train_throughput = importlib.import_module("train_throughput")
TorchTransformerModel = _train_throughput.TorchTransformerModel
make_batches = _train_throughput.make_batches

PAD, BOS, EOS = 0, 1, 2  # the ids of all three models (Marian's decoder start is BOS)
MAX_LEN = 512  # rows of the positional tables; longer than any sequence used here
MARIAN, TORCH = "Marian", "torch.nn"
CHILD_FLAG = "--memory-child"  # the hidden flag of the memory measurement's process


@dataclasses.dataclass(frozen=True)
class Size:
    """A model size and the work that measures it."""

    name: str
    vocab: int
    d_model: int
    heads: int
    layers: int  # encoder layers, and as many decoder layers
    d_ff: int
    batch_size: int  # training: pairs per batch
    seq_len: int  # training: sequences of seq_len / 2 to seq_len - 1 tokens
    steps: int  # training: batches per timed repetition
    decode_batch: int  # decoding: source sentences
    src_lens: tuple[int, int]  # decoding: source lengths, uniform in [low, high]


SIZES = {
    "book": Size("book", 4000, 256, 4, 3, 512, 32, 32, 2, 32, (10, 25)),
    "base": Size("base", 8000, 512, 8, 6, 2048, 12, 32, 1, 32, (10, 25)),
    "smoke": Size("smoke", 200, 32, 2, 1, 64, 4, 8, 1, 4, (3, 6)),
}


# ----------------------------------------------------------------------------------
# The three models


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def aiayn_config(size: Size, dropout: float) -> TransformerConfig:
    """The config of aiayn's model, and of torch.nn's wrapper: post-norm, shared."""
    return TransformerConfig(
        size.vocab,
        size.vocab,
        d_model=size.d_model,
        n_heads=size.heads,
        n_encoder_layers=size.layers,
        n_decoder_layers=size.layers,
        d_ff=size.d_ff,
        dropout=dropout,
        norm_first=False,
        share_embeddings=True,
        tie_output=True,
        max_len=MAX_LEN,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )


def build_marian(size: Size, dropout: float) -> nn.Module:
    """A randomly initialised MarianMTModel of the given size, with aiayn's choices."""
    import transformers
    from transformers import MarianConfig, MarianMTModel

    transformers.logging.set_verbosity_error()  # no advice about generation configs
    fields: dict[str, Any] = {
        "vocab_size": size.vocab,
        "d_model": size.d_model,
        "encoder_layers": size.layers,
        "decoder_layers": size.layers,
        "encoder_attention_heads": size.heads,
        "decoder_attention_heads": size.heads,
        "encoder_ffn_dim": size.d_ff,
        "decoder_ffn_dim": size.d_ff,
        "activation_function": "relu",
        "scale_embedding": True,  # sqrt(d_model) E[tokens], as in the paper
        "dropout": dropout,
        "attention_dropout": dropout,
        "activation_dropout": dropout,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "max_position_embeddings": MAX_LEN,  # sinusoidal and frozen, as Marian has them
        "pad_token_id": PAD,
        "decoder_start_token_id": BOS,
        "eos_token_id": EOS,
        "forced_eos_token_id": None,  # MarianConfig's default would force id 0 last
    }
    try:
        config = MarianConfig(**fields, attn_implementation="sdpa")
    except (TypeError, ValueError):
        config = MarianConfig(**fields)
    return MarianMTModel(config)


def build_model(name: str, size: Size, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    if name == "aiayn":
        return Transformer(aiayn_config(size, dropout))
    if name == TORCH:
        return TorchTransformerModel(aiayn_config(size, dropout))
    return build_marian(size, dropout)


def count_parameters(model: nn.Module) -> int:
    """Trained parameters, a shared matrix once (Marian's sinusoids are frozen ones)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def logits_of(name: str, model: nn.Module, batch: Batch) -> Tensor:
    """Teacher-forced logits [batch, tgt_len, vocab] of any of the three models."""
    if name == MARIAN:
        return model(
            input_ids=batch.src,
            attention_mask=batch.src != PAD,
            decoder_input_ids=batch.tgt_in,
            decoder_attention_mask=batch.tgt_in != PAD,
            use_cache=False,  # as without labels it would return a key-value cache
        ).logits
    return model(batch.src, batch.tgt_in)


def train_step(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch
) -> None:
    """One full update, with the same loss for all three models."""
    optimizer.zero_grad(set_to_none=True)
    logits = logits_of(name, model, batch)  # [b, t, V]
    loss = F.cross_entropy(
        logits.flatten(0, 1),
        batch.tgt_out.flatten(),
        ignore_index=PAD,
        label_smoothing=0.1,
    )
    loss.backward()
    optimizer.step()


def new_optimizer(model: nn.Module) -> torch.optim.Adam:
    """torch.optim.Adam, lr 1e-4, betas (0.9, 0.98), eps 1e-9, trained parameters."""
    return make_optimizer(model, lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


def train_batches(size: Size, n: int) -> list[Batch]:
    return make_batches(n, size.batch_size, size.seq_len, size.vocab, seed=0)


# ----------------------------------------------------------------------------------
# Timing and statistics


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer sees all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds of this process, and the result of one call of fn."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def interleaved(
    runs: dict[str, Callable[[], Any]],
    reps: int,
    check: Callable[[str, Any], None] = lambda name, out: None,
) -> dict:
    """Seconds of each run, {name: {"wall": [...], "cpu": [...]}}, rotating the order.

    Repetition r starts with the (r mod n)-th run, so every run goes first as often
    as the others and a machine that drifts affects all alike.
    """
    names = list(runs)
    seconds = {name: {"wall": [], "cpu": []} for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            wall, cpu, out = timed(runs[name])
            check(name, out)
            seconds[name]["wall"].append(wall)
            seconds[name]["cpu"].append(cpu)
    return seconds


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rate_rows(seconds: dict, work: float) -> dict[str, dict[str, dict[str, float]]]:
    """{name: {"wall" | "cpu": median/min/max of work per second}}."""
    return {
        name: {kind: summary([work / s for s in times[kind]]) for kind in times}
        for name, times in seconds.items()
    }


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}"


def mib(x: float) -> str:
    return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def rate_table(rows: dict[str, dict], ref_name: str = "aiayn") -> list[str]:
    """A markdown table of throughputs (higher is better); the ratio of medians."""
    ref = rows[ref_name]["wall"]["median"]
    head = (
        "| model | median | min | max | CPU-time median | CPU-time min "
        f"| CPU-time max | ratio {ref_name}/model |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        wall, cpu = row["wall"], row["cpu"]
        lines.append(
            f"| {name} | {fmt(wall['median'])} | {fmt(wall['min'])} "
            f"| {fmt(wall['max'])} | {fmt(cpu['median'])} | {fmt(cpu['min'])} "
            f"| {fmt(cpu['max'])} | {ratio(ref, wall['median'])} |"
        )
    return lines


# ----------------------------------------------------------------------------------
# 1. Training throughput


def measure_train(names: list[str], size: Size, args: argparse.Namespace) -> dict:
    device = args.device
    models = {
        name: build_model(name, size, args.dropout).to(device).train() for name in names
    }
    optimizers = {name: new_optimizer(m) for name, m in models.items()}
    batches = [b.to(device) for b in train_batches(size, args.steps or size.steps)]
    tokens = sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)  # real tokens

    def run(name: str) -> Callable[[], None]:
        def steps() -> None:
            for batch in batches:
                train_step(name, models[name], optimizers[name], batch)
            synchronize(device)

        return steps

    runs = {name: run(name) for name in names}
    for name in names:  # warm-up: Adam's state, the allocator, lazy initialisation
        for _ in range(args.warmup):
            train_step(name, models[name], optimizers[name], batches[0])
    seconds = interleaved(runs, args.reps)
    rows = rate_rows(seconds, tokens)
    title = (
        f"training step, real source + target tokens/s (higher is better): "
        f"{len(batches)} batch(es) of {size.batch_size} pairs of "
        f"{size.seq_len // 2}-{size.seq_len - 1} tokens "
        f"({tokens / len(batches):,.0f} real tokens each) per repetition"
    )
    return {
        "title": title,
        "tokens": tokens,
        "seconds": seconds,
        "rows": rows,
        "table": rate_table(rows),
    }


# ----------------------------------------------------------------------------------
# 2. Memory of one training step, each in a fresh process


def statm_rss_mib() -> float:
    """Resident memory now, from /proc/self/statm (pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def vm_hwm_mib() -> float:
    """The resident-memory high-water mark VmHWM of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_high_water_mark() -> bool:
    """Hand freed heap back to the system, then reset VmHWM to the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc only
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak resident set size
    except OSError:
        return False
    return vm_hwm_mib() <= statm_rss_mib() + 1


def memory_child(name: str, size: Size, args: argparse.Namespace) -> None:
    """In a fresh process: print the MiB one training step adds, as a JSON line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors.*")
        model = build_model(name, size, args.dropout).train()
        optimizer = new_optimizer(model)
        batch = train_batches(size, 1)[0]
        train_step(name, model, optimizer, batch)  # untimed: Adam's state now exists
        reset = reset_high_water_mark()
        before = statm_rss_mib()
        train_step(name, model, optimizer, batch)
        peak = vm_hwm_mib()
    sample = {"model": name, "rss_before_mib": before, "peak_mib": peak}
    print(json.dumps({**sample, "step_mib": peak - before, "hwm_reset": reset}))


def run_child(name: str, size: Size, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, name]
    command += ["--threads", str(args.threads), "--dropout", str(args.dropout)]
    command += ["--smoke"] if size.name == "smoke" else ["--size", size.name]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory process of {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cuda_step_memory(name: str, size: Size, args: argparse.Namespace) -> dict:
    """On a CUDA device: the MiB one training step allocates beyond what it found."""
    device = args.device
    model = build_model(name, size, args.dropout).to(device).train()
    optimizer = new_optimizer(model)
    batch = train_batches(size, 1)[0].to(device)
    train_step(name, model, optimizer, batch)  # untimed: Adam's state now exists
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) / 2**20
    train_step(name, model, optimizer, batch)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    del model, optimizer
    torch.cuda.empty_cache()
    return {
        "model": name,
        "rss_before_mib": before,
        "peak_mib": peak,
        "step_mib": peak - before,
        "hwm_reset": True,
    }


def saved_for_backward_mib(name: str, size: Size, args: argparse.Namespace) -> float:
    """MiB that autograd keeps for the backward pass of one step's forward and loss.

    The sum over the distinct storages of the tensors saved for backward, weights
    left out: the activations, whatever the allocator does (same on every machine).
    """
    torch.manual_seed(0)
    model = build_model(name, size, args.dropout).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage address -> bytes

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    batch = train_batches(size, 1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = logits_of(name, model, batch)
        F.cross_entropy(
            logits.flatten(0, 1),
            batch.tgt_out.flatten(),
            ignore_index=PAD,
            label_smoothing=0.1,
        )
    return sum(saved.values()) / 2**20


def measure_memory(names: list[str], size: Size, args: argparse.Namespace) -> dict:
    on_cuda = args.device.type == "cuda"
    samples: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            measure = cuda_step_memory if on_cuda else run_child
            samples[name].append(measure(name, size, args))
    step = {n: summary([s["step_mib"] for s in ss]) for n, ss in samples.items()}
    before = {
        n: statistics.median(s["rss_before_mib"] for s in ss)
        for n, ss in samples.items()
    }
    saved = {n: saved_for_backward_mib(n, size, args) for n in names}
    ref = step["aiayn"]["median"]
    held = "allocated" if on_cuda else "RSS"
    head = (
        f"| model | median MiB | min | max | {held} before the step, MiB "
        "| saved for backward, MiB | ratio aiayn/model |"
    )
    table = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in step.items():
        table.append(
            f"| {name} | {mib(s['median'])} | {mib(s['min'])} "
            f"| {mib(s['max'])} | {before[name]:,.0f} | {mib(saved[name])} "
            f"| {ratio(ref, s['median'])} |"
        )
    added = (
        "the peak MiB it allocates on the GPU"
        if on_cuda
        else "MiB added to the resident set"
    )
    fresh = "" if on_cuda else ", a fresh process per model and repetition"
    title = (
        f"memory of one training step, {added} (lower is better): a batch of "
        f"{size.batch_size} pairs of up to {size.seq_len - 1} tokens{fresh}"
    )
    notes = []
    if not all(s["hwm_reset"] for ss in samples.values() for s in ss):
        notes.append(
            "WARNING: VmHWM could not be reset here; the warm-up step's peak "
            "may hide the measured step's, so these numbers are lower bounds"
        )
    notes.append(
        "saved for backward: the activations that autograd keeps for one "
        "step's backward pass (weights excluded), counted once per storage "
        "on the CPU; the rest of a step's memory is gradients and "
        "temporaries"
    )
    return {
        "title": title,
        "samples": samples,
        "step": step,
        "saved_mib": saved,
        "table": table,
        "notes": notes,
    }


# ----------------------------------------------------------------------------------
# 3. Decoding throughput


def decode_source(size: Size, n: int) -> Tensor:
    """n random sentences of src_lens[0]..src_lens[1] tokens, right-padded: [n, len]."""
    g = torch.Generator().manual_seed(1)
    low, high = size.src_lens
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    src = torch.full((n, max(lengths)), PAD, dtype=torch.long)
    for i, length in enumerate(lengths):
        src[i, :length] = torch.randint(4, size.vocab, (length,), generator=g)
    return src


def decoders(
    name: str, model: nn.Module, src: Tensor, beams: int
) -> Callable[[int], Tensor]:
    """m -> the generated tokens [batch, m] of one search that writes exactly m."""
    if name == "aiayn":
        if beams == 1:
            return lambda m: greedy_search(model, src, max_len=m, min_len=m).tokens
        return lambda m: (
            beam_search(model, src, beam_size=beams, max_len=m, min_len=m).tokens
        )

    def generate(m: int) -> Tensor:
        out = model.generate(
            input_ids=src,
            attention_mask=src != PAD,
            num_beams=beams,
            max_new_tokens=m,
            min_new_tokens=m,
            do_sample=False,
            use_cache=True,
            decoder_start_token_id=BOS,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )  # [batch, 1 + m]: the start token, then the generated ones
        assert out.shape[1] == m + 1 and bool((out[:, 0] == BOS).all()), out.shape
        return out[:, 1:]

    return generate


def measure_decode(size: Size, args: argparse.Namespace) -> dict:
    names = ["aiayn", MARIAN]
    device = args.device
    models = {
        name: build_model(name, size, args.dropout).to(device).eval() for name in names
    }
    src = decode_source(size, args.decode_batch or size.decode_batch).to(device)
    m = args.gen_len
    tokens = src.size(0) * m  # generated tokens of one search
    result = {}
    for label, beams in (("greedy", 1), ("beam 4", 4)):
        search = {name: decoders(name, models[name], src, beams) for name in names}

        def check(name: str, out: Tensor, label: str = label) -> None:
            assert out.shape == (src.size(0), m), (name, label, tuple(out.shape))

        with torch.inference_mode():
            for name in names:  # warm-up, shorter
                search[name](min(m, 8))

            def run(f: Callable[[int], Tensor]) -> Callable[[], Tensor]:
                def search_m() -> Tensor:
                    out = f(m)
                    synchronize(device)
                    return out

                return search_m

            runs = {name: run(search[name]) for name in names}
            seconds = interleaved(runs, args.reps, check)
        rows = rate_rows(seconds, tokens)
        title = (
            f"{label} decoding, generated tokens/s (higher is better): "
            f"{src.size(0)} sentences of {size.src_lens[0]}-{size.src_lens[1]} "
            f"tokens, exactly {m} generated tokens each"
        )
        result[label] = {
            "title": title,
            "tokens": tokens,
            "seconds": seconds,
            "rows": rows,
            "table": rate_table(rows),
        }
    return result


# ----------------------------------------------------------------------------------
# The report


def transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(
    size: Size, counts: dict[str, int], attention: str | None, args: argparse.Namespace
) -> list[str]:
    """The size, the setting and the parameter counts (a warning if they differ)."""
    n = size.layers
    title = (
        f"## {size.name}: vocabulary {size.vocab:,}, d_model {size.d_model}, "
        f"{size.heads} heads, {n}+{n} layers, d_ff {size.d_ff}"
    )
    where = (
        torch.cuda.get_device_name(args.device)
        if args.device.type == "cuda"
        else f"{args.device.type.upper()} ({platform.machine()})"
    )
    setting = (
        f"post-norm, dropout {args.dropout}; {where}, "
        f"float32, {torch.get_num_threads()} CPU thread(s); "
        f"torch {torch.__version__}, transformers {transformers_version()}; "
        f"{args.reps} repetition(s)"
    )
    if attention:
        setting += f"; Marian's attention: {attention}"
    ours = counts["aiayn"]
    params = [
        f"{name} {c:,}" + ("" if c == ours else f" ({c / ours:.4f} x aiayn)")
        for name, c in counts.items()
    ]
    lines = [title, "", setting, "parameters: " + ", ".join(params)]
    for name, c in counts.items():
        if abs(c / ours - 1) > 0.01:
            lines.append(
                f"WARNING: {name} has {c / ours:.3f} times aiayn's "
                "parameters; the models differ by more than 1%"
            )
    return lines


def print_section(title: str, table: list[str], notes: Sequence[str] = ()) -> None:
    print(f"\n### {title}\n")
    print("\n".join(table))
    for note in notes:
        print(note)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size",
        action="append",
        choices=["book", "base"],
        help="book or base, repeatable (default: both)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, 1 repetition, tiny batches: runs in seconds",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=["train", "memory", "decode"],
        help="the measurements to make, repeatable (default: all)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions of each model (default 7; --smoke 1)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed training steps of each model first (default 2)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training batches per repetition (default: book 2, base 1)",
    )
    p.add_argument(
        "--gen-len",
        type=int,
        default=None,
        help="tokens generated per sentence (default 40; --smoke 5)",
    )
    p.add_argument(
        "--decode-batch",
        type=int,
        default=None,
        help="source sentences to decode (default 32)",
    )
    p.add_argument("--dropout", type=float, default=0.0, help="every dropout (0.0)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, mps or auto; off the CPU the memory "
        "measurement is what the device allocates for one step",
    )
    p.add_argument("--json", type=Path, default=None, help="write every raw number")
    p.add_argument(CHILD_FLAG, dest="memory_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.device = pick_device(args.device)
    except ValueError as err:
        p.error(str(err))
    if args.reps is None:
        args.reps = 1 if args.smoke else 7
    if args.gen_len is None:
        args.gen_len = 5 if args.smoke else 40
    if args.smoke:
        args.warmup = min(args.warmup, 1)
    if not 1 <= args.gen_len < MAX_LEN:
        p.error(f"--gen-len must be in [1, {MAX_LEN - 1}]")
    if args.reps < 1 or args.threads < 1:
        p.error("--reps and --threads must be at least 1")
    return args


def run_size(size: Size, args: argparse.Namespace, marian: bool) -> dict:
    names = ["aiayn", MARIAN, TORCH] if marian else ["aiayn", TORCH]
    models = {name: build_model(name, size, args.dropout) for name in names}
    counts = {name: count_parameters(model) for name, model in models.items()}
    attention = None
    if marian:
        attention = getattr(models[MARIAN].config, "_attn_implementation", "?")
    del models
    print("\n" + "\n".join(header(size, counts, attention, args)), flush=True)
    out: dict[str, Any] = {
        "size": dataclasses.asdict(size),
        "parameters": counts,
        "marian_attention": attention,
    }
    only = set(args.only or ["train", "memory", "decode"])
    if "train" in only:
        train = out["train"] = measure_train(names, size, args)
        print_section(f"{size.name}: {train['title']}", train["table"])
    if "memory" in only and args.device.type not in ("cpu", "cuda"):
        print(
            f"\n(memory is measured on the CPU and on CUDA only: skipped on "
            f"{args.device.type})"
        )
    elif "memory" in only:
        memory = out["memory"] = measure_memory(names, size, args)
        print_section(
            f"{size.name}: {memory['title']}", memory["table"], memory["notes"]
        )
    if "decode" in only and marian:
        for label, d in measure_decode(size, args).items():
            out.setdefault("decode", {})[label] = d
            print_section(f"{size.name}: {d['title']}", d["table"])
    elif "decode" in only:
        print("\n(decoding compares aiayn with Marian only: skipped)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["smoke"] if args.smoke else dict.fromkeys(args.size or ["book", "base"])
    sizes = [SIZES[name] for name in names]
    if args.memory_child is not None:
        memory_child(args.memory_child, sizes[0], args)
        return 0
    marian = have_transformers()
    if not marian:
        print(
            "Marian skipped: transformers is not installed "
            "(pip install -r benchmarks/requirements.txt)"
        )
    results: dict[str, Any] = {
        "meta": {
            "device": str(args.device),
            "threads": args.threads,
            "reps": args.reps,
            "warmup": args.warmup,
            "dropout": args.dropout,
            "gen_len": args.gen_len,
            "torch": torch.__version__,
            "transformers": transformers_version(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        }
    }
    with warnings.catch_warnings():
        # torch.nn.Transformer warns that padding masks disable its nested tensors
        warnings.filterwarnings("ignore", message=".*nested tensors.*")
        for size in sizes:
            results[size.name] = run_size(size, args, marian)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
