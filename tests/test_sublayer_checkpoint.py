"""`prune --unit attention|mlp` writes a nemotron-nas (DeciLM) folder: config round-trip, exact shapes, logits
against an independent hook-zeroed reference, cached = uncached decoding, refusals, and eval/heal on it."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from typer.testing import CliRunner

from prunetool.checkpoint.nemotron_nas.convert import ffn_mult_for
from prunetool.cli import app
from test_cli import PROSE
from tiny_models import _common_kwargs, make_tokenizer

runner = CliRunner()
SEQ = "32"
CONFIGS = {  # the Llama family, without sliding windows; "smollm2" has a 256-multiple MLP, so ffn_mult is written
    "llama": lambda common: LlamaConfig(**common),
    "smollm2": lambda common: LlamaConfig(**(common | {"intermediate_size": 256, "tie_word_embeddings": True})),
    "mistral": lambda common: MistralConfig(**common, sliding_window=None),
    "qwen2": lambda common: Qwen2Config(**common, use_sliding_window=False),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> a saved random checkpoint of the Llama family (built once per module)."""
    built = {}

    def make(arch):
        if arch not in built:
            path = tmp_path_factory.mktemp(arch)
            tok = make_tokenizer(path)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(CONFIGS[arch](_common_kwargs(tok, 6)), dtype=torch.float32)
            model.save_pretrained(path)
            built[arch] = path
        return built[arch]

    return make


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(PROSE * 3)
    return path


def prune(source, out, calib, unit="attention", layers="1,3,4", *extra):
    return runner.invoke(app, ["prune", str(source), "--unit", unit, "--remove-layers", layers, "--calib", str(calib),
                               "--seq-len", SEQ, "--samples", "4", "--output-dir", str(out), *extra])


