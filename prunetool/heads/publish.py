"""The heads report folder: heads.json, kv_budget.json and report.html, published whole or not at all."""

import json
from pathlib import Path

from prunetool.errors import OptionError
from prunetool.heads.analysis import HeadsReport
from prunetool.surgery.output import staged_folder


def check_report_folder(output: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder without --force, before any slow work starts."""
    if output.exists() and not output.is_dir():
        raise OptionError(f"--output {output} exists and is not a folder; choose a folder name")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise OptionError(f"--output {output} exists and is not empty; choose another folder or pass --force to replace it")


def publish_report(output: Path, report: HeadsReport, force: bool) -> list[str]:
    """Write everything into a hidden sibling folder, then rename it into place; returns the files written."""
    from prunetool.heads.render import write_report

    check_report_folder(output, force)
    with staged_folder(output, force) as folder:
        files = ["heads.json"]
        (folder / "heads.json").write_text(json.dumps(report.data, indent=1) + "\n")
        if report.data.get("kv_budget"):
            (folder / "kv_budget.json").write_text(json.dumps(report.data["kv_budget"], indent=1) + "\n")
            files.append("kv_budget.json")
        files += write_report(folder, report.data, report.thumbnails)
    return files
