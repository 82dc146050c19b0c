"""`prunetool score` against the independent Gram-matrix reference on the real models -> bench/results/score_reference.json.

Run: .venv/bin/python bench/score_reference.py [--models smollm2-135m,gemma3-270m]

The setting of tests/test_real_models.py (WikiText-2 test, 4 windows x 256 tokens, float32 on CPU),
which asserts < 1e-4; this records how far below that bound each field actually is.
"""

import argparse
import sys
from pathlib import Path

from provenance import write_results

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext2-test.raw"
FIELDS = ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1", "block_influence")


def differences(alias: str) -> dict:
    """Largest absolute difference per field between prunetool's scores and tests/reference.py."""
    import torch

    sys.path.insert(0, str(ROOT))
    from prunetool.select.calibration import load_calibration
    from prunetool.model.loading import load_model
    from prunetool.select.scoring import score_model
    from prunetool.sources import resolve_model
    from tests.reference import reference_scores

    model, tokenizer = load_model(resolve_model(alias), dtype="float32", device="cpu")
    calibration = load_calibration(str(TEXT), tokenizer, seq_len=256, stride=256, samples=4)
    scores = score_model(model, calibration, model_name=alias, batch_size=2)
    reference = reference_scores(model, calibration.input_ids)

    def gap(got, want) -> float:
        return (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs().max().item()

    out = {field: gap(scores.column(field), reference[field]) for field in FIELDS}
    out["heads_q_similarity"] = gap(scores.heads["q_similarity"], reference["heads_q_similarity"])
    out["angular_distance"] = gap(scores.angular_distance, reference["angular_distance"])
    return out


def table(results: dict) -> str:
    """The docs table: one row per model, the largest absolute difference per field."""
    columns = (*FIELDS, "heads_q_similarity", "angular_distance")
    lines = ["| model | q_similarity | post-RoPE | lag-1 | block_influence | per-head | angular |",
             "|---|---|---|---|---|---|---|"]
    for alias, row in results["models"].items():
        lines.append(f"| {alias} | " + " | ".join(f"{row[c]:.1e}" for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    results = {"models": {alias: differences(alias) for alias in parser.parse_args().models.split(",")}}
    write_results("score_reference", results)
    print(table(results))


if __name__ == "__main__":
    main()
