"""The README stays true: its file tree names every module, its usage names every command, and every
option it documents exists in the CLI."""

import re
from pathlib import Path

from typer.main import get_command

from prunetool.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def tree_entries() -> dict[str, set[str]]:
    """{folder relative to prunetool/ ("" for the package itself): entries the tree names under it}; a
    package the tree names without listing its files has no key."""
    tree = README[README.index("```text\nprunetool/\n"):]
    tree = tree[:tree.index("```", 8)]
    entries: dict[str, set[str]] = {}
    parents = [""]
    for match in re.finditer(r"^((?:  ){1,4})([A-Za-z_]+(?:\.py|/))", tree, re.MULTILINE):
        depth = len(match.group(1)) // 2
        del parents[depth:]
        entries.setdefault(parents[-1], set()).add(match.group(2))
        parents.append(parents[-1] + match.group(2))
    return entries


def listing(folder: Path) -> set[str]:
    names = {p.name for p in folder.glob("*.py") if not p.name.startswith("__")}
    return names | {p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_file_tree_names_every_module_and_package():
    package = ROOT / "prunetool"
    entries = tree_entries()
    assert entries[""] == listing(package)
    for folder, named in entries.items():  # a package whose files the tree lists lists all of them
        assert named - {"__init__.py"} == listing(package / folder), folder


def test_usage_names_every_command_and_documented_options_exist():
    group = get_command(app)
    usage = README[README.index("## Usage"):README.index("## Layout")]
    for name in group.commands:
        assert f"prunetool {name}" in usage, name
    options = {opt for command in group.commands.values() for param in command.params for opt in param.opts
               if not getattr(param, "hidden", False)}
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", usage))
    assert documented and documented <= options | {"--help", "--debug", "--version"}, documented - options
