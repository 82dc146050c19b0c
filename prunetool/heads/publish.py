"""The heads report folder: heads.json, kv_budget.json and report.html, published whole or not at all."""

import json
from pathlib import Path

from prunetool.heads.analysis import HeadsReport
from prunetool.checkpoint_io import check_free_folder, staged_folder


def publish_report(output: Path, report: HeadsReport, force: bool) -> list[str]:
    """Write everything into a hidden sibling folder, then rename it into place; returns the files written."""
    from prunetool.heads.render import write_report

    check_free_folder(output, force)
    with staged_folder(output, force) as folder:
        files = ["heads.json"]
        (folder / "heads.json").write_text(json.dumps(report.data, indent=1) + "\n")
        if report.data.get("kv_budget"):
            (folder / "kv_budget.json").write_text(json.dumps(report.data["kv_budget"], indent=1) + "\n")
            files.append("kv_budget.json")
        files += write_report(folder, report.data, report.thumbnails)
    return files
