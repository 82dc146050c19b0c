"""How well does each per-layer signal predict what removing that layer costs?

For every layer, the calibration perplexity with that layer alone removed (the first 4 C4 calibration
windows, never WikiText), against each signal in the scores: Spearman rank correlation over layers.
A removal criterion wants a signal whose order matches this cost (low signal = cheap to remove), so
signals where high means "predictable" (q-similarity) are reported negated.

Run: .venv/bin/python bench/layer_signals.py   (needs bench/results/quality.json from bench/quality.py)
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import DATA, MAIN_CALIBRATION, RESULTS, SAMPLES, SEQ_LEN, load_results, save_results, spearman  # noqa: E402

WINDOWS = 4


def signals(scores: dict) -> dict[str, list[float]]:
    layers = scores["layers"]
    heads = {name: torch.tensor(rows, dtype=torch.float64) for name, rows in scores["heads"].items()}
    out = {
        "block influence": [l["block_influence"] for l in layers],
        "-qsim (pre-RoPE, mean over heads)": [-l["q_similarity"] for l in layers],
        "-qsim (post-RoPE)": [-l["q_similarity_post_rope"] for l in layers],
        "-qsim lag 1": [-l["q_similarity_lag1"] for l in layers],
        "-qsim, least similar head": (-heads["q_similarity"].min(1).values).tolist(),
        "-qsim, most similar head": (-heads["q_similarity"].max(1).values).tolist(),
        "qsim spread over heads (std)": heads["q_similarity"].std(1).tolist(),
    }
    angular = scores["angular_distance"]
    out["angular distance, one layer"] = [angular[i][i + 1] for i in range(len(layers))]
    return out


def main() -> None:
    from prunetool.calibration import load_calibration
    from prunetool.in_memory import layers_removed
    from prunetool.loading import load_model
    from prunetool.perplexity import perplexity
    from prunetool.sources import resolve_model

    results = load_results()
    for alias, entry in results.items():
        if "single_layer_ppl" not in entry:
            source = resolve_model(alias)
            model, tokenizer = load_model(source, dtype="float32", device="cpu")
            calibration = load_calibration(str(DATA / "c4_en_sample_1000.jsonl"), tokenizer, seq_len=SEQ_LEN,
                                           samples=SAMPLES)
            windows = calibration.input_ids[:WINDOWS]
            costs = []
            for layer in range(len(entry["scores"][MAIN_CALIBRATION]["layers"])):
                with layers_removed(model, [layer]):
                    costs.append(perplexity(model, windows))
                print(f"{alias} layer {layer}: {costs[-1]:.2f}", file=sys.stderr, flush=True)
            entry["single_layer_ppl"] = {"windows": WINDOWS, "base": perplexity(model, windows), "ppl": costs}
            save_results(results)
        cost = entry["single_layer_ppl"]["ppl"]
        print(f"\n{alias}: Spearman of each signal with the C4 perplexity after removing that layer alone")
        print("| signal | all layers | without first and last |")
        print("|---|---|---|")
        for name, values in signals(entry["scores"][MAIN_CALIBRATION]).items():
            inner = slice(1, len(values) - 1)
            print(f"| {name} | {spearman(values, cost):+.2f} | {spearman(values[inner], cost[inner]):+.2f} |")


if __name__ == "__main__":
    main()
