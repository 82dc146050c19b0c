"""docs/ and README.md agree with bench/results: every generated region equals a fresh render.

No model is loaded: bench/render_docs.py only formats the committed JSON, so this runs in seconds.
"""

import importlib
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def render_docs():
    """bench/render_docs.py as a module (bench/ is a folder of scripts, not a package)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("render_docs")
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture
def copy_root(tmp_path):
    """The documents and results files in a scratch folder laid out like the repository."""
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench" / "results").glob("*.json")]:
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return tmp_path


def test_committed_docs_equal_their_regeneration(render_docs):
    assert render_docs.stale(ROOT) == [], "run `make docs` and commit the result"


def test_every_results_file_is_rendered(render_docs):
    used = {file for region in render_docs.REGIONS.values() for file in region.results}
    assert used == {path.name for path in (ROOT / "bench" / "results").glob("*.json")}


def test_an_edited_number_in_a_generated_table_fails(render_docs, copy_root):
    assert render_docs.stale(copy_root) == []
    doc = copy_root / "docs" / "benchmarks.md"
    text = doc.read_text()
    region = re.search(r"<!-- generated:quality .*?<!-- end generated:quality -->", text, re.S)
    number = re.search(r"\| halving \(default\) \| (\d+\.\d)", region[0])
    edited = region[0].replace(number[0], number[0][:-1] + str((int(number[1][-1]) + 1) % 10), 1)
    doc.write_text(text.replace(region[0], edited))
    assert render_docs.stale(copy_root) == ["docs/benchmarks.md"]


def test_a_changed_results_file_makes_its_docs_stale(render_docs, copy_root):
    results = copy_root / "bench" / "results" / "quality.json"
    results.write_text(results.read_text().replace('"base": ', '"base": 1', 1))  # first model's base perplexity
    assert "docs/benchmarks.md" in render_docs.stale(copy_root)


def test_a_region_must_name_the_script_that_measures_it(render_docs, copy_root):
    doc = copy_root / "docs" / "benchmarks.md"
    doc.write_text(doc.read_text().replace("generated:quality (bench/quality.py)", "generated:quality (bench/other.py)"))
    with pytest.raises(SystemExit, match="names bench/other.py, but bench/quality.py produces it"):
        render_docs.stale(copy_root)


def test_the_default_prune_is_stated_the_same_everywhere(render_docs):
    """evaluation, pruning and heads say which layers `prune --drop 6` removes, all from quality.json."""
    quality = render_docs.load(ROOT, "quality.json")
    removed = render_docs.importlib.import_module("quality").default_removal(quality, "smollm2-135m", 6)
    listed = ", ".join(map(str, removed))
    for name in ("evaluation.md", "pruning.md", "heads.md"):
        text = (ROOT / "docs" / name).read_text()
        assert "<!-- generated:default-drop" in text or "<!-- generated:heads-removed-smollm2" in text, name
        assert listed in text, name


def test_every_figure_is_made_by_a_bench_command(render_docs):
    figures = [str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.png")]
    assert figures
    assert all(any(fnmatch(figure, pattern) for pattern in render_docs.FIGURES) for figure in figures)
    for doc in (ROOT / "docs").glob("*.md"):  # and every figure a document shows exists
        for link in re.findall(r'(?:src="|\]\()([^")]+\.png)', doc.read_text()):
            assert (doc.parent / link).is_file(), f"{doc.name} shows missing {link}"


def test_rendering_loads_no_model():
    """`make docs` must stay cheap: the renderer never imports transformers (so it cannot build a model)."""
    code = ("import runpy, sys; sys.argv = ['render_docs.py', '--check']\n"
            "try:\n    runpy.run_path('bench/render_docs.py', run_name='__main__')\n"
            "finally:\n    print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_heads_prose_quotes_the_committed_heads_results():
    """docs/heads.md interprets its tables in prose; the figures it quotes must still be the measured ones."""
    import json
    from collections import Counter

    text = " ".join((ROOT / "docs" / "heads.md").read_text().split())
    quoted = []
    for model in ("smollm2", "gemma3"):
        data = json.loads((ROOT / "bench" / "results" / f"heads-{model}.json").read_text())["heads"]
        heads = data["heads"]
        types = Counter(head["type"] for head in heads)
        labels = Counter((head["type"], head["swap"]["label"]) for head in heads)
        c = data["correlation"]
        quoted.append(f"{labels['sequential', 'positional']} of {types['sequential']}")
        quoted.append(f"{labels['retrieval', 'symbolic']} of {types['retrieval']}")
        quoted.append(f"{c['post_rope']['pearson_vs_predictable']:.2f}")
        quoted.append(f"{c['layers']['pearson_post_rope_vs_predictable_share']:.2f}")
        quoted.append(f"({c['pre_rope']['pearson_vs_predictable']:.2f})")
        if model == "gemma3":
            quoted.append(f"only {types['re-access']} of {len(heads)} heads are re-access")
    missing = [phrase for phrase in quoted if phrase not in text]
    assert not missing, f"docs/heads.md no longer quotes {missing}: update its prose to the new results"