def tensors(folder):
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def hooked_logits(source, ids, removed, unit, dtype):
    """The independent reference: the unpruned model with those sublayers' outputs zeroed through hooks."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    name = "self_attn" if unit == "attention" else "mlp"

    def zero(_module, _args, output):
        return (torch.zeros_like(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)

    for index in removed:
        getattr(model.model.layers[index], name).register_forward_hook(zero)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("unit", ["attention", "mlp"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_written_folder_round_trips_and_matches_the_reference(arch, unit, family, calib, tmp_path):
    source, out = family(arch), tmp_path / "out"
    result = prune(source, out, calib, unit)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert config["per_layer_config"] == {str(i): {"skip": [unit]} for i in (1, 3, 4)}
    parsed = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(parsed).__name__ == "DeciLMConfig" and len(parsed.block_configs) == 6
    before, after = tensors(source), tensors(out)
    module, norm = ("self_attn", "input_layernorm") if unit == "attention" else ("mlp", "post_attention_layernorm")
    for index, block in enumerate(parsed.block_configs):
        gone = index in (1, 3, 4)
        assert bool(getattr(block, "attention" if unit == "attention" else "ffn").no_op) == gone
        names = [n for n in before if n.startswith((f"model.layers.{index}.{module}.", f"model.layers.{index}.{norm}."))]
        assert names and all((name in after) != gone for name in names)
    for name, value in after.items():  # every kept tensor has the source's shape and bytes
        assert torch.equal(value, before[name]), name
    assert set(before) - set(after) == {n for n in before if any(
        n.startswith((f"model.layers.{i}.{module}.", f"model.layers.{i}.{norm}.")) for i in (1, 3, 4))}
    if arch == "smollm2":
        assert parsed.block_configs[0].ffn.ffn_mult == ffn_mult_for(256, 64) == 6.0
    ids = torch.randint(0, parsed.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, None)):
        reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=dtype).eval()
        with torch.no_grad():
            got = reloaded(ids).logits.float()
        want = hooked_logits(source, ids, (1, 3, 4), unit, dtype)
        if atol is None:  # bfloat16: the same kernels in the same order, so within a few bf16 ulps of the logits
            atol = 8 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        if dtype == torch.float32:
            prompt = ids[:1, :6]
            cached = reloaded.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
            uncached = reloaded.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
            assert cached.tolist() == uncached.tolist()


def test_attention_cut_keeps_no_cache_for_removed_layers(family, calib, tmp_path):
    out = tmp_path / "out"
    assert prune(family("llama"), out, calib, "attention", "1,2").exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache.get_seq_length() == 9
    filled = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    assert len(filled) == 4  # six layers, two attention sublayers removed


@pytest.mark.parametrize("args,words", [
    (["--unit", "head", "--drop", "2"], "--unit must be one of"),
    (["--unit", "attention", "--drop", "6"], "below the number of attention sublayers"),
    (["--unit", "mlp", "--drop", "7"], "more than the 6 MLP sublayers"),
    (["--unit", "attention", "--remove-layers", "0,1,2,3,4,5"], "all 6 attention sublayers"),
    (["--unit", "attention", "--drop", "2", "--patch"], "no fold exists"),
    (["--unit", "attention", "--remove-layers", "0,2"], "vLLM cannot serve this cut: layer 0 keeps its MLP"),
    (["--unit", "mlp", "--drop", "2", "--criterion", "qsim"], "does not rank mlp sublayers"),
])
def test_bad_sublayer_options_are_one_line_and_write_nothing(args, words, family, calib, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(family("llama")), *args, "--calib", str(calib), "--seq-len", SEQ,
                                 "--output-dir", str(out)])
    assert result.exit_code == 1 and words in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("arch,words", [("gemma2", "sandwich norms"), ("gemma3_text", "sandwich norms"),
                                        ("qwen3", "q_norm"), ("phi3", "fused qkv_proj"), ("mistral", "sliding")])
def test_architectures_the_format_cannot_express_are_refused(arch, words, tiny_checkpoint, calib, tmp_path):
    out = tmp_path / "out"
    result = prune(tiny_checkpoint(arch), out, calib)
    assert result.exit_code == 1 and words in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_eval_and_heal_accept_the_folder(family, calib, tmp_path):
    pruned, healed = tmp_path / "pruned", tmp_path / "healed"
    assert prune(family("llama"), pruned, calib).exit_code == 0
    result = runner.invoke(app, ["eval", "--tasks", "heldout_ppl", "--json"])  # the current run: pruned and base
    assert result.exit_code == 0, result.output
    models = json.loads(result.stdout)["models"]
    base, cut = models["base"]["efficiency"], models["pruned"]["efficiency"]
    assert cut["kv_cache_bytes_per_token"] == base["kv_cache_bytes_per_token"] // 2  # 3 of 6 attention layers
    assert cut["relative_to_base"]["parameters"] < 1
    result = runner.invoke(app, ["heal", str(pruned), "--train", "all", "--tokens", "512", "--seq-len", "16",
                                 "--batch-size", "2", "--output-dir", str(healed), "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads((healed / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas" and (healed / "modeling_decilm.py").is_file()
    assert set(tensors(healed)) == set(tensors(pruned))


@pytest.mark.parametrize("criterion,unit", [("bi", "attention"), ("angular", "attention"), ("tappa", "attention"),
                                            ("qsim", "attention"), ("bi", "mlp"), ("halving", "attention")])
def test_every_sublayer_criterion_chooses_and_writes(criterion, unit, family, calib, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(family("llama")), "--unit", unit, "--drop", "2", "--criterion", criterion,
                                 "--calib", str(calib), "--seq-len", SEQ, "--samples", "4", "--output-dir", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "prune.json").read_text())
    assert plan["unit"] == unit and len(plan["removed"]) == 2
    blocks = json.loads((out / "config.json").read_text())["block_configs"]
    gone = [i for i, block in enumerate(blocks) if block["attention" if unit == "attention" else "ffn"].get("no_op")]
    assert gone == sorted(plan["removed"])
    if unit == "attention":  # vLLM's nemotron_nas cannot run layer 0's MLP without its attention
        assert 0 not in plan["removed"]


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_every_block_writes_every_key_the_engines_read(arch, family, calib, tmp_path):
    """llama.cpp's converter indexes n_heads_in_group and ffn_mult on every block; vLLM reads intermediate_size
    only where ffn_mult is absent, so a kept MLP has a width-reproducing ffn_mult, or no ffn_mult at all."""
    source, hidden, width = family(arch), 64, 256 if arch == "smollm2" else 128
    for unit in ("attention", "mlp"):
        out = tmp_path / unit
        assert prune(source, out, calib, unit).exit_code == 0
        for index, block in enumerate(json.loads((out / "config.json").read_text())["block_configs"]):
            attention, ffn = block["attention"], block["ffn"]
            assert attention["n_heads_in_group"] == (None if attention["no_op"] else 2)
            if ffn["no_op"]:
                assert ffn["ffn_mult"] is None
            elif arch == "smollm2":
                assert ffn["ffn_mult"] == 6.0 and "intermediate_size" not in ffn
                assert -(-int(2 * ffn["ffn_mult"] * hidden / 3) // 256) * 256 == width
            else:  # 128 is no multiple of 256: no ffn_mult gives it back
                assert "ffn_mult" not in ffn and ffn["intermediate_size"] == width


def mixed_reference(source, ids, attention, mlp, dtype):
    """Independent of the writer and of prunetool's in-memory removal: the unpruned model with hooks that zero a
    removed sublayer's output, or pass a removed block's input straight through."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()

    def zero(_module, _args, output):
        return (torch.zeros_like(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)

    def through(_module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

    for index, layer in enumerate(model.model.layers):
        if index in attention and index in mlp:
            layer.register_forward_hook(through, with_kwargs=True)
        elif index in attention:
            layer.self_attn.register_forward_hook(zero)
        elif index in mlp:
            layer.mlp.register_forward_hook(zero)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "smollm2"])
