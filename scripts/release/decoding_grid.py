#!/usr/bin/env python3
"""Beam size and length penalty of a shipped model, measured on the validation set.

    python scripts/release/decoding_grid.py multi30k-de-en --data-dir DIR
    python scripts/release/decoding_grid.py multi30k-en-de --beams 4 6 --alphas 0.6 1.2

Loads the shipped model the way users load it (`aiayn.multi30k.pretrained`), decodes
the 1,014 validation sentences with greedy search and with beam search for every
(beam size, alpha) pair of the grid, and scores each with sacreBLEU. The test sets
are never read. To say how much of the spread is noise, it adds sacreBLEU's 95%
bootstrap interval of the paper's setting (beam 4, alpha 0.6) and a paired
bootstrap test of the grid's best setting against it. The record goes to
results/NAME/decoding.json with the model's digest, the command, commit, machine
and date; a markdown table for the model card is printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

# this file's folder, scripts/release/, is on sys.path when it runs as a script
import checksums
import sacrebleu
import torch
from sacrebleu.significance import PairedTest
from ship_pretrained import cpu_name, head_commit

from aiayn.model import sha256_file
from aiayn.multi30k import evaluate_bleu, load_multi30k, pretrained, pretrained_file

ROOT = Path(__file__).resolve().parents[2]
PAPER = (4, 0.6)  # the paper's beam size and alpha (section 6.1)


def best_setting(grid: list[dict]) -> dict:
    """The highest BLEU of the grid; a tie goes to the smaller beam, then alpha."""
    if not grid:
        raise ValueError(
            "the grid is empty; give at least one beam size and one alpha."
        )
    return max(grid, key=lambda row: (row["bleu"], -row["beam_size"], -row["alpha"]))


def markdown(record: dict) -> str:
    """The grid as a table: one row per beam size, one column per alpha."""
    alphas = sorted({row["alpha"] for row in record["grid"]})
    beams = sorted({row["beam_size"] for row in record["grid"]})
    score = {(row["beam_size"], row["alpha"]): row["bleu"] for row in record["grid"]}
    lines = [
        "| beam \\ alpha | " + " | ".join(f"{a:g}" for a in alphas) + " |",
        "|---" * (len(alphas) + 1) + "|",
    ]
    for beam in beams:
        cells = [f"{score[beam, a]:.2f}" if (beam, a) in score else "" for a in alphas]
        lines.append(f"| {beam} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command(argv: list[str]) -> str:
    """The command line as run, with the data directory named by its variable."""
    words = list(argv)
    for i, word in enumerate(words):
        if word == "--data-dir" and i + 1 < len(words):
            words[i + 1] = "$AIAYN_MULTI30K_DIR"
        elif word.startswith("--data-dir="):
            words[i] = "--data-dir=$AIAYN_MULTI30K_DIR"
    return " ".join(["python scripts/release/decoding_grid.py", *words])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("name", choices=["multi30k-de-en", "multi30k-en-de"])
    p.add_argument("--data-dir", help="the Multi30k directory")
    p.add_argument("--beams", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    p.add_argument(
        "--alphas", type=float, nargs="+", default=[0.0, 0.3, 0.6, 0.8, 1.0, 1.2, 1.5]
    )
    p.add_argument(
        "--bootstrap", type=int, default=1000, help="resamples (default 1000)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="default: results/NAME/decoding.json")
    args = p.parse_args(argv)
    if min(args.beams) < 1 or min(args.alphas) < 0:
        p.error("beam sizes must be >= 1 and alphas >= 0")
    if PAPER[0] not in args.beams or PAPER[1] not in args.alphas:
        p.error("the grid must hold the paper's setting, beam 4 and alpha 0.6")
    torch.set_num_threads(args.threads)

    model, tokenizer = pretrained(args.name)
    pairs = load_multi30k("valid", args.name.removeprefix("multi30k-"), args.data_dir)
    references = [reference for _, reference in pairs]
    start = time.perf_counter()
    greedy = evaluate_bleu(model, tokenizer, pairs, "greedy")
    print(f"greedy: {greedy.score:.2f}", flush=True)
    grid, hypotheses = [], {}
    for beam in args.beams:
        for alpha in args.alphas:
            t = time.perf_counter()
            result = evaluate_bleu(model, tokenizer, pairs, "beam", beam, alpha)
            hypotheses[beam, alpha] = result.hypotheses
            grid.append(
                {
                    "beam_size": beam,
                    "alpha": alpha,
                    "bleu": round(result.score, 2),
                    "lowercase_bleu": round(result.lowercase_score, 2),
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            print(f"beam {beam}, alpha {alpha:g}: {result.score:.2f}", flush=True)

    best = best_setting(grid)
    paper = next(r for r in grid if (r["beam_size"], r["alpha"]) == PAPER)
    metric = sacrebleu.metrics.BLEU()
    interval = metric.corpus_score(
        hypotheses[PAPER], [references], n_bootstrap=args.bootstrap
    )
    named = [
        ("paper", hypotheses[PAPER]),
        ("best", hypotheses[best["beam_size"], best["alpha"]]),
    ]
    test = PairedTest(named, {"BLEU": metric}, [references], "bs", args.bootstrap)
    _, stats = test()
    p_value = stats["BLEU"][1].p_value
    record = {
        "name": args.name,
        "model_sha256": sha256_file(pretrained_file(args.name, "model.pt")),
        "split": "valid",
        "sentences": len(pairs),
        "signature": greedy.signature,
        "greedy_bleu": round(greedy.score, 2),
        "grid": grid,
        "paper_setting": {
            "beam_size": PAPER[0],
            "alpha": PAPER[1],
            "bleu": paper["bleu"],
            "bootstrap_mean": round(interval._mean, 2),
            "bootstrap_95ci": round(interval._ci, 2),
            "resamples": args.bootstrap,
        },
        "best_setting": {
            **{k: best[k] for k in ("beam_size", "alpha", "bleu")},
            "gain_over_paper": round(best["bleu"] - paper["bleu"], 2),
            "paired_bootstrap_p": p_value,
        },
        "command": command(sys.argv[1:] if argv is None else argv),
        "commit": head_commit(),
        "machine": f"{cpu_name()}, {args.threads} thread(s), torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(args.out) if args.out else ROOT / "results" / args.name / "decoding.json"
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if out.parent == ROOT / "results" / args.name:  # a record of the shipped folder
        checksums.write(out.parent)
    print(f"\nwrote {out}\n")
    print(markdown(record))
    print(
        f"\npaper's setting: {paper['bleu']:.2f} (95% bootstrap interval "
        f"+-{interval._ci:.2f}); best: beam {best['beam_size']}, alpha "
        f"{best['alpha']:g}, {best['bleu']:.2f}, paired bootstrap p = {p_value:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
