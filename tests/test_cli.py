"""The command line (chapter 20) as a user meets it: nothing lost, nothing scored wrong.

Each test here tries what a careful user would (an export into a folder of their own
files, a full disk, Ctrl-C in a long translation, a model of the other direction) and
checks that no file is lost, no score is silently wrong, and a mistake is one line that
says what to do.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiayn.cli import bleu_main, export_main, translate_main
from aiayn.multi30k import load_multi30k, pretrained
from conftest import HANG_S, local_multi30k

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {
    "de-en": ROOT / "results" / "multi30k-de-en" / "model.pt",
    "en-de": ROOT / "results" / "multi30k-en-de" / "model.pt",
}
# in requirements.txt; the export tests need it
ct2 = pytest.importorskip("ctranslate2")


def aiayn(
    *args: str, stdin: str | None = None, **popen: Any
) -> subprocess.CompletedProcess:
    """`python -m aiayn ARGS`, as a user runs it, on one thread."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "AIAYN_MULTI30K_DIR": str(local_multi30k()),
    }
    return subprocess.run(
        [sys.executable, "-m", "aiayn", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
        **popen,
    )


def digests(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- export: never delete what the package did not write ------------------------------


def test_export_into_a_folder_of_other_files_deletes_nothing(
    tmp_path, monkeypatch, capsys
):
    """At 22e25ab, `export --ctranslate2 .` emptied the working directory."""
    (tmp_path / "notes.txt").write_text("keep me")
    # looked like an export
    (tmp_path / "model.bin").write_text("not a model, but a file of mine")
    monkeypatch.chdir(tmp_path)
    assert export_main(["--ctranslate2", ".", "--pretrained", "multi30k-de-en"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "holds files that no export of this package wrote" in err
    )
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_new_export_replaces_an_earlier_one_and_keeps_the_users_files(
    tmp_path, capsys
):
    out = tmp_path / "export"
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )
    (out / "README.txt").write_text("my notes")
    assert (
        export_main(
            [
                "--ctranslate2",
                str(out),
                *"--pretrained multi30k-de-en --quantization int8".split(),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "README.txt",
        "aiayn_export.json",
        "aiayn_tokenizer.json",
        "config.json",
        "model.bin",
        "shared_vocabulary.json",
    ]
    assert (out / "README.txt").read_text() == "my notes"
    manifest = json.loads((out / "aiayn_export.json").read_text())
    assert manifest["quantization"] == "int8" and set(manifest["files"]) == {
        "aiayn_tokenizer.json",
        "config.json",
        "model.bin",
        "shared_vocabulary.json",
    }
    # the task of the shipped file
    assert manifest["task"] == {"data": "multi30k", "direction": "de-en"}


def test_an_export_of_an_earlier_version_is_recognised_and_replaced(tmp_path, capsys):
    """Before the manifest, an export put aiayn_decoding.json by CTranslate2's files."""
    old = tmp_path / "old"
    old.mkdir()
    for name in (
        "model.bin",
        "config.json",
        "shared_vocabulary.json",
        "aiayn_decoding.json",
    ):
        (old / name).write_text("{}")
    (old / "mine.txt").write_text("keep me")
    assert (
        export_main(["--ctranslate2", str(old), "--pretrained", "multi30k-de-en"]) == 0
    )
    assert sorted(p.name for p in old.iterdir()) == [
        "aiayn_export.json",
        "aiayn_tokenizer.json",
        "config.json",
        "mine.txt",
        "model.bin",
        "shared_vocabulary.json",
    ]


def test_an_export_on_a_full_disk_leaves_the_earlier_export_intact(
    tmp_path, monkeypatch, capsys
):
    """At 22e25ab: the raw [Errno 28], a half-written folder, the last export gone."""
    import ctranslate2.specs.model_spec as model_spec

    model, tokenizer = pretrained("multi30k-de-en")
    good = tmp_path / "export"
    assert (
        export_main(["--ctranslate2", str(good), "--pretrained", "multi30k-de-en"]) == 0
    )
    capsys.readouterr()
    before = digests(good)

    def full_disk(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        # CTranslate2 writes the weights with open()
        if str(file).endswith("model.bin"):
            return open("/dev/full", mode, *args, **kwargs)
        return open(file, mode, *args, **kwargs)

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    monkeypatch.setattr(model_spec, "open", full_disk, raising=False)
    assert (
        export_main(
            [
                "--ctranslate2",
                str(good),
                *"--pretrained multi30k-de-en --quantization int8".split(),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "No space left on device" in err and "as it was" in err
    )
    assert digests(good) == before  # the earlier export, untouched
    from aiayn.production import CTranslate2Model

    assert CTranslate2Model(good, tokenizer).translate(["Ein Hund."], method="greedy")
    fresh = tmp_path / "fresh"
    assert (
        export_main(["--ctranslate2", str(fresh), "--pretrained", "multi30k-de-en"])
        == 2
    )
    assert not fresh.exists() and "nothing was written" in capsys.readouterr().err


def test_an_export_through_a_symbolic_link_writes_into_its_target(tmp_path, capsys):
    """At 22e25ab: "Cannot call rmtree on a symbolic link"."""
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert (
        export_main(
            ["--ctranslate2", str(tmp_path / "link"), "--pretrained", "multi30k-de-en"]
        )
        == 0
    )
    assert (tmp_path / "link").is_symlink() and (target / "model.bin").is_file()


def test_two_exports_into_one_folder_at_once_are_refused(tmp_path, capsys):
    """At 22e25ab both reported success. The lock is held here as an export holds it."""
    import fcntl

    out = tmp_path / "export"
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )
    before = digests(out)
    with open(out / ".aiayn-export.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (
            export_main(
                [
                    "--ctranslate2",
                    str(out),
                    *"--pretrained multi30k-de-en --quantization int8".split(),
                ]
            )
            == 2
        )
    assert "another export is writing into" in capsys.readouterr().err
    assert {
        k: v for k, v in digests(out).items() if k != ".aiayn-export.lock"
    } == before


def test_a_damaged_export_is_refused_and_a_killed_one_cleaned_up(tmp_path, capsys):
    """At 22e25ab a model.bin with one flipped byte loaded silently."""
    from aiayn.production import CTranslate2Model

    _, tokenizer = pretrained("multi30k-de-en")
    out = tmp_path / "export"
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )
    weights = bytearray((out / "model.bin").read_bytes())
    weights[len(weights) // 3] ^= 0x10
    (out / "model.bin").write_bytes(weights)
    with pytest.raises(
        ValueError, match="model.bin in .* are not the files the export wrote"
    ):
        CTranslate2Model(out, tokenizer)
    (out / ".aiayn-export-killed").mkdir()  # the staging folder of a killed export
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )
    assert not (out / ".aiayn-export-killed").exists()
    assert CTranslate2Model(out, tokenizer).translate(["Ein Hund."], method="greedy")


# --- an export's folder is a model for every command ---------------------------------


@pytest.fixture(scope="module")
def exported_de_en(tmp_path_factory) -> Path:
    """The shipped de-en model, exported once for the tests below."""
    out = tmp_path_factory.mktemp("export") / "de-en"
    assert (
        export_main(["--ctranslate2", str(out), "--pretrained", "multi30k-de-en"]) == 0
    )
    return out


def test_an_export_holds_its_tokenizer_and_translates_on_its_own(exported_de_en):
    """At 22e25ab an export held no tokenizer; only Python, given one, could use it."""
    from aiayn.production import CTranslate2Model, load_model, model_source

    model, tokenizer = pretrained("multi30k-de-en")
    engine = CTranslate2Model(exported_de_en)  # no tokenizer given
    assert engine.tokenizer.to_dict() == tokenizer.to_dict()
    sources = [s for s, _ in load_multi30k("test2016", "de-en")[:40]] + ["  ", ""]
    from aiayn.decoding import translate

    book = translate(model, tokenizer, sources, method="greedy", batch_size=16)
    batches = []
    assert (
        engine.translate(
            sources, method="greedy", batch_size=16, on_batch=batches.append
        )
        == book
    )
    assert book[-2:] == ["", ""] and [x for b in batches for x in b] == book
    source = model_source(exported_de_en)
    assert source.kind == "export"
    loaded, _, task = load_model(source)
    assert isinstance(loaded, CTranslate2Model)
    assert task == {"data": "multi30k", "direction": "de-en"}


def test_translate_and_bleu_run_an_export_folder(exported_de_en, tmp_path):
    """At 22e25ab `translate --checkpoint DIR` on an export said to train a model."""
    sources = [s for s, _ in load_multi30k("test2016", "de-en")[:20]]
    text = "".join(line + "\n" for line in sources)
    book = aiayn("translate", "--pretrained", "multi30k-de-en", "--greedy", stdin=text)
    engine = aiayn(
        "translate", "--checkpoint", str(exported_de_en), "--greedy", stdin=text
    )
    assert engine.returncode == 0, engine.stderr
    assert engine.stdout == book.stdout and len(engine.stdout.splitlines()) == 20
    scored = [
        aiayn("bleu", how, name, "--limit", "50", "--greedy")
        for how, name in [
            ("--checkpoint", str(exported_de_en)),
            ("--pretrained", "multi30k-de-en"),
        ]
    ]
    assert [r.returncode for r in scored] == [0, 0], scored[0].stderr
    assert scored[0].stdout == scored[1].stdout  # same BLEU, same signature
    assert "test2016 de-en, 50 sentences, greedy: BLEU" in scored[0].stdout
    wrong = aiayn("bleu", "--checkpoint", str(exported_de_en), "--direction", "en-de")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().endswith("or give a model of en-de.")
    again = aiayn(
        "export",
        "--ctranslate2",
        str(tmp_path / "x"),
        "--checkpoint",
        str(exported_de_en),
    )
    assert again.returncode == 2 and "is an export already" in again.stderr


def test_an_export_without_a_tokenizer_asks_for_one(exported_de_en, tmp_path):
    """A tokenizer without to_dict() is not written; loading then says what to pass."""
    from aiayn.production import CTranslate2Model, export_ctranslate2

    model, tokenizer = pretrained("multi30k-de-en")

    class Plain:  # a tokenizer of the user's own, without to_dict()
        def __getattr__(self, name: str) -> Any:
            if name == "to_dict":
                raise AttributeError(name)
            return getattr(tokenizer, name)

    out = export_ctranslate2(model, Plain(), tmp_path / "plain")
    assert not (out / "aiayn_tokenizer.json").exists()
    with pytest.raises(
        ValueError,
        match="holds no tokenizer .* CTranslate2Model\\(folder, tokenizer\\)",
    ):
        CTranslate2Model(out)
    assert CTranslate2Model(out, tokenizer).translate(["Ein Hund."], method="greedy")


# --- every command reads the direction a model was trained for ------------------------


def test_bleu_reads_the_direction_of_a_checkpoint(capsys):
    """At 22e25ab `bleu --checkpoint` scored an en-de model as if it were de-en."""
    assert (
        bleu_main(
            [
                "--checkpoint",
                str(SHIPPED["en-de"]),
                "--limit",
                "40",
                "--greedy",
                "--data-dir",
                str(local_multi30k()),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("test2016 en-de, 40 sentences, greedy: BLEU ")
    # the wrong direction scores near 0
    assert float(out.split("BLEU ")[1].split()[0]) > 20


@pytest.mark.parametrize("how", ["--pretrained", "--checkpoint"])
def test_a_direction_that_contradicts_the_model_is_an_error_naming_both(how, capsys):
    model = "multi30k-en-de" if how == "--pretrained" else str(SHIPPED["en-de"])
    for main in (bleu_main, translate_main):
        args = [how, model, "--direction", "de-en"] + (
            ["A dog."] if main is translate_main else []
        )
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and "trained for en-de, not for de-en" in err


def test_a_checkpoint_that_does_not_record_its_direction_needs_one(tmp_path, capsys):
    from aiayn.model import read_checkpoint, write_checkpoint

    saved = read_checkpoint(SHIPPED["en-de"])
    saved.pop("task", None)
    # the same weights in other bytes
    saved["state_dict"] = {k: v.float() for k, v in saved["state_dict"].items()}
    path = write_checkpoint(saved, tmp_path / "plain.pt")
    assert bleu_main(["--checkpoint", str(path), "--limit", "5", "--greedy"]) == 2
    err = capsys.readouterr().err
    assert "does not record which direction it translates; give --direction" in err


def test_a_trained_checkpoint_records_its_task_and_export_carries_it(tmp_path, capsys):
    from aiayn.model import read_checkpoint

    done = aiayn(
        *"train --preset multi30k-en-de --model tiny --steps 2".split(),
        *"--train-size 200 --bleu-size 4".split(),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        *"--no-progress --keep-checkpoints 2 --checkpoint-every 1".split(),
    )
    assert done.returncode == 0, done.stderr
    for name in ("last.pt", "averaged.pt", "step_00000002.pt"):
        task = read_checkpoint(tmp_path / "run" / name)["task"]
        assert task == {"data": "multi30k", "direction": "en-de"}, name
    out = tmp_path / "export"
    assert (
        export_main(["--ctranslate2", str(out), "--checkpoint", str(tmp_path / "run")])
        == 0
    )
    assert (
        json.loads((out / "aiayn_export.json").read_text())["task"]["direction"]
        == "en-de"
    )
    assert (
        export_main(
            [
                "--ctranslate2",
                str(tmp_path / "x"),
                "--checkpoint",
                str(tmp_path / "run"),
                "--direction",
                "de-en",
            ]
        )
        == 2
    )


def test_bleu_refuses_a_model_of_a_synthetic_task(tmp_path, capsys):
    done = aiayn(
        *"train --task copy --steps 2".split(),
        "--checkpoint-dir",
        str(tmp_path / "copy"),
        *"--no-progress --train-size 100 --valid-size 10".split(),
    )
    assert done.returncode == 0, done.stderr
    assert bleu_main(["--checkpoint", str(tmp_path / "copy"), "--limit", "3"]) == 2
    assert "trained on the task 'copy', not on Multi30k" in capsys.readouterr().err


# --- translate: finished lines are kept; signals and full disks are one line ----------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_keeps_the_finished_lines_and_says_how_far_it_got(tmp_path, signum):
    """At 22e25ab, 0 of 3,000 lines were written after 25 s; Ctrl-C printed 74 lines."""
    sources = [
        source for source, _ in load_multi30k("train", root=local_multi30k())[:3000]
    ]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (
        open(tmp_path / "in.de", "rb") as stdin,
        open(tmp_path / "out.en", "wb") as stdout,
    ):
        run = subprocess.Popen(
            [
                sys.executable,
                *"-m aiayn translate --pretrained multi30k-de-en".split(),
                *"--greedy --batch-size 8".split(),
            ],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + HANG_S
        while (tmp_path / "out.en").stat().st_size == 0:  # the first batch is written
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        run.send_signal(signum)
        _, err = run.communicate(timeout=HANG_S)
    assert run.returncode == 128 + signum
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(
        f"interrupted by {signal.Signals(signum).name}: "
    )
    written = (tmp_path / "out.en").read_text(encoding="utf-8").splitlines()
    assert (
        last.endswith(f": {len(written)} of 3000 lines written")
        and len(written) % 8 == 0
    )
    from aiayn.decoding import translate

    # the first batch, as a whole run writes it
    model, tokenizer = pretrained("multi30k-de-en")
    assert written[:8] == translate(
        model, tokenizer, sources[:8], method="greedy", batch_size=8
    )


def test_bleu_stopped_by_ctrl_c_says_so_in_one_line(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "AIAYN_MULTI30K_DIR": str(local_multi30k()),
    }
    run = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, threading, os, signal, time\n"
                "from aiayn.cli import bleu_main\n"
                "import aiayn.cli as cli\n"
                "real = cli.evaluate_bleu\n"
                "def slow(*a, **k):\n"
                "    os.kill(os.getpid(), signal.SIGINT)\n"
                "    time.sleep(60)\n"
                "cli.evaluate_bleu = slow\n"
                "sys.exit(bleu_main("
                "['--pretrained', 'multi30k-de-en', '--limit', '3']))\n"
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, err = run.communicate(timeout=HANG_S)
    assert run.returncode == 130 and out == ""
    assert err.strip().splitlines()[-1] == "interrupted by SIGINT: nothing scored"
    assert "Traceback" not in err


def test_translate_to_a_full_disk_is_one_error_line():
    """At 22e25ab: a traceback (cli.py:667)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [
                sys.executable,
                *"-m aiayn translate --pretrained multi30k-de-en".split(),
                "--greedy",
                "Ein Hund.",
                "Zwei Katzen.",
            ],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=HANG_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    errors = [
        line for line in done.stderr.splitlines() if not line.startswith("note: ")
    ]
    assert done.returncode == 2 and errors == [
        "error: cannot write the translations (No space left on device); "
        "0 of 2 lines written."
    ]


def test_a_closed_pipe_ends_translate_quietly():
    """`translate ... | head -1`: the reader has its line; no traceback, no error."""
    run = subprocess.Popen(
        [
            sys.executable,
            *"-m aiayn translate --pretrained multi30k-de-en".split(),
            *"--greedy --batch-size 1".split(),
            *["Ein Hund."] * 50,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    first = run.stdout.readline()
    run.stdout.close()
    err = run.stderr.read()
    run.wait(timeout=HANG_S)
    assert first == "A dog.\n" and "Traceback" not in err and "error" not in err
    assert run.returncode in (0, 128 + signal.SIGPIPE)


# --- names, threads, warnings ---------------------------------------------------------


def test_a_mistyped_shipped_name_is_refused_at_once_with_the_closest(
    capsys, monkeypatch
):
    """At 22e25ab: 29 s of retries on the hub, then a message blaming the network."""
    import aiayn.production

    monkeypatch.setattr(
        aiayn.production, "load_huggingface", lambda *a: pytest.fail("went to the hub")
    )
    assert export_main(["--ctranslate2", "x", "--pretrained", "multi30k-de-em"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no shipped model is called 'multi30k-de-em'" in err
    assert "did you mean multi30k-de-en?" in err
    for missing in ("./models/opus", "/nonexistent/opus-mt"):
        assert export_main(["--ctranslate2", "x", "--pretrained", missing]) == 2
        assert capsys.readouterr().err == f"error: there is no folder {missing}.\n"
    assert translate_main(["--pretrained", "multi30k-fr-en", "Un chien."]) == 2
    assert "no shipped model is called 'multi30k-fr-en'" in capsys.readouterr().err


@pytest.mark.parametrize("threads", ["-1", "0", "two"])
def test_threads_must_be_a_whole_number_of_at_least_one(threads, capsys):
    """At 22e25ab: -1 gave a 17-line RuntimeError, 0 silently meant 1."""
    for main, extra in ((translate_main, ["Ein Hund."]), (bleu_main, [])):
        with pytest.raises(SystemExit) as stopped:
            main(["--pretrained", "multi30k-de-en", "--threads", threads, *extra])
        assert stopped.value.code == 2
        said = (
            "argument --threads: must be an int of at least 1, or none, "
            f"got '{threads}'"
        )
        assert said in capsys.readouterr().err


def test_warnings_reach_a_user_as_one_line():
    # runes: all unknown
    done = aiayn("translate", "--pretrained", "multi30k-de-en", "--greedy", "ᚠᚢᚦ")
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]
    assert done.returncode == 0, done.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "warning: 1 text(s) are mostly unknown tokens"
    )
    assert ".py" not in done.stderr  # no source path, no source line


def test_errno_of_the_export_failure_is_kept_for_callers(tmp_path):
    """The one-line message is still an OSError, its cause chained for programs."""
    from aiayn.production import export_folder

    with pytest.raises(OSError) as failed:
        with export_folder(tmp_path / "x", {}) as staging:
            raise OSError(
                errno.ENOSPC, "No space left on device", str(staging / "model.bin")
            )
    assert (
        failed.value.__cause__.errno == errno.ENOSPC and not (tmp_path / "x").exists()
    )


# --- the command line a newcomer meets ------------------------------------------------


def test_the_package_and_its_help_import_no_torch_and_production_no_charts():
    code = (
        "import sys, aiayn, aiayn.__main__\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "import aiayn.production, aiayn.cli\n"
        "assert 'aiayn.viz' not in sys.modules, 'viz'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    helped = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "aiayn", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    # -X importtime lists every import
    assert helped.returncode == 0 and "torch" not in helped.stderr
    lines = helped.stdout.splitlines()
    assert lines[1:5] == [
        "  train      train a preset and write its checkpoints (chapter 20)",
        "  translate  translate texts with a model (chapter 20)",
        "  bleu       score a model with sacreBLEU on a split (chapter 20)",
        "  export     write a model for CTranslate2 (chapter 20)",
    ]


def test_version_and_a_mistyped_command_are_one_line():
    from importlib.metadata import version

    assert aiayn("--version").stdout == f"aiayn {version('aiayn')}\n"
    typo = aiayn("tranlsate", "Ein Hund.")
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1
    assert "unknown command 'tranlsate' (did you mean translate?)" in typo.stderr


def test_a_usage_mistake_is_one_line_with_a_hint():
    """At 22e25ab a mistake printed 4 to 18 lines of usage first."""
    for args, said in (
        (
            ["--pretrained", "multi30k-de-en", "--beamsize", "5", "x"],
            "(did you mean --beam-size?)",
        ),
        (
            ["--pretrained", "multi30k-de-en", "--beam-size", "0", "x"],
            "argument --beam-size: must be an int of at least 1, got '0'",
        ),
        (
            ["--pretrained", "multi30k-de-en", "--greedy", "--sample", "x"],
            "not allowed with argument",
        ),
    ):
        done = aiayn("translate", *args)
        assert (
            done.returncode == 2
            and done.stderr.count("\n") == 1
            and said in done.stderr
        ), done.stderr
        assert done.stderr.startswith("python -m aiayn translate: error: ")


@pytest.mark.parametrize(
    "flags",
    [
        ["--greedy", "--beam-size", "5"],
        ["--sample", "--alpha", "1"],
        ["--beam-size", "5", "--temperature", "0.5"],
    ],
)
def test_a_flag_of_another_method_is_refused_not_ignored(flags, capsys):
    """At 22e25ab `--greedy --beam-size 5` ignored the beam size without a word."""
    assert translate_main(["--pretrained", "multi30k-de-en", *flags, "Ein Hund."]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: --") and "would change nothing" in err


def test_translate_reads_and_writes_files_and_refuses_a_lone_file_name(
    tmp_path, capsys
):
    """At 22e25ab `translate in.de` translated the file's name and exited 0."""
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
    assert (
        translate_main(["--pretrained", "multi30k-de-en", "--greedy", str(source)]) == 2
    )
    assert (
        f"{source} is a file: translate its lines with --input {source}"
        in capsys.readouterr().err
    )
    out = tmp_path / "out.en"
    assert (
        translate_main(
            [
                "--pretrained",
                "multi30k-de-en",
                "--greedy",
                "--input",
                str(source),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert out.read_text(encoding="utf-8") == "A dog.\nTwo cats.\n"
    assert capsys.readouterr().out == ""  # nothing on standard output
    missing = tmp_path / "no" / "out.en"
    assert (
        translate_main(
            [
                "--pretrained",
                "multi30k-de-en",
                "--input",
                str(source),
                "--output",
                str(missing),
            ]
        )
        == 2
    )
    assert (
        "give --output a file in an existing, writable directory"
        in capsys.readouterr().err
    )


def test_every_flag_of_every_command_is_a_field():
    """One declaration per setting: cli.py writes no flag by hand."""
    import dataclasses

    from aiayn.cli import (
        BleuOptions,
        ExportOptions,
        ModelOptions,
        TrainOptions,
        TranslateOptions,
        _bleu_parser,
        _export_parser,
        _train_parser,
        _translate_parser,
    )
    from aiayn.decoding import DecodingConfig
    from aiayn.model import TransformerConfig
    from aiayn.multi30k import Multi30kTask
    from aiayn.train import SyntheticTask, TrainConfig

    classes = (
        BleuOptions,
        ExportOptions,
        ModelOptions,
        Multi30kTask,
        TrainOptions,
        TranslateOptions,
        DecodingConfig,
        TransformerConfig,
        SyntheticTask,
        TrainConfig,
    )
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    for parser in (
        _train_parser(),
        _translate_parser(),
        _bleu_parser(),
        _export_parser(),
    ):
        dests = {a.dest for a in parser._actions if a.dest != "help"}
        assert dests <= names, dests - names
    source = (ROOT / "src" / "aiayn" / "cli.py").read_text(encoding="utf-8")
    assert source.count("add_argument(") <= 15 and "parse_known_args" not in source
    assert "SUPPRESS" not in source
    decimals = [
        line
        for name in ("cli", "decoding", "multi30k", "production")
        for line in (ROOT / "src" / "aiayn" / f"{name}.py").read_text().splitlines()
        if re.search(r"\b0\.6\b", line)
    ]
    # the paper's alpha, declared once
    assert len(decimals) == 1 and "ALPHA" in decimals[0]


def test_a_hugging_face_folder_without_tokenizer_is_one_line_even_on_stderr(
    tmp_path, capsys
):
    """No progress bar of transformers' loading before the one line of the error."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=50,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=49,
        decoder_start_token_id=49,
        eos_token_id=0,
    )
    MarianMTModel(config).save_pretrained(tmp_path / "marian")
    done = aiayn(
        "export",
        "--ctranslate2",
        str(tmp_path / "out"),
        "--pretrained",
        str(tmp_path / "marian"),
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "holds no tokenizer that transformers can read" in done.stderr


# --- --compile: chapter 18's fast decoder from the command line ----------------------


def test_compile_decodes_as_without_and_says_what_it_compiled(exported_de_en):
    sources = [s for s, _ in load_multi30k("test2016", "de-en")[:20]]
    text = "".join(line + "\n" for line in sources)
    plain = aiayn("translate", "--pretrained", "multi30k-de-en", "--greedy", stdin=text)
    fast = aiayn(
        "translate",
        "--pretrained",
        "multi30k-de-en",
        "--greedy",
        "--compile",
        stdin=text,
    )
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and len(fast.stdout.splitlines()) == 20
    assert "note: compiled the step pass in" in fast.stderr
    scored = [
        aiayn("bleu", "--pretrained", "multi30k-de-en", "--limit", "30", *more)
        for more in ([], ["--compile"])
    ]
    assert [r.returncode for r in scored] == [0, 0], scored[1].stderr
    assert scored[0].stdout == scored[1].stdout  # beams: same BLEU, same signature
    engine = aiayn(
        "translate", "--checkpoint", str(exported_de_en), "--compile", "Hallo"
    )
    assert engine.returncode == 2
    assert "--compile is for the book's models" in engine.stderr
