"""`prunetool export --gguf` checked against llama.cpp and transformers on the same tokens.

Every folder kind prune writes (block cuts of each family, nemotron-nas attention, MLP and mixed cuts) is
exported and run in llama.cpp (its Python bindings, all-token logits, float32 KV cache); its next-token
log-probabilities must equal transformers' float32 ones within conversion error, and `llama-perplexity`
must agree with transformers on the windows it scores. llama.cpp's own converter is the second
reference for what the file holds. Refusals and atomic writes need no engine and run everywhere.

Measured on this machine's CPU build (max |difference| of log-softmax over all positions and vocabulary):
f32 <= 5.7e-6 for llama, mistral, qwen2, qwen3 and deci; Gemma 3 f32 <= 1.7e-3, because llama.cpp's CPU
GELU looks its result up in a float16 table; f16 <= 7.2e-3, bf16 <= 5.4e-2, q8_0 <= 1.7e-1.
llama-perplexity against transformers: relative gap <= 1.3e-7, Gemma 3 <= 3.8e-5; SmolLM2 cuts <= 1.1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine_models import FOLDERS, LAYERS, MORE_FOLDERS, SIZES, wikitext_prefix
from prunetool.cli import app
from prunetool.checkpoint.gguf import export_gguf
from prunetool.serving.llamacpp_tokens import (WORKER, llama_tokenize, llamacpp_logits, log_softmax, max_logprob_gap,
                                               perplexity_pair)

TESTS = Path(__file__).resolve().parent
TINY_FOLDERS = [*FOLDERS, *MORE_FOLDERS]
# Longer than Gemma 3's 16-token test window, so sliding and full layers compute different things.
PROMPTS = [
    "The people of the village went fishing every morning and came back in the evening with baskets of fish, "
    "while the children built castles of sand on the beach.",
    "Question: Which planet is known as the red planet? Answer: Mars is known as the red planet, and the first "
    "prime numbers are two, three, five and seven.",
    "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i, add(i, i))\n",
]
# Bounds on max |log-prob difference| over every position and vocabulary entry, about 3x what was measured.
F32_BOUND = 2e-5
GEMMA3_F32_BOUND = 5e-3  # llama.cpp's CPU GELU rounds through a float16 table
TYPE_BOUND = {"f16": 2e-2, "bf16": 0.15, "q8_0": 0.5}
runner = CliRunner()


def is_nemotron(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text())["model_type"] == "nemotron-nas"


def expected_architecture(folder: Path) -> str:
    """llama.cpp's graph for a folder: Qwen2 whose heads do not fill hidden_size goes to llama's (see layout.py)."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    kind = {"nemotron-nas": "deci", "gemma3_text": "gemma3", "mistral": "llama"}.get(text["model_type"],
                                                                                  text["model_type"])
    if kind == "qwen2" and text["num_attention_heads"] * text["head_dim"] != text["hidden_size"]:
        return "llama"
    return kind


def f32_bound(name: str) -> float:
    return GEMMA3_F32_BOUND if name.startswith("gemma3") else F32_BOUND


# ------------------------------------------------------------------------------------------------
# References: transformers in float32, and llama.cpp in a subprocess


def load_transformers(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trust = is_nemotron(folder)  # the folder's own modeling code (prunetool's)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def transformers_reference(engine_folder):
    """name -> (token ids of PROMPTS, float64 log-probabilities at every position), from transformers."""
    cache: dict[str, tuple] = {}

    def reference(name: str):
        if name not in cache:
            model, tokenizer = load_transformers(engine_folder(name))
            ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
            with torch.no_grad():
                logprobs = [log_softmax(model(torch.tensor([seq])).logits[0]) for seq in ids]
            cache[name] = (ids, logprobs)
        return cache[name]

    return reference


@pytest.fixture(scope="session")
def exported(engine_folder, tmp_path_factory):
    """(name, type) -> (GGUF path, ExportResult), each exported once."""
    out = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple, tuple] = {}

    def export(name: str, type_name: str = "f32"):
        if (name, type_name) not in cache:
            path = out / f"{name}.{type_name}.gguf"
            cache[name, type_name] = (path, export_gguf(engine_folder(name), path, type_name))
        return cache[name, type_name]

    return export


