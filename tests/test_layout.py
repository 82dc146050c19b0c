"""The package's imports point down the data flow: a stage imports only the stages below it (lazy imports
inside functions included), and no two modules import each other, directly or around a circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prunetool"

# lowest first: each stage may import its own modules and any stage before it
STAGES = [
    {"prunetool", "errors", "paths", "network", "progress", "memory", "checkpoint_io", "cut"},
    {"sources"},
    {"model"},
    {"repair"},  # below select: repair-aware selection judges candidate cuts after their patch
    {"select"},
    {"checkpoint"},
    {"serving"},  # engines run what checkpoint wrote; evaluation measures through them
    {"kv"},
    {"evaluation"},
    {"output"},
    {"heads"},
    {"commands"},
    {"cli", "__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(path: Path, known: set[str]) -> set[str]:
    """Every prunetool module `path` imports anywhere in its body (`from a import b` counts a.b when a
    module b exists)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("prunetool"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names} & known
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("prunetool")}
    return found


def stage_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "prunetool"
    return next(index for index, names in enumerate(STAGES) if top in names)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, set(known)) - {name} for name, path in known.items()}


def test_every_top_level_entry_has_a_stage():
    tops = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    staged = set().union(*STAGES) - {"prunetool"}
    assert tops - {"__init__"} == staged


def test_imports_point_down_the_flow():
    upward = [f"{module} imports {target}" for module, targets in graph().items() for target in targets
              if stage_of(target) > stage_of(module)]
    assert upward == []


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                circles.append(trail[trail.index(target):] + [target])
            elif state.get(target) is None:
                visit(target, trail + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == []
