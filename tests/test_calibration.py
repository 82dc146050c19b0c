"""Calibration: the windowing contract, every source form and every error, on real tokenizers."""

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import torch

from prunetool.select import calibration as cal
from prunetool.select.calibration import CalibrationSet, load_calibration, load_presets, make_windows, parse_hf_spec
from prunetool.errors import CalibrationError, OptionError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Dear friend, the weather here is cold and grey, but the soup is warm.",
    "Water boils at one hundred degrees Celsius at sea level; at altitude it boils sooner.",
] * 20


def _tokenizer(eos: bool = True):
    """A real byte-level BPE whose post-processor adds BOS/EOS, so 'no special tokens' is a real check."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>"] if eos else ["<s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    single = "<s> $A </s>" if eos else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(s, tok.token_to_id(s)) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>" if eos else None)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNETOOL_CACHE_DIR", str(tmp_path / "cache"))


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- the windowing contract, by hand

def test_overlapping_windows_when_stride_below_seq_len():
    got = make_windows(list(range(20)), seq_len=5, stride=3, samples=3)
    assert got.tolist() == [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [6, 7, 8, 9, 10]]
    assert got.dtype == torch.int64


def test_gaps_when_stride_above_seq_len():
    got = make_windows(torch.arange(20), seq_len=3, stride=5, samples=4)
    assert got.tolist() == [[0, 1, 2], [5, 6, 7], [10, 11, 12], [15, 16, 17]]


def test_partial_last_window_dropped_and_samples_caps():
    assert make_windows(list(range(20)), seq_len=6, stride=6, samples=3).tolist() == [
        list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]  # 18, 19 never used
    assert make_windows(list(range(20)), seq_len=6, stride=6, samples=2).shape == (2, 6)
    with pytest.raises(CalibrationError) as err:
        make_windows(list(range(20)), seq_len=6, stride=6, samples=4)
    msg = str(err.value)
    assert "\n" not in msg and "20 tokens available" in msg and "24 needed" in msg and "--samples" in msg


def test_exactly_enough_tokens_is_enough():
    assert make_windows(list(range(24)), seq_len=6, stride=6, samples=4)[-1].tolist() == list(range(18, 24))


@pytest.mark.parametrize("kwargs,flag,value", [
    (dict(seq_len=0), "--seq-len", 0), (dict(stride=-2), "--stride", -2), (dict(samples=0), "--samples", 0)])
def test_options_below_one(tok, tmp_path, kwargs, flag, value):
    path = tmp_path / "t.txt"
    path.write_text("hello world " * 50)
    with pytest.raises(OptionError, match=f"^{flag} must be at least 1, got {value}$"):
        load_calibration(str(path), tok, **kwargs)
    with pytest.raises(OptionError, match=flag):
        make_windows(list(range(10)), **{"seq_len": 2, "stride": 2, "samples": 1, **kwargs})


# ---------------------------------------------------------------- text files

def test_text_file_is_one_stream_without_special_tokens(tok, tmp_path):
    text = "The quick brown fox. " * 40
    path = tmp_path / "notes.md"
    path.write_text(text, encoding="utf-8")
    ids = _enc(tok, text)
    got = load_calibration(str(path), tok, seq_len=len(ids), samples=1)
    assert got.input_ids[0].tolist() == ids
    assert tok.bos_token_id not in ids and tok.eos_token_id not in ids
    assert tok(text)["input_ids"][0] == tok.bos_token_id  # the tokenizer would have added them
    assert got.source == str(path.resolve())
    assert got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_hand_reproduction_from_docs(tok, tmp_path):
    path = tmp_path / "my.txt"
    path.write_text("Dear friend, the soup is warm.\r\n" * 60, encoding="utf-8")
    got = load_calibration(str(path), tok, seq_len=32, stride=24, samples=5)
    text = Path(path).read_bytes().decode("utf-8")  # the recipe in docs/calibration.md
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    assert torch.equal(got.input_ids, ids.unfold(0, 32, 24)[:5])
    assert got.describe() == {"source": str(path.resolve()), "spec": str(path.resolve()), "sha256": got.sha256,
                              "seq_len": 32, "stride": 24, "windows": 5, "tokens": 160}
    assert isinstance(got, CalibrationSet) and got.windows == 5 and got.tokens == 160


@pytest.mark.parametrize("content,reason", [
    (b"", "is empty"), (b"  \n\t\n ", "is empty"), (b"abc\x00def", "is not UTF-8 text (binary?)"),
    (b"caf\xe9 au lait", "is not UTF-8 text (binary?)")])
def test_unusable_file_contents(tok, tmp_path, content, reason):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(CalibrationError, match=f"calibration file .*bad.txt {re.escape(reason)}$"):
        load_calibration(str(path), tok)


def test_missing_file_and_directory(tok, tmp_path):
    with pytest.raises(CalibrationError, match="nope.txt does not exist"):
        load_calibration(str(tmp_path / "nope.txt"), tok)
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration("some/dir/text", tok)
    with pytest.raises(CalibrationError, match="is a directory"):
        load_calibration(str(tmp_path), tok)
    with pytest.raises(CalibrationError, match="empty string"):
        load_calibration(" ", tok)


def test_too_short_names_the_source(tok, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("only a few words here")
    with pytest.raises(CalibrationError, match=r"short.txt: calibration text is too short: \d+ tokens available, 8192 needed"):
        load_calibration(str(path), tok)


# ---------------------------------------------------------------- jsonl

def _write_jsonl(path, rows):
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows), encoding="utf-8")


def test_jsonl_joins_documents_with_eos_between_not_after(tok, tmp_path):
    docs = ["alpha beta fox", "gamma soup", "", "delta weather"]
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [{"text": d, "id": i} for i, d in enumerate(docs)] + ["   "])
    eos = tok.eos_token_id
    expected = _enc(tok, docs[0]) + [eos] + _enc(tok, docs[1]) + [eos] + _enc(tok, docs[3])
    got = load_calibration(str(path), tok, seq_len=len(expected), samples=1)
    assert got.input_ids[0].tolist() == expected and expected[-1] != eos
    assert got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    short = load_calibration(str(path), tok, seq_len=3, samples=1)  # stops early: same prefix
    assert short.input_ids[0].tolist() == expected[:3]


def test_jsonl_without_eos_joins_with_blank_line(tmp_path):
    tok = _tokenizer(eos=False)
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [{"text": "alpha beta"}, {"text": "gamma soup"}])
    expected = _enc(tok, "alpha beta") + _enc(tok, "\n\n") + _enc(tok, "gamma soup")
    got = load_calibration(str(path), tok, seq_len=len(expected), samples=1)
    assert got.input_ids[0].tolist() == expected
    assert 'joined by "\\n\\n"' in got.source


def test_jsonl_bad_line_and_missing_field(tok, tmp_path):
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [{"text": "fine"}, "", '{"text": "broken"'])
    with pytest.raises(CalibrationError, match="docs.jsonl line 3 is not valid JSON"):
        load_calibration(str(path), tok)
    _write_jsonl(path, [{"text": "fine"}, {"body": "no text here"}])
    with pytest.raises(CalibrationError, match='docs.jsonl line 2 has no string field "text"'):
        load_calibration(str(path), tok)
    _write_jsonl(path, [{"text": ""}])
    with pytest.raises(CalibrationError, match="no document"):
        load_calibration(str(path), tok)


# ---------------------------------------------------------------- hf: and presets

def test_hf_spec_parsing():
    assert parse_hf_spec("hf:user/ds") == ("user/ds", None, "train", "text")
    assert parse_hf_spec("hf:user/ds::validation") == ("user/ds", None, "validation", "text")
    assert parse_hf_spec("hf:ds:cfg:test:body") == ("ds", "cfg", "test", "body")
    for bad in ("hf:", "hf::cfg", "hf:a:b:c:d:e"):
        with pytest.raises(CalibrationError, match="expected hf:DATASET"):
            parse_hf_spec(bad)


def test_presets_are_well_formed():
    presets = load_presets()
    assert {"wikitext2", "c4", "pg19", "tappa"} <= set(presets)
    for name, preset in presets.items():
        assert preset["spec"].startswith("hf:"), name
        dataset, _, split, field = parse_hf_spec(preset["spec"])
        assert "/" in dataset and split and field
        assert preset["description"].strip() and preset["citation"].strip() and preset["url"].startswith("https://")


def test_unknown_preset_lists_presets(tok):
    with pytest.raises(CalibrationError, match="unknown calibration source 'wikitext3'.*c4, c4-validation, pg19, tappa"):
        load_calibration("wikitext3", tok)


def test_hf_offline_fails_fast_without_hanging(tok, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(CalibrationError) as err:  # no network here; with network the dataset does not exist
        load_calibration("hf:prunetool-tests/no-such-dataset", tok, seq_len=8, samples=1)
    assert time.monotonic() - start < 30 and "\n" not in str(err.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CalibrationError, match=r"hf:allenai/c4:en:train:text \(preset c4\) .*HF_HUB_OFFLINE"):
        load_calibration("c4", tok)


def test_hf_documents_joined_and_hashed(tok, monkeypatch):
    """The streaming path without a network: load_dataset replaced by rows in memory."""
    import datasets

    rows = [{"text": "alpha beta fox"}, {"text": ""}, {"text": "gamma soup"}, {"text": "delta"}, {"text": "never"}]
    seen = []

    def fake_load(name, config, split, streaming):
        assert (name, config, split, streaming) == ("user/ds", None, "validation", True)
        for row in rows:
            seen.append(row["text"])
            yield row

    monkeypatch.setattr(cal, "_check_hub_reachable", lambda label: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    eos = tok.eos_token_id
    first = _enc(tok, "alpha beta fox") + [eos] + _enc(tok, "gamma soup")
    got = load_calibration("hf:user/ds::validation", tok, seq_len=len(first), samples=1)
    assert got.input_ids[0].tolist() == first and "never" not in seen
    assert got.source == "hf:user/ds::validation:text"
    assert got.sha256 == hashlib.sha256("alpha beta fox\n\ngamma soup".encode()).hexdigest()
    with pytest.raises(CalibrationError, match="no field 'body'"):
        load_calibration("hf:user/ds::validation:body", tok, seq_len=4, samples=1)


# ---------------------------------------------------------------- the offline default: generated text

@pytest.fixture(scope="module")
def tiny_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(config).eval()


def test_generated_default_is_deterministic_cached_and_reused(tok, tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cal, "LADDER_START", 256)  # 32 prompts x 9 new tokens: a quick test
    rng = torch.get_rng_state()
    first = load_calibration(None, tok, seq_len=16, samples=8, model=tiny_model, model_key="tiny/llama")
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left alone
    path = cal.self_cache_path("tiny/llama", 256)
    assert path.name == "tiny--llama-self-seed0-256.jsonl" and path.exists()
    assert first.source == f"{path} (generated by tiny/llama, seed 0)"
    assert first.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert capsys.readouterr().out == ""  # progress and notes go to stderr
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(cal.self_prompts())
    docs = [json.loads(line)["text"] for line in path.read_bytes().decode("utf-8").split("\n") if line.strip()]
    stream = []  # the .jsonl recipe in docs/calibration.md: the cached file is the whole story
    for i, doc in enumerate(d for d in docs if d):
        stream += ([tok.eos_token_id] if i else []) + tok(doc, add_special_tokens=False)["input_ids"]
    assert torch.equal(torch.tensor(stream).unfold(0, 16, 16)[:8], first.input_ids)

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached file should have been reused")

    generate = cal.generate_self_text
    monkeypatch.setattr(cal, "generate_self_text", no_generation)
    again = load_calibration("self", tok, seq_len=16, samples=8, model=tiny_model, model_key="tiny/llama")
    assert torch.equal(again.input_ids, first.input_ids) and again.sha256 == first.sha256

    other = tmp_path / "again.jsonl"  # a second generation with the same seed gives the same bytes
    generate(tiny_model, tok, other, 256, "tiny/llama")
    assert other.read_bytes() == path.read_bytes()


def test_continuing_a_generated_stream_reads_past_its_nominal_size_and_never_generates(tok, tiny_model, monkeypatch):
    """heal's training text continues prune's generated stream: a rung holds more than its name (GEN_MARGIN),
    so a continuation that ends past the nominal size must still read that file, not ask for a bigger rung."""
    monkeypatch.setattr(cal, "LADDER_START", 256)
    first = load_calibration(None, tok, seq_len=16, samples=8, model=tiny_model, model_key="tiny/margin", holdout=2)
    monkeypatch.setattr(cal, "generate_self_text", lambda *a, **k: pytest.fail("a continuation must never generate"))
    start = 10 * 16  # after 8 selection + 2 held-out windows of 16
    stream_tokens = sum(len(tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]) + 1
                        for line in cal.self_cache_path("tiny/margin", 256).read_text().splitlines())
    count = (min(stream_tokens - 32, 300) - start) // 16  # windows that end past 256 but inside the file
    assert start + count * 16 > 256 and count > 0, stream_tokens
    more = load_calibration(None, tok, seq_len=16, samples=0, holdout=count, holdout_from=start, model_key="tiny/margin")
    assert more.sha256 == first.sha256 and more.held_out.shape == (count, 16)
    with pytest.raises(CalibrationError) as error:  # past the end: how much there is, never a generation
        load_calibration(None, tok, seq_len=16, samples=0, holdout=1000, holdout_from=start, model_key="tiny/margin")
    assert getattr(error.value, "available", None) is not None


def test_generated_default_needs_the_model(tok):
    with pytest.raises(CalibrationError, match="generated by the model"):
        load_calibration(None, tok)


# ---------------------------------------------------------------- real public data (skipped when absent)

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"public data folder {DATA} is absent")


@needs_data
def test_wikitext_raw_file(tok, capfd):
    path = DATA / "wikitext2-test.raw"
    tok.model_max_length = 128  # a long text must not trigger the 'longer than maximum' warning
    got = load_calibration(str(path), tok, seq_len=512, samples=16)
    assert got.input_ids.shape == (16, 512) and got.tokens == 8192
    assert got.sha256 == "71fa921e51ba607b4364d8787d05f4513b41b33732dd3504ff1af8952c6e7e77"  # data README
    assert "longer than the specified maximum" not in capfd.readouterr().err


@needs_data
def test_c4_sample_jsonl(tok):
    path = DATA / "c4_en_sample_1000.jsonl"
    got = load_calibration(str(path), tok, seq_len=256, stride=128, samples=32)
    first_doc = json.loads(path.read_text(encoding="utf-8").split("\n", 1)[0])["text"]
    ids = _enc(tok, first_doc)
    stream = torch.cat([got.input_ids[0], got.input_ids[1:, 128:].reshape(-1)])
    assert stream[: len(ids)].tolist() == ids and stream[len(ids)].item() == tok.eos_token_id
    assert got.sha256 == "cdd5b754119131d2934e3e799a059a9d64f53a6aac9e7e2ef79b43120bb01a32"


@needs_data
def test_tinyshakespeare_overlapping_windows(tok):
    got = load_calibration(str(DATA / "tinyshakespeare_input.txt"), tok, seq_len=128, stride=64, samples=10)
    assert torch.equal(got.input_ids[1:, :64], got.input_ids[:-1, 64:])
