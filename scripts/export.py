#!/usr/bin/env python3
"""Generate the package `aiayn` (src/aiayn/) from the book's cells tagged `export`.

Each chapter `book/NN_name.md` that exports code names its module in its front
matter (`module: aiayn.attention`); its cells tagged `export`, in order, become
that module, under a header that names the chapter and says not to edit it.
`src/aiayn/__init__.py` is generated too, with the map from modules to chapters
and the names that chapters lift to the top level (`reexport: [Transformer]` in
the front matter makes `from aiayn import Transformer` work). `src/aiayn/__main__.py`
dispatches `python -m aiayn COMMAND` to the functions that chapters declare
(`commands: {train: main}` runs `aiayn.<module>.main(argv)` for
`python -m aiayn train`). A module that a chapter renamed keeps its old name
for the code written against it: `formerly: [aiayn.data]` in the front matter
generates `aiayn/data.py`, which warns and offers the new module's names.

`book/api.md`, the API reference, is generated too: a section for each module, and
a table of "where things live" from the chapters' `hosts:` front matter, which names
what a chapter holds only because later chapters need it below them (`hosts:
{pick_device: choosing the device}`), with the modules that import each name.

The bookkeeping is generated, not written by hand: a chapter's first export cell
holds its imports and nothing else; the module's `__all__` (every top-level name
without a leading underscore) follows them; and each block of code is marked with
the chapter section it comes from (`# Chapter 9, "A forward pass"`), so that a
reader of the module finds the prose that explains it.

A class can be built across cells, a method or two at a time with prose between them:
a later export cell that holds only `class Name(Name):` continues the class `Name` of an
earlier export cell of the same chapter. In the notebook it is a subclass that adds
methods; in the module its body is appended to the one class `Name`.

    python scripts/export.py            write src/aiayn/ from the book
    python scripts/export.py --check    exit 1, naming each file, when src/aiayn/
                                        differs from what the book exports
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
PACKAGE = ROOT / "src" / "aiayn"
API_PAGE = BOOK / "api.md"
CHAPTER_GLOB = "[0-9][0-9]_*.md"
EXPORT_TAG = "export"
MODULE_NAME = re.compile(r"^aiayn\.[a-z_][a-z0-9_]*$")
MAGIC = re.compile(r"^\s*[%!]", re.M)
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Chapter:
    path: Path  # book/NN_name.md
    title: str
    module: str | None  # "aiayn.attention", or None for a chapter that exports nothing
    cells: list[str]  # sources of the cells tagged `export`, in order
    sections: list[str]  # the heading of the section that holds each of those cells
    reexport: list[str]  # names that `from aiayn import ...` offers
    commands: dict[str, str]  # `python -m aiayn NAME` -> function of the module
    formerly: list[str] = field(default_factory=list)  # earlier names of the module
    hosts: dict[str, str] = field(default_factory=dict)  # name -> what it is for

    @property
    def number(self) -> str:
        return self.path.name[:2]

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


class ExportError(Exception):
    """A chapter that cannot be exported; the message says which and why."""


def chapter_paths() -> list[Path]:
    """Every chapter source, in book order (by its NN_ prefix)."""
    return sorted(BOOK.glob(CHAPTER_GLOB))


def read_chapter(path: Path) -> Chapter:
    """Read one chapter's title, module and export cells from its MyST source."""
    nb = jupytext.read(path)
    rel = path.relative_to(ROOT).as_posix()
    title = next(
        (
            line[2:].strip()
            for cell in nb.cells
            if cell.cell_type == "markdown"
            for line in cell.source.splitlines()
            if line.startswith("# ")
        ),
        None,
    )
    if title is None:
        raise ExportError(f"{rel}: no '# Title' heading; every chapter starts with one")
    module = nb.metadata.get("module")
    cells, sections, section = [], [], title
    for c in nb.cells:
        if c.cell_type == "markdown":
            headings = re.findall(r"^#{2,3} +(.+?)\s*$", c.source, re.M)
            section = headings[-1] if headings else section
        elif EXPORT_TAG in c.metadata.get("tags", []):
            cells.append(c.source.strip("\n"))
            sections.append(section)
    if module is not None and not MODULE_NAME.match(str(module)):
        raise ExportError(
            f"{rel}: front matter 'module: {module}' must look like 'aiayn.name'"
        )
    if cells and module is None:
        raise ExportError(
            f"{rel}: has cells tagged '{EXPORT_TAG}' but no 'module: aiayn.<name>' "
            "in its front matter"
        )
    if module is not None and not cells:
        raise ExportError(
            f"{rel}: names module {module} but has no cell tagged '{EXPORT_TAG}'"
        )
    for source in cells:
        if MAGIC.search(source):
            raise ExportError(
                f"{rel}: an '{EXPORT_TAG}' cell uses an IPython magic "
                f"or shell escape:\n{source}"
            )
    reexport = nb.metadata.get("reexport", [])
    if not isinstance(reexport, list) or not all(
        isinstance(n, str) and IDENTIFIER.match(n) for n in reexport
    ):
        raise ExportError(
            f"{rel}: front matter 'reexport' must be a list of names, got {reexport!r}"
        )
    commands = nb.metadata.get("commands", {})
    if not isinstance(commands, dict) or not all(
        isinstance(k, str)
        and re.fullmatch(r"[a-z][a-z0-9-]*", k)
        and isinstance(v, str)
        and IDENTIFIER.match(v)
        for k, v in commands.items()
    ):
        raise ExportError(
            f"{rel}: front matter 'commands' must map command names to functions, "
            f"got {commands!r}"
        )
    hosts = nb.metadata.get("hosts", {})
    if not isinstance(hosts, dict) or not all(
        isinstance(k, str) and IDENTIFIER.match(k) and isinstance(v, str) and v
        for k, v in hosts.items()
    ):
        raise ExportError(
            f"{rel}: front matter 'hosts' must map names to what they are for, "
            f"got {hosts!r}"
        )
    if (reexport or commands or hosts) and module is None:
        raise ExportError(
            f"{rel}: 'reexport', 'commands' and 'hosts' need a "
            "'module: aiayn.<name>' to export from"
        )
    code = "\n".join(cells)
    for name in [*reexport, *commands.values(), *hosts]:
        if not re.search(rf"^(class|def) {name}\b|^{name}\s*[:=]", code, re.M):
            raise ExportError(
                f"{rel}: front matter names {name}, "
                f"which its '{EXPORT_TAG}' cells do not define"
            )
    formerly = nb.metadata.get("formerly", [])
    if not isinstance(formerly, list) or not all(
        isinstance(n, str) and MODULE_NAME.match(n) for n in formerly
    ):
        raise ExportError(
            f"{rel}: front matter 'formerly' must be a list of module names "
            f"like aiayn.name, got {formerly!r}"
        )
    if formerly and module is None:
        raise ExportError(f"{rel}: 'formerly' needs a 'module: aiayn.<name>'")
    if cells:
        check_bookkeeping(cells, rel)
    return Chapter(
        path, title, module, cells, sections, reexport, commands, formerly, hosts
    )


