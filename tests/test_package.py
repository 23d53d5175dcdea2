"""Tests of the package as users install it: a wheel built from the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import export
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_exported_module_and_imports(tmp_path: Path) -> None:
    # The same build that `pip install git+<repository URL>` runs, from a copy of the
    # files it reads (an in-tree build would leave build/ behind in the repository).
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "src",
        source / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    subprocess.run(
        [
            sys.executable,
            *"-m pip wheel --no-deps -q -w".split(),
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("aiayn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"aiayn/{p.name}" for p in export.expected_files() if p.suffix == ".py"}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            *"-m pip install -q --no-deps".split(),
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # Import from the installed copy (not the source tree): run outside the repository.
    code = (
        "import aiayn, aiayn.attention, pathlib, sys; "
        "assert pathlib.Path(aiayn.__file__).is_relative_to("
        "pathlib.Path(sys.argv[1])), aiayn.__file__; "
        "from aiayn.attention import scaled_dot_product_attention; "
        "print(aiayn.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.1.0"
    # The installed copy's commands: `python -m aiayn train ...` and
    # `python -m aiayn translate ...`.
    for command, expected in (("train", "--preset"), ("translate", "--checkpoint")):
        result = subprocess.run(
            [sys.executable, "-m", "aiayn", command, "--help"],
            cwd=tmp_path,
            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0 and expected in result.stdout, result.stderr
    # The wheel holds no weights: `--pretrained` downloads the shipped model into the
    # cache, here from a file:// URL of this checkout's results/ (never the network).
    installed = {
        "PYTHONPATH": str(site),
        "PATH": "/usr/bin:/bin",
        "AIAYN_CACHE_DIR": str(tmp_path / "cache"),
        "AIAYN_PRETRAINED_URL": (ROOT / "results").as_uri(),
    }
    result = subprocess.run(
        [
            sys.executable,
            *"-m aiayn translate --pretrained multi30k-de-en".split(),
            "--greedy",
            "Ein Hund läuft über eine Wiese.",
        ],
        cwd=tmp_path,
        env=installed,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "dog" in result.stdout, result.stderr
    assert (tmp_path / "cache" / "pretrained" / "multi30k-de-en" / "model.pt").is_file()
    result = subprocess.run(  # and the paper's direction, in two lines of Python
        [
            sys.executable,
            "-c",
            "from aiayn.multi30k import pretrained; from aiayn.decoding import "
            "translate; m, t = pretrained('multi30k-en-de'); "
            "print(translate(m, t, ['A dog runs.']))",
        ],
        cwd=tmp_path,
        env=installed,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "Hund" in result.stdout, result.stderr
    assert (tmp_path / "cache" / "pretrained" / "multi30k-en-de" / "model.pt").is_file()


def test_readme_examples_run(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    build, translate, shipped, production = re.findall(
        r"```python\n(.*?)```", readme, re.S
    )
    # The production model needs the network: its code compiles, and what it imports
    # exists (tests/test_production.py loads such a model from a folder).
    compile(production, "README.md", "exec")
    from aiayn.production import load_huggingface  # noqa: F401

    # The shipped model, from this checkout's results/ (no download).
    result = subprocess.run(
        [sys.executable, "-c", shipped],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "AIAYN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr
    assert "dogs" in result.stdout and "snow" in result.stdout, result.stdout
    assert not (tmp_path / "cache").exists()
    result = subprocess.run(
        [sys.executable, "-c", build], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "63,082,496"
    # The translation example reads the checkpoint that the README's training command
    # writes: train the copy task briefly in a fresh folder, then run the example there.
    train = [
        sys.executable,
        *"-m aiayn train --task copy --steps 40".split(),
        *"--checkpoint-every 10 --eval-every 20 --train-size 2000".split(),
        *"--valid-size 100 --no-progress".split(),
    ]
    result = subprocess.run(train, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "checkpoints/copy/averaged.pt").exists(), result.stdout
    result = subprocess.run(
        [sys.executable, "-c", translate], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("['") and line.endswith("']"), line


@pytest.mark.parametrize(
    ("old", "new"), [("aiayn.data", "aiayn.multi30k"), ("aiayn.engine", "aiayn.runs")]
)
def test_a_renamed_module_still_imports_under_its_old_name_and_warns(old, new):
    """Code written for the old names keeps working, and is told the new one."""
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old.__all__ == new.__all__ and old.__all__\n"
        "assert all(getattr(old, n) is getattr(new, n) for n in new.__all__)\n"
        "(w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        "print(w.message)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{old} is now {new}; import {new} instead."
