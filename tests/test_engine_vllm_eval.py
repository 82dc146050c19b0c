"""`prunetool eval --backend vllm` through vLLM's CPU build (`make engines`) scores as `--backend hf` does.

Without vllm in the project's venv, eval serves each folder with the engine venv's OpenAI-compatible server
and runs lm-eval's own `local-completions` model against it (log-likelihoods by echo + logprobs). The local
tasks run on tiny data files; a block cut and a nemotron-nas sublayer cut are scored by both backends and
must agree per task and metric, and the efficiency columns come from vLLM. Every vLLM start costs about a
minute on two busy cores, so the module starts as few as it can: one per folder, once.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.serving.engines import VLLM_VERSION
from test_eval import write_tiny_data
from test_prune_cli import assert_refused

pytestmark = pytest.mark.engines
runner = CliRunner()
TASKS = "wikitext,lambada_openai,arc_easy,arc_challenge,piqa,winogrande"
FOLDERS = ("llama-block", "qwen2-mixed")  # a block cut, and a nemotron-nas cut missing attention and MLPs
TOLERANCE = 0.01  # accuracies, bits per byte, and log-perplexities (mean log-likelihood per word or token)
EFFICIENCY = ("parameters", "kv_cache_bytes_per_token", "prefill_tokens_per_second", "decode_tokens_per_second",
              "peak_memory_bytes")


def evaluate(folders, data, backend: str, *extra: str) -> dict:
    result = runner.invoke(app, ["eval", *map(str, folders), "--tasks", TASKS, "--data-dir", str(data),
                                 "--limit", "6", "--backend", backend, "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def reports(engine_folder, vllm_engine, tmp_path_factory):
    data = write_tiny_data(tmp_path_factory.mktemp("eval-data"))
    folders = [engine_folder(name) for name in FOLDERS]
    return {backend: evaluate(folders, data, backend, *(("--device", "cpu") if backend == "hf" else ()))
            for backend in ("hf", "vllm")}


def assert_same_scores(hf: dict, vllm: dict, label: str) -> None:
    theirs = vllm["lm_eval"]["results"]
    for task, metrics in hf["lm_eval"]["results"].items():
        assert vllm["lm_eval"]["n-samples"][task] == hf["lm_eval"]["n-samples"][task]
        for metric, value in metrics.items():
            if "stderr" in metric or not isinstance(value, float):
                continue
            other = theirs[task][metric]
            if "perplexity" in metric:
                value, other = math.log(value), math.log(other)
            assert abs(value - other) <= TOLERANCE, (label, task, metric, value, other)


@pytest.mark.parametrize("name", FOLDERS)
def test_vllm_backend_scores_every_local_task_as_hf(name, reports):
    label = str(next(label for label in reports["hf"]["models"] if label.endswith(name)))
    assert_same_scores(reports["hf"]["models"][label], reports["vllm"]["models"][label], label)


def test_vllm_backend_reports_engine_workload_and_efficiency(reports):
    hf, vllm = reports["hf"], reports["vllm"]
    assert vllm["prunetool"]["backend"] == "vllm"
    engine = vllm["prunetool"]["vllm"]
    assert engine["mode"] == "server" and engine["version"] == VLLM_VERSION
    assert "512 random prompt tokens" in engine["efficiency_workload"]
    for label, entry in vllm["models"].items():
        backend = entry["backend"]
        assert backend["vllm_version"] == VLLM_VERSION and backend["lm_eval_model"] == "local-completions"
        assert backend["server"]["prefix_caching"] is False and backend["server"]["kv_cache_space_gib"] > 0
        served, measured = entry["efficiency"], hf["models"][label]["efficiency"]
        assert all(served[key] > 0 for key in EFFICIENCY), served
        assert served["setting"]["engine"] == f"vLLM {VLLM_VERSION}" and served["setting"]["batch"] == 1
        # parameters and KV bytes come from the folder's config with the hf backend's own formulas
        for key in ("parameters", "kv_cache_bytes_per_token"):
            assert served[key] == measured[key], (label, key)
    cut = vllm["models"][next(label for label in vllm["models"] if label.endswith("qwen2-mixed"))]["efficiency"]
    assert cut["kv_cache_bytes_per_token"] == 4 * 2 * 2 * 64 * 4  # 4 of 6 attention sublayers, 2 KV heads x 64


def test_a_folder_vllm_cannot_load_is_one_line_naming_vllm(engine_folder, vllm_engine, tmp_path):
    folder = tmp_path / "unknown-architecture"
    folder.mkdir()
    source = engine_folder("llama-block")
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["PrunetoolUnknownForCausalLM"]}))
    data = write_tiny_data(tmp_path / "data", n=2)
    result = runner.invoke(app, ["eval", str(folder), "--tasks", "arc_easy", "--data-dir", str(data), "--backend",
                                 "vllm"])
    assert_refused(result, "vLLM", str(folder), "PrunetoolUnknownForCausalLM")
