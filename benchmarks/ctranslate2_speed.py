#!/usr/bin/env python3
"""The shipped model translated by the book's decoding and by CTranslate2, side by side.

Five engines translate the same test sentences with greedy search and with beam
search (4 beams), one CPU thread each:

- the book's `translate` (chapter 15), eager PyTorch;
- the same with chapter 18's `FastDecoder` (`steps=`): the step and the source
  pass compiled by inductor, batches that drop ended sentences; its compilation
  runs first, before the timing, and the record gives its time and the number of
  programs torch.compile made for it (and for any engine while timed: none);
- the book's model under `torch.compile` (inductor with `freezing`), encoder and
  decoder compiled with dynamic shapes; the compilation runs once before the timing;
- CTranslate2 with the model exported in float32 by `aiayn.production`;
- CTranslate2 with the model exported with int8 weights.

The engines run in turn, repetition after repetition, so that a machine that
speeds up or slows down affects them alike; each row reports the median time of
the repetitions, its spread (min-max), the ratio to the book's eager median, and
the BLEU of the output (sacreBLEU, as chapter 16 scores). The greedy outputs of the
float32 export must equal the book's; the script says how many do.

    python benchmarks/ctranslate2_speed.py \\
        --out benchmarks/results/ctranslate2-speed.json

Multi30k is read from $AIAYN_MULTI30K_DIR (or downloaded), or from --data-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from aiayn.decoding import translate
from aiayn.fast_decoding import FastDecoder
from aiayn.multi30k import corpus_bleu, load_multi30k, pretrained
from aiayn.production import CTranslate2Model, export_ctranslate2


def cpu_name() -> str:
    """The processor's model name, as Linux reports it (else the platform's)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(script: str, threads: str) -> dict:
    """What a record says of how it was made: command, commit, date, machine."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return dict(
        command=f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        commit=commit,
        date=str(date.today()),
        machine=f"{cpu_name()}, {os.cpu_count()} cores, {threads}",
        torch=torch.__version__,
        ctranslate2=__import__("ctranslate2").__version__,
    )


def book_engine(model, tokenizer, batch_size, steps=None):
    def run(texts, method):
        with torch.no_grad():
            return translate(
                model,
                tokenizer,
                texts,
                method=method,
                batch_size=batch_size,
                steps=steps,
            )

    return run


def programs() -> int:
    """The programs torch.compile has made in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_book_engine(tokenizer, batch_size):
    import torch._inductor.config as inductor

    inductor.freezing = True  # weights become constants of the compiled graphs
    model, _ = pretrained("multi30k-de-en")
    model.encode = torch.compile(model.encode, dynamic=True)
    model.decode = torch.compile(model.decode, dynamic=True)
    return book_engine(model, tokenizer, batch_size)


def ct2_engine(directory, tokenizer, batch_size):
    engine = CTranslate2Model(directory, tokenizer, threads=1)

    def run(texts, method):
        return engine.translate(texts, method=method, batch_size=batch_size)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="the Multi30k folder")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None, help="write the record here")
    parser.add_argument(
        "--note", default="nothing else ran", help="what else ran on the machine"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    pairs = load_multi30k("test2016", "de-en", args.data_dir)[: args.sentences]
    model, tokenizer = pretrained("multi30k-de-en")
    # sorted by length, as chapter 16's evaluate_bleu batches them: less padding
    pairs = sorted(pairs, key=lambda pair: len(tokenizer.encode(pair[0])))
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    folder = Path(tempfile.mkdtemp())
    export_ctranslate2(model, tokenizer, folder / "float32")
    export_ctranslate2(model, tokenizer, folder / "int8", quantization="int8")

    fast = FastDecoder()
    fast_engine = book_engine(model, tokenizer, args.batch_size, steps=fast)
    start = time.perf_counter()  # before the engine below turns freezing on
    for method in ("greedy", "beam"):
        fast_engine(sources, method)
    fast_warmup = dict(
        compiling_seconds=round(fast.warmup_seconds, 1),
        first_runs_seconds=round(time.perf_counter() - start, 1),
        programs=programs(),  # the first to compile: all of them are its
    )
    engines = {
        "book, eager": book_engine(model, tokenizer, args.batch_size),
        "book, FastDecoder": fast_engine,
        "book, torch.compile": compiled_book_engine(tokenizer, args.batch_size),
        "CTranslate2, float32": ct2_engine(
            folder / "float32", tokenizer, args.batch_size
        ),
        "CTranslate2, int8": ct2_engine(folder / "int8", tokenizer, args.batch_size),
    }
    searches = {"greedy": "greedy", "beam 4": "beam"}
    start = time.perf_counter()
    for name, run in engines.items():  # warm-up; compiles the compiled engine
        for method in searches.values():
            run(sources, method)
    warmup = time.perf_counter() - start
    compiled = programs()
    times = {(e, s): [] for e in engines for s in searches}
    outputs = {}
    for _ in range(args.reps):
        for search, method in searches.items():
            for name, run in engines.items():
                t = time.perf_counter()
                outputs[name, search] = run(sources, method)
                times[name, search].append(time.perf_counter() - t)

    rows = []
    for search in searches:
        base = statistics.median(times["book, eager", search])
        for name in engines:
            ts = times[name, search]
            bleu, signature = corpus_bleu(outputs[name, search], references)
            same = sum(
                a == b
                for a, b in zip(outputs[name, search], outputs["book, eager", search])
            )
            rows.append(
                dict(
                    search=search,
                    engine=name,
                    seconds=round(statistics.median(ts), 3),
                    spread=f"{min(ts):.2f}-{max(ts):.2f} s",
                    ratio=round(statistics.median(ts) / base, 3),
                    bleu=round(bleu, 2),
                    same_as_book=same,
                )
            )
            print(
                f"{search:7s} {name:22s} {rows[-1]['seconds']:7.2f} s "
                f"({rows[-1]['spread']}) {rows[-1]['ratio']:.2f}x  BLEU {bleu:.2f}"
                f"  same as the book: {same}/{len(sources)}"
            )
    record = dict(
        **provenance("ctranslate2_speed.py", "1 thread per engine"),
        note=args.note,
        sentences=len(sources),
        reps=args.reps,
        warmup_seconds=round(warmup, 1),
        fast_decoder=fast_warmup,
        programs_compiled_while_timed=programs() - compiled,
        signature=signature,
        rows=rows,
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