def former_module_text(chapter: Chapter, old: str) -> str:
    """The module under a chapter's earlier name: a warning, then the new names."""
    new = chapter.module
    return (
        f"# Generated by scripts/export.py: {old} is now {new}, chapter "
        f"{chapter.number}.\n"
        "# Do not edit: rename in the chapter's front matter (formerly: [...]).\n"
        f'"""The former name of {new} (chapter {int(chapter.number)}), kept for code '
        f"written against it.\n\nImporting it warns; import {new} instead.\n"
        '"""\n\n'
        "import warnings\n\n"
        f"from {new} import *  # noqa: F403\n"
        f"from {new} import __all__  # noqa: F401\n\n"
        "warnings.warn(\n"
        f'    "{old} is now {new}; import {new} instead.",\n'
        "    DeprecationWarning,\n"
        "    stacklevel=2,\n"
        ")\n"
    )


def check_bookkeeping(cells: list[str], rel: str) -> None:
    """The first export cell holds all the imports; nothing writes `__all__`."""
    trees = []
    for k, source in enumerate(cells):
        try:
            trees.append(ast.parse(source))
        except SyntaxError as err:
            raise ExportError(
                f"{rel}: export cell {k + 1} is not valid Python: {err}"
            ) from None
    imports = (ast.Import, ast.ImportFrom)
    extra = [n for n in trees[0].body if not isinstance(n, imports)]
    if extra:
        start = ast.unparse(extra[0]).splitlines()[0][:60]
        raise ExportError(
            f"{rel}: the first '{EXPORT_TAG}' cell must hold the module's "
            "imports only; "
            f"line {extra[0].lineno} ({start}) belongs in a later cell"
        )
    for k, tree in enumerate(trees[1:], start=2):
        for node in tree.body:
            if isinstance(node, imports):
                raise ExportError(
                    f"{rel}: export cell {k} imports ({ast.unparse(node)}); "
                    f"move the import to the chapter's first '{EXPORT_TAG}' cell"
                )
            if "__all__" in assigned_names(node):
                raise ExportError(
                    f"{rel}: export cell {k} writes __all__, "
                    "which scripts/export.py generates; remove it"
                )