@pytest.fixture(scope="session")
def llamacpp_logprobs(llamacpp_engine, exported, transformers_reference, tmp_path_factory):
    """name -> {type: (llama.cpp token ids of PROMPTS, log-probabilities)} for f32, f16, bf16, q8_0 in one run."""
    cache: dict[str, dict] = {}
    types = ["f32", *TYPE_BOUND]

    def run(name: str) -> dict:
        if name not in cache:
            ids, _ = transformers_reference(name)
            paths = [exported(name, type_name)[0] for type_name in types]
            data = llamacpp_logits(llamacpp_engine, paths, ids, PROMPTS)
            cache[name] = {type_name: ([data[f"tokens_{m}_{j}"].tolist() for j in range(len(PROMPTS))],
                                       [log_softmax(data[f"logits_{m}_{i}"]) for i in range(len(ids))])
                           for m, type_name in enumerate(types)}
        return cache[name]

    return run


# ------------------------------------------------------------------------------------------------
# llama.cpp computes what transformers computes


@pytest.mark.engines
@pytest.mark.parametrize("name", TINY_FOLDERS)
def test_f32_export_gives_transformers_logprobs(name, engine_folder, exported, transformers_reference,
                                                llamacpp_logprobs):
    ids, reference = transformers_reference(name)
    tokens, logprobs = llamacpp_logprobs(name)["f32"]
    assert exported(name)[1].architecture == expected_architecture(engine_folder(name))
    assert min(len(seq) for seq in ids) > 16  # past Gemma 3's test window
    assert tokens == ids, "llama.cpp tokenizes the prompts differently from transformers"
    difference = max_logprob_gap(logprobs, reference)
    assert difference <= f32_bound(name), f"{name}: max |log-prob difference| {difference:.2e}"


@pytest.mark.engines
@pytest.mark.parametrize("type_name", list(TYPE_BOUND))
@pytest.mark.parametrize("name", TINY_FOLDERS)
def test_smaller_types_load_and_stay_close(name, type_name, transformers_reference, llamacpp_logprobs):
    _, reference = transformers_reference(name)
    _, logprobs = llamacpp_logprobs(name)[type_name]
    difference = max_logprob_gap(logprobs, reference)
    assert difference <= TYPE_BOUND[type_name], f"{name} {type_name}: max |log-prob difference| {difference:.2e}"
    chosen = [np.argmax(lp, -1) for lp in logprobs]
    agree = np.mean(np.concatenate([a == np.argmax(r, -1) for a, r in zip(chosen, reference)]))
    assert agree >= 0.8, f"{name} {type_name}: top-1 agreement {agree:.2f}"  # measured >= 0.91 (near-tied tiny logits)


# one folder per llama.cpp graph and nemotron-nas cut kind (every folder's logits are compared above)
PERPLEXITY_FOLDERS = ["llama-block", "qwen2-block", "qwen3-block", "gemma3-block", "gemma3mm-block", "llama-mlp",
                      "llama-mixed", "qwen2-mixed"]


@pytest.mark.engines
@pytest.mark.parametrize("name", PERPLEXITY_FOLDERS)
def test_llama_perplexity_matches_transformers(name, engine_folder, exported, llamacpp_engine, shared_data,
                                               tmp_path):
    text_path, text = wikitext_prefix(shared_data, tmp_path, 12_000)
    model, tokenizer = load_transformers(engine_folder(name))
    ours, reference = perplexity_pair(llamacpp_engine, model, tokenizer, exported(name)[0], text_path, n_ctx=128,
                                      chunks=4)
    assert abs(ours / reference - 1) < 1e-3, f"{name}: llama-perplexity {ours:.4f}, transformers {reference:.4f}"


