"""The package's module graph: each chapter's module imports only earlier chapters'.

The layers of the book are its chapters. A module may import the modules of earlier
chapters and never a later one, so there is no import cycle; the command line
(`aiayn.cli`, the last chapter) is on top and imported by none. Only the dispatcher
`__main__` and the tokenizer table that a checkpoint names import modules by name, and
only the command line parses arguments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import export

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "aiayn"
CHAPTERS = list(map(export.read_chapter, export.chapter_paths()))
CHAPTER_OF = {  # module name -> chapter number, from the chapters' front matter
    c.module.removeprefix("aiayn."): int(c.number) for c in CHAPTERS if c.module
}
FORMER = {old.removeprefix("aiayn.") for c in CHAPTERS for old in c.formerly}


def imported_modules(path: Path) -> set[str]:
    """The aiayn modules that a module imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "aiayn."
        ):
            found.add(node.module.removeprefix("aiayn.").split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module == "aiayn":
            found.update(a.name for a in node.names if a.name in CHAPTER_OF)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("aiayn.")
            )
    return found


def imported_names(path: Path) -> set[str]:
    """The top-level names of everything a module imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def calls_of(path: Path, name: str) -> int:
    """How many times a module calls a function or names an attribute called `name`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(
        isinstance(n, ast.Name)
        and n.id == name
        or isinstance(n, ast.Attribute)
        and n.attr == name
        for n in ast.walk(tree)
    )


def test_every_module_imports_only_earlier_chapters() -> None:
    modules = {p.stem for p in SRC.glob("*.py")} - {"__init__", "__main__"}
    assert set(CHAPTER_OF) == modules - FORMER  # a former name only warns
    later = {
        f"{name} (chapter {CHAPTER_OF[name]}) "
        f"imports {other} (chapter {CHAPTER_OF[other]})"
        for name in CHAPTER_OF
        for other in imported_modules(SRC / f"{name}.py")
        if CHAPTER_OF[other] >= CHAPTER_OF[name]
    }
    assert not later


def test_no_chapter_reads_a_later_chapter() -> None:
    """The chapters' cells, too, import only earlier chapters' modules (and their own).

    A reader meets the chapters in order: a cell of chapter 10 that used chapter 17's
    recorder would lean on code the reader has not seen.
    """
    import re

    import jupytext

    ahead = []
    for chapter, path in zip(CHAPTERS, export.chapter_paths()):
        for cell in jupytext.read(path).cells:
            if cell.cell_type != "code":
                continue
            for name in re.findall(r"(?:from|import) aiayn\.(\w+)", cell.source):
                if CHAPTER_OF.get(name, 0) > int(chapter.number):
                    ahead.append(f"{path.stem} imports aiayn.{name}")
    assert not ahead, ahead


def test_the_command_line_is_on_top_and_imported_by_no_module() -> None:
    top = max(CHAPTER_OF, key=CHAPTER_OF.get)
    assert top == "cli"
    assert not [
        name for name in CHAPTER_OF if "cli" in imported_modules(SRC / f"{name}.py")
    ]


def test_inference_needs_neither_training_nor_multi30k() -> None:
    assert not imported_modules(SRC / "decoding.py") & {"train", "runs", "multi30k"}


def test_only_the_command_line_parses_arguments() -> None:
    parsing = sorted(
        p.stem for p in SRC.glob("*.py") if "argparse" in imported_names(p)
    )
    assert parsing == ["cli"]


def test_only_the_dispatcher_and_the_tokenizer_table_import_modules_by_name() -> None:
    by_name = sorted(p.stem for p in SRC.glob("*.py") if calls_of(p, "import_module"))
    # __init__: lazy top-level names
    assert by_name == ["__init__", "__main__", "batching"]


