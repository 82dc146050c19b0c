"""heads.json -> the markdown tables in docs/heads.md (pattern mix per layer, correlations, periods, sensitivity).

    .venv/bin/prunetool heads smollm2-135m --calib ../shared/data/wikitext2-test.raw --kv-budget 128 --output-dir out
    .venv/bin/python bench/heads_markdown.py out/heads.json
"""

import argparse
import json
from collections import Counter

from prunetool.heads.patterns import PATTERNS, name_pattern


def fmt(value, digits=3):
    return "—" if value is None else f"{value:.{digits}f}"


def mix_table(data: dict) -> list[str]:
    budgets = {row["index"]: row["budget"] for row in data["kv_budget"]["layers"]} if data.get("kv_budget") else {}
    lines = ["| layer | re-access | sequential | seasonal | retrieval | q-sim pre | q-sim post | positional | symbolic | mixed |"
             + (" KV budget |" if budgets else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if budgets else "")]
    for layer in data["layers"]:
        counts, swap = layer["patterns"], layer["swap"]
        cells = [layer["index"], *(counts[kind] for kind in PATTERNS), fmt(layer["q_similarity"]),
                 fmt(layer["q_similarity_post_rope"]), *(swap.get(label, 0) for label in ("positional", "symbolic", "mixed"))]
        if budgets:
            cells.append(budgets[layer["index"]])
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    total = Counter()
    for layer in data["layers"]:
        total.update(layer["patterns"])
    lines.append("| all | " + " | ".join(str(total[kind]) for kind in PATTERNS) + " | | | | | |" + (" |" if budgets else ""))
    return lines


def correlation_table(data: dict) -> list[str]:
    c = data["correlation"]
    lines = ["| over heads | pre-RoPE q-sim | post-RoPE q-sim |", "|---|---:|---:|",
             f"| Pearson vs predictable (not retrieval) | {fmt(c['pre_rope']['pearson_vs_predictable'])} | "
             f"{fmt(c['post_rope']['pearson_vs_predictable'])} |",
             f"| Spearman vs structure share | {fmt(c['pre_rope']['spearman_vs_structure'])} | "
             f"{fmt(c['post_rope']['spearman_vs_structure'])} |"]
    for kind in PATTERNS:
        lines.append(f"| mean q-sim of {kind} heads | {fmt(c['pre_rope']['mean_by_type'][kind])} | "
                     f"{fmt(c['post_rope']['mean_by_type'][kind])} |")
    lines.append(f"| per layer: Pearson vs predictable share | {fmt(c['layers']['pearson_q_similarity_vs_predictable_share'])} | "
                 f"{fmt(c['layers']['pearson_post_rope_vs_predictable_share'])} |")
    return lines


def seasonal_table(data: dict, rows: int = 12) -> list[str]:
    lines = ["| layer | head | seasonal share | named seasonal | measured period | predicted period (channel) | ratio |",
             "|---:|---:|---:|---|---:|---:|---:|"]
    for row in data["seasonal"][:rows]:
        lines.append(f"| {row['layer']} | {row['head']} | {fmt(row['seasonal'])} | {'yes' if row['classified_seasonal'] else 'no'} | "
                     f"{fmt(row['measured_period'], 2)} | {fmt(row['predicted_period'], 2)} ({row['channel']}) | {fmt(row['ratio'])} |")
    return lines


def sensitivity(data: dict) -> list[str]:
    lines = ["| threshold | " + " | ".join(PATTERNS) + " |", "|---:|" + "---:|" * len(PATTERNS)]
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):
        counts = Counter()
        for head in data["heads"]:
            p = head["pattern"]
            counts[name_pattern(p["re_access"], p["sequential"], p["seasonal"], threshold)] += 1
        lines.append(f"| {threshold} | " + " | ".join(str(counts[kind]) for kind in PATTERNS) + " |")
    return lines


def type_by_swap(data: dict) -> list[str]:
    labels = ("positional", "symbolic", "mixed", "untested")
    lines = ["| type | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for kind in PATTERNS:
        counts = Counter(head["swap"]["label"] for head in data["heads"] if head["type"] == kind)
        lines.append(f"| {kind} | " + " | ".join(str(counts[label]) for label in labels) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads_json")
    data = json.loads(open(parser.parse_args().heads_json).read())
    for title, lines in (("pattern mix per layer", mix_table(data)), ("correlation", correlation_table(data)),
                         ("seasonal combs", seasonal_table(data)),
                         ("pattern type by swap-test label", type_by_swap(data)), ("threshold sensitivity", sensitivity(data))):
        print(f"### {title}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