@pytest.mark.slow
@pytest.mark.engines
@pytest.mark.parametrize("name", ["smollm2-block6", "smollm2-attn6"])
def test_smollm2_cuts_in_llama_perplexity(name, engine_folder, llamacpp_engine, shared_data, tmp_path):
    """The acceptance run: `prunetool export` of the real cuts, WikiText-2, 4 windows of 512 tokens (each
    window costs llama.cpp about 6 s of float32 on two cores, so a longer run measures nothing more)."""
    folder, gguf = engine_folder(name), tmp_path / f"{name}.gguf"
    result = runner.invoke(app, ["export", str(folder), "--gguf", str(gguf), "--type", "f32", "--json"])
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["architecture"] == ("deci" if name.endswith("attn6") else "llama")
    text_path, text = wikitext_prefix(shared_data, tmp_path, 24_000)
    model, tokenizer = load_transformers(folder)
    ours, reference = perplexity_pair(llamacpp_engine, model, tokenizer, gguf, text_path, n_ctx=512, chunks=4)
    assert abs(ours / reference - 1) < 1e-3, f"{name}: llama-perplexity {ours:.4f}, transformers {reference:.4f}"


def with_pre_tokenizer(out: Path, pre: dict | None, ignore_merges: bool, corpus: str, vocab: int = 1000) -> Path:
    """A one-layer Llama folder whose byte-level BPE was trained on `corpus` without any splitting (so its merges
    cross words, digits and punctuation) and then given `pre` as its pre-tokenizer: a vocabulary under which
    every pre-tokenizer splits text differently."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trained.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                              show_progress=False))
    tokenizer = json.loads(trained.to_str())
    tokenizer["pre_tokenizer"], tokenizer["model"]["ignore_merges"] = pre, ignore_merges
    tokenizer["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>", eos_token="</s>").save_pretrained(out)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def regex_then_bytes(name: str) -> dict:
    from prunetool.checkpoint.gguf.vocab import LLAMA3_REGEX, QWEN2_REGEX

    regex = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}[name]
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


PRE_TOKENIZERS = {  # llama.cpp's name -> (tokenizer.json pre_tokenizer, ignore_merges)
    "smollm": ({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}, False),
    "llama-bpe": (regex_then_bytes("llama-bpe"), True),
    "qwen2": (regex_then_bytes("qwen2"), False),
}
TRICKY = ("In 1987, 12345 people didn't say 'I'LL go' -- they'd   rather\r\n\r\n  wait 3.14159 s!\t\u00e9\u00e8 "
          "\u65e5\u672c\u8a9e \U0001f642 x=y+1;\n\n\n    indented    spaces   \n")


@pytest.mark.engines
@pytest.mark.parametrize("pre", list(PRE_TOKENIZERS))
def test_pre_tokenizers_split_text_as_transformers_does(pre, llamacpp_engine, shared_data, tmp_path):
    """Each byte-level pre-tokenizer export names: llama.cpp's ids equal transformers' on WikiText-2 and on
    digits, contractions, CRLF, tabs and non-Latin text (and differ under any other name, checked by hand)."""
    from transformers import AutoTokenizer

    text_path, corpus = wikitext_prefix(shared_data, tmp_path, 8_000)
    text = corpus + TRICKY  # the training text itself, where the merges apply most
    folder = with_pre_tokenizer(tmp_path / "folder", *PRE_TOKENIZERS[pre], corpus)
    gguf, result = tmp_path / "model.gguf", export_gguf(folder, tmp_path / "model.gguf")
    assert result.vocab.startswith(f"gpt2 (pre-tokenizer {pre})")
    text_path.write_bytes(text.encode("utf-8"))
    tokens = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert llama_tokenize(llamacpp_engine, gguf, text_path) == tokens


@pytest.mark.slow
@pytest.mark.engines
def test_gemma3_sentencepiece_vocabulary_tokenizes_as_transformers(llamacpp_engine, shared_data, tmp_path):
    """Gemma 3 270M's tokenizer.json (SentencePiece-style BPE with byte fallback, 262144 tokens) on a one-layer
    model: llama.cpp's `llama` tokenizer, scored by merge rank, gives transformers' ids."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    from prunetool.sources import resolve_model

    demo, folder = resolve_model("gemma3-270m").path, tmp_path / "folder"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    result = export_gguf(folder, tmp_path / "model.gguf", "f16")
    assert result.vocab.startswith("llama")
    text_path, text = wikitext_prefix(shared_data, tmp_path, 12_000)
    text_path.write_bytes((text + TRICKY).encode("utf-8"))
    assert llama_tokenize(llamacpp_engine, tmp_path / "model.gguf", text_path) == tokenizer(text + TRICKY)["input_ids"]


