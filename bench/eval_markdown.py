"""Render `prunetool eval --output-file` files as the Markdown tables in docs/evaluation.md.

    python bench/eval_markdown.py side.json            # task x metric table, one column per model
    python bench/eval_markdown.py hop.json --hop       # hop-probe accuracy against length
"""

import argparse
import json

from prunetool.evaluation.hop import parse_task_name
from prunetool.output.report import eval_rows


def number(value, stderr=None) -> str:
    text = f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return text + (f" ± {stderr:.4f}" if stderr else "")


def metrics_table(report: dict) -> str:
    labels = list(report["models"])
    lines = ["| task | metric | " + " | ".join(labels) + (" | change |" if len(labels) == 2 else " |"),
             "|---|---|" + "---:|" * (len(labels) + (len(labels) == 2))]
    for task, metric, higher, values in eval_rows(report):
        if parse_task_name(task):
            continue
        arrow = {True: " ↑", False: " ↓"}.get(higher, "")
        cells = [number(*values[label]) if label in values else "—" for label in labels]
        if len(labels) == 2 and all(label in values for label in labels):
            cells.append(f"{values[labels[1]][0] - values[labels[0]][0]:+.4g}")
        lines.append(f"| {task} | {metric}{arrow} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hop_table(report: dict) -> str:
    cells, lengths = {}, set()
    for label, entry in report["models"].items():
        for task, metrics in entry["lm_eval"]["results"].items():
            parsed = parse_task_name(task)
            if parsed:
                cells.setdefault((parsed[0], label), {})[parsed[1]] = (metrics["acc,none"], metrics.get("acc_stderr,none"))
                lengths.add(parsed[1])
    order = sorted(lengths)
    lines = ["| probe | model | " + " | ".join(str(n) for n in order) + " |", "|---|---|" + "---:|" * len(order)]
    for (kind, label), row in sorted(cells.items(), key=lambda item: (item[0][0], list(report["models"]).index(item[0][1]))):
        lines.append(f"| {kind} | {label} | " + " | ".join(number(*row[n]) if n in row else "—" for n in order) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--hop", action="store_true", help="the hop-probe table instead of the metrics table")
    args = parser.parse_args()
    report = json.loads(open(args.report).read())
    info = report["prunetool"]
    print(hop_table(report) if args.hop else metrics_table(report))
    print(f"\n(limit {info['limit']}, data {info['data_dir']}, {info['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