def assigned_names(node: ast.stmt) -> list[str]:
    """The names a top-level statement defines: def, class, assignment to a name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else ([node.target] if isinstance(node, ast.AnnAssign) else [])
    )
    names = []
    for target in targets:
        elements = target.elts if isinstance(target, ast.Tuple) else [target]
        names += [e.id for e in elements if isinstance(e, ast.Name)]
    return names


def public_names(code: str) -> list[str]:
    """Every top-level name of a module without a leading underscore, sorted."""
    names = {n for node in ast.parse(code).body for n in assigned_names(node)}
    return sorted(n for n in names if not n.startswith("_"))


def continues_a_class(node: ast.stmt) -> bool:
    """Whether a top-level statement is `class Name(Name): ...`, continuing a class."""
    if not isinstance(node, ast.ClassDef) or len(node.bases) != 1 or node.keywords:
        return False
    base = node.bases[0]
    return isinstance(base, ast.Name) and base.id == node.name


def section_marker(chapter_number: str, section: str, indent: str = "") -> str:
    """The comment that names the chapter section a block of the module comes from."""
    return f'{indent}# Chapter {int(chapter_number)}, "{section}"'


def merge_continued_classes(
    cells: list[str], rel: str, sections: list[str] | None = None, number: str = "0"
) -> list[str]:
    """Move the body of each `class Name(Name):` to the end of the earlier class Name.

    The other statements of a continuing cell stay where they are. With `sections`
    (one heading per cell), each block that starts a new section is preceded by a
    marker comment naming it; a continued class body gets its own marker when it
    comes from another section than the class.
    """
    merged: list[str] = []
    chunk_sections: list[str] = []
    last = None
    for k, source in enumerate(cells):
        section = sections[k] if sections else None
        try:
            tree = ast.parse(source)
        except SyntaxError:
            merged.append(source)
            chunk_sections.append(section)
            continue
        continued = [n for n in tree.body if continues_a_class(n)]
        lines = source.splitlines()
        for node in continued:
            if node.decorator_list or ast.get_docstring(node) is not None:
                raise ExportError(
                    f"{rel}: the cell continuing class {node.name} "
                    "may hold methods only, "
                    f"without decorators on the class or a docstring"
                )
            body = lines[node.lineno : node.end_lineno]
            _append_to_class(
                merged, chunk_sections, node.name, body, rel, section, number
            )
        for node in reversed(continued):
            del lines[node.lineno - 1 : node.end_lineno]
        rest = re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).strip("\n")
        if rest:
            if section is not None and section != last:
                rest = section_marker(number, section) + "\n" + rest
                last = section
            merged.append(rest)
            chunk_sections.append(section)
    return merged


def _append_to_class(
    chunks: list[str],
    chunk_sections: list[str | None],
    name: str,
    body: list[str],
    rel: str,
    section: str | None = None,
    number: str = "0",
) -> None:
    """Insert body (indented method lines) at the end of the last class `name`."""
    for k in range(len(chunks) - 1, -1, -1):
        classes = [
            n
            for n in ast.parse(chunks[k]).body
            if isinstance(n, ast.ClassDef) and n.name == name
        ]
        if classes:
            lines = chunks[k].splitlines()
            end = classes[-1].end_lineno
            if section is not None and section != chunk_sections[k]:
                indent = re.match(r"\s*", body[0]).group() if body else "    "
                body = [section_marker(number, section, indent), *body]
            chunks[k] = "\n".join(lines[:end] + [""] + body + lines[end:])
            chunk_sections[k] = section if section is not None else chunk_sections[k]
            return
    raise ExportError(
        f"{rel}: a cell continues class {name}, which no earlier '{EXPORT_TAG}' cell "
        f"of the chapter defines"
    )


def module_text(chapter: Chapter) -> str:
    """The generated module of one chapter."""
    header = (
        f"# Generated by scripts/export.py from {chapter.rel}, "
        f"chapter {chapter.number}:\n"
        f'# "{chapter.title}".\n'
        "# Do not edit: change the chapter, then run `python scripts/export.py`.\n"
    )
    doc = (
        f'"""{chapter.title}.\n\n'
        f'Chapter {int(chapter.number)} of the book, {chapter.rel}.\n"""\n'
    )
    imports, *rest = chapter.cells
    body = merge_continued_classes(
        rest, chapter.rel, chapter.sections[1:], chapter.number
    )
    names = public_names("\n\n".join([imports, *body]))
    listed = "".join(f'    "{name}",\n' for name in names)
    all_list = f"__all__ = [\n{listed}]" if names else "__all__: list[str] = []"
    return (
        header
        + doc
        + "\n"
        + "\n\n".join([imports, all_list])
        + "\n\n\n"
        + "\n\n\n".join(body)
        + "\n"
    )