def test_an_unknown_pre_tokenizer_is_refused(tmp_path):
    pre = {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": False}
    folder = with_pre_tokenizer(tmp_path / "folder", pre, False, "a b c d e f g " * 20, vocab=300)
    result = runner.invoke(app, ["export", str(folder), "--gguf", str(tmp_path / "m.gguf")])
    assert_refused(result, "pre-tokenizer", "unknown")
    assert not (tmp_path / "m.gguf").exists()


# ------------------------------------------------------------------------------------------------
# llama.cpp's own converter as a second reference for what the file holds


OFFICIAL_SAME = ["llama-block", "mistral-block", "llama3rope-block", "qwen2-fit-block", "qwen3-block", "gemma3-block",
                 "gemma3mm-block"]
OFFICIAL_NEMOTRON = ["llama-attention", "qwen2-mixed"]


@pytest.fixture(scope="session")
def official(engine_folder, llamacpp_engine, tmp_path_factory):
    """name -> (GGUF path, returncode, log) of llama.cpp's converter, every folder converted in one process.

    Block cuts get `gpt-2` where the converter's pre-tokenizer lookup fails (tests/llamacpp_convert.py);
    nemotron-nas folders get nothing and fail as they would."""
    names = [*OFFICIAL_SAME, "qwen2-wide-block", *OFFICIAL_NEMOTRON]
    out = tmp_path_factory.mktemp("official")
    jobs = [{"folder": str(engine_folder(name)), "outfile": str(out / f"{name}.gguf"),
             "pre": None if name in OFFICIAL_NEMOTRON else "gpt-2"} for name in names]
    (out / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(TESTS / "llamacpp_convert.py"), str(llamacpp_engine.converter),
                           str(out / "jobs.json"), str(out / "results.json")],
                          env={**os.environ, **llamacpp_engine.python_env()}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    return {name: (Path(job["outfile"]), result["returncode"], result["log"])
            for name, job, result in zip(names, jobs, results)}


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(tensor name -> (shape, type, values), key -> value) as gguf's reader sees the file."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name, np.array(t.data)) for t in reader.tensors}
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    return tensors, fields


OWN_KEYS = {"general.name", "general.description", "general.size_label", "prunetool.version",
            "prunetool.source_layers"}


@pytest.mark.engines
@pytest.mark.parametrize("name", OFFICIAL_SAME)
def test_official_converter_writes_the_same_file(name, engine_folder, exported, official):
    path, returncode, log = official[name]
    assert returncode == 0, log[-3000:]
    (ours, our_keys), (theirs, their_keys) = read_gguf(exported(name)[0]), read_gguf(path)
    assert ours.keys() == theirs.keys()
    for tensor, (shape, kind, values) in ours.items():
        assert (shape, kind) == theirs[tensor][:2], tensor
        if tensor == "rope_freqs.weight":  # transformers' float32 frequencies vs the converter's float64 formula
            np.testing.assert_allclose(values, theirs[tensor][2], rtol=1e-6)
        else:
            assert np.array_equal(values, theirs[tensor][2]), tensor
    differing = {key for key in our_keys.keys() | their_keys.keys() if our_keys.get(key) != their_keys.get(key)}
    arch = expected_architecture(engine_folder(name))
    # what export writes beyond the converter: the per-layer window pattern (the converter leaves llama.cpp's
    # default 5:1 rhythm, wrong once layers are removed), the RoPE dimension, the vocabulary size, and
    # add_bos/add_eos where the tokenizer leaves them unsaid
    extra = {f"{arch}.attention.sliding_window_pattern", f"{arch}.rope.dimension_count", f"{arch}.vocab_size",
             "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"}
    assert differing - OWN_KEYS - extra == set()
    assert all(key not in their_keys for key in differing & extra)


@pytest.mark.engines
def test_official_gemma3_file_ignores_the_cut_window_pattern(official, transformers_reference, llamacpp_engine,
                                                             tmp_path):
    """The converter's Gemma 3 file is llama.cpp's default pattern (5 sliding, 1 full) over the 4 kept layers."""
    ids, reference = transformers_reference("gemma3-block")
    data = llamacpp_logits(llamacpp_engine, [official["gemma3-block"][0]], ids)
    difference = max_logprob_gap([log_softmax(data[f"logits_0_{i}"]) for i in range(len(ids))], reference)
    assert difference > 100 * GEMMA3_F32_BOUND


@pytest.mark.engines
def test_official_converter_keeps_qwen2_rows_where_llama_cpp_cannot_load_them(engine_folder, exported, official,
                                                                               llamacpp_engine):
    """Heads wider than hidden_size / heads: export writes llama's graph, whose q/k rows are interleaved; the
    converter writes qwen2's, which sizes q_proj as hidden x hidden and so cannot load them."""
    folder, (path, returncode, log) = engine_folder("qwen2-wide-block"), official["qwen2-wide-block"]
    assert returncode == 0, log[-3000:]
    load = ("import sys; sys.path.insert(0, sys.argv[1]); from llamacpp_worker import import_llama_cpp; "
            "import_llama_cpp().Llama(model_path=sys.argv[2], verbose=True)")
    loading = subprocess.run([sys.executable, "-c", load, str(WORKER.parent), str(path)], capture_output=True, text=True,
                             env={**os.environ, **llamacpp_engine.python_env()}, timeout=120)
    assert loading.returncode != 0 and "attn_q.weight' has wrong shape" in loading.stderr
    (ours, _), (theirs, their_keys) = read_gguf(exported("qwen2-wide-block")[0]), read_gguf(path)
    assert their_keys["general.architecture"] == "qwen2"
    config = json.loads((folder / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor, (shape, kind, values) in ours.items():
        part = tensor.split(".")[-2]
        if part in heads:
            values = interleave_back(values, heads[part])
        assert np.array_equal(values, theirs[tensor][2]), tensor


def interleave_back(rows: np.ndarray, heads: int) -> np.ndarray:
    """GGML's interleaved pairs -> transformers' rotate-half order (the inverse of `interleave`)."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.mark.engines
@pytest.mark.parametrize("name", OFFICIAL_NEMOTRON)
def test_official_converter_stops_at_the_vocabulary_of_nemotron_folders(name, official):
    """It reads every block's n_heads_in_group and ffn_mult (written as null for removed sublayers), then its
    DeciLM path finds neither a Llama-3 vocabulary nor a byte-fallback one."""
    path, returncode, log = official[name]
    assert returncode != 0 and not path.exists()
    assert "Cannot find Llama BPE tokenizer" in log
    assert "KeyError" not in log


# ------------------------------------------------------------------------------------------------
# What the file records, and refusals (no engine needed)


@pytest.mark.parametrize("name, dropped, zero_ffn", [
    ("llama-mixed", [3], [4]), ("qwen2-mixed", [1], [2]), ("llama-mlp", [], [1, 2, 5]), ("llama-attention", [], []),
])
def test_nemotron_layers_llama_cpp_would_miscompute_are_rewritten(name, dropped, zero_ffn, exported):
    path, result = exported(name)
    assert (result.dropped_layers, result.zero_ffn_layers) == (dropped, zero_ffn)
    tensors, keys = read_gguf(path)
    kept = [index for index in range(LAYERS) if index not in dropped]
    assert keys["prunetool.source_layers"] == kept and keys["deci.block_count"] == len(kept)
    widths = keys["deci.feed_forward_length"]
    for block, source in enumerate(kept):
        if source in zero_ffn:
            assert widths[block] == 32
            for part in ("ffn_gate", "ffn_up", "ffn_down"):
                assert not tensors[f"blk.{block}.{part}.weight"][2].any()
        else:
            assert widths[block] == SIZES["intermediate_size"]
    assert all(width > 0 for width in widths)  # llama.cpp's deci graph skips the rest of a width-0 layer
    for line in result.notes:
        assert "\n" not in line


def test_gemma3_records_the_window_pattern_of_the_kept_layers(exported):
    _, keys = read_gguf(exported("gemma3-block")[0])
    # layers 0, 2, 4, 5 of s s f s s f
    assert keys["gemma3.attention.sliding_window_pattern"] == [True, False, True, False]
    assert keys["gemma3.rope.freq_base"] == 1e6 and keys["gemma3.rope.freq_base_swa"] == 1e4


def test_q8_0_keeps_vectors_and_norms_in_float32(exported):
    tensors, _ = read_gguf(exported("llama-mlp", "q8_0")[0])
    for name, (shape, kind, _) in tensors.items():
        if len(shape) == 1 or "norm" in name:
            assert kind == "F32", name
        else:
            assert kind == "Q8_0", name


def assert_refused(result, *words):
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


def folder_state(folder: Path) -> dict:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


@pytest.mark.parametrize("case", ["missing", "file", "type", "gemma2", "phi3", "windowed mistral", "no --gguf",
                                  "inside source"])
def test_refusals_are_one_line_and_write_nothing(case, engine_folder, tiny_checkpoint, tmp_path):
    folder = engine_folder("llama-mixed")
    target = tmp_path / "out" / "model.gguf"
    args, words = {
        "missing": (["export", str(tmp_path / "nope"), "--gguf", str(target)], ["does not exist"]),
        "file": (["export", str(folder / "config.json"), "--gguf", str(target)], ["not a folder"]),
        "type": (["export", str(folder), "--gguf", str(target), "--type", "q4_k"], ["--type", "q4_k", "q8_0"]),
        "gemma2": (["export", str(tiny_checkpoint("gemma2")), "--gguf", str(target)], ["gemma2", "soft-capping"]),
        "phi3": (["export", str(tiny_checkpoint("phi3")), "--gguf", str(target)], ["phi3", "qkv_proj"]),
        "windowed mistral": (["export", str(tiny_checkpoint("mistral")), "--gguf", str(target)], ["sliding"]),
        "no --gguf": (["export", str(folder)], ["--gguf"]),
        "inside source": (["export", str(folder), "--gguf", str(folder / "m.gguf")], ["inside the source folder"]),
    }[case]
    before = folder_state(folder)
    assert_refused(runner.invoke(app, args), *words)
    assert not target.parent.exists() or not any(target.parent.iterdir())
    assert folder_state(folder) == before


def test_existing_output_is_kept_without_force_and_replaced_with_it(engine_folder, tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"keep me")
    args = ["export", str(engine_folder("llama-block")), "--gguf", str(target)]
    assert_refused(runner.invoke(app, args), "--force")
    assert target.read_bytes() == b"keep me"
    result = runner.invoke(app, [*args, "--force", "--json"])
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:4] == b"GGUF" and json.loads(result.stdout)["output"] == str(target.resolve())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.gguf"]


def test_a_failed_write_leaves_no_file(engine_folder, tmp_path, monkeypatch):
    import prunetool.checkpoint.gguf.writer as writer

    real, written = writer.encode, []

    def fail_on_third(values, qtype):
        written.append(qtype)
        if len(written) == 3:
            raise OSError("disk full")
        return real(values, qtype)

    monkeypatch.setattr(writer, "encode", fail_on_third)
    result = runner.invoke(app, ["export", str(engine_folder("qwen2-mixed")), "--gguf", str(tmp_path / "m.gguf")])
    assert_refused(result, "disk full")
    assert list(tmp_path.iterdir()) == []
