"""Checkpoint surgery against an independent in-memory prune, on every tiny architecture.

The reference (`prune_in_memory`) is the transformers-level recipe: slice `decoder.layers`,
renumber `layer_idx`, slice `layer_types`, fix `max_window_layers`. The written folder must reload
to exactly the same model (logits bit-equal, same greedy tokens with and without the KV cache),
hold byte-identical tensors under renumbered names, and leave the source folder untouched.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from prunetool.errors import OptionError, PrunetoolError, UnsupportedModelError
from prunetool.select.plan import PrunePlan
from prunetool.checkpoint.surgery import prune_config, write_pruned_checkpoint
from prunetool.checkpoint.surgery import safetensors_io
from prunetool.sources.weights import find_decoder_prefix
from tiny_models import ARCHITECTURES

DROP = (1, 3, 4)
KEPT = [0, 2, 5]
PROMPT = "The people of the village went fishing"
CASES = [(arch, None) for arch in ARCHITECTURES] + [("llama", "20KB"), ("gemma3", "20KB")]


def plan(num_layers: int = 6, drop=DROP) -> PrunePlan:
    return PrunePlan("tiny", num_layers, tuple(drop), "manual")


def decoder_prefix(arch: str) -> str:
    """Written independently of the production prefix detection: the known on-disk layouts."""
    return "language_model.model.layers." if arch == "gemma3" else "model.layers."


def prune_in_memory(model, drop) -> None:
    """The reference prune (notes section 1.2), done on a loaded model."""
    text_cfg = model.config.get_text_config(decoder=True)
    decoder = model.get_decoder()
    keep = [i for i in range(len(decoder.layers)) if i not in set(drop)]
    decoder.layers = nn.ModuleList([decoder.layers[i] for i in keep])
    for new_idx, layer in enumerate(decoder.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    if getattr(text_cfg, "layer_types", None) is not None:
        text_cfg.layer_types = [text_cfg.layer_types[i] for i in keep]
    if getattr(text_cfg, "max_window_layers", None) is not None:
        text_cfg.max_window_layers = sum(1 for i in keep if i < text_cfg.max_window_layers)
    text_cfg.num_hidden_layers = len(keep)


def snapshot(folder: Path) -> dict:
    """Every file's bytes and mtime: what "the source is unchanged" means."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, for single-file and sharded folders alike."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: folder / "model.safetensors" for k in f.keys()}


