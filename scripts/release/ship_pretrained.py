#!/usr/bin/env python3
"""Choose a trained Multi30k model on the validation set, ship it in float16, score it.

    python scripts/release/ship_pretrained.py --name multi30k-de-en \\
        checkpoints/long-dropout01 checkpoints/long-dropout03
    python scripts/release/ship_pretrained.py checkpoints/study-de-en-dropout03-12k \\
        --average 5 --incumbent results/multi30k-de-en/model.pt

Each RUN is a folder written by `python -m aiayn train --preset multi30k-...`. Its
candidates are last.pt and averaged.pt (the mean of all the snapshots it kept),
and, for each K of `--average`, the mean of its last K snapshots. Every
candidate is scored by greedy BLEU on the validation set (1,014 sentences), and
only there; the best one is written to results/NAME/ in float16 with
`aiayn.multi30k.save_pretrained`. With `--incumbent FILE` (the model shipped now),
that file is a candidate too, and if it wins no model is written (a new model
ships only when it is better on the validation set): the contest is appended to
results/NAME/challengers/contests.json instead, with the runs' logs beside it
in challengers/runs/, so that a study that changed nothing is on record too.
A shipped file is loaded back the way users load it, and scored once on the
validation set and on test2016, with greedy and beam search. results/NAME/
receives:

    model.pt, tokenizer.json   the shipped model (float16 weights) and its tokenizer
    scores.json                every candidate's validation BLEU, the choice, the
                               shipped model's scores with their sacreBLEU
                               signatures, and how the run was made
    runs/RUN.metrics.jsonl.gz  each run's log, as the engine wrote it
    runs/RUN.log               what its training command printed, if RUN.log exists

SHA256SUMS                 the digest of every file above (scripts/release/checksums.py)

The digests to put into chapter 16's PRETRAINED are printed at the end; once the files
are committed, that commit goes into PRETRAINED_COMMIT, the address they are downloaded
from.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import checksums  # scripts/release/, on sys.path when this runs as a script
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from aiayn.batching import load_checkpoint_model
from aiayn.model import sha256_file
from aiayn.multi30k import (
    LONG_RECIPE,
    encode_text_pairs,
    evaluate_bleu,
    load_multi30k,
    save_pretrained,
)
from aiayn.train import average_checkpoints, make_loader

ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    """The CPU's model name, from /proc/cpuinfo where it exists."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def head_commit() -> str:
    """The commit the repository is at, as git names it."""
    git = ["git", "rev-parse", "HEAD"]
    return subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def summarize(run: Path, pairs) -> dict:
    """A run's settings, size, last step, passes, BLEU by step, and wall time.

    The wall time adds up the parts of a run (one per start or --resume): each part
    from the creation of its TensorBoard event file (the number in its name) to the
    last event written to it.
    """
    model, tokenizer = load_checkpoint_model(run / "last.pt")
    config = model.config.to_dict()
    batches = len(
        make_loader(
            encode_text_pairs(tokenizer, pairs), tokenizer, LONG_RECIPE.max_tokens
        )
    )
    rows = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    valid = [(r["step"], round(r["valid BLEU"], 2)) for r in rows if "valid BLEU" in r]
    parts = []
    for events in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        start = int(events.name.split(".")[3])
        end = max(event.wall_time for event in EventFileLoader(str(events)).Load())
        parts.append(end - start)
    steps = max(r["step"] for r in rows)
    return {
        "name": run.name,
        "dropout": config["dropout"],
        "vocab_size": config["tgt_vocab_size"],
        "parameters": model.num_parameters(),
        "steps": steps,
        "passes": round(steps / batches, 2),
        "valid_greedy_bleu_by_step": valid,
        "wall_seconds": round(sum(parts), 1),
        "parts": len(parts),
    }


def candidates(runs: list[Path], averages: list[int]) -> list[tuple[str, list[Path]]]:
    """Each candidate's name and the checkpoint files whose mean it is.

    A run offers last.pt and averaged.pt where they exist, and the mean of its last K
    snapshots for each K in averages that it has K snapshots for.
    """
    found = []
    for run in runs:
        for file in ("last.pt", "averaged.pt"):
            if (run / file).is_file():
                found.append((str(run / file), [run / file]))
            else:
                print(f"{run / file}: missing, skipped", file=sys.stderr)
        snapshots = sorted(run.glob("step_*.pt"))
        for k in averages:
            if len(snapshots) < k:
                print(f"{run}: fewer than {k} snapshots, skipped", file=sys.stderr)
                continue
            last = snapshots[-k:]
            found.append((f"{run}/mean of {last[0].stem}..{last[-1].stem} ({k})", last))
    return found


