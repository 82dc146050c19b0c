"""The README stays true: its file tree names every module, its usage names every command, and every
option it documents exists in the CLI."""

import re
from pathlib import Path

from typer.main import get_command

from prunetool.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def tree_entries() -> set[str]:
    tree = README[README.index("```text\nprunetool/\n"):]
    tree = tree[:tree.index("```", 8)]
    return {match.group(1) for match in re.finditer(r"^  ([A-Za-z_]+(?:\.py|/))", tree, re.MULTILINE)}


def test_file_tree_names_every_module_and_package():
    package = ROOT / "prunetool"
    present = {p.name for p in package.glob("*.py") if not p.name.startswith("__")}
    present |= {p.name + "/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert tree_entries() == present


def test_usage_names_every_command_and_documented_options_exist():
    group = get_command(app)
    usage = README[README.index("## Usage"):README.index("## Layout")]
    for name in group.commands:
        assert f"prunetool {name}" in usage, name
    options = {opt for command in group.commands.values() for param in command.params for opt in param.opts
               if not getattr(param, "hidden", False)}
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", usage))
    assert documented and documented <= options | {"--help", "--debug", "--version"}, documented - options
