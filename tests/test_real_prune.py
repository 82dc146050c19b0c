"""Acceptance of `prunetool prune` on the two real checkpoints (slow): the written folder equals an
independent in-memory prune in config, tensor bytes, logits and cached generation."""

import hashlib
import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.sources import resolve_model
from tests.test_surgery import greedy, prune_in_memory, raw_bytes, tensor_files

pytestmark = pytest.mark.slow
LAYER_KEY = re.compile(r"^(model\.layers\.)(\d+)(\..+)$")


def fingerprint(folder):
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in folder.iterdir()
            if p.is_file()}


@pytest.mark.parametrize("alias,layers", [("smollm2-135m", (3, 12, 13, 20, 27)), ("gemma3-270m", (5, 8, 9, 16))])
def test_real_prune_equals_in_memory_prune(alias, layers, shared_data, tmp_path):
    source = resolve_model(alias).path
    before = fingerprint(source)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "prune", alias, "--layers", ",".join(map(str, layers)), "--output", str(out), "--json",
        "--calib", str(shared_data / "wikitext2-test.raw"), "--seq-len", "128", "--samples", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["verification"]["cached_generation_matches"]

    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    num_layers = reference.config.num_hidden_layers
    prune_in_memory(reference, layers)
    kept = [i for i in range(num_layers) if i not in layers]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == len(kept)
    assert config.get("layer_types") == getattr(reference.config, "layer_types", None)

    new_to_old = {new: old for new, old in enumerate(kept)}
    source_files, written_files = tensor_files(source), tensor_files(out)
    assert len(written_files) == len(source_files) - sum(
        1 for name in source_files if (m := LAYER_KEY.match(name)) and int(m.group(2)) in layers)
    for name, path in written_files.items():
        match = LAYER_KEY.match(name)
        old = f"{match.group(1)}{new_to_old[int(match.group(2))]}{match.group(3)}" if match else name
        with safe_open(path, "pt") as new_file, safe_open(source_files[old], "pt") as old_file:
            got, want = new_file.get_tensor(name), old_file.get_tensor(old)
        assert got.dtype == want.dtype and raw_bytes(got) == raw_bytes(want), name

    written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(out)("The old lighthouse keeper said", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(written(ids).logits, reference(ids).logits)
    cached, uncached = greedy(written, ids)
    assert cached == uncached == greedy(reference, ids)[0]
    assert fingerprint(source) == before