def choose(scored: list[dict], incumbent: str | None = None) -> dict | None:
    """The candidate with the best validation BLEU; None if that is the incumbent.

    A tie keeps the incumbent: a new model ships only when it is better.
    """
    best = max(scored, key=lambda c: c["valid_greedy_bleu"])
    if incumbent is not None:
        held = [c for c in scored if c["checkpoint"] == incumbent]
        if held and held[0]["valid_greedy_bleu"] >= best["valid_greedy_bleu"]:
            return None
    return best


def load_candidate(files: list[Path]):
    """The model and tokenizer of one checkpoint, or of the mean of several."""
    if len(files) == 1:
        return load_checkpoint_model(files[0])
    model, tokenizer = average_checkpoints(files)
    return model.eval(), tokenizer


def bleu(model, tokenizer, pairs, method: str) -> dict:
    """Corpus BLEU of one decoding method, with the time it took."""
    start = time.perf_counter()
    result = evaluate_bleu(model, tokenizer, pairs, method=method)
    return {
        "bleu": round(result.score, 2),
        "signature": result.signature,
        "lowercase_bleu": round(result.lowercase_score, 2),
        "lowercase_signature": result.lowercase_signature,
        "seconds": round(time.perf_counter() - start, 1),
    }


CHOSEN_ON = "greedy BLEU on the validation set (1,014 sentences)"


def keep_logs(runs: list[Path], folder: Path, pairs) -> list[dict]:
    """Each run's summary; its metrics (gzipped) and its printed log go to folder."""
    folder.mkdir(parents=True, exist_ok=True)
    summaries = []
    for run in runs:
        summaries.append(summarize(run, pairs))
        metrics = (run / "metrics.jsonl").read_bytes()
        (folder / f"{run.name}.metrics.jsonl.gz").write_bytes(
            gzip.compress(metrics, mtime=0)
        )
        log = run.with_name(run.name + ".log")
        if log.is_file():
            shutil.copy(log, folder / f"{run.name}.log")
    return summaries


def record_contest(path: Path, contest: dict) -> Path:
    """Append a contest the incumbent won to the JSON list at path.

    A contest of the same runs, or of some of them, is replaced: scoring a study
    again, or once more runs have finished, does not record it twice.
    """
    contests = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    runs = {r["name"] for r in contest["runs"]}
    contests = [c for c in contests if not {r["name"] for r in c["runs"]} <= runs]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([*contests, contest], indent=2) + "\n", encoding="utf-8")
    return path


def study_markdown(runs: list[dict], candidates: list[dict]) -> str:
    """A table of runs: each one's settings and the validation BLEU of what it offered.

    A run offers its last snapshot (last.pt), the mean of the snapshots it kept
    (averaged.pt, the last ten) and the mean of its last five.
    """

    def offered(run: str, suffix: str) -> str:
        found = [
            c["valid_greedy_bleu"]
            for c in candidates
            if f"/{run}/" in c["checkpoint"] and c["checkpoint"].endswith(suffix)
        ]
        return f"{found[0]:.2f}" if found else "–"

    lines = [
        "| run | vocabulary | parameters | steps | passes | last snapshot "
        "| mean of the last 5 | mean of the last 10 | wall time |",
        "|---" * 9 + "|",
    ]
    for run in runs:
        name = run["name"]
        lines.append(
            f"| `{name}` | {run['vocab_size']:,} | {run['parameters'] / 1e6:.2f}M "
            f"| {run['steps']:,} | {run['passes']:.0f} | {offered(name, 'last.pt')} "
            f"| {offered(name, '(5)')} | {offered(name, 'averaged.pt')} "
            f"| {run['wall_seconds'] / 3600:.1f} h |"
        )
    return "\n".join(lines)


