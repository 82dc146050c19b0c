"""Evaluation backends: `eval --backend vllm` is refused cleanly without vllm (neither in this venv nor in the
engine venv of `make engines`; tests/test_engine_vllm_eval.py runs it), passes its parallel sizes through,
and pruned checkpoints keep the config fields vLLM reads (checked without running vLLM)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from transformers import AutoConfig
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.evaluation.runner import vllm_arguments
from test_heal import prune_tiny  # noqa: F401  (fixture helpers shared with the heal tests)
from test_heal import calib_file  # noqa: F401
from test_prune_cli import assert_refused

runner = CliRunner()

# The architecture names vLLM registers for these model types (vllm/model_executor/models/registry.py).
VLLM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def vllm_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(not vllm_missing(), reason="vllm is installed here: the refusal only applies without it")
def test_backend_vllm_without_vllm_is_one_line(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNETOOL_ENGINES", str(tmp_path / "no-engines"))  # nor vLLM's CPU build (make engines)
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--backend", "vllm", "--tasks", "arc_easy"])
    assert_refused(result, "--backend vllm", "make engines", "pip install vllm")


@pytest.mark.parametrize("options, words", [
    (["--backend", "tgi"], ["--backend", "hf, vllm"]),
    (["--tensor-parallel", "0"], ["--tensor-parallel"]),
    (["--tensor-parallel", "2"], ["--tensor-parallel", "--backend vllm"]),
    (["--data-parallel", "4"], ["--data-parallel", "accelerate launch"]),
])
def test_bad_backend_options_are_refused(tiny_checkpoint, options, words):
    result = runner.invoke(app, ["eval", str(tiny_checkpoint("llama")), "--tasks", "arc_easy", *options])
    assert_refused(result, *words)


def test_vllm_arguments_carry_the_parallel_sizes_and_the_checkpoint_folder():
    arguments = vllm_arguments("/m/pruned", dtype="bfloat16", tensor_parallel=4, data_parallel=2, batch_size="16",
                               max_length=2048, trust_remote_code=False)
    assert arguments == {"pretrained": "/m/pruned", "dtype": "bfloat16", "tensor_parallel_size": 4,
                         "data_parallel_size": 2, "batch_size": 16, "trust_remote_code": False,
                         "max_model_len": 2048}
    auto = vllm_arguments("/m", dtype="auto", tensor_parallel=1, data_parallel=1, batch_size="auto",
                          max_length=None, trust_remote_code=True)
    assert auto["batch_size"] == "auto" and "max_model_len" not in auto and auto["dtype"] == "auto"


def layer_indices(folder) -> set[int]:
    found = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if "layers" in parts:
                    found.add(int(parts[parts.index("layers") + 1]))
    return found


def tensor_names(folder) -> set[str]:
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("arch", list(VLLM_ARCHITECTURES))
def test_pruned_config_keeps_what_vllm_reads(arch, tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    """vLLM builds layers 0..num_hidden_layers-1 from the config, picks each one's attention kind from
    layer_types (Gemma 3, Qwen2) or max_window_layers (older Qwen2 code), and loads weights by name."""
    base_folder = tiny_checkpoint(arch)
    out = prune_tiny(tiny_checkpoint, arch, calib_file, tmp_path / "pruned", layers="1,2")
    base, pruned = (json.loads((f / "config.json").read_text()) for f in (base_folder, out))
    kept = [i for i in range(base["num_hidden_layers"]) if i not in (1, 2)]
    assert pruned["architectures"] == [VLLM_ARCHITECTURES[arch]]
    assert pruned["num_hidden_layers"] == len(kept) == 4
    assert layer_indices(out) == set(range(len(kept)))  # renumbered without gaps: vLLM maps names to layers
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "max_position_embeddings", "sliding_window", "tie_word_embeddings", "rms_norm_eps"):
        assert pruned.get(field) == base.get(field), field
    if base.get("layer_types") is not None:
        assert pruned["layer_types"] == [base["layer_types"][i] for i in kept]
    if "max_window_layers" in base:  # layers at or above it slide: the count of kept layers below the old value
        assert pruned["max_window_layers"] == sum(i < base["max_window_layers"] for i in kept)
    if not pruned.get("tie_word_embeddings", True):
        assert "lm_head.weight" in tensor_names(out)
    config = AutoConfig.from_pretrained(out)  # what vLLM itself parses the folder with
    assert config.num_hidden_layers == len(kept)
    assert len(getattr(config, "layer_types", None) or kept) == len(kept)
