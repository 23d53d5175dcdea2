"""How the release scripts offer, choose and record models (they train nothing here).

scripts/release/ship_pretrained.py and decoding_grid.py are importable because
tests/conftest.py puts scripts/release/ on sys.path.
"""

from __future__ import annotations

import json
from pathlib import Path

import decoding_grid
import ship_pretrained

from aiayn.model import sha256_file

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_offers_last_averaged_and_the_mean_of_its_last_k_snapshots(
    tmp_path, capsys
):
    run = tmp_path / "run"
    run.mkdir()
    for name in (
        "last.pt",
        "averaged.pt",
        *(f"step_{s:08d}.pt" for s in (250, 500, 750)),
    ):
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
    assert [name for name, _ in ship_pretrained.candidates([run], [])] == [
        f"{run}/last.pt"
    ]


def test_a_new_model_ships_only_when_it_beats_the_incumbent_on_validation():
    def scored(*pairs):
        return [{"checkpoint": c, "valid_greedy_bleu": b} for c, b in pairs]

    assert ship_pretrained.choose(scored(("a", 40.0), ("b", 41.5)))["checkpoint"] == "b"
    shipped = "results/multi30k-de-en/model.pt"
    better = scored(("a", 41.2), (shipped, 41.0))
    assert ship_pretrained.choose(better, shipped)["checkpoint"] == "a"
    assert ship_pretrained.choose(scored(("a", 40.9), (shipped, 41.0)), shipped) is None
    tie = scored(("a", 41.0), (shipped, 41.0))
    assert ship_pretrained.choose(tie, shipped) is None


def test_a_lost_contest_replaces_the_contests_of_some_of_its_runs(tmp_path):
    def contest(runs, bleu):
        return {"runs": [{"name": r} for r in runs], "candidates": [bleu]}

    path = tmp_path / "challengers" / "contests.json"
    ship_pretrained.record_contest(path, contest(["a"], 40.0))
    ship_pretrained.record_contest(path, contest(["b", "c"], 41.0))
    # the same study, scored again
    ship_pretrained.record_contest(path, contest(["a"], 40.5))
    assert json.loads(path.read_text()) == [
        contest(["b", "c"], 41.0),
        contest(["a"], 40.5),
    ]
    # the same study once its run d has finished
    ship_pretrained.record_contest(path, contest(["a", "d"], 42.0))
    assert json.loads(path.read_text()) == [
        contest(["b", "c"], 41.0),
        contest(["a", "d"], 42.0),
    ]


def test_the_study_table_gives_each_run_the_scores_of_the_candidates_it_offered():
    run = {
        "name": "r",
        "vocab_size": 10000,
        "parameters": 8_090_624,
        "steps": 12000,
        "passes": 51.6,
        "wall_seconds": 4.5 * 3600,
    }
    scored = [
        {"checkpoint": "checkpoints/r/last.pt", "valid_greedy_bleu": 41.0},
        {
            "checkpoint": "checkpoints/r/mean of step_1..step_5 (5)",
            "valid_greedy_bleu": 41.5,
        },
        {"checkpoint": "checkpoints/rr/averaged.pt", "valid_greedy_bleu": 40.0},
    ]
    rows = ship_pretrained.study_markdown([run], scored).splitlines()
    assert (
        rows[2] == "| `r` | 10,000 | 8.09M | 12,000 | 52 | 41.00 | 41.50 | – | 4.5 h |"
    )


def test_each_recorded_contest_was_won_by_a_shipped_model_and_is_on_its_card():
    for path in sorted((ROOT / "results").glob("multi30k-*/challengers/contests.json")):
        folder = path.parents[1]
        shipped = [json.loads((folder / "scores.json").read_text())]
        shipped += [
            json.loads(p.read_text()) for p in folder.glob("previous/scores.json")
        ]
        card = (folder / "README.md").read_text()
        for contest in json.loads(path.read_text()):
            held, *others = sorted(
                contest["candidates"],
                key=lambda c: c["checkpoint"] != contest["incumbent"],
            )
            assert held["checkpoint"] == contest["incumbent"], path
            assert held["sha256"] in [s["model_sha256"] for s in shipped], path
            assert all(
                c["valid_greedy_bleu"] <= held["valid_greedy_bleu"] for c in others
            )
            for run in contest["runs"]:
                log = path.parent / "runs" / f"{run['name']}.metrics.jsonl.gz"
                assert log.is_file()
            table = ship_pretrained.study_markdown(
                contest["runs"], contest["candidates"]
            )
            assert table in card, f"{folder}/README.md lacks the table of {path}"


def test_the_decoding_grid_picks_its_best_setting_and_breaks_ties_toward_less_search():
    def row(beam, alpha, bleu):
        return {"beam_size": beam, "alpha": alpha, "bleu": bleu}

    grid = [row(4, 0.6, 43.0), row(8, 1.0, 43.5), row(6, 1.2, 43.5), row(6, 0.6, 43.5)]
    assert decoding_grid.best_setting(grid) == row(6, 0.6, 43.5)
    table = decoding_grid.markdown({"grid": grid}).splitlines()
    assert table[0] == "| beam \\ alpha | 0.6 | 1 | 1.2 |"
    assert table[2:] == [
        "| 4 | 43.00 |  |  |",
        "| 6 | 43.50 |  | 43.50 |",
        "| 8 |  | 43.50 |  |",
    ]


def test_each_recorded_decoding_grid_belongs_to_the_shipped_model_and_its_scores():
    records = sorted((ROOT / "results").glob("multi30k-*/decoding.json"))
    assert records, "no decoding grid is recorded under results/"
    for path in records:
        record = json.loads(path.read_text())
        folder = path.parent
        scores = json.loads((folder / "scores.json").read_text())["scores"]["valid"]
        assert record["model_sha256"] == sha256_file(folder / "model.pt"), path
        assert record["greedy_bleu"] == scores["greedy"]["bleu"], path
        assert record["paper_setting"]["bleu"] == scores["beam"]["bleu"], path
        assert record["best_setting"]["bleu"] == max(r["bleu"] for r in record["grid"])
        assert record["signature"] == scores["greedy"]["signature"]
        card = (folder / "README.md").read_text()
        assert decoding_grid.markdown(record) in card, (
            f"{folder}/README.md lacks the grid"
        )
        assert (
            record["command"] in card
            and "/" not in record["command"].split("--data-dir")[-1]
        )


def test_the_recorded_decoding_command_names_the_data_by_its_variable_not_its_path():
    script = "python scripts/release/decoding_grid.py"
    assert decoding_grid.command(["multi30k-de-en", "--data-dir", "/home/me/m30k"]) == (
        f"{script} multi30k-de-en --data-dir $AIAYN_MULTI30K_DIR"
    )
    assert (
        decoding_grid.command(["multi30k-en-de", "--data-dir=/d", "--beams", "4"])
        == f"{script} multi30k-en-de --data-dir=$AIAYN_MULTI30K_DIR --beams 4"
    )
