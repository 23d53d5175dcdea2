#!/usr/bin/env python3
"""Chapter 16's recipe study: variants of BOOK_RECIPE, judged on the validation set.

    python scripts/release/recipe_study.py                 # every variant, in turn
    python scripts/release/recipe_study.py book post-norm  # only the named ones

Each variant changes one or two fields of BOOK_RECIPE (the five-minute CPU model),
trains with chapter 16's train_multi30k on one CPU thread, and is scored by greedy
sacreBLEU on the whole validation set (1,014 sentences). The test set is never
read. A variant's row (its recipe, its score with the signature, its training
time and tokens) is appended to results/recipe-study/study.jsonl, with the
commit, the machine and the date, so that a study can run in parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

# this file's folder, scripts/release/, is on sys.path when it runs as a script
from ship_pretrained import cpu_name, head_commit

from aiayn import TransformerConfig
from aiayn.multi30k import (
    BOOK_RECIPE,
    Multi30kRecipe,
    evaluate_bleu,
    load_multi30k,
    train_multi30k,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "recipe-study" / "study.jsonl"

# name -> the fields that differ from BOOK_RECIPE
VARIANTS = {
    "book": {},
    "vocab-8000": {"vocab_size": 8000},
    "post-norm": {"norm_first": False},
    "post-norm-half-rate": {"norm_first": False, "factor": 0.16},
    "factor-0.5": {"factor": 0.5},
    "batch-768": {"max_tokens": 768, "steps": 747},  # as many tokens as 560 x 1024
    "batch-2048": {"max_tokens": 2048, "steps": 280},
    "dropout-0.1": {"dropout": 0.1},
    "no-label-smoothing": {"label_smoothing": 0.0},
}


def variant(changes: dict) -> Multi30kRecipe:
    """BOOK_RECIPE with the changes, each made where its setting is declared."""
    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    top = {k: v for k, v in changes.items() if k in ("vocab_size", "max_tokens")}
    model = {k: v for k, v in changes.items() if k in model_fields}
    schedule = {k: v for k, v in changes.items() if k not in top and k not in model}
    return dataclasses.replace(
        BOOK_RECIPE,
        **top,
        model=dataclasses.replace(BOOK_RECIPE.model, **model),
        schedule=dataclasses.replace(BOOK_RECIPE.schedule, **schedule),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default: all)"
    )
    p.add_argument(
        "--data-dir",
        help="the Multi30k directory (default: $AIAYN_MULTI30K_DIR, else the cache)",
    )
    args = p.parse_args(argv)
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; the variants are {list(VARIANTS)}")
    torch.set_num_threads(1)
    valid = load_multi30k("valid", "de-en", args.data_dir)
    commit = head_commit()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    for name in args.variants or list(VARIANTS):
        recipe = variant(VARIANTS[name])
        start = time.perf_counter()
        model, tokenizer, history = train_multi30k(
            recipe, args.data_dir, device="cpu", log=None
        )
        seconds = time.perf_counter() - start
        result = evaluate_bleu(model, tokenizer, valid, method="greedy")
        row = {
            "variant": name,
            "changes": VARIANTS[name],
            "recipe": dataclasses.asdict(recipe),
            "valid_greedy_bleu": round(result.score, 2),
            "signature": result.signature,
            "valid_loss": round(history["valid_loss"][-1], 4),
            "train_seconds": round(seconds, 1),
            "commit": commit,
            "machine": f"{cpu_name()}, 1 thread, torch {torch.__version__}",
            "date": datetime.date.today().isoformat(),
        }
        print(json.dumps(row), flush=True)
        with open(OUT, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