def init_text(chapters: list[Chapter]) -> str:
    """The generated package __init__: version, the module map, lazy top-level names.

    The names that chapters lift to the top level are imported when first used
    (PEP 562), so that `import aiayn`, and `python -m aiayn --help`, import no torch.
    """
    width = max((len(c.module) for c in chapters if c.module), default=0)
    rows = "\n".join(
        f"    {c.module:<{width}}  chapter {c.number}, {c.rel}"
        for c in chapters
        if c.module
    )
    lifted = [(c.module, name) for c in chapters for name in c.reexport]
    table = "".join(f'    "{name}": "{module}",\n' for module, name in lifted)
    top_level = (
        "\n# the names that `from aiayn import NAME` offers "
        "-> the module that defines them\n"
        f"_LIFTED = {{\n{table}}}\n__all__ = sorted(_LIFTED)\n\n\n"
        "def __getattr__(name: str) -> Any:\n"
        '    """A lifted name, from its module, imported on first use."""\n'
        "    if name in _LIFTED:\n"
        "        return getattr(import_module(_LIFTED[name]), name)\n"
        "    raise AttributeError(f\"module 'aiayn' has no attribute {name!r}\")\n"
        if lifted
        else ""
    )
    return (
        "# Generated by scripts/export.py. Do not edit.\n"
        '"""aiayn: the Transformer of "Attention Is All You Need", '
        "from a literate, tested book.\n"
        "\n"
        "Each module is the code of one chapter:\n"
        "\n"
        f"{rows}\n"
        '"""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "from importlib import import_module\n"
        "from importlib.metadata import PackageNotFoundError, version\n"
        "from typing import Any\n"
        "\n"
        "try:\n"
        '    __version__ = version("aiayn")\n'
        "except PackageNotFoundError:"
        "  # imported from a source tree that is not installed\n"
        '    __version__ = "0+unknown"\n' + top_level
    )


def command_summary(c: Chapter, func: str) -> str:
    """What a command does: its function's docstring's first line, after the colon."""
    for tree in (ast.parse(cell) for cell in c.cells):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == func:
                doc = ast.get_docstring(node)
                line = doc.splitlines()[0] if doc else ""
                line = re.sub(
                    r"\s*\((chapter|ch\.) \d+\)\.?$", "", line.split(": ", 1)[-1]
                )
                if line:
                    return line
    raise ExportError(
        f"{c.rel}: the command function {func} needs a docstring that says what it does"
    )


def book_url() -> str:
    """The hosted book's address, from pyproject.toml's [project.urls] Book = "..."."""
    pyproject = ROOT / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8") if pyproject.exists() else ""
    match = re.search(r'^Book\s*=\s*"([^"]+)"', text, re.M)
    return match.group(1) if match else ""


