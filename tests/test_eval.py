"""`prunetool eval`: real lm-eval on tiny real checkpoints and tiny local data files, hop probes, refusals."""

from __future__ import annotations

import json
import random
import re
import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from eval_reference import arc_accuracy, lambada_accuracy, read_arc, read_lambada
from prunetool.cli import app
from prunetool.errors import OptionError
from prunetool.evaluation import hop
from prunetool.evaluation.local_data import LOCAL_TASKS, arc_easy, piqa, wikitext_pages
from prunetool.output.report import eval_rows

runner = CliRunner()
WORDS = "river stone lamp winter harbour garden letter window candle market bridge thunder".split()


def write_tiny_data(folder, n: int = 6):
    """Every local task's files in the release formats, `n` records each, deterministic."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)

    def sentence(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    pages = [f" = Title {i} = \n\n {sentence(30)} . \n\n = = Part = = \n\n {sentence(20)} \n" for i in range(n)]
    (folder / "wikitext2-test.raw").write_text("\n" + "".join(pages))
    with (folder / "lambada_openai_test.jsonl").open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": sentence(12)}) + "\n")
    for name in ("ARC-Easy", "ARC-Challenge"):
        with (folder / f"{name}-Test.jsonl").open("w") as f:
            for i in range(n):
                labels = ["A", "B", "C", "D"] if i % 2 else ["1", "2", "3"]
                choices = [{"text": sentence(2), "label": label} for label in labels]
                f.write(json.dumps({"id": f"q{i}", "question": {"stem": sentence(6) + "?", "choices": choices},
                                    "answerKey": labels[i % len(labels)]}) + "\n")
    with (folder / "piqa_valid.jsonl").open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": str(i), "goal": sentence(5), "sol1": sentence(3), "sol2": sentence(4)}) + "\n")
    (folder / "piqa_valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(n)))
    with (folder / "winogrande_1.1_dev.jsonl").open("w") as f:
        for i in range(n):
            f.write(json.dumps({"qID": str(i), "sentence": f"{sentence(4)} _ {sentence(3)}.", "option1": "lamp",
                                "option2": "river", "answer": str(1 + i % 2)}) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return write_tiny_data(tmp_path_factory.mktemp("eval-data"))


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(" ".join(WORDS) * 40)
    return path


FAST_CALIB = ["--seq-len", "16", "--samples", "3"]


def assert_refused(result, *words):
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


# ------------------------------------------------------------------ local data -> lm-eval's record layout


def test_wikitext_pages_split_at_top_level_headings():
    text = "\n = A = \n\n one two \n\n = = Sub = = \n\n three \n = B = \n\n four \n"
    pages = wikitext_pages(text)
    assert len(pages) == 2
    assert pages[0].startswith("\n = A = ") and "= = Sub = =" in pages[0] and "three" in pages[0]
    assert pages[1].startswith(" = B = ") and "four" in pages[1]


def test_arc_records_take_the_hub_layout(tiny_data):
    record = arc_easy(str(tiny_data))["test"][1]
    assert set(record) == {"id", "question", "answerKey", "choices"}
    assert record["choices"]["label"] == ["A", "B", "C", "D"] and len(record["choices"]["text"]) == 4
    assert record["question"].endswith("?")


def test_piqa_label_count_must_match(tmp_path, tiny_data):
    broken = write_tiny_data(tmp_path / "d")
    (broken / "piqa_valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(OptionError, match="2 labels for 6 questions"):
        piqa(str(broken))
    assert piqa(str(tiny_data))["validation"]["label"] == [0, 1, 0, 1, 0, 1]


def test_every_local_task_has_a_shipped_config():
    from prunetool.evaluation.tasks import TASKS_DIR

    assert {path.stem for path in TASKS_DIR.glob("*.yaml")} == set(LOCAL_TASKS)


# ------------------------------------------------------------------ hop probes


def test_hop_documents_are_deterministic_and_answer_what_they_ask():
    for kind in hop.KINDS:
        first, again = hop.make_documents(kind, 64, 20), hop.make_documents(kind, 64, 20)
        assert first == again and len({doc["prompt"] for doc in first}) == 20
        assert hop.make_documents(kind, 64, 5, seed=7) != first[:5]
    for doc in hop.make_documents("hop_number", 64, 50):
        question = doc["prompt"].split("\n\n")[-1]
        row, back = re.fullmatch(r"((?:[A-Z] )+)\| (\d) back:", question).groups()
        letters = row.split()
        assert len(letters) == 64
        k = int(back)
        assert letters[-k] == hop.LETTERS[doc["answer"]]
        assert all(letters[i] != letters[-k] for i in (-k - 1, -k + 1) if -len(letters) <= i < 0)
        for shot in doc["prompt"].split("\n\n")[:-1]:
            assert f"| {k} back:" in shot  # the worked examples ask the same offset
    for doc in hop.make_documents("hop_name", 256, 50):
        question = doc["prompt"].split("\n\n")[-1]
        items, asked = re.fullmatch(r"Items: (.*)\n([A-Z])-", question).groups()
        pairs = [item.split("-") for item in items.split() if "-" in item]
        assert len(items.split()) == 256 and len(pairs) == hop.PAIRS
        capitals = [c for pair in pairs for c in pair]
        assert len(set(capitals)) == len(capitals)
        assert dict(pairs)[asked] == hop.LETTERS[doc["answer"]]


def test_hop_names_expand_and_parse():
    assert hop.expand("hop_name") == [f"hop_name_{n}" for n in hop.LENGTHS]
    assert len(hop.expand("hop")) == 2 * len(hop.LENGTHS)
    assert hop.expand("hop_number_512") == ["hop_number_512"]
    assert hop.expand("hop_number_x") == [] and hop.parse_task_name("arc_easy") is None


# ------------------------------------------------------------------ lm-eval for real on a tiny model


def test_eval_runs_lm_eval_on_local_files_and_matches_an_independent_reference(tiny_checkpoint, tiny_data, tmp_path,
                                                                                calib_file):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "r.json"
    tasks = "wikitext,lambada_openai,arc_easy,arc_challenge,piqa,winogrande,hop_name_16,heldout_ppl"
    result = runner.invoke(app, ["eval", str(model_dir), "--tasks", tasks, "--data-dir", str(tiny_data), "--limit", "4",
                                 "--calib", str(calib_file), *FAST_CALIB, "--output", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["prunetool"]["limit"] == 4 and report["prunetool"]["data_dir"] == str(tiny_data.resolve())
    (entry,) = report["models"].values()
    lm = entry["lm_eval"]
    assert set(lm) >= {"results", "versions", "n-samples", "configs"}
    for task in ("wikitext", "lambada_openai", "arc_easy", "arc_challenge", "piqa", "winogrande"):
        assert lm["n-samples"][task]["effective"] == 4
    assert lm["n-samples"]["wikitext"]["original"] == 6 and lm["n-samples"]["hop_name_16"]["effective"] == 4
    results = lm["results"]
    assert results["wikitext"]["word_perplexity,none"] > 1 and "bits_per_byte,none" in results["wikitext"]
    assert {"acc,none", "perplexity,none"} <= set(results["lambada_openai"])
    assert {"acc,none", "acc_norm,none"} <= set(results["piqa"])
    assert entry["heldout_ppl"]["windows"] == 4 and entry["heldout_ppl"]["perplexity"] > 1
    # the same documents scored without lm-eval or prunetool: the task wiring, not the harness, is under test
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert results["lambada_openai"]["acc,none"] == pytest.approx(
        lambada_accuracy(model, tokenizer, read_lambada(tiny_data, 4)))
    assert results["arc_easy"]["acc,none"] == pytest.approx(arc_accuracy(model, tokenizer, read_arc(tiny_data, 4)))
    # people get a table on stdout; lm-eval's own prints and bars stay off it
    assert "arc_easy" in result.stdout and "bootstrapping" not in result.stdout
    rows = {(task, metric) for task, metric, _, _ in eval_rows(report)}
    assert ("heldout_ppl", "perplexity") in rows and ("hop_name_16", "acc") in rows


def test_eval_with_no_model_compares_the_pruned_model_with_its_base(tiny_checkpoint, tiny_data, tmp_path, calib_file):
    source = tiny_checkpoint("qwen3")
    assert runner.invoke(app, ["score", str(source), "--calib", str(calib_file), *FAST_CALIB]).exit_code == 0
    pruned = tmp_path / "pruned"
    assert runner.invoke(app, ["prune", "--drop", "2", "--output", str(pruned)]).exit_code == 0
    result = runner.invoke(app, ["eval", "--tasks", "arc_easy,heldout_ppl", "--data-dir", str(tiny_data),
                                 "--limit", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["models"]) == ["base", "pruned"]
    assert report["models"]["pruned"]["path"] == str(pruned.resolve())
    assert len(report["prunetool"]["pruning"]["removed"]) == 2
    base, after = (report["models"][label]["heldout_ppl"] for label in ("base", "pruned"))
    assert base["text"] == after["text"] and base["perplexity"] != after["perplexity"]
    # held-out perplexity uses the windows prune held out, so it equals what prune recorded
    record = json.loads((pruned / "prune.json").read_text())
    assert after["perplexity"] == pytest.approx(record["perplexity"]["after"], rel=1e-4)
    assert base["perplexity"] == pytest.approx(record["perplexity"]["before"], rel=1e-4)


# ------------------------------------------------------------------ refusals, before any model is loaded


def test_unknown_task_is_refused(tiny_checkpoint, tiny_data):
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--tasks", "arc_easy,no_such_task",
                                 "--data-dir", str(tiny_data)])
    assert_refused(result, "unknown task", "no_such_task")


def test_missing_data_dir_and_missing_file_are_named(tiny_checkpoint, tiny_data, tmp_path):
    model = str(tiny_checkpoint("llama"))
    assert_refused(runner.invoke(app, ["eval", model, "--data-dir", str(tmp_path / "nope")]), "--data-dir", "nope")
    partial = write_tiny_data(tmp_path / "partial")
    (partial / "piqa_valid-labels.lst").unlink()
    assert_refused(runner.invoke(app, ["eval", model, "--tasks", "piqa", "--data-dir", str(partial)]),
                   "piqa_valid-labels.lst", "PIQA")


def test_local_task_without_data_offline_is_refused(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("PRUNETOOL_DATA_DIR", raising=False)
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--tasks", "lambada_openai"])
    assert_refused(result, "lambada_openai", "--data-dir", "HF_HUB_OFFLINE")


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path, tiny_data):
    from transformers import BertConfig, BertForMaskedLM

    folder = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForMaskedLM(config).save_pretrained(folder)
    result = runner.invoke(app, ["eval", str(folder), "--tasks", "arc_easy", "--data-dir", str(tiny_data)])
    assert_refused(result, "encoder-only", "causal LM")


@pytest.mark.parametrize("options, words", [
    (["--limit", "0"], ["--limit"]),
    (["--batch-size", "many"], ["--batch-size"]),
    (["--num-fewshot", "-1"], ["--num-fewshot"]),
    (["--tasks", " , "], ["--tasks"]),
    (["--max-length", "4"], ["--max-length"]),
])
def test_bad_options_are_refused(tiny_checkpoint, tiny_data, options, words):
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--data-dir", str(tiny_data), *options])
    assert_refused(result, *words)


def test_output_that_is_a_folder_is_refused(tiny_checkpoint, tiny_data, tmp_path):
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--data-dir", str(tiny_data),
                                 "--output", str(tmp_path)])
    assert_refused(result, "--output", "folder")


def test_no_pruned_model_in_the_current_run_is_refused(tiny_checkpoint, calib_file, tiny_data):
    assert runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--calib", str(calib_file),
                               *FAST_CALIB]).exit_code == 0
    assert_refused(runner.invoke(app, ["eval", "--data-dir", str(tiny_data)]), "no pruned model", "prunetool prune")


# ------------------------------------------------------------------ the shipped configs are lm-eval's own


BUNDLED = {"wikitext": "wikitext/wikitext.yaml", "lambada_openai": "lambada/lambada_openai.yaml",
           "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
           "winogrande": "winogrande/default.yaml"}
SAME = ("task", "output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_results", "metric_list",
        "metadata")


@pytest.mark.parametrize("task", sorted(BUNDLED))
def test_local_configs_keep_lm_evals_prompts_targets_metrics_and_versions(task):
    """Only the data source may differ from the definitions lm-eval ships; !function names resolve to its code."""
    from pathlib import Path

    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from prunetool.evaluation.tasks import TASKS_DIR

    ours = load_yaml(TASKS_DIR / f"{task}.yaml", resolve_func=True)
    theirs = load_yaml(Path(lm_eval.tasks.__file__).parent / BUNDLED[task], resolve_func=True)
    for key in SAME:
        mine, reference = ours.get(key), theirs.get(key)
        if callable(reference):
            same_code = (mine.__code__.co_filename, mine.__qualname__, mine.__code__.co_code)
            assert same_code == (reference.__code__.co_filename, reference.__qualname__, reference.__code__.co_code), key
        else:
            assert mine == reference, key
    assert callable(ours["custom_dataset"])
    split = "test" if theirs.get("test_split") else "validation"
    assert ours.get(f"{split}_split") == theirs.get(f"{split}_split")