def test_a_mixed_cut_drops_its_blocks_and_matches_the_reference(arch, family, tmp_path):
    from prunetool.checkpoint.surgery import write_cut_checkpoint
    from prunetool.cut import Cut

    source, out = family(arch), tmp_path / "mixed"
    cut = Cut(6, attention=(1, 2, 4), mlp=(2, 5))  # block 2, attention 1 and 4, MLP 5
    write_cut_checkpoint(source, cut, out)
    parsed = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert len(parsed.block_configs) == 5  # layer 2 left; the others renumbered 0, 1, 2, 3, 4
    assert [(bool(b.attention.no_op), bool(b.ffn.no_op)) for b in parsed.block_configs] == [
        (False, False), (True, False), (False, False), (True, False), (False, True)]
    before, after = tensors(source), tensors(out)
    assert not any(name.startswith("model.layers.5.") for name in after)
    assert torch.equal(after["model.layers.2.self_attn.q_proj.weight"], before["model.layers.3.self_attn.q_proj.weight"])
    ids = torch.randint(0, parsed.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=dtype).eval()
        with torch.no_grad():
            got = reloaded(ids).logits.float()
        want = mixed_reference(source, ids, cut.attention, cut.mlp, dtype)
        atol = 1e-5 if dtype == torch.float32 else 8 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_a_mixed_cut_vllm_cannot_serve_is_refused_before_writing(family, tmp_path):
    from prunetool.checkpoint.surgery import write_cut_checkpoint
    from prunetool.cut import Cut
    from prunetool.errors import OptionError

    with pytest.raises(OptionError, match=r"^vLLM cannot serve this cut: layer 1 \(layer 0 once"):
        write_cut_checkpoint(family("llama"), Cut(6, attention=(0, 1), mlp=(0,)), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