def read_tensor(path: Path, name: str) -> tuple[torch.Tensor, dict]:
    with safe_open(path, "pt") as f:
        return f.get_tensor(name), f.metadata()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def greedy(model, ids: torch.Tensor) -> tuple[list, list]:
    """(generate with the KV cache, a cache-free argmax loop of the same length)."""
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        loop = ids
        for _ in range(gen.shape[1] - ids.shape[1]):
            loop = torch.cat([loop, model(loop, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return gen.tolist(), loop.tolist()


def load(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{s or 'single'}" for a, s in CASES])
def pruned(request, tiny_checkpoint, tmp_path_factory):
    """(arch, source, output, source snapshot before writing): each case is written once."""
    arch, shard_size = request.param
    source = tiny_checkpoint(arch, max_shard_size=shard_size)
    before = snapshot(source)
    output = tmp_path_factory.mktemp("pruned") / "out"
    seen = []
    write_pruned_checkpoint(source, plan(), output, on_shard=seen.append)
    assert seen, "on_shard was never called"
    return arch, source, output, before


def test_config_matches_in_memory_prune(pruned):
    arch, source, output, _ = pruned
    reference, _ = load(source)
    prune_in_memory(reference, DROP)
    ref_cfg = reference.config.get_text_config(decoder=True)
    written = json.loads((output / "config.json").read_text())
    text = written.get("text_config", written)
    assert text["num_hidden_layers"] == 3
    if getattr(ref_cfg, "layer_types", None) is not None:
        assert text["layer_types"] == list(ref_cfg.layer_types)  # explicitly present, sliced
    else:
        assert "layer_types" not in text
    if "max_window_layers" in text:
        assert text["max_window_layers"] == ref_cfg.max_window_layers == 2
    if arch == "gemma3":
        assert written["vision_config"] == json.loads((source / "config.json").read_text())["vision_config"]


def test_tensors_are_renamed_bytes_of_the_source(pruned):
    arch, source, output, _ = pruned
    prefix = decoder_prefix(arch)
    layer = re.compile(rf"^{re.escape(prefix)}(\d+)(\..*)$")
    expected = {}  # new name -> source name
    for name in tensor_files(source):
        m = layer.match(name)
        if not m:
            expected[name] = name
        elif int(m[1]) in KEPT:
            expected[f"{prefix}{KEPT.index(int(m[1]))}{m[2]}"] = name
    written, sources = tensor_files(output), tensor_files(source)
    assert sorted(written) == sorted(expected)
    total = 0
    for new, old in expected.items():
        got, meta = read_tensor(written[new], new)
        want, want_meta = read_tensor(sources[old], old)
        assert written[new].name == sources[old].name  # same shard layout
        assert got.dtype == want.dtype and got.shape == want.shape
        assert raw_bytes(got) == raw_bytes(want), new
        assert meta == want_meta == {"format": "pt"}
        total += got.numel() * got.element_size()
    index = output / "model.safetensors.index.json"
    assert index.is_file() == (source / "model.safetensors.index.json").is_file()
    if index.is_file():
        data = json.loads(index.read_text())
        assert data["metadata"]["total_size"] == total
        assert set(data["weight_map"].values()) == {p.name for p in output.glob("*.safetensors")}
    else:
        assert [p.name for p in output.glob("*.safetensors")] == ["model.safetensors"]


def test_reload_equals_in_memory_prune(pruned, tmp_path):
    arch, source, output, before = pruned
    reference, _ = load(source)
    prune_in_memory(reference, DROP)
    reloaded, info = load(output)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert len(reloaded.get_decoder().layers) == 3
    ids = AutoTokenizer.from_pretrained(output)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reloaded(ids).logits - reference(ids).logits).abs().max().item()
    assert diff == 0.0  # same weights, same kernels: bit-equal, no tolerance needed
    gen, loop = greedy(reloaded, ids)
    ref_gen, _ = greedy(reference, ids)
    assert gen == ref_gen == loop
    reloaded.save_pretrained(tmp_path / "resaved")  # runs config validation (layer_types length)
    assert snapshot(source) == before


# --- per-layer lists that only transformers knows (config.json lacks them) -------------------------

def _drop_layer_types(cfg: dict) -> None:
    del cfg["layer_types"]


def _gemma3_pattern(cfg: dict) -> None:
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 3  # the tiny models' s, s, f pattern


@pytest.mark.parametrize("arch, edit", [("gemma2", _drop_layer_types), ("qwen2", _drop_layer_types),
                                        ("gemma3_text", _gemma3_pattern)])
def test_derived_layer_types_are_written_explicitly(arch, edit, tiny_checkpoint, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(arch), source)
    cfg = json.loads((source / "config.json").read_text())
    full = cfg["layer_types"]
    edit(cfg)
    (source / "config.json").write_text(json.dumps(cfg))
    reference, _ = load(source)
    assert list(reference.config.layer_types) == full  # transformers derives the same list
    prune_in_memory(reference, DROP)
    write_pruned_checkpoint(source, plan(), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == [full[i] for i in KEPT]
    assert written.get("sliding_window_pattern") == cfg.get("sliding_window_pattern")  # untouched; layer_types wins
    if "max_window_layers" in cfg:
        assert written["max_window_layers"] == 2
    reloaded, _ = load(tmp_path / "out")
    ids = torch.tensor([[1, 7, 42, 99, 150, 8, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)


def test_bin_checkpoint_is_materialised_first(tiny_checkpoint, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), source)
    state = load_file(source / "model.safetensors")
    torch.save(state, source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    write_pruned_checkpoint(source, plan(), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # scratch copy removed
    assert not list((tmp_path / "out").glob("*.bin"))
    written = load_file(tmp_path / "out" / "model.safetensors")
    for new_idx, old_idx in enumerate(KEPT):
        for key in [k for k in state if k.startswith(f"model.layers.{old_idx}.")]:
            new_key = key.replace(f"model.layers.{old_idx}.", f"model.layers.{new_idx}.", 1)
            assert raw_bytes(written[new_key]) == raw_bytes(state[key])
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    prune_in_memory(reference, DROP)
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "out")[0](ids).logits, reference(ids).logits)


# --- the output folder -------------------------------------------------------------------------------

@pytest.fixture
def source(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the sharded llama checkpoint with typical side files."""
    path = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama", max_shard_size="20KB"), path)
    for name in ("README.md", "prunetool_source.json", "chat_template.jinja", "special_tokens_map.json"):
        (path / name).write_text(f"{name} of the source\n")
    (path / "original").mkdir()
    (path / "original" / "consolidated.pth").write_bytes(b"weights")
    return path


def test_side_files_and_extra_files(source, tmp_path):
    before = snapshot(source)
    extra = {"prune.json": "{}\n", "exports/layers.txt": "0 2 5\n"}
    out = write_pruned_checkpoint(source, plan(), tmp_path / "out", extra_files=extra)
    for name in ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    for name in ("README.md", "prunetool_source.json", "original"):  # the CLI writes its own card
        assert not (out / name).exists()
    assert {name: (out / name).read_text() for name in extra} == extra
    assert snapshot(source) == before
    for bad in ({"../x": ""}, {"config.json": ""}, {"model.safetensors": ""}):
        with pytest.raises(OptionError):
            write_pruned_checkpoint(source, plan(), tmp_path / "out2", extra_files=bad)
    assert not (tmp_path / "out2").exists()


def test_kernel_copy_fallback_writes_the_same_bytes(source, tmp_path, monkeypatch):
    """Without os.copy_file_range (other OSes, EXDEV) the read/write loop must give identical files."""
    fast = write_pruned_checkpoint(source, plan(), tmp_path / "fast")

    def unsupported(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(safetensors_io.os, "copy_file_range", unsupported)
    slow = write_pruned_checkpoint(source, plan(), tmp_path / "slow")
    assert snapshot_bytes(fast) == snapshot_bytes(slow)


def snapshot_bytes(folder: Path) -> dict:
    return {name: data for name, (data, _) in snapshot(folder).items()}


def test_refuses_source_as_output(source, tmp_path):
    before = snapshot(source)
    link = tmp_path / "link"
    link.symlink_to(source)
    tmp_path.joinpath("outer").mkdir()
    inner = tmp_path / "outer" / "model"
    shutil.copytree(source, inner)
    for src, out in ((source, source), (source, source / "sub"), (source, link), (source, link / "x"),
                     (inner, tmp_path / "outer")):
        with pytest.raises(OptionError, match="source"):
            write_pruned_checkpoint(src, plan(), out, force=True)
    assert snapshot(source) == before and not (source / "sub").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "outer", "src"]


def test_existing_output_needs_force(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OptionError, match="--force"):
        write_pruned_checkpoint(source, plan(), out)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    write_pruned_checkpoint(source, plan(), out, force=True)
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # nothing left aside
    (tmp_path / "file").write_text("x")
    with pytest.raises(OptionError, match="not a folder"):
        write_pruned_checkpoint(source, plan(), tmp_path / "file", force=True)
    (tmp_path / "empty").mkdir()
    write_pruned_checkpoint(source, plan(), tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "config.json").is_file()


class Stop(Exception):
    pass


def fail_on_shard(number: int, error: type[BaseException]):
    """An on_shard callback that raises `error` when the `number`-th shard is done."""
    seen = []

    def callback(name: str) -> None:
        seen.append(name)
        if len(seen) == number:
            raise error()

    return callback


@pytest.mark.parametrize("error", [Stop, KeyboardInterrupt])
def test_interrupted_write_leaves_nothing(source, tmp_path, error):
    outs = tmp_path / "outs"
    with pytest.raises(error):
        write_pruned_checkpoint(source, plan(), outs / "new", on_shard=fail_on_shard(2, error))
    assert list(outs.iterdir()) == []  # neither the output nor the temporary folder
    old = outs / "old"
    old.mkdir()
    (old / "keep.txt").write_text("keep")
    with pytest.raises(error):
        write_pruned_checkpoint(source, plan(), old, force=True, on_shard=fail_on_shard(1, error))
    assert [p.name for p in outs.iterdir()] == ["old"] and (old / "keep.txt").read_text() == "keep"


def test_before_publish_sees_the_complete_folder_and_can_veto(source, tmp_path):
    seen = {}

    def check(folder: Path) -> None:
        seen["layers"] = len(load(folder)[0].get_decoder().layers)
        seen["files"] = sorted(p.name for p in folder.iterdir())
        raise Stop("reload check failed")

    with pytest.raises(Stop):
        write_pruned_checkpoint(source, plan(), tmp_path / "out", before_publish=check)
    assert seen["layers"] == 3 and "config.json" in seen["files"] and "model.safetensors.index.json" in seen["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    write_pruned_checkpoint(source, plan(), tmp_path / "out", before_publish=lambda folder: None)
    assert (tmp_path / "out" / "config.json").is_file()


def test_refuses_plan_for_another_model_and_mtp_layers(tiny_checkpoint, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), source)
    with pytest.raises(OptionError, match="8-layer"):
        write_pruned_checkpoint(source, plan(num_layers=8), tmp_path / "out")
    state = load_file(source / "model.safetensors")
    state["model.layers.6.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP block stored after the decoder
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="beyond num_hidden_layers=6"):
        write_pruned_checkpoint(source, plan(), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_decoder_prefix_detection():
    decoder = [f"model.layers.{i}.mlp.weight" for i in range(4)]
    vision = ["vision_tower.encoder.layers.0.w", "model.norm.weight", "lm_head.weight"]
    assert find_decoder_prefix(decoder + vision, 4) == "model.layers."
    with pytest.raises(UnsupportedModelError, match="no decoder layer prefix"):
        find_decoder_prefix(decoder, 5)
    twin = [n.replace("model.", "model.shadow.") for n in decoder]
    with pytest.raises(UnsupportedModelError, match="several.*model.shadow.layers."):
        find_decoder_prefix(decoder + twin, 4)


# --- prune_config on plain dicts ------------------------------------------------------------------------

def test_prune_config_writes_derived_layer_types():
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 6, "sliding_window": 4096}
    derived = {"layer_types": ["sliding_attention", "full_attention"] * 3}
    out = prune_config(gemma2, KEPT, derived)
    assert out["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert out["num_hidden_layers"] == 3 and "layer_types" not in gemma2  # input untouched


def test_prune_config_remaps_indices_and_slices_per_layer_lists():
    cfg = {"num_hidden_layers": 6, "max_window_layers": 3, "first_k_dense_replace": 1, "mlp_only_layers": [0, 4, 5],
           "no_rope_layers": [1, 1, 1, 0, 1, 0], "eos_token_id": [1, 2, 3, 4, 5, 6], "decoder_sparse_step": 1}
    out = prune_config(cfg, KEPT, None)
    assert out["max_window_layers"] == 2 and out["first_k_dense_replace"] == 1
    assert out["mlp_only_layers"] == [0, 2]
    assert out["no_rope_layers"] == [1, 1, 0]
    assert out["eos_token_id"] == cfg["eos_token_id"]  # not per-layer, whatever its length
    every = prune_config({**cfg, "mlp_only_layers": list(range(6))}, KEPT, None)
    assert every["mlp_only_layers"] == [0, 1, 2]  # an index list of length 6 is renumbered, not sliced


def test_prune_config_nested_text_config():
    cfg = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 6, "layer_types": list("ssfssf")},
           "vision_config": {"num_hidden_layers": 6}}
    out = prune_config(cfg, KEPT, None)
    assert out["text_config"] == {"num_hidden_layers": 3, "layer_types": list("sff")}
    assert out["vision_config"] == {"num_hidden_layers": 6}


@pytest.mark.parametrize("field, value", [("decoder_sparse_step", 2), ("moe_layer_freq", 2),
                                          ("sliding_window_pattern", 6)])
def test_prune_config_refuses_index_formulas(field, value):
    with pytest.raises(UnsupportedModelError, match=field):
        prune_config({"num_hidden_layers": 6, field: value}, KEPT, None)
    assert issubclass(UnsupportedModelError, PrunetoolError)