def provenance(args, argv) -> dict:
    """How the runs were trained and how they were scored, for a record."""
    return {
        "trained_by": {
            "runs": [
                {"commit": c, "date": d, "command": cmd} for c, d, cmd in args.trained
            ],
            "machine": f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores, "
            "one thread per run",
        },
        "scored_by": {
            # the data directory is machine-specific: recorded as its variable
            "command": "python scripts/release/ship_pretrained.py "
            + " ".join(sys.argv[1:] if argv is None else argv).replace(
                str(args.data_dir), "$AIAYN_MULTI30K_DIR"
            ),
            "commit": head_commit(),
            "date": datetime.date.today().isoformat(),
            "machine": f"{cpu_name()}, {torch.get_num_threads()} thread(s), "
            f"torch {torch.__version__}",
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "runs", nargs="+", type=Path, help="run folders of `python -m aiayn train`"
    )
    p.add_argument(
        "--direction",
        choices=["de-en", "en-de"],
        default="de-en",
        help="default: de-en",
    )
    p.add_argument("--name", help="results/NAME (default: multi30k-DIRECTION)")
    p.add_argument(
        "--data-dir",
        help="the Multi30k directory (default: $AIAYN_MULTI30K_DIR, else the cache)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument(
        "--trained",
        nargs=3,
        metavar=("COMMIT", "DATE", "COMMAND"),
        action="append",
        default=[],
        help="how a run was trained (repeat per run); recorded as given",
    )
    p.add_argument(
        "--average",
        type=int,
        nargs="+",
        default=[],
        metavar="K",
        help="also offer the mean of each run's last K snapshots",
    )
    p.add_argument(
        "--incumbent",
        type=Path,
        metavar="FILE",
        help="the model shipped now: a candidate that a new model must beat",
    )
    p.add_argument(
        "--limit",
        type=int,
        help="score only the first N sentences of each split (a smoke test)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    direction = args.direction
    args.name = args.name or f"multi30k-{direction}"
    train = load_multi30k("train", direction, args.data_dir)
    valid = load_multi30k("valid", direction, args.data_dir)
    test = load_multi30k("test2016", direction, args.data_dir)
    if args.limit:
        valid, test = valid[: args.limit], test[: args.limit]

    offered = candidates(args.runs, args.average)
    if args.incumbent:
        offered.append((str(args.incumbent), [args.incumbent]))
    scored = []
    for name, files in offered:
        model, tokenizer = load_candidate(files)
        score = evaluate_bleu(model, tokenizer, valid, method="greedy").score
        print(f"{name}: validation BLEU (greedy) {score:.2f}", flush=True)
        files = [str(f) for f in files]
        scored.append(
            {"checkpoint": name, "files": files, "valid_greedy_bleu": round(score, 2)}
        )
    if not scored:
        print("no checkpoint to choose from", file=sys.stderr)
        return 2
    # the shipped file, named by its digest: git keeps it after it is replaced
    if args.incumbent:
        scored[-1]["sha256"] = sha256_file(args.incumbent)
    best = choose(scored, str(args.incumbent) if args.incumbent else None)
    out = ROOT / "results" / args.name
    how = provenance(args, argv)
    if best is None:
        contest = {
            "incumbent": str(args.incumbent),
            "candidates": scored,
            "chosen_on": CHOSEN_ON,
            "runs": keep_logs(args.runs, out / "challengers" / "runs", train),
            **how,
        }
        path = record_contest(out / "challengers" / "contests.json", contest)
        print(
            f"{args.incumbent} is still the best on validation: no model written; "
            f"the contest is recorded in {path.relative_to(ROOT)}"
        )
        return 1
    print(f"chosen on validation: {best['checkpoint']}", flush=True)

    model, tokenizer = load_candidate([Path(f) for f in best["files"]])
    shipped = save_pretrained(model, tokenizer, out)
    model, tokenizer = load_checkpoint_model(shipped)  # as pretrained() loads it
    scores = {
        split: {
            method: bleu(model, tokenizer, pairs, method)
            for method in ("greedy", "beam")
        }
        for split, pairs in (("valid", valid), ("test2016", test))
    }
    for split, methods in scores.items():
        for method, s in methods.items():
            print(
                f"shipped model, {split}, {method}: "
                f"BLEU {s['bleu']:.2f} ({s['signature']})"
            )

    saved = torch.load(best["files"][-1], map_location="cpu", weights_only=True)
    record = {
        "name": args.name,
        "chosen": best["checkpoint"],
        "candidates": scored,
        "chosen_on": CHOSEN_ON,
        "runs": keep_logs(args.runs, out / "runs", train),
        "scores": scores,
        "parameters": model.num_parameters(),
        "config": saved["config"],
        "model_sha256": sha256_file(shipped),
        "model_bytes": shipped.stat().st_size,
        **how,
    }
    (out / "scores.json").write_text(
        json.dumps(record, indent=2) + "\n", encoding="utf-8"
    )
    print(f"wrote {out}; model.pt: {record['model_bytes']:,} bytes")
    sums = checksums.write(out)  # every record of the folder, for `sha256sum -c`
    print("for chapter 16's PRETRAINED (then, once committed, its PRETRAINED_COMMIT):")
    for path in (out / "model.pt", out / "tokenizer.json", sums):
        print(f"{sha256_file(path)}  {path.relative_to(out.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
