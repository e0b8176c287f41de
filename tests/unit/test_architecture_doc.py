"""docs/ARCHITECTURE.md describes the code as it is: every module it names exists, its layout section
names every package, and its layer list is the one pyproject.toml's import-linter contract enforces.

What counts as naming a module (anywhere in the doc, code blocks included):
- a path ending in .py or .c: `src/paramserver/x/y.py`, `x/y.py` (relative to src/paramserver when its
  first folder is a package there), `tests/unit/t.py` or `bench/b.py` (relative to the repository);
  and, as a doc it points to, a path ending in .md (`docs/cli.md`);
- a dotted name starting with `paramserver.`: a module, or a name defined at the top of one (a function,
  class, assignment, import or `__all__` entry), or a class's member (`paramserver.x.y.Class.method`);
- a dotted name in backticks whose first part is a package or module of paramserver (`checkpoint.z`).
Reads files and parses them; imports nothing of paramserver.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "paramserver"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|c|md))(?![\w/])")
_DOTTED = re.compile(r"(?<![\w.])paramserver(?:\.\w+)+")
_BACKTICKED = re.compile(r"`(\w+(?:\.\w+)+)")


def _path_exists(path: str) -> bool:
    """A path as the doc writes it: under src/paramserver when its first part lives there, else the repository's."""
    first = path.split("/", 1)[0]
    if not path.startswith("src/") and (SRC / first).exists():
        return (SRC / path).is_file()
    return (ROOT / path).is_file()


def _module_file(parts: list[str]) -> Path | None:
    """The file of module `paramserver.<parts>`, or None."""
    base = SRC.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _defined(path: Path) -> dict[str, ast.AST]:
    """The names a module defines at its top level (with their node; an import's is the Import node)."""
    tree = ast.parse(path.read_text())
    return _names_in(tree.body)


def _names_in(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                for element in getattr(node.value, "elts", []):
                    if isinstance(element, ast.Constant) and isinstance(element.value, str):
                        names.setdefault(element.value, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _dotted_exists(parts: list[str]) -> bool:
    """`paramserver.<parts>`: the longest module prefix, then names defined in it (and in a class, its members)."""
    for cut in range(len(parts), -1, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest, names = parts[cut:], _defined(module)
        for name in rest:
            node = names.get(name)
            if node is None:
                return False
            names = _names_in(node.body) if isinstance(node, ast.ClassDef) else {}
        return True
    return False


def missing_modules(text: str) -> list[str]:
    """Every module reference in `text` that names nothing in the repository, in order of appearance."""
    missing = [path for path in _PATH.findall(text) if not _path_exists(path)]
    missing += [name for name in _DOTTED.findall(text) if not _dotted_exists(name.split(".")[1:])]
    for name in _BACKTICKED.findall(text):
        parts = name.split(".")
        if parts[0] != "paramserver" and _module_file(parts[:1]) is not None and not _dotted_exists(parts):
            missing.append(name)
    return missing


def layout_section(text: str) -> str:
    """The doc's "## Layout ..." section, up to the next section of the same level."""
    match = re.search(r"^## Layout.*?(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, "docs/ARCHITECTURE.md has no '## Layout' section"
    return match.group(0)


def packages() -> list[str]:
    """Every package under src/paramserver, as a path relative to it (`tables/tiered`)."""
    return sorted(init.parent.relative_to(SRC).as_posix() for init in SRC.rglob("__init__.py") if init.parent != SRC)


def unnamed_packages(section: str) -> list[str]:
    """The packages a layout section names neither as `pkg/` nor by a path under it."""
    return [package for package in packages() if not re.search(rf"(?<![\w/]){re.escape(package)}/", section)]


def doc_layers(section: str) -> list[list[str]]:
    """The layer list of a layout section: its first code block, one layer a line (`a | b  what they do`)."""
    match = re.search(r"^```\n(.*?)^```", section, re.M | re.S)
    assert match is not None, "the layout section has no code block of layers"
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    return [[name.strip() for name in re.split(r"\s{2,}", line.strip())[0].split("|")] for line in lines]


def contract_layers() -> list[list[str]]:
    """The layers of pyproject.toml's import-linter `layers` contract, without the `paramserver.` prefix."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [[name.strip().removeprefix("paramserver.") for name in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def test_every_module_the_doc_names_exists():
    assert missing_modules(DOC.read_text()) == []


def test_the_layout_section_names_every_package():
    assert unnamed_packages(layout_section(DOC.read_text())) == []


def test_the_doc_lists_the_layers_of_the_import_contract():
    assert doc_layers(layout_section(DOC.read_text())) == contract_layers()


def test_a_doc_naming_missing_modules_is_caught():
    text = (
        "The writer is `checkpoint.save_shard` (checkpoint/save_shard.py); tables in src/paramserver/server/"
        "table_store.py (docs/tables.md), and paramserver.server.hyper.check_hyper; `checkpoint.shard_writer` and"
        " server/shard.py's paramserver.server.shard.Shard.step exist, as do tests/unit/test_stubs.py and"
        " `paramserver.optim.Adam(...)`; paramserver.server.shard.Shard.no_such_method does not."
    )
    assert missing_modules(text) == [
        "checkpoint/save_shard.py",
        "src/paramserver/server/table_store.py",
        "docs/tables.md",
        "paramserver.server.hyper.check_hyper",
        "paramserver.server.shard.Shard.no_such_method",
        "checkpoint.save_shard",
    ]


def test_a_layout_missing_a_package_or_a_layer_is_caught():
    section = layout_section(DOC.read_text())
    without_tiered = re.sub(r"(?<![\w/])tables/tiered/", "tables/", section)
    assert "tables/tiered" in unnamed_packages(without_tiered)
    assert "tables/tiered" not in unnamed_packages(section)
    renamed = section.replace("\nserver  ", "\nshards  ", 1)
    assert renamed != section
    assert doc_layers(renamed) != contract_layers()