# One definition of each thing: the helpers the chapters share are defined once and
# imported; the integer check is written once.
BOOK = ROOT / "book"
SHARED_HELPERS = {  # name -> the module that defines it
    "count_parameters": "attention",
    "count_flops": "attention",
    "show_error": "model",
    "is_int": "masks",
    "is_number": "masks",
    "atomic_file": "model",
}
RETYPED = (
    r"^def (n_params|count|matmul_flops|flops|count_flops|count_parameters|show_error)"
    r"\("
)


def test_the_shared_helpers_are_defined_once_and_imported_elsewhere() -> None:
    import re

    for name, home in SHARED_HELPERS.items():
        defining = [
            p.stem
            for p in SRC.glob("*.py")
            if re.search(rf"^def {name}\(", p.read_text(), re.M)
        ]
        assert defining == [home], (name, defining)
    retyped = {
        p.name: re.findall(RETYPED, p.read_text(encoding="utf-8"), re.M)
        for p in sorted(BOOK.glob("[0-9][0-9]_*.md"))
    }
    # only the chapters whose modules export them define them
    assert {k: v for k, v in retyped.items() if v} == {
        "01_attention.md": ["count_parameters", "count_flops"],
        "09_transformer.md": ["show_error"],
    }


def test_the_integer_check_is_written_once() -> None:
    import re

    pattern = re.compile(
        r"isinstance\(([\w.]+), bool\)\s*(or|and)\s*(not )?isinstance\(\1, \(?int"
    )
    copies = {p.stem: len(pattern.findall(p.read_text())) for p in SRC.glob("*.py")}
    assert {k: v for k, v in copies.items() if v} == {"masks": 1}  # is_int itself
    fsync_writers = sorted(
        p.stem for p in SRC.glob("*.py") if "os.fsync(f.fileno())" in p.read_text()
    )
    assert fsync_writers == ["model"]  # atomic_file, the one atomic write


def test_the_configurations_are_short_and_the_recipe_declares_no_field_twice() -> None:
    tree = ast.parse((SRC / "model.py").read_text(encoding="utf-8"))
    config = next(
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "TransformerConfig"
    )
    assert config.end_lineno - config.lineno + 1 <= 150
    tree = ast.parse((SRC / "multi30k.py").read_text(encoding="utf-8"))
    recipe = next(
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "Multi30kRecipe"
    )
    declared = {n.target.id for n in recipe.body if isinstance(n, ast.AnnAssign)}
    assert declared == {"direction", "vocab_size", "model", "schedule", "max_tokens"}


def test_loading_a_model_and_picking_a_device_sit_below_training_and_multi30k() -> None:
    for name in ("pick_device", "load_checkpoint_model", "model_from_checkpoint"):
        homes = [p.stem for p in SRC.glob("*.py") if f"\ndef {name}(" in p.read_text()]
        assert homes == ["batching"], (name, homes)
        assert CHAPTER_OF["batching"] < min(CHAPTER_OF["train"], CHAPTER_OF["multi30k"])


def calls(path: Path) -> set[str]:
    """The dotted names a module calls, such as torch.save."""
    return {
        ast.unparse(node.func)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
    }


def test_checkpoint_files_are_read_and_written_by_one_module() -> None:
    """torch.save and torch.load are called in model.py alone (chapter 9's format);
    every other module goes through write_checkpoint and read_checkpoint."""
    io = {"torch.save", "torch.load"}
    homes = sorted(p.stem for p in SRC.glob("*.py") if calls(p) & io)
    assert homes == ["model"], homes
    readers = {p.stem for p in SRC.glob("*.py") if "read_checkpoint" in calls(p)}
    assert {"batching", "production", "runs"} <= readers, readers


def test_the_run_level_of_a_checkpoint_builds_on_the_model_level() -> None:
    """A run's checkpoint (chapter 13) is the model's (chapter 9) with training state:
    train.py makes it with checkpoint_dict and writes it with write_checkpoint."""
    assert {"checkpoint_dict", "write_checkpoint"} <= calls(SRC / "train.py")
