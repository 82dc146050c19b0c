"""Local copies of the standard evaluation sets -> the documents lm-eval's own task definitions expect.

Each loader reads one public release file from the data folder and returns a `datasets.DatasetDict`
whose records have the fields of the Hub dataset lm-eval normally downloads, so the task configs in
`tasks/` can keep lm-eval's prompts, targets and metrics unchanged. lm-eval calls the loaders through
`custom_dataset` with the task metadata as keyword arguments; `data_dir` arrives that way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import OptionError

DATA_DIR_ENV = "PRUNETOOL_DATA_DIR"


@dataclass(frozen=True)
class LocalTask:
    name: str
    files: tuple[str, ...]
    what: str  # which public release goes in the folder, for the error message


LOCAL_TASKS = {
    task.name: task
    for task in (
        LocalTask("wikitext", ("wikitext2-test.raw",), "the WikiText-2 raw test split (wiki.test.raw)"),
        LocalTask("lambada_openai", ("lambada_openai_test.jsonl",), "LAMBADA, OpenAI version, test split (jsonl, field text)"),
        LocalTask("arc_easy", ("ARC-Easy-Test.jsonl",), "AI2 ARC-Easy test split (ARC-V1 jsonl)"),
        LocalTask("arc_challenge", ("ARC-Challenge-Test.jsonl",), "AI2 ARC-Challenge test split (ARC-V1 jsonl)"),
        LocalTask("piqa", ("piqa_valid.jsonl", "piqa_valid-labels.lst"), "PIQA validation (valid.jsonl and valid-labels.lst)"),
        LocalTask("winogrande", ("winogrande_1.1_dev.jsonl",), "WinoGrande 1.1 dev split (dev.jsonl)"),
    )
}


def check_local_files(task: str, data_dir: Path) -> list[Path]:
    """The task's files in `data_dir`; a missing one is an error naming it and what belongs there."""
    spec = LOCAL_TASKS[task]
    paths = [Path(data_dir) / name for name in spec.files]
    for path in paths:
        if not path.is_file():
            raise OptionError(f"task {task} needs {path.resolve()}: put {spec.what} there, saved as {path.name}")
    return paths


def _dataset(split: str, records: list[dict]):
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(records)})


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def _is_page_heading(line: str) -> bool:
    """A top-level ` = Title = ` line: where one WikiText article ends and the next begins."""
    folded = line.replace("= = =", "===").replace("= =", "==").strip()
    return folded.startswith("= ") and folded.endswith(" =")


def wikitext_pages(text: str) -> list[str]:
    """Split the raw file into articles the way the document-level Hub copy lm-eval uses does (62 in test)."""
    pages, lines = [], []
    for line in text.split("\n"):
        if _is_page_heading(line) and "".join(lines).strip():
            pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    if "".join(lines).strip():
        pages.append("\n".join(lines))
    return pages


def wikitext(data_dir: str, **_):
    (path,) = check_local_files("wikitext", Path(data_dir))
    return _dataset("test", [{"page": page} for page in wikitext_pages(path.read_text(encoding="utf-8"))])


def lambada_openai(data_dir: str, **_):
    (path,) = check_local_files("lambada_openai", Path(data_dir))
    return _dataset("test", [{"text": record["text"]} for record in _jsonl(path)])


def _arc_record(record: dict) -> dict:
    """ARC-V1 jsonl nests choices as a list of {text, label}; the Hub copy has parallel lists."""
    choices = record["question"]["choices"]
    return {"id": record["id"], "question": record["question"]["stem"], "answerKey": record["answerKey"],
            "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]}}


def _arc(task: str, data_dir: str):
    (path,) = check_local_files(task, Path(data_dir))
    return _dataset("test", [_arc_record(record) for record in _jsonl(path)])


def arc_easy(data_dir: str, **_):
    return _arc("arc_easy", data_dir)


def arc_challenge(data_dir: str, **_):
    return _arc("arc_challenge", data_dir)


def piqa(data_dir: str, **_):
    questions, labels = check_local_files("piqa", Path(data_dir))
    records = _jsonl(questions)
    answers = [int(line) for line in labels.read_text().split()]
    if len(answers) != len(records):
        raise OptionError(f"{labels} has {len(answers)} labels for {len(records)} questions in {questions}")
    return _dataset("validation", [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": answer}
                                   for r, answer in zip(records, answers)])


def winogrande(data_dir: str, **_):
    (path,) = check_local_files("winogrande", Path(data_dir))
    fields = ("sentence", "option1", "option2", "answer")
    return _dataset("validation", [{key: str(record[key]) for key in fields} for record in _jsonl(path)])
