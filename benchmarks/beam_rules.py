#!/usr/bin/env python3
"""Which rule of CTranslate2's beam search makes its outputs differ from the book's.

The book's beam search (chapter 15) and CTranslate2's (chapter 19) differ in three
rules, each a field of `aiayn.decoding.BeamRules`:

- the penalty: GNMT's ((5 + |Y|) / 6) ** alpha against |Y| ** alpha;
- |Y|: with the end token, or without it;
- the stop: once no live hypothesis beats the k finished, or once k are finished.

For each shipped model, the 1,000 sentences of test2016 are decoded with beams of 4
and alpha 0.6 by CTranslate2 (the float32 export, one thread), and by the book's
beam search with its own rules, with each of CTranslate2's rules alone, and with
all three; each row counts the outputs identical to CTranslate2's. Where the
outputs still differ with all three rules, the book's model scores both (log P by
teacher forcing, divided as CTranslate2 divides) and the record says how often the
book's output scores higher, and the largest difference.

    python benchmarks/beam_rules.py --out benchmarks/results/beam-rules.json

Multi30k is read from $AIAYN_MULTI30K_DIR (or downloaded), or from --data-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from ctranslate2_speed import provenance  # benchmarks/, on sys.path as a script

from aiayn.batching import pad_sequences
from aiayn.decoding import (
    ALPHA,
    BEAM_SIZE,
    CTRANSLATE2_RULES,
    RULES,
    BeamRules,
    beam_search,
)
from aiayn.multi30k import DIRECTIONS, load_multi30k, pretrained
from aiayn.production import CTranslate2Model, export_ctranslate2

VARIANTS = {  # the book's rules, with one of CTranslate2's, then all three
    "the book's rules": RULES,
    "|Y| ** alpha": dataclasses.replace(RULES, penalty="power"),
    "end token not in |Y|": dataclasses.replace(RULES, count_end=False),
    "stop at k finished": dataclasses.replace(RULES, stop="full"),
    "all three (CTranslate2's)": CTRANSLATE2_RULES,
}


def book_outputs(
    model: torch.nn.Module, tokenizer, sources: list[str], rules: BeamRules, batch: int
) -> list[str]:
    """translate's beam search, in translate's batches, with other rules."""
    ids = [tokenizer.encode(text) for text in sources]
    outputs = []
    for first in range(0, len(ids), batch):
        src = pad_sequences(ids[first : first + batch], model.config.pad_id)
        result = beam_search(model, src, BEAM_SIZE, ALPHA, rules=rules)
        outputs += [tokenizer.decode(row) for row in result.tokens.tolist()]
    return outputs


def score(model, tokenizer, source: str, output: str, rules: BeamRules) -> float:
    """log P(output | source) / the rules' divisor, teacher-forced in float32."""
    c = model.config
    y = [*tokenizer.encode(output), c.eos_id]
    src, tgt_in = (
        torch.tensor([tokenizer.encode(source)]),
        torch.tensor([[c.bos_id, *y[:-1]]]),
    )
    with torch.no_grad():
        log_p = model(src, tgt_in).log_softmax(-1)[0, torch.arange(len(y)), y]
    return log_p.sum().item() / rules.divisor(len(y), True, ALPHA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="the Multi30k folder")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the record here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for direction in DIRECTIONS:
        name = f"multi30k-{direction}"
        model, tokenizer = pretrained(name)
        pairs = load_multi30k("test2016", direction, args.data_dir)
        sources = [source for source, _ in pairs[: args.sentences]]
        folder = Path(tempfile.mkdtemp()) / "float32"
        export_ctranslate2(model, tokenizer, folder)
        engine = CTranslate2Model(folder, threads=1)
        theirs = engine.translate(sources, method="beam", batch_size=args.batch_size)
        for label, rules in VARIANTS.items():
            ours = book_outputs(model, tokenizer, sources, rules, args.batch_size)
            same = sum(a == b for a, b in zip(ours, theirs))
            rows.append(dict(model=name, rules=label, **dataclasses.asdict(rules)))
            rows[-1].update(same_as_ctranslate2=same, sentences=len(sources))
            if (
                rules == CTRANSLATE2_RULES
            ):  # where the two still differ, which is better?
                gaps = [
                    score(model, tokenizer, sources[i], ours[i], rules)
                    - score(model, tokenizer, sources[i], theirs[i], rules)
                    for i in range(len(sources))
                    if ours[i] != theirs[i]
                ]
                rows[-1].update(
                    book_scores_higher=sum(g > 0 for g in gaps),
                    largest_gap=round(max(map(abs, gaps), default=0.0), 5),
                )
            print(f"{name}  {label:28s} {same:5d} of {len(sources)} as CTranslate2")
    record = dict(
        **provenance("beam_rules.py", "1 thread"),
        beam_size=BEAM_SIZE,
        alpha=ALPHA,
        rows=rows,
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