def main_text(chapters: list[Chapter]) -> str:
    """The generated `python -m aiayn` dispatcher: one command per chapter function.

    Its help, --version and its errors import nothing but the standard library.
    """
    rows = "".join(
        f'    "{name}": ("{c.module}", "{func}", {command_summary(c, func)!r}, '
        f'"chapter {int(c.number)}"),\n'
        for c in chapters
        for name, func in c.commands.items()  # in the order of the front matter
    )
    return (
        "# Generated by scripts/export.py. Do not edit.\n"
        '"""The command line: `python -m aiayn COMMAND [ARGS]`, '
        'one per chapter function."""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "import difflib\n"
        "import sys\n"
        "from importlib import import_module\n"
        "from importlib.metadata import PackageNotFoundError, version\n"
        "\n"
        f'BOOK_URL = "{book_url()}"\n'
        "\n"
        "# command -> (module, function, what it does, the chapter that explains it)\n"
        f"COMMANDS: dict[str, tuple[str, str, str, str]] = {{\n{rows}}}\n"
        'USAGE = "usage: python -m aiayn [--version] COMMAND [ARGS]"\n'
        "\n"
        "\n"
        "def main(argv: list[str] | None = None) -> int:\n"
        '    """Run `python -m aiayn COMMAND [ARGS]`: '
        'find the command, call its function."""\n'
        "    argv = sys.argv[1:] if argv is None else list(argv)\n"
        '    if not argv or argv[0] in ("-h", "--help"):\n'
        "        print(USAGE)\n"
        "        for name, (_, _, does, chapter) in COMMANDS.items():\n"
        '            print(f"  {name:10s} {does} ({chapter})")\n'
        '        print(f"Flags of a command: python -m aiayn COMMAND --help. '
        'Book: {BOOK_URL}")\n'
        "        return 0 if argv else 2\n"
        '    if argv[0] in ("-V", "--version"):\n'
        "        try:\n"
        "            print(f\"aiayn {version('aiayn')}\")\n"
        "        except PackageNotFoundError:  # a source tree that is not installed\n"
        '            print("aiayn (not installed)")\n'
        "        return 0\n"
        "    if argv[0] not in COMMANDS:\n"
        "        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)\n"
        '        hint = f" (did you mean {close[0]}?)" if close else ""\n'
        "        print(\n"
        '            f"python -m aiayn: error: unknown command {argv[0]!r}{hint}; '
        'the commands "\n'
        "            f\"are {', '.join(COMMANDS)} (see --help)\",\n"
        "            file=sys.stderr,\n"
        "        )\n"
        "        return 2\n"
        "    module, func, _, _ = COMMANDS[argv[0]]\n"
        "    return int(getattr(import_module(module), func)(argv[1:]) or 0)\n"
        "\n"
        "\n"
        'if __name__ == "__main__":\n'
        "    sys.exit(main())\n"
    )


def ruff() -> list[str]:
    """The command that runs ruff: the executable next to this Python, or on PATH."""
    local = Path(sys.executable).with_name("ruff")
    if local.exists():
        return [str(local)]
    if shutil.which("ruff"):
        return ["ruff"]
    raise ExportError(
        "ruff is not installed; pip install -r requirements.txt installs it"
    )


def formatted(path: Path, text: str) -> str:
    """A generated file as ruff sorts its imports and formats it (pyproject.toml's)."""
    settings = (
        ["--config", str(ROOT / "pyproject.toml")]
        if (ROOT / "pyproject.toml").exists()
        else []
    )
    for args in (
        ["check", "--fix", "--select", "I", "--quiet", "--exit-zero"],
        ["format", "--quiet"],
    ):
        run = subprocess.run(
            [*ruff(), *args, *settings, "--stdin-filename", str(path), "-"],
            input=text,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise ExportError(f"ruff {args[0]} failed on {path.name}:\n{run.stderr}")
        text = run.stdout
    return text


def expected_files() -> dict[Path, str]:
    """Every file of src/aiayn/ (formatted by ruff), and book/api.md, from the book."""
    chapters = [read_chapter(p) for p in chapter_paths()]
    owners: dict[str, Chapter] = {}
    for c in chapters:
        if c.module is None:
            continue
        if c.module in owners:
            raise ExportError(
                f"{c.module} is claimed by both {owners[c.module].rel} and {c.rel}"
            )
        if c.module in ("aiayn.__init__", "aiayn.__main__"):
            raise ExportError(
                f"{c.rel}: {c.module} is generated; pick another module name"
            )
        owners[c.module] = c
    files = {
        PACKAGE / "__init__.py": init_text(chapters),
        PACKAGE / "__main__.py": main_text(chapters),
    }
    seen: dict[str, str] = {}
    for c in chapters:
        for name in c.commands:
            if name in seen:
                raise ExportError(
                    f"command {name!r} is declared by both {seen[name]} and {c.rel}"
                )
            seen[name] = c.rel
    for module, c in owners.items():
        files[PACKAGE / (module.split(".", 1)[1] + ".py")] = module_text(c)
    files[API_PAGE] = api_text(
        chapters, {c.module: files_of(files, c) for c in owners.values()}
    )
    for c in chapters:
        for old in c.formerly:
            if old in owners or old in ("aiayn.__init__", "aiayn.__main__"):
                raise ExportError(f"{c.rel}: {old} is a module of the book still")
            files[PACKAGE / (old.split(".", 1)[1] + ".py")] = former_module_text(c, old)
    return {
        path: text if path.suffix == ".md" else formatted(path, text)
        for path, text in files.items()
    }


def files_of(files: dict[Path, str], chapter: Chapter) -> str:
    """The generated module of a chapter, from the files made so far."""
    return files[PACKAGE / (chapter.module.split(".", 1)[1] + ".py")]


def importers(name: str, module: str, modules: dict[str, str]) -> list[str]:
    """The modules whose code imports name from module (`from module import name`)."""
    found = []
    for other, text in modules.items():
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == module
                and any(a.name == name for a in node.names)
            ):
                found.append(other)
                break
    return found


