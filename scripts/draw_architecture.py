#!/usr/bin/env python3
"""Draw the Transformer (the paper's Figure 1) as an SVG, each box naming its chapter.

Every box names the chapter that derives it and the module of `aiayn` that implements
it; both are read from the chapters' front matter (`module: aiayn.name`), so the figure
cannot drift from the book. The SVG is plain text made by this script, byte for byte the
same on every run, and renders offline.

    python scripts/draw_architecture.py           write book/images/transformer.svg
    python scripts/draw_architecture.py --check   exit 1 when the stored file differs
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

import export

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "book" / "images" / "transformer.svg"

WIDTH, HEIGHT = 760, 975
BOX_W, BOX_H = 250, 46
LEFT_X, RIGHT_X = 75, 435  # left edges of the encoder and decoder columns
COLOURS = {  # fill of each kind of box
    "attention": "#fde2c8",
    "norm": "#f6f1b8",
    "ffn": "#cfe8fc",
    "embed": "#f9d0d8",
    "position": "#ffffff",
    "head": "#d8d3f5",
}


@dataclass
class Box:
    label: str
    module: str  # the module of aiayn that implements it, e.g. "aiayn.multi_head"
    kind: str  # a key of COLOURS
    x: float
    y: float  # top edge

    @property
    def cx(self) -> float:
        return self.x + BOX_W / 2


def chapters_by_module() -> dict[str, int]:
    """aiayn.name -> the number of the chapter that exports it."""
    numbers = {}
    for path in export.chapter_paths():
        chapter = export.read_chapter(path)
        if chapter.module:
            numbers[chapter.module] = int(chapter.number)
    return numbers


def box_svg(box: Box, chapters: dict[str, int]) -> str:
    """A rounded box with its label and, below it, its chapter and module."""
    if box.module not in chapters:
        raise SystemExit(
            f"no chapter exports {box.module}; update scripts/draw_architecture.py"
        )
    note = f"ch. {chapters[box.module]} · {box.module}"
    return (
        f'<rect x="{box.x}" y="{box.y}" width="{BOX_W}" height="{BOX_H}" rx="7" '
        f'fill="{COLOURS[box.kind]}" stroke="#333" stroke-width="1.2"/>\n'
        f'<text x="{box.cx}" y="{box.y + 20}" class="label">'
        f"{escape(box.label)}</text>\n"
        f'<text x="{box.cx}" y="{box.y + 37}" class="note">{escape(note)}</text>\n'
    )


def arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" class="arrow"/>\n'


def elbow(x1: float, y1: float, x2: float, y2: float, up: float, across: float) -> str:
    """An arrow from (x1, y1) up to `up`, across to `across`, down and into (x2, y2)."""
    return (
        f'<polyline points="{x1},{y1} {x1},{up} {across},{up} {across},{y2} {x2},{y2}" '
        'class="arrow" fill="none"/>\n'
    )


def stack(x: float, top: float, rows: list[tuple[str, str, str]]) -> list[Box]:
    """Boxes from the top down, 20 pixels apart, in one column."""
    return [
        Box(label, module, kind, x, top + k * (BOX_H + 20))
        for k, (label, module, kind) in enumerate(rows)
    ]


def svg() -> str:
    chapters = chapters_by_module()
    ffn = ("Feed forward", "aiayn.sublayers", "ffn")
    norm = ("Add & norm", "aiayn.sublayers", "norm")
    encoder = stack(
        LEFT_X,
        470,
        [
            norm,
            ffn,
            norm,
            ("Multi-head self-attention", "aiayn.multi_head", "attention"),
        ],
    )
    decoder = stack(
        RIGHT_X,
        270,
        [
            norm,
            ffn,
            norm,
            ("Multi-head cross-attention", "aiayn.multi_head", "attention"),
            norm,
            ("Masked self-attention", "aiayn.masks", "attention"),
        ],
    )
    head = stack(
        RIGHT_X,
        60,
        [
            ("Softmax (loss, decoding)", "aiayn.optim", "head"),
            ("Linear (tied weights)", "aiayn.embedding", "head"),
        ],
    )
    bottom = 800
    inputs = [
        Box("Positional encoding", "aiayn.positional", "position", LEFT_X, bottom),
        Box("Input embedding", "aiayn.embedding", "embed", LEFT_X, bottom + 80),
        Box("Positional encoding", "aiayn.positional", "position", RIGHT_X, bottom),
        Box("Output embedding", "aiayn.embedding", "embed", RIGHT_X, bottom + 80),
    ]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n',
        "<title>"
        "The Transformer, each part labelled by its chapter and module"
        "</title>\n",
        "<style>\n"
        ".label { font-size: 15px; text-anchor: middle; fill: #111; }\n"
        ".note { font-size: 11.5px; text-anchor: middle; fill: #555; }\n"
        ".side { font-size: 14px; fill: #111; }\n"
        ".frame { fill: #f4f4f4; stroke: #777; stroke-width: 1.2; }\n"
        ".arrow { stroke: #333; stroke-width: 1.5; marker-end: url(#tip); }\n"
        "</style>\n",
        '<defs><marker id="tip" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#333"/>'
        "</marker></defs>\n",
    ]
    # the two stacks: grey frames, "N x" and the chapter of each stack
    enc_top, enc_bottom = encoder[0].y - 14, encoder[-1].y + BOX_H + 14
    dec_top, dec_bottom = decoder[0].y - 14, decoder[-1].y + BOX_H + 14
    parts.append(
        f'<rect x="{LEFT_X - 18}" y="{enc_top}" width="{BOX_W + 36}" '
        f'height="{enc_bottom - enc_top}" rx="12" class="frame"/>\n'
    )
    parts.append(
        f'<rect x="{RIGHT_X - 18}" y="{dec_top}" width="{BOX_W + 36}" '
        f'height="{dec_bottom - dec_top}" rx="12" class="frame"/>\n'
    )
    parts.append(
        f'<text x="{LEFT_X - 62}" y="{(enc_top + enc_bottom) / 2}" class="side">'
        "N ×</text>\n"
    )
    parts.append(
        f'<text x="{RIGHT_X + BOX_W + 26}" y="{(dec_top + dec_bottom) / 2}" '
        'class="side">× N</text>\n'
    )
    parts.append(
        f'<text x="{LEFT_X + BOX_W / 2}" y="{enc_bottom + 24}" class="note">'
        f"Encoder: ch. {chapters['aiayn.encoder']} · aiayn.encoder</text>\n"
    )
    parts.append(
        f'<text x="{RIGHT_X + BOX_W / 2}" y="{dec_bottom + 24}" class="note">'
        f"Decoder: ch. {chapters['aiayn.decoder']} · aiayn.decoder</text>\n"
    )
    parts.append(
        f'<text x="{LEFT_X + BOX_W / 2}" y="90" class="label">The whole model: '
        f"ch. {chapters['aiayn.model']} · aiayn.model</text>\n"
    )
    parts.append(
        f'<text x="{LEFT_X + BOX_W / 2}" y="114" class="note">'
        "scaled dot-product attention: "
        f"ch. {chapters['aiayn.attention']} · aiayn.attention</text>\n"
    )
    # data flow: bottom to top in each column
    for column in (encoder, decoder, head):
        for upper, lower in zip(column, column[1:]):
            parts.append(arrow(upper.cx, lower.y, upper.cx, upper.y + BOX_H))
    left_pe, left_emb, right_pe, right_emb = inputs
    parts.append(arrow(left_emb.cx, left_emb.y, left_emb.cx, left_pe.y + BOX_H))
    parts.append(arrow(right_emb.cx, right_emb.y, right_emb.cx, right_pe.y + BOX_H))
    parts.append(arrow(left_pe.cx, left_pe.y, left_pe.cx, encoder[-1].y + BOX_H))
    parts.append(arrow(right_pe.cx, right_pe.y, right_pe.cx, decoder[-1].y + BOX_H))
    parts.append(arrow(decoder[0].cx, decoder[0].y, head[-1].cx, head[-1].y + BOX_H))
    # the encoder's output feeds every cross-attention
    cross = decoder[3]
    up = encoder[0].y - 44
    parts.append(
        elbow(
            encoder[0].cx,
            encoder[0].y - 14,
            cross.x,
            cross.y + BOX_H / 2,
            up,
            RIGHT_X - 38,
        )
    )
    parts.append(
        f'<text x="{encoder[0].cx + 8}" y="{up - 6}" class="note" '
        'style="text-anchor: start">keys and values</text>\n'
    )
    # inputs and outputs
    parts.append(
        f'<text x="{left_emb.cx}" y="{left_emb.y + BOX_H + 24}" class="label">'
        "source tokens</text>\n"
    )
    parts.append(
        f'<text x="{right_emb.cx}" y="{right_emb.y + BOX_H + 24}" class="label">'
        "target tokens (shifted right)</text>\n"
    )
    parts.append(
        f'<text x="{head[0].cx}" y="{head[0].y - 10}" class="label">'
        "next-token probabilities</text>\n"
    )
    for box in [*encoder, *decoder, *head, *inputs]:
        parts.append(box_svg(box, chapters))
    parts.append("</svg>\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only compare with the stored file"
    )
    args = parser.parse_args(argv)
    text = svg()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: "
                "run python scripts/draw_architecture.py"
            )
            return 1
        print(f"{OUTPUT.relative_to(ROOT)} is up to date")
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
