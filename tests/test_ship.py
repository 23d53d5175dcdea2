"""How scripts/ship_pretrained.py offers and chooses candidates (it trains nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import ship_pretrained  # noqa: E402


def test_a_run_offers_last_averaged_and_the_mean_of_its_last_k_snapshots(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("last.pt", "averaged.pt", *(f"step_{s:08d}.pt" for s in (250, 500, 750))):
        (run / name).touch()
    offered = ship_pretrained.candidates([run], [2, 5])
    assert [name for name, _ in offered] == [
        f"{run}/last.pt",
        f"{run}/averaged.pt",
        f"{run}/mean of step_00000500..step_00000750 (2)",
    ]
    assert offered[2][1] == [run / "step_00000500.pt", run / "step_00000750.pt"]
    assert "fewer than 5 snapshots, skipped" in capsys.readouterr().err
    (run / "averaged.pt").unlink()
    assert [name for name, _ in ship_pretrained.candidates([run], [])] == [f"{run}/last.pt"]


def test_a_new_model_ships_only_when_it_beats_the_incumbent_on_validation():
    def scored(*pairs):
        return [{"checkpoint": c, "valid_greedy_bleu": b} for c, b in pairs]

    assert ship_pretrained.choose(scored(("a", 40.0), ("b", 41.5)))["checkpoint"] == "b"
    shipped = "results/multi30k-de-en/model.pt"
    better = scored(("a", 41.2), (shipped, 41.0))
    assert ship_pretrained.choose(better, shipped)["checkpoint"] == "a"
    assert ship_pretrained.choose(scored(("a", 40.9), (shipped, 41.0)), shipped) is None
    assert ship_pretrained.choose(scored(("a", 41.0), (shipped, 41.0)), shipped) is None  # a tie