def api_text(chapters: list[Chapter], modules: dict[str, str]) -> str:
    """book/api.md: where things live, then one section for each module."""
    chapter_of = {c.module: c for c in chapters if c.module}
    lines = [
        "# API reference",
        "",
        "The package `aiayn` is generated from the chapters: each module below is "
        "the code of the",
        "chapter that exports it (see the {doc}`intro`). Install it with",
        '`pip install "aiayn @ git+https://github.com/literate-transformer/aiayn"`.',
        "",
        "## Where things live",
        "",
        "A chapter imports only from earlier chapters, so what a later chapter needs",
        "below it sometimes lives in an earlier one. This table, generated from the",
        "chapters, says where to find such things and which modules use them.",
        "",
        "| name | lives in | what it is for | used by |",
        "|---|---|---|---|",
    ]
    for c in chapters:
        for name, purpose in c.hosts.items():
            users = importers(name, c.module, modules)
            later = [u for u in users if chapter_of[u].number > c.number]
            if not later:
                raise ExportError(
                    f"{c.rel}: 'hosts' names {name}, which no later module imports; "
                    "take it out of 'hosts'"
                )
            used = ", ".join(
                f"`{u}` ({int(chapter_of[u].number)})"
                for u in sorted(users, key=lambda u: chapter_of[u].number)
            )
            home = f"`{c.module}`, {{doc}}`{c.path.stem}`"
            lines.append(f"| `{name}` | {home} | {purpose} | {used} |")
    for c in chapters:
        if c.module is None:
            continue
        lines += [
            "",
            f"## `{c.module}`",
            "",
            f"Chapter {{doc}}`{c.path.stem}`.",
            "",
            "```{eval-rst}",
            f".. automodule:: {c.module}",
            "   :members:",
            "```",
        ]
    return "\n".join(lines) + "\n"


def actual_files() -> dict[Path, str]:
    """Every Python file now under src/aiayn/, and the API page."""
    found = {
        p: p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    if API_PAGE.exists():
        found[API_PAGE] = API_PAGE.read_text(encoding="utf-8")
    return found


def check() -> int:
    """Compare src/aiayn/ with the book's export; print the differences; 0 in sync."""
    expected, actual = expected_files(), actual_files()
    problems = []
    for path, text in expected.items():
        rel = path.relative_to(ROOT).as_posix()
        if path not in actual:
            problems.append(f"{rel}: missing (run python scripts/export.py)")
        elif actual[path] != text:
            diff = difflib.unified_diff(
                text.splitlines(),
                actual[path].splitlines(),
                "exported",
                "on disk",
                lineterm="",
                n=1,
            )
            excerpt = "\n".join(list(diff)[:12])
            problems.append(
                f"{rel}: differs from what the book exports "
                "(a hand edit, or a stale export: "
                f"change the chapter, then run python scripts/export.py)\n{excerpt}"
            )
    for path in actual.keys() - expected.keys():
        rel = path.relative_to(ROOT).as_posix()
        problems.append(
            f"{rel}: no chapter exports this module "
            "(remove it, or export it from a chapter)"
        )
    for p in problems:
        print(p)
    if not problems:
        print(f"src/aiayn is in sync with the book ({len(expected)} files)")
    return 1 if problems else 0


def write() -> int:
    """Write src/aiayn/ from the book, removing modules that no chapter exports."""
    expected, actual = expected_files(), actual_files()
    PACKAGE.mkdir(parents=True, exist_ok=True)
    for path, text in expected.items():
        if actual.get(path) != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT).as_posix()}")
    for path in actual.keys() - expected.keys():
        path.unlink()
        print(f"removed {path.relative_to(ROOT).as_posix()} (no chapter exports it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only compare; exit 1 on any difference"
    )
    args = parser.parse_args(argv)
    try:
        return check() if args.check else write()
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
